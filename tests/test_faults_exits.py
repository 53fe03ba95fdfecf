"""Fault injection for how ``offload-harness run`` ends (CPU), one test per row of issue #47's
table: every run ends, every report survives, every error says where. The offloaders that
provoke the rows are the small backends of ``tests/offloaders.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import warm

from harness.cli import main

HERE = Path(__file__).resolve().parent
ZERO3 = (
    "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16_zero3",
    "hybrid-moe-+E+-+E_expert_fc1+moe_act_1f1b_bf16_inflight-none_zero3",
)
SMALL = ["--pattern", "+-", "--offload", "core_attn", "--steps", "2", "--microbatches", "1"]


@pytest.fixture
def backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder to run in, with ``tests/offloaders.py`` importable by the run."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), *sys.path]))
    return tmp_path


def _run(folder: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "harness", "run", "--device", "cpu", "--jobs", "1", *argv]
    return warm.run(command, cwd=folder, timeout=timeout)


def _summary(root: Path) -> dict[str, Any]:
    (path,) = root.glob("*/summary.json")
    return json.loads(path.read_text())


@pytest.mark.heavy
def test_kept_references_are_no_transfers_of_the_group_on_zero3_and_every_case_runs(
    backends: Path,
) -> None:
    """An offloader that keeps the activations it offloaded (their memory freed by a forced
    release) passes both default ZeRO-3 rows; both ``--case`` values run."""
    argv = [arg for name in ZERO3 for arg in ("--case", name)]
    done = _run(backends, *argv, "--backend", "offloaders:Keep", "--report-dir", "r")
    cases = _summary(backends / "r")["cases"]
    assert sorted(c["name"] for c in cases) == sorted(ZERO3), done.stdout
    for case in cases:
        assert case["checks"]["transfers"]["status"] == "pass", case["problems"]
    assert done.returncode == 0, done.stdout + done.stderr


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--backend", "reference", "--backend", "hooks"], "--backend was given twice"),
        (["run", "--jobs", "1", "--jobs", "2"], "--jobs was given twice"),
        (["run", *SMALL, "--steps", "3"], "--steps was given twice"),
        (["run", "--case", ZERO3[0], "--case", ZERO3[0]], f"--case {ZERO3[0]} was given twice"),
        (["repro", "--case", ZERO3[0], "--case", ZERO3[1]], "--case was given twice"),
        (["repro", *SMALL, "--seed", "1", "--seed", "2"], "--seed was given twice"),
    ],
)
def test_a_repeated_single_value_flag_is_refused_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*argv, "--report-dir", str(tmp_path)]) == 2
    assert needle in _error_line(capsys)
    assert not list(tmp_path.iterdir()), "a refused run must not write a report"


def test_several_cases_are_all_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--case A --case B`` selects both, in order (before any run)."""
    import harness.cli as cli

    chosen: list[list[str]] = []

    def run_cases(cases: list[Any], *args: Any, **kwargs: Any) -> str:
        chosen.append([c.name for c in cases])
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_cases", run_cases)
    argv = ["run", "--device", "cpu", "--report-dir", "", "--case", ZERO3[1], "--case", ZERO3[0]]
    assert main(argv) == 130
    assert chosen == [[ZERO3[1], ZERO3[0]]]
