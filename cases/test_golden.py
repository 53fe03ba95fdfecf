"""Golden values: the plain baseline's loss trace equals the committed golden file of this
machine's numerics fingerprint bitwise (``harness.verify.golden``), so a model, runner or library
change that moves the numbers is caught even when the offload run still matches its baseline.
A machine with no trace for its fingerprint skips with the fingerprint and how to record one.
No extra training: the trace comes from the case's shared run. ``--update-golden`` rewrites the
files instead. Decided by ``harness.verify.judge`` (check ``golden``); rank 0 checks (or writes) its
trace and every rank reports the same verdict."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.cases import Case

pytestmark = pytest.mark.case_matrix  # parametrized over the session's case rows


def test_golden_baseline(case: Case, case_check: Callable[[str, Case], None]) -> None:
    case_check("golden", case)
