"""The ``offload-harness`` CLI: bad input, listings, real runs, the tools' subcommands.

Bad input: exit code 2 and one line on stderr. Listings: the case ids and backend names. One
real passing run (report on disk) and one failing run whose backend corrupts every reload
(transport corruption must be reported). The pytest plugin's options are in
``test_cli_plugin.py``, ``--jobs`` and ``mutation-score``'s in ``test_cli_jobs.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import warm
from cli_lines import one_error_line

from harness.cases import default_matrix, full_matrix
from harness.cli import main
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- a broken backend


class FlipSignOffloader(OffloadContext):
    """The reference offloader with a transport bug: every reloaded floating tensor comes back
    with its first element negated (the hooks and the graph are untouched)."""

    name = "broken.flip_sign"

    def _copy_in(self, group: Any, entry: Any) -> torch.Tensor:
        restored = super()._copy_in(group, entry)
        if not restored.is_floating_point() or restored.numel() == 0:
            return restored
        corrupted = restored.clone()
        first = (0,) * corrupted.dim()
        corrupted[first] = -corrupted[first]
        return corrupted


def flip_sign_offloader(config: OffloadConfig, device: torch.device) -> FlipSignOffloader:
    """Backend factory (``module:flip_sign_offloader``) of the broken offloader."""
    return FlipSignOffloader(config, device)


# This module's import name depends on pytest's import mode ("test_cli" or "tests.test_cli");
# the name it was imported under always resolves to this very module object.
FLIP_SIGN_BACKEND = f"{__name__}:flip_sign_offloader"


# ---------------------------------------------------------------------------------- bad input

CUSTOM = ("run", "--device", "cpu", "--steps", "1")
ONE_LAYER = (*CUSTOM, "--pattern", "+-", "--offload", "core_attn")

BAD_INPUT = {
    "unknown-symbol": [*CUSTOM, "--pattern", "+x-", "--offload", "core_attn"],
    "mixed-attention": [*CUSTOM, "--pattern", "+*", "--offload", "core_attn"],
    "not-applicable": [*CUSTOM, "--pattern", "+-+-+-", "--offload", "mlp_norm"],
    "conflicting": [*CUSTOM, "--pattern", "*E*E", "--offload", "fused_group_mlp,expert_fc1"],
    "attn_proj-alone": [*CUSTOM, "--pattern", "+-", "--offload", "attn_proj"],
    "unknown-module": [*CUSTOM, "--pattern", "+-", "--offload", "core_atn"],
    "pattern-without-offload": [*CUSTOM, "--pattern", "+-"],
    "unknown-backend": [*CUSTOM, "--backend", "nope"],
    "unimportable-backend": [*CUSTOM, "--backend", "no_such_module_xyz:factory"],
    "max-inflight-word": [*ONE_LAYER, "--max-inflight", "many"],
    "max-inflight-negative": [*ONE_LAYER, "--max-inflight", "-1"],
    "unknown-case": ["run", "--device", "cpu", "--case", "no-such-case"],
    "case-and-pattern": [
        *("run", "--device", "cpu", "--case", default_matrix()[0].name),
        *("--pattern", "+-", "--offload", "core_attn"),
    ],
    "unknown-subcommand": ["frobnicate"],
    "no-subcommand": [],
    "unknown-option": ["run", "--frobnicate"],
    "bad-schedule": [*CUSTOM, "--schedule", "zigzag"],
    "bad-steps": [*CUSTOM, "--steps", "two"],
    "bad-matrix": ["cases", "--matrix", "huge"],
    "update-golden-custom": [*ONE_LAYER, "--update-golden"],
    "overrides-on-the-matrix": ["run", "--device", "cpu", "--steps", "2"],
    "bad-override-of-a-row": [
        *("run", "--device", "cpu", "--case", default_matrix()[0].name, "--microbatches", "0")
    ],
}


@pytest.mark.parametrize("argv", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main([*argv, "--report-dir", str(tmp_path)] if argv[:1] == ["run"] else argv)
    line = one_error_line(capsys)
    assert code == 2, line
    assert not list(tmp_path.iterdir()), "a rejected run must not write a report"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (BAD_INPUT["unknown-symbol"], "'x'"),
        (BAD_INPUT["not-applicable"], "mlp_norm"),
        (BAD_INPUT["conflicting"], "fused_group_mlp"),
        (BAD_INPUT["unknown-backend"], "--backend"),
        (BAD_INPUT["max-inflight-word"], "--max-inflight"),
        (BAD_INPUT["unknown-case"], "no-such-case"),
        (BAD_INPUT["case-and-pattern"], "--case"),
        (BAD_INPUT["unknown-option"], "--frobnicate"),
        (BAD_INPUT["unknown-subcommand"], "frobnicate"),
    ],
)
def test_error_line_names_the_problem(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible: --device cuda is valid")
def test_device_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--device", "cuda", "--pattern", "+-", "--offload", "core_attn"]) == 2
    assert "cuda" in one_error_line(capsys)


# ----------------------------------------------------------------------------------- listings


def _stdout_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    out, err = capsys.readouterr()
    assert err == ""
    return out.splitlines()


def test_cases_lists_the_default_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cases"]) == 0
    ids = _stdout_lines(capsys)
    assert ids == [c.name for c in default_matrix()]
    assert len(ids) >= 17 and len(set(ids)) == len(ids)
    # The seed case comes first.
    assert ids[0] == "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"


def test_cases_full_lists_the_full_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cases", "--matrix", "full"]) == 0
    ids = _stdout_lines(capsys)
    assert ids == [c.name for c in full_matrix()]
    assert len(ids) >= 192 and len(set(ids)) == len(ids)
    assert "hybrid-+-+-+-_core_attn+attn_proj_1f1b_bf16_inflight-none" in ids


def test_backends_lists_the_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    lines = _stdout_lines(capsys)
    assert [line.split()[0] for line in lines[:3]] == ["reference", "none", "hooks"]
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines), "a line lacks a description"


# ----------------------------------------------------------------------------------- real runs

# Two attention layers: after the warmup the last core_attn/attn_proj of each microbatch stays on
# the device (its backward comes right after the forward, the "margin" policy), so with a single
# attention layer ("+-") the steady state would offload nothing and the run is refused as
# proving nothing (test_run_that_offloads_nothing_is_refused). Layer 0 keeps offloading here.
RUN = ["run", "--device", "cpu", "--pattern", "+-+-", "--offload", "core_attn,attn_proj"]
RUN += ["--steps", "3"]
CASE_NAME = "hybrid-+-+-_core_attn+attn_proj_sequential_fp32_3x2"


def _only_summary(report_dir: Path) -> dict[str, Any]:
    summaries = list(report_dir.glob("*/summary.json"))
    assert len(summaries) == 1, summaries
    assert [p.name for p in report_dir.iterdir()] == [summaries[0].parent.name]
    return json.loads(summaries[0].read_text())


@pytest.mark.heavy
@pytest.mark.usefixtures("plots_on")
def test_run_passes_and_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*RUN, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    table = out[out.index("case ") :]
    assert CASE_NAME in table and "pass" in table
    assert "1/1 cases passed" in out

    summary = _only_summary(tmp_path)
    (case,) = summary["cases"]
    assert case["name"] == CASE_NAME
    assert case["verdict"] == "pass" and case["problems"] == []
    losses = {k: torch.tensor(v) for k, v in case["losses"].items()}
    assert set(losses) == {"plain", "hooks", "offload"}
    assert losses["plain"].shape == (3, 2)
    assert torch.equal(losses["offload"], losses["plain"])
    # a passing case's hooks baseline trains its first iteration only
    assert torch.equal(losses["hooks"], losses["plain"][:1])
    # where the case's time went, run by run
    assert {"plain", "hooks", "offload", "disabled"} <= set(case["run_seconds"])
    assert all(seconds >= 0 for seconds in case["run_seconds"].values())
    assert case["plain_baseline"] == {"key": case["plain_baseline"]["key"], "made_by": CASE_NAME}
    assert torch.isfinite(losses["plain"]).all()
    transfers = case["transfers"]
    assert transfers["d2h_bytes"] == transfers["h2d_bytes"] > 0
    assert transfers["d2h_copies"] == transfers["h2d_copies"] > 0
    assert set(transfers["names_moved"]) == {"core_attn", "attn_proj"}
    assert case["golden"]["status"] == "missing"  # a custom case has no golden trace
    folder = next(tmp_path.iterdir())
    assert {p.name for p in folder.iterdir()} == {
        "summary.json",
        "junit.xml",
        "index.html",
        "plots",
    }
    assert CASE_NAME in (folder / "index.html").read_text()
    assert "<testcase" in (folder / "junit.xml").read_text()
    assert f"report: {folder / 'index.html'}" in out


def test_run_that_offloads_nothing_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One attention layer: only the warmup offloads; the final step moves nothing, and a case
    that cannot prove anything is a failure, not a pass."""
    argv = ["run", "--device", "cpu", "--pattern", "+-", "--offload", "core_attn,attn_proj"]
    code = main([*argv, "--steps", "3", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "the prediction moves nothing in the final step" in out
    (case,) = _only_summary(tmp_path)["cases"]
    assert case["verdict"] == "fail"
    assert case["equivalence"] == "pass"  # the numbers themselves are fine


def test_run_reports_transport_corruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*RUN, "--backend", FLIP_SIGN_BACKEND, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"FAIL {CASE_NAME}" in out
    assert "transport corruption" in out
    assert "first divergence" in out
    (case,) = _only_summary(tmp_path)["cases"]
    assert case["verdict"] == "fail"
    assert case["equivalence"] == "transport"
    # The hooks baseline is untouched by the bug; only the offload run diverges.
    assert case["losses"]["hooks"] == case["losses"]["plain"]
    assert case["losses"]["offload"] != case["losses"]["plain"]


def test_case_row_takes_the_flags_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``run --case ID`` applies --steps/--microbatches/--precision/--schedule as repro does
    (they were silently ignored), and a one-step run's final step is judged as the warmup."""
    row = next(c for c in default_matrix() if c.precision == "bf16" and c.sharding == "none")
    flags = ("--steps", "1", "--microbatches", "1", "--precision", "fp32", "--schedule", "1f1b")
    code = main(
        ["run", "--device", "cpu", "--case", row.name, *flags, "--report-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    (case,) = _only_summary(tmp_path)["cases"]
    changed = row.replace(steps=1, microbatches=1, precision="fp32", schedule="1f1b")
    assert case["name"] == changed.name != row.name
    assert torch.tensor(case["losses"]["plain"]).shape == (1, 1)
    assert case["checks"]["transfers"]["status"] == "pass"


@pytest.mark.parametrize("tool", ["bench", "mutation-score", "nightly", "host-profile"])
def test_tools_are_subcommands(tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([tool, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: offload-harness {tool} ")


WRAPPERS = ("bench", "mutation_score", "nightly", "host_profile")

_RUN_WRAPPERS = """
import runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    print("=== " + path, flush=True)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        print("=== exit " + str(done.code), flush=True)
"""


def test_script_wrappers_call_the_tools(tmp_path: Path) -> None:
    """Each ``scripts/`` wrapper run as a program (``__main__``) with ``--help`` prints its
    tool's usage and exits 0; all four in one ``python -m`` process (forked warm: one torch
    import, not four)."""
    paths = [str(REPO / "scripts" / name) for name in WRAPPERS]
    (tmp_path / "run_wrappers.py").write_text(_RUN_WRAPPERS)
    done = warm.run([sys.executable, "-m", "run_wrappers", *paths], cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    outputs = done.stdout.split("=== ")[1:]
    assert len(outputs) == 2 * len(WRAPPERS), done.stdout
    for name, path, (head, tail) in zip(
        WRAPPERS, paths, zip(outputs[::2], outputs[1::2], strict=True), strict=True
    ):
        first, _, usage = head.partition("\n")
        assert first == path, head
        assert usage.startswith(f"usage: offload-harness {name.replace('_', '-')} "), usage
        assert tail.strip() == "exit 0", (name, tail)


def test_empty_report_dir_writes_no_report(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--report-dir ''`` means no report, as in pytest (it meant the current folder)."""
    monkeypatch.chdir(tmp_path)
    assert main([*ONE_LAYER, "--report-dir", ""]) == 0
    out = capsys.readouterr().out
    assert "1/1 cases passed" in out and "no report (--report-dir '')" in out
    assert list(tmp_path.iterdir()) == []
