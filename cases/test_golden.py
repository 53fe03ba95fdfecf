"""Golden values: the plain baseline's loss trace equals the committed golden file of this
machine's numerics fingerprint bitwise (``harness.golden``), so a model, runner or library
change that moves the numbers is caught even when the offload run still matches its baseline.
A machine with no trace for its fingerprint skips with the fingerprint and how to record one.
No extra training: the trace comes from the case's shared run. ``--update-golden`` rewrites the
files instead.

Rank 0 checks (or writes) its trace; the verdict is collective, so every rank raises the same
assertion or skips with the same reason."""

from __future__ import annotations

import pytest

from fixtures.dist import DistEnv
from harness import distributed, fingerprint, golden
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
    outcome = None
    if dist_env.rank == 0:
        variant = golden.variant(environment.model_size, case.sharding, dist_env.world_size)
        check = golden.update if pytestconfig.getoption("--update-golden") else golden.check
        outcome = check(case.name, res.plain.losses, fingerprint.of(environment.device), variant)
        record_result(case.name, {"golden": outcome.record()})
    problems = [outcome.message] if outcome is not None and not outcome.ok else []
    combined = distributed.collective_problems(problems)
    assert not combined, "\n".join(combined)
    missing = outcome.message if outcome is not None and outcome.status == "missing" else None
    missing = distributed.broadcast_object(missing)
    if missing is not None:
        pytest.skip(missing)
