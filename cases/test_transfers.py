"""Transfer counts and bytes per group, from the profiler, in the final (steady-state) step.

The expectation comes from ``harness.predict`` (saved tensors recorded by the hooks baseline,
the selection and the policies), never from the offloader's own log; the log must then agree
with the profiler. A run with the offloader disabled must copy nothing; no copy may use
pageable host memory; only selected groups may move."""

from __future__ import annotations

from harness.cases import Case
from harness.checks import disabled_problems, fidelity_problems, transfer_problems
from harness.distributed import collective_problems
from harness.execute import CaseRun, Environment, run_case


def test_transfer_counts(case: Case, case_result, environment: Environment) -> None:
    res: CaseRun = case_result(run_case, case)
    problems = collective_problems(transfer_problems(case, res, environment.device))
    assert not problems, "\n".join(problems)


def test_disabled_moves_nothing(case: Case, case_result) -> None:
    problems = collective_problems(disabled_problems(case_result(run_case, case)))
    assert not problems, "\n".join(problems)


def test_name_fidelity(case: Case, case_result, environment: Environment) -> None:
    """Only selected groups move, and every selected group the prediction moves does."""
    res: CaseRun = case_result(run_case, case)
    problems = collective_problems(fidelity_problems(case, res, environment.spec(case)))
    assert not problems, "\n".join(problems)
