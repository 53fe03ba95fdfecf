"""Broken offloaders whose bug is a race between a copy and the memory it reads or writes
(a D2H or H2D still in flight): the fault is genuine on CUDA, widened by the reference's race
delays, and on CPU a deferred copy stands in for the copy still in flight (``_DeferredD2H``,
a D2H that lands only when something waits for it; ``PoolEarlyReuse``'s H2D likewise)."""

from __future__ import annotations

from collections import deque

import torch

from harness.offload.config import OffloadConfig
from harness.offload.pool import HostBufferPool
from harness.offload.reference import GroupState, OffloadContext, RaceDelays, group_range


class _ZeroedPool(HostBufferPool):
    """A pool whose new buffers start zeroed, so reading one before any copy landed in it is
    deterministic (CPU stand-ins only)."""

    def acquire(
        self, shape: torch.Size, dtype: torch.dtype, stream: torch.cuda.Stream | None
    ) -> tuple[torch.Tensor, bool]:
        buffer, hit = super().acquire(shape, dtype, stream)
        if not hit:
            buffer.zero_()
        return buffer, hit


class _RecentFirstPool(_ZeroedPool):
    """A pool that hands out the most recently returned buffer of a shape first (cache-warm),
    instead of the reference's oldest-first order."""

    def release(self, buffer: torch.Tensor, pending_read: torch.cuda.Event | None) -> None:
        super().release(buffer, pending_read)
        free = self._free[(tuple(buffer.shape), buffer.dtype)]
        free.appendleft(free.pop())


class _DeferredD2H(OffloadContext):
    """CPU stand-in for a D2H still in flight (on CUDA this class changes nothing).

    A group's D2H copies are queued at its commit and *land* only when something waits for
    them: a prefetch's wait on the group's D2H, the max-inflight cap (the compute stream waits
    for the oldest D2H of the name), or the end of the iteration. A landing copy runs inside its
    group's d2h profiler range, so the transfer counts and the log are those of the reference.
    New host buffers start zeroed.
    """

    release_waits_for_d2h = True
    """Forced releases happen when the copies land (the reference's ``record_stream`` keeps the
    memory until the D2H has read it); False frees them at the commit."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        if not self.cuda:
            self.pool = _ZeroedPool(pin_memory=False)
        self._in_flight: dict[GroupState, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._held_releases: dict[GroupState, tuple[torch.Tensor, ...]] = {}
        self._cap_queue: dict[str, deque[GroupState]] = {}

    def _new_host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buffer = super()._new_host_buffer(shape, dtype)
        return buffer if self.cuda else buffer.zero_()

    def _d2h_copy(self, group: GroupState, buffer: torch.Tensor, src: torch.Tensor) -> None:
        if self.cuda:
            super()._d2h_copy(group, buffer, src)
        else:
            self._in_flight.setdefault(group, []).append((buffer, src))

    def _release(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        if self.cuda or not self.release_waits_for_d2h or group not in self._in_flight:
            super()._release(group, release)
        else:
            self._held_releases[group] = release

    def _land(self, group: GroupState) -> None:
        """The group's queued D2H copies complete now."""
        copies = self._in_flight.pop(group, [])
        if copies:
            with group_range("d2h", group):
                for buffer, src in copies:
                    super()._d2h_copy(group, buffer, self._landing_source(buffer, src))
        held = self._held_releases.pop(group, None)
        if held is not None:
            super()._release(group, held)

    def _landing_source(self, buffer: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """What a landing copy reads (the source itself here)."""
        return src

    def _await_d2h(self, group: GroupState, *, inline: bool) -> None:
        self._land(group)
        super()._await_d2h(group, inline=inline)

    def _cap_inflight(self, group: GroupState) -> None:
        super()._cap_inflight(group)
        cap = self.config.max_inflight_offloads
        if self.cuda or cap is None:
            return
        queue = self._cap_queue.setdefault(group.name, deque())
        queue.append(group)
        while len(queue) > cap:
            self._land(queue.popleft())

    def end_iteration(self) -> None:
        for group in list(self._in_flight):
            self._land(group)
        self._cap_queue.clear()
        super().end_iteration()


class ReloadBeforeD2H(_DeferredD2H):
    """Reload reads a host buffer before its D2H finished (Megatron-LM #7398, fix PR #7399).

    The inline reload (backward unpacks a tensor of a group nobody prefetched; in the warmup
    iteration the first group of each chunk's backward) has no edge on the group's D2H event.
    CUDA: the H2D stream skips ``wait_event(d2h_event)`` on that path; ``+delays`` with a slow
    D2H stream widens the window. CPU: the inline path reads the buffer first, the deferred D2H
    lands afterwards (zeroed or stale bytes come back). Caught by loss equivalence (the warmup
    step's gradients); a cap of 0 in-flight offloads closes the window (the compute stream waits
    for each D2H at its commit), on both devices.
    """

    name = "broken.reload_before_d2h"

    def _await_d2h(self, group: GroupState, *, inline: bool) -> None:
        if not inline:
            super()._await_d2h(group, inline=inline)

    def _reload(self, group: GroupState, *, inline: bool = False) -> None:
        super()._reload(group, inline=inline)
        self._land(group)  # CPU: the copy lands after the inline H2D has read the buffer


class SourceReuse(_DeferredD2H):
    """Source freed or reused before its D2H finished (torchtune #1867; trl #7195).

    No ``record_stream`` on offloaded sources or forced-released tensors: their memory returns
    to the allocator while the D2H still has to read it. CUDA: with ``+delays`` on the D2H
    stream the next allocations overwrite the sources first. CPU: the forced release frees the
    storage at the commit while the D2H is deferred; a landing copy from a freed storage reads
    the memory's next user (zeros here). Caught by loss equivalence.
    """

    name = "broken.source_reuse"
    release_waits_for_d2h = False

    def _protect_source(self, tensor: torch.Tensor) -> None:
        return None

    def _landing_source(self, buffer: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if src.untyped_storage().nbytes() == 0:
            return torch.zeros_like(buffer)  # freed: the allocator handed the memory on
        return src


class PoolEarlyReuse(OffloadContext):
    """Pooled host buffer reused while its H2D is pending (Megatron pinned-pool hazard, bugs
    list #19; TE #2341 double-buffer reuse).

    The pool gets a buffer back at H2D enqueue without the H2D's event, so the next D2H may
    write it before the H2D has read it; the pool hands out the most recently returned buffer
    first, so that next D2H is the first one of the shape. CUDA: ``+delays`` on the H2D
    stream. CPU: a reload's H2D copies land only when the consumer waits for them, so a D2H
    acquiring the buffer in between overwrites the data first. Needs a forward between a
    prefetch and its consumer: 1F1B with at least 3 microbatches (at the end of microbatch 0's
    backward the last group of microbatch 1 is prefetched, then microbatch 2's forward runs).
    The default matrix has 2 microbatches per row, so it cannot show there (its catalogue
    entry's ``needs``). Caught by loss equivalence on such a row.
    """

    name = "broken.pool_early_reuse"

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self.pool = _RecentFirstPool(pin_memory=self.cuda)
        self._h2d_in_flight: dict[GroupState, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _return_buffer(self, group: GroupState, buffer: torch.Tensor) -> None:
        self.pool.release(buffer, None)  # no event: free to write at once

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        if self.cuda:
            super()._h2d_copy(group, restored, buffer)
        else:
            self._h2d_in_flight.setdefault(group, []).append((restored, buffer))

    def _wait_reload(self, group: GroupState) -> None:
        super()._wait_reload(group)
        copies = self._h2d_in_flight.pop(group, [])
        if copies:
            with group_range("h2d", group):
                for restored, buffer in copies:
                    super()._h2d_copy(group, restored, buffer)

    def end_iteration(self) -> None:
        for group in list(self._h2d_in_flight):
            self._wait_reload(group)
        super().end_iteration()
