"""The one judge (``harness.verify.judge``): outcomes and verdicts, and the proof that pytest's case
files and ``offload-harness run`` decide every check of a case identically (on one case, with a
broken offloader and with the correct one: pytest in a subprocess, ``run`` in this process
through its ``main``, as ``tests/e2e/test_cli.py`` runs it; its cases run in worker processes
either way)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest
import warm
from child_pytest import pytest_command

from harness.cases import find_case
from harness.reporting.report import CHECK_COLUMNS
from harness.verify.judge import CASE_TESTS, CHECKS, CheckOutcome, Judgement

REPO = Path(__file__).resolve().parents[2]
CASE = "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"


def test_every_check_has_a_case_test_and_a_column() -> None:
    assert set(CASE_TESTS) == set(CHECKS)
    assert [name for name, _ in CHECK_COLUMNS] == list(CHECKS)
    for node in CASE_TESTS.values():
        path, name = node.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), node


def test_outcomes_and_verdict() -> None:
    with pytest.raises(ValueError, match="check status must be one of"):
        CheckOutcome(name="x", status="ok")
    case = find_case(CASE)
    passed = CheckOutcome(name="transfers", status="pass", record={"seconds": 1.0})
    skipped = CheckOutcome(name="memory", status="n-a", reason="needs CUDA")
    failed = CheckOutcome(name="golden", status="fail", problems=("drifted",))
    ok = Judgement(case=case, outcomes=(passed, skipped))
    assert ok.verdict == "pass" and ok.first_failure() is None and ok.problems == []
    bad = Judgement(case=case, outcomes=(passed, skipped, failed))
    assert bad.verdict == "fail" and bad.first_failure() is failed
    record = bad.record()
    assert record["problems"] == ["golden: drifted"] and record["seconds"] == 1.0
    assert record["checks"]["memory"] == {"status": "n-a", "reason": "needs CUDA"}


def test_update_golden_is_updated_not_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--update-golden`` writes the trace it would compare with: the check says ``updated``
    (no comparison made), the table shows it, JUnit counts the case neither failed nor
    skipped; the next comparison with that trace passes."""
    import torch

    from harness.execute.environment import Environment
    from harness.reporting.report import verdict_table, write_junit
    from harness.verify import golden
    from harness.verify.judge import CaseRuns, check

    case = find_case(CASE)
    monkeypatch.setenv(golden.ROOT_VARIABLE, str(tmp_path))
    made = SimpleNamespace(plain=SimpleNamespace(losses=torch.ones(case.steps, case.microbatches)))
    env = Environment(device=torch.device("cpu"))
    writing = CaseRuns(case, env, update_golden=True)
    monkeypatch.setattr(writing, "case_run", lambda: made)
    updated = check("golden", writing)
    assert updated.status == "updated" and updated.reason.startswith("wrote "), updated
    judgement = Judgement(case=case, outcomes=(updated,))
    assert judgement.verdict == "pass" and judgement.first_failure() is None
    assert "updated" in verdict_table({"cases": [judgement.record()]}).splitlines()[1].split()
    suite = ElementTree.parse(write_junit(tmp_path, {"cases": [judgement.record()]})).getroot()[0]
    assert (suite.get("failures"), suite.get("skipped")) == ("0", "0")
    reading = CaseRuns(case, env)
    monkeypatch.setattr(reading, "case_run", lambda: made)
    assert check("golden", reading).status == "pass"


def _summary_checks(folder: Path) -> dict[str, str]:
    """Each check's status in a report; a case test skipped before it ran (a ``gpu`` test on
    CPU) has no check status, only its test outcome: read as ``skip``."""
    (path,) = folder.glob("*/summary.json")
    (case,) = [c for c in json.loads(path.read_text())["cases"] if c["name"] == CASE]
    statuses = {name: c["status"] for name, c in case["checks"].items()}
    for name, node in CASE_TESTS.items():
        test = node.split("::")[1]
        if name not in statuses and case.get("tests", {}).get(test) == "skipped":
            statuses[name] = "skip"
    return statuses


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["broken.noop", "reference"])
def test_pytest_and_run_decide_every_check_alike(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.cli import main

    common = ["--backend", backend, "--device", "cpu"]
    nodes = [f"{node}[{CASE}]" for node in CASE_TESTS.values()]
    command = pytest_command("-p", "no:xdist", "-q", *nodes, *common)
    command += ["--report-dir", str(tmp_path / "pytest")]
    # The pytest session starts first and imports while the CLI runs here.
    child = warm.start(command, cwd=REPO)
    try:
        code = main(["run", "--case", CASE, *common, "--report-dir", str(tmp_path / "cli")])
        out = capsys.readouterr()
        stdout, stderr = child.communicate(timeout=300)
    finally:
        child.kill()
        child.wait()
    tests = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    failing = backend != "reference"
    assert code == (1 if failing else 0), out.out + out.err
    assert tests.returncode == (1 if failing else 0), tests.stdout + tests.stderr
    from_cli, from_pytest = _summary_checks(tmp_path / "cli"), _summary_checks(tmp_path / "pytest")
    assert set(from_cli) == set(CHECKS)
    # pytest reports n-a as a skip; otherwise the statuses are the same
    assert {k: ("skip" if v == "n-a" else v) for k, v in from_cli.items()} == {
        k: ("skip" if v == "n-a" else v) for k, v in from_pytest.items()
    }
    assert (from_cli["transfers"] == "fail") is failing
