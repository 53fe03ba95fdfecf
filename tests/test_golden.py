"""Golden loss traces (``harness.golden``): device kinds, the text format's exact round trip,
the bitwise check (match, one-ULP drift, shape change, missing file) and the committed CPU files
of the default matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import golden
from harness.cases import default_matrix


@pytest.mark.parametrize(
    ("device_name", "short"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("Tesla V100-PCIE-32GB", "v100"),
        ("NVIDIA", "unknown"),
    ],
)
def test_gpu_short_name(device_name: str, short: str) -> None:
    assert golden.gpu_short_name(device_name) == short


def test_device_kind_marks_non_default_sizes() -> None:
    cpu = torch.device("cpu")
    assert golden.device_kind(cpu, "tiny") == "cpu"
    assert golden.device_kind(cpu, "small") == "cpu-small"


def test_case_kind_separates_sharded_multi_rank_traces() -> None:
    cpu = torch.device("cpu")
    assert golden.case_kind(cpu, "tiny", "none", 8) == "cpu"
    assert golden.case_kind(cpu, "tiny", "zero3", 1) == "cpu"
    assert golden.case_kind(cpu, "tiny", "zero3", 4) == "cpu-ranks4"


def test_golden_path_escapes_awkward_characters(tmp_path: Path) -> None:
    path = golden.golden_path("cpu", "moe-*E*E_core_attn+attn_proj_sequential_bf16", tmp_path)
    assert path == tmp_path / "cpu" / "moe-%2AE%2AE_core_attn+attn_proj_sequential_bf16.txt"


def _losses() -> torch.Tensor:
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) * 3 + 4
    values[0, 0] = torch.finfo(torch.float32).tiny / 3  # subnormal
    values[1, 2] = -0.0
    return values


def test_trace_round_trip_is_bitwise() -> None:
    losses = _losses()
    text = golden.trace_text(losses, comments=("a comment",))
    lines = text.splitlines()
    assert lines[0] == "# a comment"
    assert lines[1].split()[:2] == ["0", "0"] and len(lines) == 1 + 15
    back = golden.parse_trace(text)
    assert back.dtype == torch.float32
    assert torch.equal(back.view(torch.int32), losses.view(torch.int32))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("0 0 1.0\n0 1\n", "expected 'step microbatch loss'"),
        ("0 0 one\n", "expected 'step microbatch loss'"),
        ("# only a comment\n", "no 'step microbatch loss' lines"),
        ("0 0 1.0\n1 1 1.0\n", "full grid"),
    ],
)
def test_malformed_trace_is_one_line(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        golden.parse_trace(text, "f.txt")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_check_missing_update_match_drift(tmp_path: Path) -> None:
    losses, name = _losses(), "hybrid-+-_core_attn_sequential_fp32"
    missing = golden.check(name, losses, "cpu", root=tmp_path)
    assert missing.status == "missing" and missing.ok
    assert "--update-golden" in missing.message and "'cpu'" in missing.message

    updated = golden.update(name, losses, "cpu", root=tmp_path)
    assert updated.status == "updated" and updated.path.is_file()
    assert golden.check(name, losses.clone(), "cpu", root=tmp_path).status == "match"

    drifted = losses.clone()
    drifted[2, 1] = torch.nextafter(drifted[2, 1], torch.tensor(100.0))  # one ULP
    result = golden.check(name, drifted, "cpu", root=tmp_path)
    assert result.status == "mismatch" and not result.ok
    assert "step 2 microbatch 1" in result.message
    assert "drifted from its golden trace" in result.message
    assert "golden written with: torch" in result.message
    row = next(line for line in result.message.splitlines() if line.split()[:2] == ["2", "1"])
    assert row.split()[-1] == "1", row  # the table says: one ULP

    shorter = golden.check(name, losses[:4], "cpu", root=tmp_path)
    assert shorter.status == "mismatch" and "(4, 3)" in shorter.message


def test_record_paths_are_repository_relative() -> None:
    case = default_matrix()[0]
    outcome = golden.check(case.name, torch.zeros(6, 2), "cpu")
    assert outcome.record()["path"].startswith("cases/golden/cpu/")


def test_cpu_golden_files_cover_the_default_matrix() -> None:
    """Every single-rank row of the default matrix has a committed CPU trace of its shape."""
    rows = [c for c in default_matrix() if getattr(c, "min_ranks", 1) == 1]
    for case in rows:
        path = golden.golden_path("cpu", case.name)
        assert path.is_file(), f"no CPU golden trace for {case.name}: {path}"
        trace = golden.parse_trace(path.read_text(), str(path))
        assert trace.shape == (case.steps, case.microbatches)
        assert torch.isfinite(trace).all()
