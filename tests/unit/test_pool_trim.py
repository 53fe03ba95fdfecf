"""The reference's host buffer pool (``harness.offload.pool.HostBufferPool``): it trims to the
most buffers a steady iteration had out at once, keeps a buffer whose last reader has not
finished, waits for readers before dropping everything, and on CUDA takes pinned buffers of
their own size (``harness.offload.pinned.exact_pinned``), falling back to the caching
allocator's pinned blocks - never to pageable memory - where registration fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.offload import pool as pool_module
from harness.offload.pool import HostBufferPool

SHAPE = torch.Size([4, 8])


class _Event:
    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True


def _out(pool: HostBufferPool, n: int) -> list[torch.Tensor]:
    return [pool.acquire(SHAPE, torch.float32, None)[0] for _ in range(n)]


def test_trim_keeps_what_the_steady_iteration_had_out_at_once() -> None:
    pool = HostBufferPool(pin_memory=False)
    warmup = _out(pool, 3)  # the warmup offloads every group: 3 at once
    for buffer in warmup:
        pool.release(buffer, None)
    pool.count_peaks()
    steady = _out(pool, 2)  # a steady iteration: 2 at once
    for buffer in steady:
        pool.release(buffer, None)
    assert pool.trim() == 1 and pool.stats.trimmed == 1
    assert pool.stats.total_allocated == 3  # every buffer ever made, trimmed or not
    again = _out(pool, 2)
    assert pool.stats.pool_hits == 4 and pool.stats.total_allocated == 3  # no new buffer
    assert {b.data_ptr() for b in again} == {b.data_ptr() for b in steady}


def test_a_buffer_still_read_is_not_trimmed_and_clear_waits_for_its_reader() -> None:
    pool = HostBufferPool(pin_memory=False)
    buffers = _out(pool, 2)
    pool.count_peaks()
    pending = _Event(done=False)
    pool.release(buffers[0], pending)  # type: ignore[arg-type]
    pool.release(buffers[1], pending)  # type: ignore[arg-type]
    assert pool.trim() == 0  # nothing out since counting, but both still read by an H2D
    pool.clear()
    assert pending.waited


def test_cuda_buffers_are_exact_pinned_or_the_allocators_pinned_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[dict[str, Any]] = []

    def staging(shape: Any, dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
        made.append({"pin_memory": pin_memory})
        return torch.empty(shape, dtype=dtype)

    exact = torch.empty(SHAPE)
    monkeypatch.setattr(pool_module, "staging_buffer", staging)
    monkeypatch.setattr(pool_module, "exact_pinned", lambda shape, dtype: exact)
    pool = HostBufferPool(pin_memory=True)
    assert pool.acquire(SHAPE, torch.float32, None)[0] is exact and not made
    monkeypatch.setattr(pool_module, "exact_pinned", lambda shape, dtype: None)  # refused
    pool.acquire(SHAPE, torch.float32, None)
    assert made == [{"pin_memory": True}]  # pinned by the caching allocator, never pageable
