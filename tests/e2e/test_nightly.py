"""``scripts/nightly``'s gate: which summaries are red, which cases this machine must run, and
the command it launches (torchrun on GPUs, xdist on CPU). The script runs end to end in CI as
``scripts/nightly --matrix default``; here only its pure parts run."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from harness.cases import Case, default_matrix


@pytest.fixture(scope="module")
def nightly() -> ModuleType:
    return importlib.import_module("harness.tools.nightly")


def _summary(**changes: Any) -> dict[str, Any]:
    cases = [
        {"name": "a", "verdict": "pass", "golden": {"status": "match"}},
        {"name": "b", "verdict": "pass", "golden": {"status": "missing"}},
    ]
    summary = {"tests": {"collected": 10, "failed": 0}, "failed_tests": [], "cases": cases}
    summary.update(changes)
    return summary


def test_green(nightly: ModuleType) -> None:
    assert nightly.gate(_summary(), ["a", "b"], 0, require_golden=False) == []


@pytest.mark.parametrize(
    ("summary", "status", "fragment"),
    [
        (None, 2, "no summary.json"),
        (_summary(), 1, "pytest exit status 1"),
        (_summary(tests={"collected": 0}, cases=[]), 5, "zero tests collected"),
        (
            _summary(tests={"collected": 3, "failed": 1}, failed_tests=["t::x"]),
            1,
            "1 tests failed: t::x",
        ),
        (_summary(cases=[{"name": "a", "verdict": "pass"}]), 0, "missing: b"),
        (
            _summary(cases=[{"name": "a", "verdict": "skipped"}, {"name": "b", "verdict": "pass"}]),
            0,
            "missing: a",
        ),
        (
            _summary(
                cases=[
                    {"name": "a", "verdict": "fail", "golden": {"status": "mismatch"}},
                    {"name": "b", "verdict": "pass"},
                ]
            ),
            1,
            "golden baseline trace mismatch: a",
        ),
    ],
)
def test_red(nightly: ModuleType, summary: Any, status: int, fragment: str) -> None:
    reasons = nightly.gate(summary, ["a", "b"], status, require_golden=False)
    assert any(fragment in r for r in reasons), reasons


def test_missing_golden_is_red_by_default(nightly: ModuleType) -> None:
    summary = _summary()
    summary["cases"][1]["golden"]["fingerprint"] = "cpu-avx2-90fa2ca5"
    (reason,) = nightly.gate(summary, ["a", "b"], 0)
    assert reason.startswith("no golden baseline trace for this machine (fingerprint ")
    assert "cpu-avx2-90fa2ca5): b;" in reason and "--update-golden" in reason


def test_malformed_golden_is_red(nightly: ModuleType) -> None:
    summary = _summary()
    summary["cases"][0]["golden"]["status"] = "malformed"
    reasons = nightly.gate(summary, ["a", "b"], 0, require_golden=False)
    assert reasons == ["golden baseline trace mismatch: a"]


def test_expected_cases_follow_min_ranks(nightly: ModuleType) -> None:
    rows = [Case(family="hybrid", offload=("core_attn",))]
    if "min_ranks" in Case.__dataclass_fields__:
        rows.append(Case(family="hybrid", offload=("core_attn",), min_ranks=2))
    assert nightly.expected_cases(rows, 1) == [rows[0].name]
    assert nightly.expected_cases(rows, 8) == [r.name for r in rows]
    assert nightly.expected_cases(default_matrix(), 1)


def test_commands(nightly: ModuleType) -> None:
    args = nightly.argparse.Namespace(
        matrix="full", backend="reference", report_dir=Path("r"), jobs=None, pytest_args=["-x"]
    )
    gpu = nightly.command(args, 4, "night")
    assert gpu[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in gpu and gpu[-2:] == ["--device", "cuda"]
    assert gpu[gpu.index("--report-name") + 1] == "night" and "-x" in gpu
    cpu = nightly.command(args, 0, "night")
    assert cpu[:3] == [sys.executable, "-m", "pytest"] and "torch.distributed.run" not in cpu
    assert cpu[cpu.index("--device") + 1] == "cpu" and "-n" in cpu
