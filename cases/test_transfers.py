"""Transfer counts and bytes per group, from the profiler, in the final (steady-state) step.

The expectation comes from ``harness.execute.predict`` (saved tensors recorded by the hooks
baseline,
the selection and the policies), never from the offloader's own log; the log must then agree
with the profiler. A run with the offloader disabled must copy nothing; no copy may use
pageable host memory; only selected groups may move; no weight may ever be copied out.
No reload may be issued earlier than the prefetch rule allows (``cadence``). Decided by
``harness.verify.judge`` (checks ``transfers``, ``disabled``, ``fidelity``, ``weights`` and
``cadence``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.cases import Case

pytestmark = pytest.mark.case_matrix  # parametrized over the session's case rows


def test_transfer_counts(case: Case, case_check: Callable[[str, Case], None]) -> None:
    case_check("transfers", case)


def test_disabled_moves_nothing(case: Case, case_check: Callable[[str, Case], None]) -> None:
    case_check("disabled", case)


def test_name_fidelity(case: Case, case_check: Callable[[str, Case], None]) -> None:
    """Only selected groups move, and every selected group the prediction moves does."""
    case_check("fidelity", case)


def test_no_weight_offloaded(case: Case, case_check: Callable[[str, Case], None]) -> None:
    """No parameter storage, cast of one or marked tensor is copied out, in any step."""
    case_check("weights", case)


def test_reload_cadence(case: Case, case_check: Callable[[str, Case], None]) -> None:
    """No reload comes earlier than the declared or learned prefetch rule allows."""
    case_check("cadence", case)
