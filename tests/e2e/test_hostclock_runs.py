"""``harness.measure.hostclock`` on clocked runs (moved from ``tests/unit/test_hostclock.py``,
whose tests train nothing): the host time inside an offloader's entry points, on CPU (the
windows are the sync guard's, so the same coverage holds on CUDA), and the allocator counters
on CUDA."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import pytest
import torch
from hostclock_setup import CONFIG, CPU, RUN, SPEC
from hostclock_setup import reference as _reference

from harness.measure.hostclock import (
    ALLOCATOR_COUNTERS,
    KINDS,
    HostClock,
    run_clocked,
)
from harness.offload.protocol import Group, Output, Wrapper
from harness.offload.reference import OffloadContext
from harness.vocab.spec import preset

SLEEP_S = 0.004


class _SlowGroup:
    """A group whose commit sleeps ``SLEEP_S`` on the host before the real one."""

    def __init__(self, inner: Group) -> None:
        self._inner = inner
        self.input = inner.input

    def __enter__(self) -> _SlowGroup:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)  # type: ignore[arg-type]

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        time.sleep(SLEEP_S)
        return self._inner.commit(output, release)


class _SlowCommits(Wrapper):
    """The reference, with a host stall in every commit of a selected group."""

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        inner = self.inner.group(name, x, layer=layer)
        return _SlowGroup(inner) if name in CONFIG.selected else inner


def test_every_entry_point_of_the_reference_is_clocked() -> None:
    found = run_clocked(SPEC, RUN, _reference(), CPU, clocked={1, 2})
    assert found.steps == (1, 2)
    # The windows that a step of the reference must open, with counts the model fixes: a group
    # start, enter, exit and commit per group the model opens, a pack per saved tensor and
    # one unpack for each, the backward of its two autograd nodes per selected group.
    for kind in ("begin_microbatch", "start", "enter", "pack", "exit", "commit", "unpack"):
        assert found.calls[kind] > 0 and found.seconds[kind] > 0, kind
    assert found.calls["begin_microbatch"] == RUN.microbatches
    assert found.calls["end_iteration"] == 1
    assert found.calls["start"] == found.calls["enter"] == found.calls["exit"]
    assert found.calls["pack"] == found.calls["unpack"]
    selected = len(SPEC.group_sequence(CONFIG.selected))
    assert found.calls["backward"] == 2 * selected * RUN.microbatches
    assert set(found.seconds) <= set(KINDS)
    assert 0 < found.total_s < found.host_step_s


def test_a_host_stall_lands_in_its_entry_point() -> None:
    """A commit that sleeps 4 ms shows up as at least that much commit time per commit."""
    plain = run_clocked(SPEC, RUN, _reference(), CPU, clocked={1, 2})
    slow = run_clocked(SPEC, RUN, _SlowCommits(_reference()), CPU, clocked={1, 2})
    commits = slow.calls["commit"]
    assert commits == plain.calls["commit"] > 0
    stalled = len(SPEC.group_sequence(CONFIG.selected)) * RUN.microbatches
    assert slow.seconds["commit"] >= stalled * SLEEP_S
    assert slow.seconds["commit"] - plain.seconds["commit"] >= 0.9 * stalled * SLEEP_S
    assert "commit" in slow.summary().split("(")[1].split(",")[0]  # largest kind first


@pytest.mark.gpu
def test_cuda_counts_a_pinned_allocation_per_step() -> None:
    """On CUDA every clocked step counts the allocators' misses: the reference's steady steps
    have none on a small model, and a pinned allocation of a new size per step is one."""
    device = torch.device("cuda", torch.cuda.current_device())
    spec = preset("hybrid-tiny")
    steady = run_clocked(spec, RUN, OffloadContext(CONFIG, device), device, clocked={1, 2})
    assert set(steady.allocator) == set(ALLOCATOR_COUNTERS)
    assert steady.allocator["pinned allocs"] == 0 and steady.allocator["cudaMalloc"] == 0
    sizes = iter(range(1, 10))

    class _PinsEveryStep(Wrapper):
        def end_iteration(self) -> None:
            # a new power-of-two size class each step: none is cached (the cache emptied below)
            torch.empty(2 ** (20 + next(sizes)), dtype=torch.uint8, pin_memory=True)
            self.inner.end_iteration()

    # The pinned allocator caches a freed block for its whole process, per power of two, and
    # an earlier test of this pytest worker may have left 4 and 8 MiB blocks there (a small
    # model's offload run pins blocks of those sizes): the H100 at afb5c10 counted no pinned
    # allocation here. Emptied, the cache holds none of the sizes the steps pin.
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    assert empty_host_cache is not None, f"torch {torch.__version__} cannot empty its pinned cache"
    empty_host_cache()
    missing = run_clocked(
        spec, RUN, _PinsEveryStep(OffloadContext(CONFIG, device)), device, clocked={1, 2}
    )
    assert missing.allocator["pinned allocs"] >= 1, missing.allocator


def test_garbage_collections_in_a_step_are_timed() -> None:
    """A full collection forced at the start of every microbatch's first group shows as gen2
    runs and gc time (one per microbatch: a full collection in a test process holding torch
    costs tens of milliseconds)."""
    first = SPEC.group_sequence(CONFIG.selected)[0]

    class _Collects(Wrapper):
        def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
            if (layer, name) == first:
                gc.collect()
            return self.inner.group(name, x, layer=layer)

    plain = run_clocked(SPEC, RUN, _reference(), CPU, clocked={1, 2})
    found = run_clocked(SPEC, RUN, _Collects(_reference()), CPU, clocked={1, 2})
    assert found.gc_runs[2] >= RUN.microbatches > plain.gc_runs.get(2, 0)
    assert found.gc_s > plain.gc_s
    assert f"gen2 {found.gc_runs[2]:g}" in found.summary()
    assert gc.callbacks.count(None) == 0 and not any(
        getattr(cb, "__self__", None).__class__ is HostClock for cb in gc.callbacks
    )
