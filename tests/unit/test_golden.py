"""Golden loss traces (``harness.verify.golden``) keyed by the numerics fingerprint
(``harness.measure.fingerprint``): the fingerprint's fields and key, variants and paths, the text
format's exact round trip, the bitwise check (match, one-ULP drift naming the machines'
differences, shape change, missing, malformed, traces recorded before fingerprints) and the
committed files. The two end-to-end checks of the verdict's portability and teeth (a forced
lower CPU ISA has no golden, a changed model on this machine's own fingerprint fails) are in
``tests/e2e/test_golden_runs.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.cases import default_matrix, matrix
from harness.measure import fingerprint
from harness.measure.fingerprint import UNKNOWN, Fingerprint
from harness.verify import golden

REPO = Path(__file__).resolve().parents[2]


def _fp(**changes: str) -> Fingerprint:
    keyed = {
        "torch": "2.13.0+cpu",
        "aten_cpu_capability": "AVX2",
        "onednn_isa": "Intel AVX2",
        "cpu_vendor": "AuthenticAMD",
        "mkl_overrides": "none",
    }
    info = {"cpu_model": "AMD EPYC", "torch_threads": "1"}
    for field, value in changes.items():
        (info if field in info else keyed)[field] = value
    return Fingerprint(device="cpu", keyed=tuple(keyed.items()), info=tuple(info.items()))


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
    assert fingerprint.gpu_short_name(device_name) == short


def test_fingerprint_id_keys_the_keyed_fields_only() -> None:
    base = _fp()
    assert base.id.startswith("cpu-avx2-") and len(base.id) == len("cpu-avx2-") + 8
    assert _fp(torch_threads="2").id == base.id, "an info field does not move the key"
    assert _fp(onednn_isa="Intel AVX-512 with bfloat16").id != base.id
    assert _fp(aten_cpu_capability="AVX512").id.startswith("cpu-avx512-")
    assert Fingerprint.parse(base.lines()) == base


def test_fingerprint_differences_name_keyed_and_info_fields() -> None:
    diff = _fp().differences(_fp(onednn_isa="Intel AVX-512", torch_threads="2"))
    assert diff == ["onednn_isa (keyed): Intel AVX2 vs Intel AVX-512", "torch_threads: 1 vs 2"]
    assert _fp().differences(_fp()) == []


def test_partial_fingerprint_fits_whatever_it_did_not_record() -> None:
    partial = _fp(onednn_isa=UNKNOWN, cpu_vendor=UNKNOWN)
    assert partial.partial and not _fp().partial
    assert partial.fits(_fp()) and partial.fits(_fp(cpu_vendor="GenuineIntel"))
    assert not partial.fits(_fp(aten_cpu_capability="AVX512"))


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (["torch 2.13"], "no 'device cpu' or 'device cuda' line"),
        (["device cpu", "torch"], "expected 'field value'"),
        (["device cpu", "torch 2.13"], "keyed fields must be torch, aten_cpu_capability"),
    ],
)
def test_malformed_fingerprint_is_one_line(lines: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Fingerprint.parse(lines)


def test_this_machine_fingerprint_is_complete() -> None:
    here = fingerprint.of(torch.device("cpu"))
    assert not here.partial, here.lines()
    fields = dict(here.keyed)
    assert fields["torch"] == torch.__version__
    assert fields["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if torch.backends.mkldnn.is_available():
        assert fields["onednn_isa"] not in ("", UNKNOWN, "none")


def test_variant_marks_size_and_sharded_ranks() -> None:
    assert golden.variant("tiny") == "tiny"
    assert golden.variant("small", "none", 8) == "small"
    assert golden.variant("tiny", "zero3", 1) == "tiny"
    assert golden.variant("tiny", "zero3", 4) == "tiny-ranks4"


def test_golden_path_escapes_awkward_characters(tmp_path: Path) -> None:
    path = golden.golden_path("cpu-x", "tiny", "moe-*E*E_core_attn_sequential_bf16", tmp_path)
    assert path == tmp_path / "cpu-x" / "tiny" / "moe-%2AE%2AE_core_attn_sequential_bf16.txt"


def _losses() -> torch.Tensor:
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) * 3 + 4
    values[0, 0] = torch.finfo(torch.float32).tiny / 3  # subnormal
    values[1, 2] = -0.0
    return values


def test_trace_round_trip_is_bitwise() -> None:
    losses = _losses()
    text = golden.trace_text(losses, comments=("a comment",), fingerprint=_fp())
    lines = text.splitlines()
    assert lines[0] == "#: device cpu" and "# a comment" in lines
    assert golden.trace_fingerprint(text) == _fp()
    assert len([line for line in lines if not line.startswith("#")]) == 15
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


NAME = "hybrid-+-_core_attn_sequential_fp32"


def test_check_missing_update_match_drift(tmp_path: Path) -> None:
    losses, here = _losses(), _fp()
    missing = golden.check(NAME, losses, here, "tiny", root=tmp_path)
    assert missing.status == "missing" and missing.ok
    assert missing.message.startswith(f"no golden trace for this machine (fingerprint {here.id}")
    assert "--update-golden" in missing.message

    updated = golden.update(NAME, losses, here, "tiny", root=tmp_path)
    assert updated.status == "updated" and updated.path is not None and updated.path.is_file()
    assert golden.read_fingerprint(tmp_path / here.id) == here
    assert golden.check(NAME, losses.clone(), here, "tiny", root=tmp_path).status == "match"

    drifted = losses.clone()
    drifted[2, 1] = torch.nextafter(drifted[2, 1], torch.tensor(100.0))  # one ULP
    result = golden.check(NAME, drifted, here, "tiny", root=tmp_path)
    assert result.status == "mismatch" and not result.ok
    first = result.message.splitlines()[0]
    assert "first at step 2 microbatch 1: golden " in first and " vs this run " in first
    assert str(updated.path) in first
    assert "fingerprints are identical: a real numerics change" in result.message
    row = next(line for line in result.message.splitlines() if line.split()[:2] == ["2", "1"])
    assert row.split()[-1] == "1", row  # the table says: one ULP

    shorter = golden.check(NAME, losses[:4], here, "tiny", root=tmp_path)
    assert shorter.status == "mismatch" and "(4, 3)" in shorter.message


def test_drift_names_the_fields_that_differ(tmp_path: Path) -> None:
    golden.update(NAME, _losses(), _fp(), "tiny", root=tmp_path)
    drifted = _losses() + 1
    result = golden.check(NAME, drifted, _fp(torch_threads="2"), "tiny", root=tmp_path)
    assert result.status == "mismatch"
    assert "fingerprint fields that differ (golden vs this machine): torch_threads: 1 vs 2" in (
        result.message
    )


def test_other_machines_trace_is_missing_not_mismatch(tmp_path: Path) -> None:
    golden.update(NAME, _losses(), _fp(aten_cpu_capability="AVX512"), "tiny", root=tmp_path)
    result = golden.check(NAME, _losses() + 1, _fp(), "tiny", root=tmp_path)
    assert result.status == "missing" and result.ok
    assert "traces of this case exist for: cpu-avx512-" in result.message
    assert "aten_cpu_capability (keyed): AVX512 vs AVX2" in result.message


def _partial_folder(root: Path, losses: torch.Tensor) -> Fingerprint:
    partial = _fp(onednn_isa=UNKNOWN, cpu_vendor=UNKNOWN, mkl_overrides=UNKNOWN)
    path = golden.golden_path(partial.id, "tiny", NAME, root)
    path.parent.mkdir(parents=True)
    (root / partial.id / golden.FINGERPRINT_FILE).write_text("\n".join(partial.lines()))
    path.write_text(golden.trace_text(losses, fingerprint=partial))
    return partial


def test_partial_trace_confirms_but_never_refutes(tmp_path: Path) -> None:
    partial = _partial_folder(tmp_path, _losses())
    match = golden.check(NAME, _losses(), _fp(), "tiny", root=tmp_path)
    assert match.status == "match" and "recorded before fingerprints" in match.message
    other = golden.check(NAME, _losses() + 1, _fp(), "tiny", root=tmp_path)
    assert other.status == "missing" and other.ok
    assert partial.id in other.message and "cannot tell a numerics change" in other.message
    unfit = golden.check(NAME, _losses(), _fp(aten_cpu_capability="AVX512"), "tiny", root=tmp_path)
    assert unfit.status == "missing"


def test_malformed_golden_files_are_one_problem_line(tmp_path: Path) -> None:
    here = _fp()
    golden.update(NAME, _losses(), here, "tiny", root=tmp_path)
    path = golden.golden_path(here.id, "tiny", NAME, tmp_path)
    path.write_text("0 0 oops\n")
    result = golden.check(NAME, _losses(), here, "tiny", root=tmp_path)
    assert result.status == "malformed" and not result.ok
    assert "\n" not in result.message and "expected 'step microbatch loss'" in result.message

    other = _fp(aten_cpu_capability="AVX512")
    golden.update(NAME, _losses(), other, "tiny", root=tmp_path)
    (tmp_path / other.id / golden.FINGERPRINT_FILE).write_text("nonsense\n")
    result = golden.check(NAME, _losses(), _fp(torch="2.99"), "tiny", root=tmp_path)
    assert result.status == "malformed" and "FINGERPRINT" in result.message


def test_no_golden_root_is_missing(tmp_path: Path) -> None:
    result = golden.check(NAME, _losses(), _fp(), "tiny", root=tmp_path / "absent")
    assert result.status == "missing" and "not a folder" in result.message
    assert golden.ROOT_VARIABLE in result.message


def test_golden_root_is_explicit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(golden.ROOT_VARIABLE, raising=False)
    assert golden.golden_root() == REPO / "cases" / "golden"
    monkeypatch.setenv(golden.ROOT_VARIABLE, str(tmp_path))
    assert golden.golden_root() == tmp_path


def test_record_paths_are_repository_relative() -> None:
    case = default_matrix()[0]
    here = fingerprint.of(torch.device("cpu"))
    outcome = golden.check(case.name, torch.zeros(6, 2), here, "tiny")
    assert outcome.record()["path"].startswith(f"cases/golden/{here.id}/tiny/")
    assert outcome.record()["fingerprint"] == here.id


def test_committed_golden_files_are_consistent() -> None:
    """Every committed folder has a FINGERPRINT whose id is the folder's name; every trace
    names a case-table row, has its shape and repeats its folder's fingerprint; some CPU
    folder covers every single-rank row of the default matrix."""
    rows = {c.name: c for name in ("default", "full") for c in matrix(name, "all")}
    root = REPO / "cases" / "golden"
    covered: dict[str, set[str]] = {}
    folders = [p for p in root.iterdir() if p.is_dir() and any(p.glob("*/*.txt"))]
    for folder in sorted(folders):
        recorded = golden.read_fingerprint(folder)
        assert recorded.id == folder.name, f"{folder}: FINGERPRINT gives {recorded.id}"
        for path in sorted(folder.glob("*/*.txt")):
            text = path.read_text()
            case = next(
                (
                    c
                    for c in rows.values()
                    if golden.golden_path(folder.name, path.parent.name, c.name, root) == path
                ),
                None,
            )
            assert case is not None, f"{path}: no case-table row of that name"
            assert golden.trace_fingerprint(text, str(path)) == recorded, path
            trace = golden.parse_trace(text, str(path))
            assert trace.shape == (case.steps, case.microbatches), path
            assert torch.isfinite(trace).all(), path
            covered.setdefault(f"{folder.name}/{path.parent.name}", set()).add(case.name)
    single = {c.name for c in default_matrix() if c.min_ranks == 1}
    cpu = [k for k, names in covered.items() if k.startswith("cpu-") and single <= names]
    assert cpu, "no CPU golden folder covers the single-rank default matrix"
