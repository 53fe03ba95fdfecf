"""The host-sync guard on CPU without a run: windows per thread, a warning autograd reports after
the windows, what ``reset`` puts back, the disarmed guard's groups and a hit's record. With the
CUDA pieces faked (``tests/helpers/fake_cuda.py``). The guarded runs (every entry point inside a
labelled window, a sync recorded against its window whatever the offloader does with it) are in
``tests/e2e/test_syncguard_runs.py``; the verdict and the judge in ``test_syncguard_replay.py``;
the real detection on GPU in ``scripts/gpu_probe_sync.py`` and ``cases/test_sync.py``."""

from __future__ import annotations

import _thread
import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from fake_cuda import FakeCuda

from harness.measure import syncdetect
from harness.measure.syncdetect import FOREIGN, LATE, SYNC_MESSAGE
from harness.measure.syncguard import (
    GuardedGroup,
    GuardedOffloader,
    SyncGuard,
)
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext

CONFIG = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=64)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def _on_foreign_thread(work: Callable[[], None]) -> None:
    """Run ``work`` on a thread Python's ``threading`` did not start (as autograd's device
    thread is), and wait for it."""
    done = _thread.allocate_lock()
    done.acquire()

    def run() -> None:
        try:
            work()
        finally:
            done.release()

    _thread.start_new_thread(run, ())
    done.acquire()


def test_windows_are_per_thread_and_no_dummy_thread_is_left(fake: FakeCuda) -> None:
    guard = SyncGuard("cuda", armed=True)
    before = set(threading.enumerate())

    def backward_hook() -> None:
        with guard.window("unpack", "step 2, microbatch 0, group core_attn (layer 0): unpack"):
            fake.implicit()

    with guard.window("commit", "step 2, microbatch 0, group attn_proj (layer 0): commit"):
        _on_foreign_thread(backward_hook)
        fake.implicit()
        helper = threading.Thread(target=torch.cuda.synchronize, name="helper")
        helper.start()  # a thread with no window of its own: not the offloader's
        helper.join()
    guard.reset()
    assert [(hit.kind, hit.thread) for hit in guard.hits] == [
        ("unpack", FOREIGN),
        ("commit", "main"),
    ]
    assert guard.hits[0].window.endswith("core_attn (layer 0): unpack")
    assert guard.hits[1].window.endswith("attn_proj (layer 0): commit")
    assert fake.synchronized == ["device"]  # made, not recorded
    # the leftover check sees nothing new (a thread of before may have ended meanwhile: the
    # plugin's per-test timeout timer of the previous test, cancelled, can still be winding down)
    assert set(threading.enumerate()) - before == set()


def test_a_warning_autograd_reports_after_the_windows_is_charged_to_the_backward(
    fake: FakeCuda,
) -> None:
    """The engine replays a C++ node's warnings when the backward ends; the debug mode was on
    only inside windows, so the sync came from one."""
    guard = SyncGuard("cuda", armed=True)
    guard.step = 2
    with guard.window("backward", "step 2, microbatch 0, group core_attn (layer 0): backward"):
        pass
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)  # the replay, no window open
    torch.cuda.synchronize()  # the runner's own, outside every window: not recorded
    guard.reset()
    assert [(hit.kind, hit.window.split(":")[0]) for hit in guard.hits] == [
        (LATE, "step 2, the backward")
    ]
    # Had the debug mode been on before the guard (someone else's), a late warning may be
    # anyone's: it is not charged.
    fake.mode = 1
    other = SyncGuard("cuda", armed=True)
    with other.window("commit", "w"):
        pass
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)
    other.reset()
    assert other.hits == [] and fake.mode == 1


def test_reset_puts_back_everything_it_replaced(fake: FakeCuda) -> None:
    shown, filters = warnings.showwarning, list(warnings.filters)
    wrapped = (torch._C._cuda_synchronize, torch.cuda.Event.synchronize)
    guard = SyncGuard("cuda", armed=True)
    guard.open("pack", "outer")
    guard.open("unpack", "inner")
    assert fake.mode == 1 and warnings.showwarning is not shown
    assert torch._C._cuda_synchronize is not wrapped[0]
    guard.close()
    assert fake.mode == 1  # a window is still open
    guard.reset()  # the step ended with "outer" open (a backward that raised, say)
    assert fake.modes[-1] == 0 and guard.current is None
    assert warnings.showwarning is shown and list(warnings.filters) == filters
    assert (torch._C._cuda_synchronize, torch.cuda.Event.synchronize) == wrapped


def test_a_disarmed_guard_hands_out_the_backends_own_group() -> None:
    """Only the armed step pays for the wrapper's windows and node hooks."""
    guard = SyncGuard("cpu")
    wrapped = GuardedOffloader(OffloadContext(CONFIG, "cpu"), guard)
    wrapped.begin_microbatch(0)
    x = torch.ones(4, requires_grad=True)
    assert not isinstance(wrapped.group("core_attn", x, layer=0), GuardedGroup)
    guard.armed = True
    assert isinstance(wrapped.group("attn_proj", x, layer=0), GuardedGroup)


def test_a_sync_hit_reads_back_from_its_record() -> None:
    hit = syncdetect.SyncHit(window="w", kind="pack", call=SYNC_MESSAGE, source="f.py:1 in g")
    assert syncdetect.SyncHit.from_record(hit.record()) == hit
    with pytest.raises(ValueError, match="unknown \\['stack'\\], missing \\['call'\\]"):
        syncdetect.SyncHit.from_record({"window": "w", "kind": "pack", "stack": "x"})


def test_the_fake_leaves_torch_cuda_device_a_class(fake: FakeCuda) -> None:
    """torch tests ``isinstance(device, torch.cuda.device)`` wherever it reads a device index
    (``torch.cuda.current_stream()`` once CUDA is initialised, as on a GPU box); a faked
    ``torch.cuda.device`` that is no class made that raise ``TypeError`` on the H100 at afb5c10
    (tests/e2e/test_syncguard_case_runs.py). The line that raised, reached here without CUDA."""
    from torch.cuda._utils import _get_device_index

    assert isinstance(torch.cuda.device, type)
    assert _get_device_index(torch.device("cuda", 3)) == 3
    assert _get_device_index(torch.cuda.device(0)) == 0
    with torch.cuda.device(1):
        pass
