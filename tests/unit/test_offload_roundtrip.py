"""Property tests: every saved tensor survives save -> offload -> reload through ``OffloadContext``.

One group occurrence, driven the way model code drives it: the node under test is a custom
autograd Function that saves exactly the drawn tensors and hands back, in backward, whatever
autograd unpacks for them. The expectations (bit patterns, layout, bytes moved) are computed
here from the drawn tensors' metadata and Megatron-Core's view rule (docs/backends.md), never read
from the offloader.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given

from harness.offload.config import OffloadConfig
from harness.offload.protocol import IterationLog
from harness.offload.reference import OffloadContext
from harness.testing import strategies as hst
from harness.testing.autograd import SaveAndHandBack

OFFLOAD_EVERYTHING = OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=0)

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RoundTrip:
    at_commit: tuple[torch.Tensor, ...]
    """Clones of the saved tensors taken right before the commit (values at commit time)."""
    reloaded: tuple[torch.Tensor, ...]
    """What backward unpacked, in save order."""
    log: IterationLog


def round_trip(tensors: tuple[torch.Tensor, ...], *, mutate_after_commit: bool) -> RoundTrip:
    """Run one microbatch whose only group saves ``tensors``; optionally overwrite every byte
    of their storages after the commit, before backward."""
    off = OffloadContext(OFFLOAD_EVERYTHING, "cpu")
    x = torch.zeros(2, requires_grad=True)
    sink: list[torch.Tensor] = []
    off.begin_microbatch(0)
    group = off.group("core_attn", x, layer=0)
    with group:
        out = SaveAndHandBack.apply(group.input, sink, *tensors)
    at_commit = tuple(t.clone() for t in tensors)
    out = group.commit(out)
    if mutate_after_commit:
        flip_every_byte(tensors)
    out.sum().backward()
    off.end_iteration()
    assert torch.equal(x.grad, torch.ones(2)), "the group's identity ops changed the gradient"
    return RoundTrip(at_commit, tuple(sink), off.iteration_logs()[-1])


def flip_every_byte(tensors: tuple[torch.Tensor, ...]) -> None:
    """Invert every byte of each distinct storage once (an in-place write to each tensor that
    also works for stride-0 views, which reject ordinary in-place ops)."""
    flipped: set[int] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in flipped:
            continue
        flipped.add(storage.data_ptr())
        torch.empty(0, dtype=torch.uint8).set_(storage).bitwise_not_()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, so NaN payloads and -0.0 compare exactly."""
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        return tensor.view(_BITS_DTYPE[tensor.element_size()])
    return tensor


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def copies_whole_storage(tensor: torch.Tensor) -> bool:
    """Section 1.3: a non-contiguous view covering >= 50% of a storage whose size is a multiple
    of the itemsize is copied as the whole flat storage (layout restored on reload)."""
    if tensor.numel() == 0 or tensor.is_contiguous():
        return False
    storage_nbytes = tensor.untyped_storage().nbytes()
    own_nbytes = tensor.numel() * tensor.element_size()
    return storage_nbytes % tensor.element_size() == 0 and 2 * own_nbytes >= storage_nbytes


def predicted_d2h_bytes(tensor: torch.Tensor) -> int:
    """Bytes one saved tensor should move: 0 if empty (not eligible), the storage if it takes
    the whole-storage path, else its own elements (contiguous copy or gather)."""
    if copies_whole_storage(tensor):
        return tensor.untyped_storage().nbytes()
    return tensor.numel() * tensor.element_size()


def assert_layout_kept(original: torch.Tensor, reloaded: torch.Tensor) -> None:
    assert reloaded.dtype == original.dtype
    assert reloaded.shape == original.shape
    if copies_whole_storage(original):
        assert reloaded.stride() == original.stride()
        assert reloaded.storage_offset() == original.storage_offset()
    else:
        assert reloaded.is_contiguous()


def assert_clean_iteration(log: IterationLog, tensors: tuple[torch.Tensor, ...]) -> None:
    (record,) = log.groups
    assert record.decision == "offloaded"
    assert record.tracked == len(tensors)
    assert log.d2h_bytes == sum(predicted_d2h_bytes(t) for t in tensors)
    assert log.h2d_bytes == log.d2h_bytes
    assert record.d2h_copies == sum(t.numel() > 0 for t in tensors)
    assert log.leaked_tensors == 0
    assert log.pool_in_use == 0


@given(tensors=hst.saved_sets())
def test_reload_is_bitwise_equal_with_predicted_layout_and_bytes(
    tensors: tuple[torch.Tensor, ...],
) -> None:
    result = round_trip(tensors, mutate_after_commit=False)
    assert len(result.reloaded) == len(tensors)
    for original, reloaded in zip(tensors, result.reloaded, strict=True):
        assert bitwise_equal(reloaded, original)
        assert_layout_kept(original, reloaded)
    assert_clean_iteration(result.log, tensors)


@given(tensors=hst.saved_sets())
def test_in_place_write_after_commit_does_not_reach_the_reload(
    tensors: tuple[torch.Tensor, ...],
) -> None:
    result = round_trip(tensors, mutate_after_commit=True)
    for original, snapshot, reloaded in zip(
        tensors, result.at_commit, result.reloaded, strict=True
    ):
        if original.numel() > 0:
            # The write really happened, so equality below proves the reload is the commit copy.
            assert not bitwise_equal(original, snapshot)
        assert bitwise_equal(reloaded, snapshot)
    assert_clean_iteration(result.log, tensors)


@pytest.mark.parametrize(
    ("length", "step", "whole_storage"),
    [
        pytest.param(8, 2, True, id="exactly-50pct"),
        pytest.param(9, 2, True, id="5-of-9"),
        pytest.param(7, 2, True, id="4-of-7"),
        pytest.param(10, 3, False, id="4-of-10"),
        pytest.param(9, 3, False, id="3-of-9"),
    ],
)
def test_coverage_threshold_boundary(length: int, step: int, whole_storage: bool) -> None:
    base = hst.filled((length,), torch.float32, seed=length * 10 + step)
    view = base[::step]
    result = round_trip((view,), mutate_after_commit=False)
    (reloaded,) = result.reloaded
    assert bitwise_equal(reloaded, view)
    expected_bytes = length * 4 if whole_storage else view.numel() * 4
    assert result.log.d2h_bytes == expected_bytes
    assert (reloaded.stride() == view.stride()) is whole_storage


def test_misaligned_storage_is_gathered_even_when_dense() -> None:
    raw = hst.filled((13,), torch.uint8, seed=7)
    view = raw[:12].view(torch.float32)[::2]  # 2 of 3 floats: 8 bytes of a 13-byte storage
    result = round_trip((view,), mutate_after_commit=False)
    (reloaded,) = result.reloaded
    assert bitwise_equal(reloaded, view)
    assert reloaded.is_contiguous()
    assert result.log.d2h_bytes == 8


def test_square_transpose_keeps_its_layout() -> None:
    base = hst.filled((3, 3), torch.float32, seed=3)
    view = base.t()
    result = round_trip((view,), mutate_after_commit=False)
    (reloaded,) = result.reloaded
    assert reloaded.stride() == (1, 3)
    assert torch.equal(bits(reloaded), bits(base).t())
