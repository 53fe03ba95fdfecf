"""Host buffer pool for offloaded activations, keyed by (shape, dtype).

On CUDA the buffers are pinned so D2H/H2D copies are asynchronous DMA transfers. A buffer goes
back to the pool as soon as its H2D copy is *enqueued*, together with the event that marks the
copy's completion; the next user of the buffer makes its own stream wait on that event before
writing into it, so a pooled buffer is never overwritten while an H2D still reads it, and the
host never blocks.

On CUDA a pool buffer is pinned memory of its own size (``harness.offload.pinned.exact_pinned``),
not a caching-allocator block rounded up to a power of two: the pool keeps its buffers for the
run, so the rounding would be paid every step and reuse gains nothing. After the first steady
iteration the pool drops the buffers that iteration did not need at once (``trim``): the warmup
offloads every group, a steady iteration fewer, and the pool then holds what a steady iteration
has in flight at its peak. A buffer beyond a cap stays a caching-allocator block: it is dropped
at its release while its H2D may still read it, which only that allocator's event bookkeeping
makes safe.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.utils.deterministic

from harness.offload.pinned import exact_pinned

PoolKey = tuple[tuple[int, ...], torch.dtype]


@contextlib.contextmanager
def no_deterministic_fill() -> Iterator[None]:
    """New tensors meanwhile are not filled by the deterministic mode
    (``torch.utils.deterministic.fill_uninitialized_memory``, restored afterwards)."""
    flag = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = flag


def staging_buffer(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool = False
) -> torch.Tensor:
    """An uninitialised host buffer that its D2H copy fills completely before anything reads it.

    Under ``torch.use_deterministic_algorithms(True)`` (the harness trains that way) PyTorch
    fills every new ``torch.empty`` with NaN, on the host too: on the H200 that was 22 ms of
    host memset per traced ``moe-small`` step in the reference's commits (MoE groups change
    shape with routing, so the pool misses and allocates each step), on a launch-bound step
    where host time is step time. A staging buffer is overwritten by its D2H copy before any
    read, so the fill only costs. (The reload targets on the device stay filled:
    there a read racing ahead of the H2D copy could otherwise see the activation's own old
    values in a reused block and pass.)"""
    with no_deterministic_fill():
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin_memory)


@dataclass(slots=True)
class PoolStats:
    """Counters mirroring Megatron's pool statistics."""

    total_allocated: int = 0
    current_in_use: int = 0
    allocation_requests: int = 0
    free_requests: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    exhausted: int = 0
    trimmed: int = 0
    """Buffers ``HostBufferPool.trim`` dropped."""
    """Requests the pool could not serve because its cap was reached (each got a buffer of its
    own outside the pool, dropped again at its release)."""


class HostBufferPool:
    """FIFO pool of host buffers per (shape, dtype), holding at most ``cap`` buffers (None: no
    cap). Exhausted, it hands out a buffer of its own that ``release`` drops (counted in
    ``stats.exhausted``), so a capped pool never grows past its cap and never blocks."""

    def __init__(self, *, pin_memory: bool, cap: int | None = None) -> None:
        self.pin_memory = pin_memory
        self.cap = cap
        self.stats = PoolStats()
        self._outside: set[int] = set()  # ids of the handed-out buffers beyond the cap
        # key -> free buffers, each with the event its last reader recorded (None: free now)
        self._free: dict[PoolKey, deque[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._out: dict[PoolKey, int] = {}  # key -> pooled buffers handed out now
        self._peak: dict[PoolKey, int] = {}  # key -> the most handed out at once since a trim

    def acquire(
        self, shape: torch.Size, dtype: torch.dtype, stream: torch.cuda.Stream | None
    ) -> tuple[torch.Tensor, bool]:
        """A buffer of ``shape``/``dtype`` and whether it came from the pool.

        ``stream`` (the D2H stream on CUDA) is made to wait for the buffer's pending reader.
        """
        stats = self.stats
        stats.allocation_requests += 1
        stats.current_in_use += 1
        key = (tuple(shape), dtype)
        free = self._free.get(key)
        if free or self.cap is None or stats.total_allocated < self.cap:
            out = self._out[key] = self._out.get(key, 0) + 1
            if out > self._peak.get(key, 0):
                self._peak[key] = out
        if free:
            buffer, pending_read = free.popleft()
            if pending_read is not None and stream is not None:
                # ``stream.wait_event(pending_read)`` without its two Python wrappers (the
                # reference's hot path: one call per offloaded tensor).
                torch._C._CudaEventBase.wait(pending_read, stream)
            stats.pool_hits += 1
            return buffer, True
        if free is None:
            self._free[key] = deque()  # ``release`` appends to it
        stats.pool_misses += 1
        if self.cap is not None and stats.total_allocated >= self.cap:
            buffer = staging_buffer(shape, dtype, pin_memory=self.pin_memory)
            stats.exhausted += 1
            self._outside.add(id(buffer))  # the caller holds it until its release
            return buffer, False
        buffer = exact_pinned(shape, dtype) if self.pin_memory else None
        if buffer is None:  # CPU, or a registration that failed: the caching allocator's block
            buffer = staging_buffer(shape, dtype, pin_memory=self.pin_memory)
        stats.total_allocated += 1
        return buffer, False

    def release(self, buffer: torch.Tensor, pending_read: torch.cuda.Event | None) -> None:
        """Return ``buffer``; ``pending_read`` completes when its last H2D copy has finished."""
        self.stats.free_requests += 1
        self.stats.current_in_use -= 1
        if id(buffer) in self._outside:
            # Beyond the cap: dropped. On CUDA its H2D may still read it; the caching host
            # allocator keeps a pinned block until the work recorded on it is done.
            self._outside.discard(id(buffer))
            return
        key = (tuple(buffer.shape), buffer.dtype)
        self._out[key] -= 1
        self._free[key].append((buffer, pending_read))

    def count_peaks(self) -> None:
        """Count the most buffers handed out at once from now on (what ``trim`` keeps)."""
        self._peak = dict(self._out)

    def trim(self) -> int:
        """Drop the free buffers beyond the most handed out at once per (shape, dtype) since
        ``count_peaks`` (or the last trim, or the pool's start), and start counting again; a
        buffer whose last reader's event has not completed is kept (its memory is not the
        caching allocator's: nothing else would wait for that read). Returns the buffers
        dropped (``stats.trimmed``; ``stats.total_allocated`` counts every buffer ever made)."""
        dropped = 0
        for key, free in self._free.items():
            extra = len(free) + self._out.get(key, 0) - self._peak.get(key, 0)
            kept: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
            while free:
                buffer, pending = free.popleft()
                if extra > 0 and (pending is None or pending.query()):
                    extra -= 1
                    dropped += 1
                else:
                    kept.append((buffer, pending))
            self._free[key] = kept
        self._peak = dict(self._out)
        self.stats.trimmed += dropped
        return dropped

    def clear(self) -> None:
        """Drop every buffer, once the copies that read them have finished (on CUDA a pinned
        buffer of its own is unregistered and unmapped as it goes; run at the end of a run)."""
        for free in self._free.values():
            for _, pending in free:
                if pending is not None:
                    pending.synchronize()
        self._free.clear()
        self._out.clear()
        self._peak.clear()
