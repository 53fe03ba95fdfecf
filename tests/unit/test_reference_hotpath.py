"""Semantics the reference offloader's hot path must keep (``harness.offload.reference``): a
tensor saved twice in one group, a kept and an offloaded slot side by side, a plain tensor
flagged as a parameter, nested groups' hooks, tuple outputs through the commit, repeated
``mark_not_offloadable`` calls, the host buffer pool's FIFO reuse and the profiler ranges'
three modes."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from harness.offload.config import OffloadConfig
from harness.offload.pool import HostBufferPool
from harness.offload.ranges import RangeKey, current_range, profiler_range, range_name, watching
from harness.offload.reference import _MARK_CALLS_KEPT, OffloadContext
from harness.testing.autograd import SaveAndHandBack
from harness.testing.strategies import normal

MIN_NUMEL = 16
"""min_offloaded_tensor_size of these tests."""


def make_offloader(names: tuple[str, ...] = ("core_attn",)) -> OffloadContext:
    config = OffloadConfig(offload_modules=names, min_offloaded_tensor_size=MIN_NUMEL)
    return OffloadContext(config, "cpu")


def forward_one_group(
    off: OffloadContext, saved: tuple[torch.Tensor, ...], sink: list[torch.Tensor]
) -> torch.Tensor:
    """Microbatch 0's forward with one committed ``core_attn`` group saving ``saved``."""
    x = torch.zeros(2, requires_grad=True)
    off.begin_microbatch(0)
    group = off.group("core_attn", x, layer=0)
    with group:
        out = SaveAndHandBack.apply(group.input, sink, *saved)
    return group.commit(out)


def test_a_tensor_saved_twice_in_a_group_moves_twice_and_comes_back_twice() -> None:
    off = make_offloader()
    tensor = normal((4, 8), seed=1)
    sink: list[torch.Tensor] = []
    out = forward_one_group(off, (tensor, tensor), sink)
    assert off._device_refs == {}, "both saved slots were offloaded"
    out.sum().backward()
    off.end_iteration()
    (record,) = off.iteration_logs()[-1].groups
    nbytes = tensor.numel() * tensor.element_size()
    assert (record.tracked, record.d2h_copies, record.h2d_copies) == (2, 2, 2)
    assert (record.d2h_bytes, record.h2d_bytes) == (2 * nbytes, 2 * nbytes)
    assert (record.pool_hits, record.pool_misses) == (0, 2)  # one buffer per slot
    assert len(sink) == 2 and all(torch.equal(t, tensor) for t in sink)
    assert sink[0].data_ptr() != sink[1].data_ptr()


def test_a_kept_slot_beside_an_offloaded_one_is_held_until_unpacked() -> None:
    off = make_offloader()
    parameter = torch.nn.Parameter(normal((2 * MIN_NUMEL,), seed=2))
    off.mark_not_offloadable(parameter)
    marked, small = parameter.detach(), normal((MIN_NUMEL - 1,), seed=3)
    activation = normal((4, 8), seed=4)
    sink: list[torch.Tensor] = []
    out = forward_one_group(off, (marked, activation, small), sink)
    address = marked.untyped_storage().data_ptr()
    assert off._device_refs == {address: 1, small.untyped_storage().data_ptr(): 1}
    out.sum().backward()
    assert off._device_refs == {}, "every kept slot was released by its unpack"
    off.end_iteration()
    (record,) = off.iteration_logs()[-1].groups
    assert (record.tracked, record.d2h_copies, record.h2d_copies) == (3, 1, 1)
    assert sink[0] is marked and sink[2] is small
    assert torch.equal(sink[1], activation) and sink[1].data_ptr() != activation.data_ptr()


def test_a_plain_tensor_flagged_as_a_parameter_is_not_tracked() -> None:
    off = make_offloader()
    flagged = normal((4, 8), seed=5)
    flagged._is_param = True  # type: ignore[attr-defined]
    assert isinstance(flagged, torch.nn.Parameter) and type(flagged) is torch.Tensor
    sink: list[torch.Tensor] = []
    forward_one_group(off, (flagged,), sink).sum().backward()
    off.end_iteration()
    (record,) = off.iteration_logs()[-1].groups
    assert (record.tracked, record.d2h_copies) == (0, 0)
    assert sink == [flagged] and sink[0] is flagged


def test_nested_groups_save_into_the_innermost_open_one() -> None:
    off = make_offloader(("attn_norm", "core_attn"))
    x = torch.zeros(2, requires_grad=True)
    first, inner, after = (normal((4, 8), seed=seed) for seed in (6, 7, 8))
    sink: list[torch.Tensor] = []
    off.begin_microbatch(0)
    outer = off.group("attn_norm", x, layer=0)
    with outer:
        y = SaveAndHandBack.apply(outer.input, sink, first)
        group = off.group("core_attn", y, layer=0)
        with group:
            z = SaveAndHandBack.apply(group.input, sink, inner)
        z = group.commit(z)
        y = SaveAndHandBack.apply(z, sink, after)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    outer.commit(y).sum().backward()
    off.end_iteration()
    tracked = {r.name: r.tracked for r in off.iteration_logs()[-1].groups}
    assert tracked == {"attn_norm": 2, "core_attn": 1}
    assert all(torch.equal(a, b) for a, b in zip(sink, (after, inner, first), strict=True))


def test_commit_passes_element_zero_of_a_tuple_or_list_output_through() -> None:
    for container in (tuple, list):
        off = make_offloader()
        x = torch.zeros(2, requires_grad=True)
        off.begin_microbatch(0)
        group = off.group("core_attn", x, layer=0)
        with group:
            first = group.input * 2
        second = torch.ones(3)
        out = group.commit(container([first, second]))
        assert type(out) is container and len(out) == 2 and out[1] is second
        assert type(out[0].grad_fn).__name__ == "_GroupCommitBackward"
        out[0].sum().backward()
        assert torch.equal(x.grad, torch.full((2,), 2.0))
        off.end_iteration()
        assert group.commit(container()) == container()


def test_a_repeated_mark_call_marks_nothing_anew_until_a_tensor_moves() -> None:
    """The second of two identical calls is answered by the call cache (no per-tensor marking);
    once one of its tensors sits elsewhere, the same call marks it at its new address."""
    off = make_offloader()
    first, second = (torch.nn.Parameter(normal((2 * MIN_NUMEL,), seed=s)) for s in (6, 7))
    off.mark_not_offloadable(first, second)
    marked = dict(off._marked)
    off._marked.clear()  # a repeated call that marked anew would fill it again
    off.mark_not_offloadable(first, second)
    assert off._marked == {}, "the repeated call was not served from the call cache"
    off._marked.update(marked)
    moved = second.detach()
    second.data = normal((2 * MIN_NUMEL,), seed=8)  # same object, new storage
    off.mark_not_offloadable(first, second)
    assert off._is_marked(second.detach()) and off._is_marked(first.detach())
    assert not off._is_marked(moved)


def test_a_mark_call_of_a_sharded_tensor_is_not_cached() -> None:
    """A DTensor's shard (``_local_tensor``) may be replaced under the same object: such a call
    is marked anew every time, so a new shard is marked at its own address."""
    off = make_offloader()
    sharded = torch.zeros(1)  # stands in for a DTensor: the offloader reads _local_tensor
    sharded._local_tensor = normal((2 * MIN_NUMEL,), seed=9)  # type: ignore[attr-defined]
    off.mark_not_offloadable(sharded)
    assert off._mark_calls == {}
    sharded._local_tensor = normal((2 * MIN_NUMEL,), seed=10)  # type: ignore[attr-defined]
    off.mark_not_offloadable(sharded)
    assert off._is_marked(sharded._local_tensor.detach())  # type: ignore[attr-defined]


def test_the_mark_call_cache_stays_bounded() -> None:
    off = make_offloader()
    for seed in range(_MARK_CALLS_KEPT + 10):
        off.mark_not_offloadable(torch.nn.Parameter(normal((2,), seed=seed)))
    assert 0 < len(off._mark_calls) <= _MARK_CALLS_KEPT


def test_pool_reuses_a_returned_buffer_first_in_first_out() -> None:
    pool = HostBufferPool(pin_memory=False)
    shape = torch.Size((4, 8))
    first, hit = pool.acquire(shape, torch.float32, None)
    second, _ = pool.acquire(shape, torch.float32, None)
    assert not hit and first.shape == shape and first.dtype == torch.float32
    pool.release(first, None)
    pool.release(second, None)
    assert pool.acquire((4, 8), torch.float32, None) == (first, True)
    assert pool.acquire(shape, torch.float32, None) == (second, True)
    other, hit = pool.acquire(shape, torch.bfloat16, None)  # another key: a miss
    assert not hit and other.dtype == torch.bfloat16
    pool.release(other, None)
    stats = pool.stats
    assert (stats.allocation_requests, stats.pool_hits, stats.pool_misses) == (5, 2, 3)
    assert (stats.total_allocated, stats.free_requests, stats.current_in_use) == (3, 3, 2)


def test_profiler_ranges_exist_only_while_profiled_or_watched() -> None:
    with profiler_range("d2h", "core_attn", 0, 1):
        assert current_range() is None
    with watching():
        with profiler_range("d2h", "core_attn", 0, 1):
            with profiler_range("h2d", "attn_proj", 1, 2):
                assert current_range() == RangeKey("h2d", "attn_proj", 1, 2)
            assert current_range() == RangeKey("d2h", "core_attn", 0, 1)
        assert current_range() is None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with profiler_range("h2d", "attn_proj", 1, 2):
            assert current_range() is None
    assert range_name("h2d", "attn_proj", 1, 2) in {event.name for event in prof.events()}
