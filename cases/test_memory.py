"""Memory (CUDA): right after the last forward of the final step, allocated memory is lower than
the baseline's by the bytes the in-flight offloaded groups free (allocator rounding allowed);
the step's peak is not above the baseline's. Decided by ``harness.verify.judge`` (check
``memory``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.cases import Case

pytestmark = pytest.mark.case_matrix  # parametrized over the session's case rows


@pytest.mark.gpu
def test_memory_after_forward(case: Case, case_check: Callable[[str, Case], None]) -> None:
    case_check("memory", case)
