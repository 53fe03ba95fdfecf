"""Loss equivalence: the offload run against the plain and the hooks baselines, bitwise by
default, every step (the warmup included) and every microbatch; gradients and final weights too.
Before trusting equality, the case proves the offload happened (``harness.checks``)."""

from __future__ import annotations

import pytest

from harness.cases import Case
from harness.checks import equivalence_problems, leak_problems
from harness.distributed import collective_problems
from harness.execute import CaseRun, run_case
from harness.report import case_record


def test_loss_equivalence(case: Case, case_result, record_result) -> None:
    res: CaseRun = case_result(run_case, case)
    record_result(case.name, case_record(res))
    problems = collective_problems(equivalence_problems(case, res))
    assert not problems, "\n".join(problems)


def test_no_leaks(case: Case, case_result) -> None:
    """After every iteration no saved tensor is left behind and every pooled buffer is back."""
    res: CaseRun = case_result(run_case, case)
    if not res.offload.logs:
        pytest.skip("the backend under test keeps no iteration log")
    problems = collective_problems(leak_problems(case, res))
    assert not problems, "\n".join(problems)
