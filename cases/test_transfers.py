"""Transfer counts and bytes per group, from the profiler, in the final (steady-state) step.

The expectation comes from ``harness.predict`` (saved tensors recorded by the hooks baseline,
the selection and the policies), never from the offloader's own log; the log must then agree
with the profiler. A run with the offloader disabled must copy nothing; no copy may use
pageable host memory; only selected groups may move."""

from __future__ import annotations

from harness.cases import Case
from harness.checks import disabled_problems, fidelity_problems, transfer_problems
from harness.execute import Environment, TransferResult, run_transfers
from harness.report import transfer_record


def test_transfer_counts(case: Case, case_result, record_result, environment: Environment) -> None:
    res: TransferResult = case_result(run_transfers, case)
    record_result(case.name, transfer_record(res))
    problems = transfer_problems(case, res, environment.device)
    assert not problems, "\n".join(problems)


def test_disabled_moves_nothing(case: Case, case_result) -> None:
    problems = disabled_problems(case_result(run_transfers, case))
    assert not problems, "\n".join(problems)


def test_name_fidelity(case: Case, case_result, environment: Environment) -> None:
    """Only selected groups move, and every selected group the prediction moves does."""
    res: TransferResult = case_result(run_transfers, case)
    problems = fidelity_problems(case, res, environment.spec(case))
    assert not problems, "\n".join(problems)
