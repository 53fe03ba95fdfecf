"""Golden values: the plain baseline's loss trace equals the committed golden file of this device
kind bitwise (``harness.golden``), so a model, runner or library change that moves the numbers
is caught even when the offload run still matches its baseline. No extra training: the trace
comes from the case's shared run. ``--update-golden`` rewrites the files instead."""

from __future__ import annotations

import pytest

from fixtures.dist import DistEnv
from harness import golden
from harness.cases import Case
from harness.execute import CaseRun, Environment, run_case


def test_golden_baseline(
    case: Case,
    case_result,
    record_result,
    environment: Environment,
    dist_env: DistEnv,
    pytestconfig: pytest.Config,
) -> None:
    res: CaseRun = case_result(run_case, case)
    kind = golden.device_kind(environment.device, environment.model_size)
    if pytestconfig.getoption("--update-golden"):
        if dist_env.rank != 0:
            pytest.skip("--update-golden: rank 0 writes the golden files")
        outcome = golden.update(case.name, res.plain.losses, kind)
    else:
        outcome = golden.check(case.name, res.plain.losses, kind)
    record_result(case.name, {"golden": outcome.record()})
    if outcome.status == "missing":
        pytest.skip(outcome.message)
    assert outcome.ok, outcome.message
