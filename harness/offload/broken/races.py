"""Broken offloaders whose bug is a race between a copy and the memory it reads or writes
(a D2H or H2D still in flight). On CPU a deferred copy stands in for the copy still in flight
(``_DeferredD2H``, a D2H that lands only when something waits for it; ``PoolEarlyReuse``'s H2D
likewise). On CUDA ``SourceReuse`` and ``PoolEarlyReuse`` keep the genuine race, widened by the
reference's race delays; ``ReloadBeforeD2H`` defers its D2H copies there too, on the D2H
stream: its window is host time (a whole microbatch's forward or backward under 1F1B), which no
fixed GPU sleep is sure to outlast (see its docstring)."""

from __future__ import annotations

from collections import deque

import torch

from harness.offload.config import OffloadConfig
from harness.offload.pool import HostBufferPool
from harness.offload.reference import GroupState, OffloadContext, RaceDelays, group_range


class _ZeroedPool(HostBufferPool):
    """A pool whose new buffers start zeroed, so reading one before any copy landed in it is
    deterministic (a fresh pinned block may hold the bytes of an identical earlier run in the
    process, which would read back right)."""

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
    """A D2H still in flight, played by a deferred copy: on CPU always, on CUDA where the class
    sets ``defers_on_cuda`` (otherwise this class changes nothing there).

    A group's D2H copies are queued at its commit and *land* only when something waits for
    them: a prefetch's wait on the group's D2H, the max-inflight cap (the compute stream waits
    for the oldest D2H of the name), or the end of the iteration. A landing copy runs inside its
    group's d2h profiler range, so the transfer counts and the log are those of the reference.
    On CUDA it is issued on the D2H stream, which waited for the compute stream at the commit
    (so it reads the sources as they were then; the queue holds them alive), and the group's D2H
    event is recorded again after it, so every wait on that event waits for the landed copies.
    New host buffers start zeroed.
    """

    release_waits_for_d2h = True
    """Forced releases happen when the copies land (the reference's ``record_stream`` keeps the
    memory until the D2H has read it); False frees them at the commit."""
    defers_on_cuda = False
    """Whether the D2H copies are deferred on CUDA too (False: the genuine copies at the commit,
    the race left to the streams and the race delays)."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self._defers = self.defers_on_cuda or not self.cuda
        if self._defers:
            self.pool = _ZeroedPool(pin_memory=self.cuda, cap=self.config.pinned_pool_buffers)
        self._in_flight: dict[GroupState, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._held_releases: dict[GroupState, tuple[torch.Tensor, ...]] = {}
        self._cap_queue: dict[str, deque[GroupState]] = {}

    def _new_host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buffer = super()._new_host_buffer(shape, dtype)
        return buffer.zero_() if self._defers else buffer

    def _d2h_copy(self, group: GroupState, buffer: torch.Tensor, src: torch.Tensor) -> None:
        if self._defers:
            self._in_flight.setdefault(group, []).append((buffer, src))
        else:
            super()._d2h_copy(group, buffer, src)

    def _release(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        if self._defers and self.release_waits_for_d2h and group in self._in_flight:
            self._held_releases[group] = release
        else:
            super()._release(group, release)

    def _land(self, group: GroupState, *, after: torch.cuda.Event | None = None) -> None:
        """The group's queued D2H copies complete now; on CUDA the D2H stream first waits for
        ``after`` where given."""
        copies = self._in_flight.pop(group, [])
        if copies and self.cuda:
            with torch.cuda.stream(self._d2h):
                if after is not None:
                    self._d2h.wait_event(after)
                self._issue_landing(group, copies)
                group.d2h_event.record(self._d2h)
        elif copies:
            self._issue_landing(group, copies)
        held = self._held_releases.pop(group, None)
        if held is not None:
            super()._release(group, held)

    def _issue_landing(
        self, group: GroupState, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """The landing copies themselves, on the current stream, in the group's d2h range."""
        with group_range("d2h", group):
            for buffer, src in copies:
                super()._d2h_copy(group, buffer, self._landing_source(buffer, src))

    def _landing_source(self, buffer: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """What a landing copy reads (the source itself here)."""
        return src

    def _await_d2h(self, group: GroupState, *, inline: bool) -> None:
        self._land(group)
        super()._await_d2h(group, inline=inline)

    def _cap_inflight(self, group: GroupState) -> None:
        cap = self.config.max_inflight_offloads
        if self._defers and cap is not None:
            queue = self._cap_queue.setdefault(group.name, deque())
            queue.append(group)
            while len(queue) > cap:
                # before the reference makes the compute stream wait for its D2H event
                self._land(queue.popleft())
        super()._cap_inflight(group)

    def end_iteration(self) -> None:
        for group in list(self._in_flight):
            self._land(group)
        self._cap_queue.clear()
        super().end_iteration()


class ReloadBeforeD2H(_DeferredD2H):
    """Reload reads a host buffer before its D2H finished (Megatron-LM #7398, fix PR #7399).

    The inline reload (backward unpacks a tensor of a group nobody prefetched: in the warmup
    iteration the first group of each chunk's backward, and any group the prefetches passed
    over) has no edge on the group's D2H: its H2D skips ``wait_event(d2h_event)``, and its D2H
    lands only after the H2D has read the buffer (zeroed when new, else the bytes of the
    buffer's previous group). A prefetched reload waits for its D2H as the reference does, and
    a cap of 0 in-flight offloads closes the window (each D2H lands at its commit and the
    compute stream waits for it). Caught by loss equivalence and the reload checksums (the
    warmup step), on both devices.

    CUDA defers the D2H copies as CPU does (``defers_on_cuda``): they are issued on the D2H
    stream when something waits for them, the inline path's after the D2H stream has waited
    for the H2D's reload event. The genuine race (copies issued at the commit behind a sleep on
    the D2H stream) was a toss-up: its window runs from the commit to the inline H2D, host time
    that under 1F1B spans microbatch 1's whole forward (for microbatch 0's last groups) or
    microbatch 0's whole backward (for microbatch 1's), against a fixed GPU sleep (20M cycles,
    about 10 ms at the 1.98 GHz both the H100 and the H200 run at); an H100 box lost it on the
    1F1B attention row. Deferred, the D2H is still queued when the H2D reads: the race's worst
    interleaving, every time, on the inline path only.
    """

    name = "broken.reload_before_d2h"
    defers_on_cuda = True

    def _await_d2h(self, group: GroupState, *, inline: bool) -> None:
        if not inline:
            super()._await_d2h(group, inline=inline)

    def _reload(self, group: GroupState, *, inline: bool = False) -> None:
        super()._reload(group, inline=inline)
        # The copy lands after the inline H2D has read the buffer (a prefetched group's landed
        # before its H2D, in _await_d2h); on CUDA the D2H stream waits for the H2D's event.
        self._land(group, after=group.reload_event)


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
