"""Memory (CUDA): right after the last forward of the final step, allocated memory is lower than
the baseline's by the bytes the in-flight offloaded groups free (allocator rounding allowed);
the step's peak is not above the baseline's."""

from __future__ import annotations

import pytest

from harness.cases import Case
from harness.checks import memory_problems
from harness.distributed import collective_problems
from harness.execute import MemoryResult, memory_unsupported, run_memory
from harness.report import memory_record


@pytest.mark.gpu
def test_memory_after_forward(case: Case, case_result, record_result) -> None:
    reason = memory_unsupported(case)
    if reason is not None:
        pytest.skip(reason)
    res: MemoryResult = case_result(run_memory, case)
    record_result(case.name, memory_record(res))
    problems = collective_problems(memory_problems(res))
    assert not problems, "\n".join(problems)
