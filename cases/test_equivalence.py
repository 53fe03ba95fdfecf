"""Loss equivalence: the offload run against the plain and the hooks baselines, bitwise by
default, every step (the warmup included) and every microbatch; gradients and final weights too.
Before trusting equality, the case proves the offload happened. Decided by ``harness.verify.judge``
(checks ``equivalence`` and ``leaks``), as ``offload-harness run`` decides them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.cases import Case

pytestmark = pytest.mark.case_matrix  # parametrized over the session's case rows


def test_loss_equivalence(case: Case, case_check: Callable[[str, Case], None]) -> None:
    case_check("equivalence", case)


def test_no_leaks(case: Case, case_check: Callable[[str, Case], None]) -> None:
    """After every iteration no saved tensor is left behind and every pooled buffer is back."""
    case_check("leaks", case)
