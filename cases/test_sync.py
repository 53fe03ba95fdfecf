"""No host synchronisation on the offload hot path (CUDA).

The backend under test trains the case for ``GUARDED_STEP + 1`` steps. The steps before the
guarded one are unguarded on purpose: the first is the offloader's warmup (its pinned pool is
allocated there) and the optimizer allocates its state in it; the next lets every allocator
settle. In the guarded steady step every entry point of the backend - group start, enter,
pack, exit, commit, the backward of the nodes it adds, unpack, begin_microbatch,
end_iteration - runs inside a ``harness.syncguard`` window, where an implicit sync raises
(``torch.cuda.set_sync_debug_mode("error")``) and an explicit device/stream/event sync is
recorded. The model, the loss, clipping, the optimizer and the bf16 master copy run outside every
window, so whatever they might synchronise never counts against the offloader.

A failure names the step, the microbatch, the group and layer, and the phase.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.cases import Case
from harness.execute import Environment
from harness.spec import MCORE_IMPLS
from harness.syncguard import GuardedRun, HostSyncError, run_guarded

GUARDED_STEP = 2


def guarded_run(case: Case, env: Environment) -> GuardedRun:
    """The case's training with the backend under test, step ``GUARDED_STEP`` guarded."""
    run = case.run_spec().replace(steps=GUARDED_STEP + 1)
    offloader = env.offloader(case.offload_config())
    try:
        return run_guarded(env.spec(case), run, offloader, env.device, guarded={GUARDED_STEP})
    finally:
        offloader.close()


@pytest.mark.gpu
def test_no_host_sync(
    case: Case, run_training: Callable[..., object], record_result: Callable[..., None]
) -> None:
    if case.impl in MCORE_IMPLS:
        pytest.skip(
            "not guarded on megatron-core's models: their own modules drive megatron-core's "
            "offloader, not the harness protocol the guard wraps (it is guarded on ours)"
        )
    try:
        res = run_training(guarded_run, case)
    except HostSyncError as exc:
        record_result(case.name, {"host_sync": str(exc)})
        pytest.fail(f"the offloader synchronised the host with the device at {exc}", pytrace=False)
    assert isinstance(res, GuardedRun)
    record_result(case.name, {"host_sync": None, "guarded_windows": sum(res.windows.values())})
    problems = res.problems()
    assert not problems, "\n".join(problems)
