"""No host synchronisation on the offload hot path (CUDA).

The guarded step is step ``harness.measure.syncguard.GUARDED_STEP`` (2) of the case's offload run,
armed there (``harness.execute.steps.guards_in_offload_run``) so the check trains nothing of its
own; a row of too few steps gets a run of its own of ``GUARDED_STEP + 1`` steps. The steps before
the guarded one are unguarded on purpose: the first is the offloader's warmup (its pinned pool is
allocated there) and the optimizer allocates its state in it; the next lets every allocator
settle. In the guarded steady step every entry point of the backend - group start, enter, pack,
exit, commit, the backward of the nodes it adds, unpack, begin_microbatch, end_iteration - runs
inside a ``harness.measure.syncguard`` window, where an implicit sync is recorded
(``torch.cuda.set_sync_debug_mode("warn")``, its warning captured) and so is an explicit device
or event sync (``harness.measure.syncdetect``). Nothing is raised: the run goes on, the other
checks read it as any other run, and this check fails on the recorded syncs afterwards - also
where the offloader caught an error itself. The model, the loss, clipping, the optimizer and the
bf16 master copy run outside every window, so whatever they might synchronise never counts
against the offloader.

A failure names the first sync's step, microbatch, group and layer, window, call and source line,
and counts the others. On an inert row (a configuration that moves nothing) without a sync the
check is ``n-a``. Decided by ``harness.verify.judge`` (check ``sync``, which also says why it does
not apply to megatron-core's models), as ``offload-harness run`` decides it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.cases import Case

pytestmark = pytest.mark.case_matrix  # parametrized over the session's case rows


@pytest.mark.gpu
def test_no_host_sync(case: Case, case_check: Callable[[str, Case], None]) -> None:
    case_check("sync", case)
