"""Deliberately broken offloaders: one real bug class each, for measuring detection power.

Each class is the reference offloader (``harness.offload.reference.OffloadContext``) with one
step overridden. On CUDA the fault is the genuine one (a missing event edge, a missing
``record_stream``, a pool buffer returned without its event), widened by the reference's race
delays (``RaceDelays``; backend spelling ``broken.<name>+delays``). On CPU the reference copies
synchronously, so a stream race cannot happen by itself; where the class allows, a deterministic
stand-in shows the same effect: a copy that is *deferred* until something waits for it plays a
copy still in flight.

``OFFLOADERS`` lists every broken backend with its bug class, the real-world report it
reproduces (a public bug report or a peer test's blind spot), whether CPU can show it, and its
CUDA race delays. The default-matrix cases and checks that catch each are the verify side's
(``harness.verify.detection.CATALOGUE``), which ``scripts/mutation_score`` and
``tests/detection/test_detection.py`` read.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from harness.offload.broken_cadence import EagerReload, TwoAhead
from harness.offload.config import OffloadConfig
from harness.offload.policy import apply_delta, apply_margin, fraction_disabled_count, summarize
from harness.offload.pool import HostBufferPool
from harness.offload.reference import (
    OFFLOADED,
    ChunkState,
    GroupState,
    HostCopy,
    OffloadContext,
    RaceDelays,
    Tag,
    group_range,
)

LONG_DELAY = 20_000_000
"""Sleep cycles per group (about 10 ms on an H200): far longer than any copy of a test model."""

NO_DELAYS = RaceDelays()


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


class _UnownedTag:
    """A saved-tensor tag without its chunk: (layer, name, slot) only."""

    __slots__ = ("layer", "name", "slot")

    def __init__(self, group: GroupState, slot: int) -> None:
        self.layer, self.name, self.slot = group.layer, group.name, slot


class WrongMicrobatch(OffloadContext):
    """Tensor returned from the wrong microbatch: tags without chunk identity (Megatron's
    ``tensor_pop`` on the current chunk, bugs list #22 and PR #6783).

    A tag names (layer, name, slot) but not its microbatch; backward looks the group up in the
    "current" chunk, the one whose forward ran last. Sequential schedules never notice; under
    1F1B (F0 F1 B0 B1) microbatch 0's backward gets microbatch 1's activations (same shapes,
    other data): wrong gradients with finite, plausible losses. The owner's tensors are read,
    not popped, so microbatch 1 still finds its own. Caught by loss equivalence on 1F1B rows
    with two microbatches (and by the leak check: microbatch 0's tensors are never unpacked);
    expert groups' shapes vary with routing, so MoE rows may crash instead.
    """

    name = "broken.wrong_microbatch"

    def _pack(self, group: GroupState, tensor: torch.Tensor) -> Any:
        packed = super()._pack(group, tensor)
        return _UnownedTag(group, packed.slot) if isinstance(packed, Tag) else packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _UnownedTag):
            return packed
        assert self._microbatch is not None, "backward outside an iteration"
        chunk: ChunkState = self._chunks[self._microbatch]
        group = next(
            (g for g in chunk.groups if (g.layer, g.name) == (packed.layer, packed.name)), None
        )
        if group is None:
            raise RuntimeError(f"no group {packed.name} (layer {packed.layer}) in this chunk")
        if group.status == OFFLOADED:
            self._reload(group, inline=True)
        self._wait_reload(group)
        value = group.entries[packed.slot]
        assert isinstance(value, torch.Tensor), "reloaded group still holds a host copy"
        return value


class _NamedTag:
    """A saved-tensor tag by group name only: (name, occurrence of the name in its chunk,
    slot), the way a manager that matches a backward group to a chunk by name identifies it."""

    __slots__ = ("index", "name", "slot")

    def __init__(self, name: str, index: int, slot: int) -> None:
        self.name, self.index, self.slot = name, index, slot


class ChunkOrder(OffloadContext):
    """Backward served from the chunk a manager without virtual stages expects (Megatron-Core's
    chunk handlers with virtual pipeline stages: the backward queue built in the wrong stage
    order, a handler advancing to the next chunk early).

    Tags name the group by name and its occurrence in the chunk, not by chunk; backward takes
    the tensor from the first chunk in *forward* order that still holds one of that name,
    occurrence and slot - right whenever chunks run backward in forward order (sequential,
    GPipe, 1F1B), wrong under the interleaved schedule, where a microbatch's last model chunk
    runs backward before its first: its backward gets the first chunk's activations of the same
    layer kind (same shapes, other layers' data). Every tensor is still handed out exactly once,
    so nothing leaks and nothing crashes. Caught by loss equivalence on the interleaved row,
    and by nothing else in the default matrix.
    """

    name = "broken.chunk_order"

    def _pack(self, group: GroupState, tensor: torch.Tensor) -> Any:
        packed = super()._pack(group, tensor)
        if not isinstance(packed, Tag):
            return packed
        same = [g for g in group.chunk.groups if g.name == group.name]
        return _NamedTag(group.name, same.index(group), packed.slot)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _NamedTag):
            return packed
        for chunk in self._chunks.values():  # forward (warmup creation) order
            same = [g for g in chunk.groups if g.name == packed.name]
            if packed.index < len(same) and packed.slot in same[packed.index].entries:
                return super()._unpack(Tag(same[packed.index], packed.slot))
        raise RuntimeError(f"no chunk holds {packed.name} #{packed.index} slot {packed.slot}")


EXPERT_BLOCK = ("expert_fc1", "moe_act")
"""The unfused expert path's groups, which TE's fused grouped MLP offloaded as one saved set."""


class UnselectedGroups(OffloadContext):
    """Unselected groups moved (TE fused grouped MLP: TE #3047/#3108/#3128, Megatron-LM #5082).

    The fused op offloaded its whole saved set whenever offloading was on, ignoring the
    per-module selection: with only ``moe_act`` selected, fc1's input moved too. Here selecting
    either expert name opens both. Values stay right; caught by name fidelity and transfer
    counts on rows that select ``moe_act`` without ``expert_fc1``.
    """

    name = "broken.unselected_groups"

    def _opens(self, name: str) -> bool:
        if name in EXPERT_BLOCK and self.config.selected & set(EXPERT_BLOCK):
            return self.enabled and torch.is_grad_enabled()
        return super()._opens(name)


class NoOp(OffloadContext):
    """Nothing moved at all (Megatron-LM 92d5c1f4d1 / #4173: the hybrid model never called
    ``init_chunk_handler``, so offloading was a silent no-op; DeepSpeed #522, Colossal-AI #643).

    Every group start returns a pass-through group. Caught by the offload proof (no selected
    group moved bytes in the warmup step), the transfer counts and the leak check's warmup flag.
    """

    name = "broken.noop"

    def _opens(self, name: str) -> bool:
        return False


class ViewDedup(OffloadContext):
    """Views deduplicated by storage ignoring layout (ms-swift PR #10157).

    Within a group, tensors are deduplicated by (storage address, dtype): the second view of a
    storage shares the first one's host copy and comes back with the first one's shape, strides
    and offset. The SwiGLU halves saved by ``moe_act`` (gate at offset 0, up at offset 64, same
    shape) come back both as the gate half: silently wrong gradients. Caught by loss
    equivalence and transfer counts (one copy fewer each way) on rows offloading ``moe_act``;
    the fp32 attention rows save one storage under two shapes, which crashes backward instead.
    """

    name = "broken.view_dedup"

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self._shared: dict[tuple[int, torch.dtype], HostCopy] = {}
        self._restored: dict[int, torch.Tensor] = {}

    def _offload(self, group: GroupState) -> None:
        self._shared = {}
        super()._offload(group)

    def _copy_out(self, group: GroupState, tensor: torch.Tensor) -> HostCopy:
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype)  # no shape, stride, offset
        if key not in self._shared:
            self._shared[key] = super()._copy_out(group, tensor)
        return self._shared[key]

    def _reload(self, group: GroupState, *, inline: bool = False) -> None:
        self._restored = {}
        super()._reload(group, inline=inline)

    def _copy_in(self, group: GroupState, entry: HostCopy) -> torch.Tensor:
        if id(entry) not in self._restored:
            self._restored[id(entry)] = super()._copy_in(group, entry)
        return self._restored[id(entry)]


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


class FractionCount(OffloadContext):
    """Wrong group count from the fraction policy (bugs list #20, the float-floor artefact;
    Megatron-LM PR #5101/#7575, partial offload).

    Keeps at least one trailing group per chunk on the device (``max(1, int(n * (1 - f)))``)
    instead of Megatron's ``int(n * (1 - f))``: one group too few offloaded per chunk at f = 1.0,
    and n = 5, f = 0.8 keeps 1 instead of 0. Values stay right; caught by transfer counts (a
    group predicted to move moves nothing).
    """

    name = "broken.fraction_count"

    def _apply_policies(
        self, forward: list[ChunkState], backward: list[ChunkState]
    ) -> dict[str, int]:
        apply_margin(backward)
        apply_delta(backward, self.config.pp_rank * self.config.delta_offload_bytes_across_pp_ranks)
        for chunk in backward:
            eligible = [g for g in chunk.groups if g.offload and g.warmup_bytes > 0]
            count = fraction_disabled_count(len(eligible), self.config.activation_offload_fraction)
            count = max(1, count) if eligible else 0
            for group in eligible[len(eligible) - count :]:
                group.offload, group.decision = False, "kept:fraction"
        return summarize(forward, backward[0] if backward else None)


class ExtraRoundTrip(OffloadContext):
    """An extra round trip per tensor (STYLE rule 14: values stay right, only counts show it;
    cf. PyTorch ``save_on_cpu`` copying a twice-saved tensor twice).

    Every tensor is copied to the host twice and back twice; the offloader's own log counts
    all of it, so only the independent prediction disagrees. Caught by transfer counts.
    """

    name = "broken.extra_round_trip"

    def _d2h_copy(self, group: GroupState, buffer: torch.Tensor, src: torch.Tensor) -> None:
        super()._d2h_copy(group, buffer, src)
        super()._d2h_copy(group, buffer, src)

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        super()._h2d_copy(group, restored, buffer)
        super()._h2d_copy(group, restored, buffer)


class OffloadsWeights(OffloadContext):
    """Parameter marks ignored: every weight a group saves (a linear's weight, a view of one)
    is copied out and back with the activations (cf. TransformerEngine's CPU offload before
    weights were tagged do-not-offload; Megatron's scripts require ``NVTE_CPU_OFFLOAD_V1=1``
    with TE >= 2.10 "to avoid offloading weights"; megatron-core 0.19's object check lets a
    view of a parameter through).

    Values stay right (the weight comes back unchanged) and its own log counts the extra
    copies. Caught by the weights check (naming the parameter) and by transfer counts.
    """

    name = "broken.offloads_weights"

    def _is_marked(self, tensor: torch.Tensor) -> bool:
        return False


class Pageable(OffloadContext):
    """Pageable host buffers (bugs list, Megatron's pinned pool; TE v2 pins every buffer).

    Host buffers are not pinned: copies become staged, host-synchronous transfers. CUDA only:
    the profiler's ``Memcpy DtoH (Device -> Pageable)`` events; caught by the transfer check's
    pageable count. CPU has no pinned memory, so the class cannot show there.
    """

    name = "broken.pageable"

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self.pool = HostBufferPool(pin_memory=False)

    def _new_host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu")


class NoGradWarmup(OffloadContext):
    """A no-grad pass taken as the warmup (NeMo-RL PR #2279 review; Megatron never reads grad
    mode or ``forward_only``).

    Groups open whatever the grad mode, so a no-grad forward (evaluation, log-probabilities)
    run first records the chunk structure with zero bytes and ends the warmup: the first
    training step runs the steady-state policies on byte counts of zero. Needs a no-grad pass
    before the first training step; the default matrix has none, so it cannot show there (its
    catalogue entry's ``needs``). With one, caught by the leak check (one iteration log too
    many, the warmup flag on the no-grad pass) and, with fraction < 1, transfer counts.
    """

    name = "broken.nograd_warmup"

    def _opens(self, name: str) -> bool:
        return self.enabled and name in self.config.selected


class StructureRemap(OffloadContext):
    """A group-structure change between warmup and steady state mapped silently (Megatron's
    name-based cursor skip and a976754b40's silent "no offload"; bugs list #3, invariant 17).

    The warmup records groups in commit order while steady state starts them in start order;
    with a spanning group (``attn_norm`` spans the attention groups, ``mlp_norm`` the expert
    groups) the two sequences differ. The reference raises ``StructureChangedError`` on any
    difference; this one maps each start to the next recorded group of that name from the
    cursor and silently passes through when none is left. Layer-0 starts get layer-2 groups,
    the last layer offloads nothing: values stay right, policies and ranges belong to the wrong
    groups. Caught by transfer counts on rows selecting ``attn_norm`` or ``mlp_norm``.
    """

    name = "broken.structure_remap"

    def _new_group(self, chunk: ChunkState, name: str, layer: int) -> GroupState | None:
        return GroupState(chunk, name, layer, self.cuda)  # recorded at its commit instead

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        if self.warmup:
            group.chunk.groups.append(group)
        super()._commit_forward(group, release)

    def _expect_group(self, chunk: ChunkState, name: str, layer: int) -> GroupState | None:
        for index in range(chunk.cursor, len(chunk.groups)):
            if chunk.groups[index].name == name:
                chunk.cursor = index + 1
                return chunk.groups[index]
        return None

    def end_iteration(self) -> None:
        for chunk in self._chunks.values():
            chunk.cursor = len(chunk.groups)  # no end-of-iteration structure check either
        super().end_iteration()


class HostSync(OffloadContext):
    """A host synchronisation per group in the commit path (``.item()`` after each offload;
    the class PyTorch's ``CudaSyncGuard`` test and the harness's sync-guard case look for).

    CUDA: every offloaded commit reads a device scalar, so the host waits for the compute
    stream (and its 4-byte DtoH memcpy lies outside every group range). Caught on CUDA by the
    no-host-sync case (``cases/test_sync.py``) and by the transfer check's stray-memcpy count.
    CPU has no device to wait for, so the class cannot show there.
    """

    name = "broken.host_sync"

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self._probe = torch.zeros((), device=self.device)

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        super()._commit_forward(group, release)
        if group.iter_decision == "offloaded":
            self._probe.item()  # the bug: a host sync on the hot path


class CorruptReload(OffloadContext):
    """Transport corruption: one bit flipped on the way back (STYLE rule 14; the generic
    symptom of every race above).

    The lowest exponent bit of the first element of every reloaded floating tensor is flipped
    (the value doubles or halves). Caught by loss equivalence, classified as transport
    corruption (the hooks baseline equals plain).
    """

    name = "broken.corrupt_reload"

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        super()._h2d_copy(group, restored, buffer)
        if restored.is_floating_point() and restored.numel() and restored.is_contiguous():
            # Little-endian: exponent bit 0 sits right above the mantissa bits.
            mantissa = round(-math.log2(torch.finfo(restored.dtype).eps))
            byte = restored.view(torch.uint8)[mantissa // 8 : mantissa // 8 + 1]
            # A mask tensor, not a Python int: a wrapped scalar would add a counted copy_.
            byte.bitwise_xor_(torch.full_like(byte, 1 << (mantissa % 8)))


class MiddleStepSkip(OffloadContext):
    """A group left on the device in one step between the warmup and the final one (a per-step
    policy bug: an offloader that moves only on some iterations).

    In step 2 every layer-0 group stays on the device, and its log says so (``kept:skipped``).
    Values stay right and steps 0 and 5 move exactly the prediction, so only a check of every
    step sees it. Caught by transfer counts (the steps before the final one).
    """

    name = "broken.middle_step_skip"

    def _decide(self, group: GroupState) -> str:
        decision = super()._decide(group)
        if len(self._logs) == 2 and group.layer == 0 and decision == "offloaded":
            return "kept:skipped"
        return decision


class LyingLog(OffloadContext):
    """An offloader whose log lies in one middle step: iteration 3's log claims one D2H copy
    more for its first offloaded group than it made (a stale or double-counted log record).

    Every copy is right; only the log of step 3 is wrong. Caught by transfer counts (the
    offloader's log against the counted copies, in the steps before the final one).
    """

    name = "broken.lying_log"

    def end_iteration(self) -> None:
        super().end_iteration()
        if len(self._logs) != 4:
            return
        log = self._logs[-1]
        records = list(log.groups)
        for i, record in enumerate(records):
            if record.d2h_copies:
                records[i] = dataclasses.replace(record, d2h_copies=record.d2h_copies + 1)
                break
        self._logs[-1] = dataclasses.replace(log, groups=tuple(records))


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokenOffloader:
    """One broken offloader: its class and what the backend resolver and a report say of it. Which
    cases and checks catch it is the verify side's (``harness.verify.detection``)."""

    factory: type[OffloadContext]
    bug_class: str
    """One line: what goes wrong."""
    reference: str
    """The real-world report(s) it reproduces."""
    cpu: bool
    """Whether the class can show on CPU at all (False: CUDA only)."""
    cuda_delays: RaceDelays = NO_DELAYS
    """Race delays that widen its window on CUDA (``scripts/mutation_score --device cuda``)."""

    @property
    def name(self) -> str:
        return self.factory.name

    @property
    def description(self) -> str:
        return f"{self.bug_class} - {self.reference}"


OFFLOADERS: tuple[BrokenOffloader, ...] = (
    BrokenOffloader(
        factory=ReloadBeforeD2H,
        bug_class="inline reload reads a host buffer before its D2H finished",
        reference="Megatron-LM #7398",
        cpu=True,
        cuda_delays=RaceDelays(d2h=LONG_DELAY),
    ),
    BrokenOffloader(
        factory=SourceReuse,
        bug_class="source freed or reused before its D2H finished",
        reference="torchtune #1867",
        cpu=True,
        cuda_delays=RaceDelays(d2h=LONG_DELAY),
    ),
    BrokenOffloader(
        factory=WrongMicrobatch,
        bug_class="tensor returned from the wrong microbatch (tags without chunk identity)",
        reference="Megatron-LM tensor_pop, bugs list #22, PR #6783",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ChunkOrder,
        bug_class="backward served from the wrong model chunk (chunks assumed to run backward "
        "in forward order)",
        reference="Megatron-Core chunk handlers with virtual pipeline stages (issue 25)",
        cpu=True,
    ),
    BrokenOffloader(
        factory=UnselectedGroups,
        bug_class="unselected groups moved (moe_act selected, fc1's input moved too)",
        reference="TE fused grouped MLP #3047/#3108, Megatron-LM #5082",
        cpu=True,
    ),
    BrokenOffloader(
        factory=NoOp,
        bug_class="nothing moved at all (offloading a silent no-op)",
        reference="Megatron-LM 92d5c1f4d1 (#4173), DeepSpeed #522",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ViewDedup,
        bug_class="views deduplicated by storage ignoring layout (wrong view reloaded)",
        reference="ms-swift PR #10157",
        cpu=True,
    ),
    BrokenOffloader(
        factory=PoolEarlyReuse,
        bug_class="pooled host buffer reused while its H2D is pending",
        reference="Megatron pinned-pool hazard (bugs list #19), TE #2341",
        cpu=True,
        cuda_delays=RaceDelays(h2d=LONG_DELAY),
    ),
    BrokenOffloader(
        factory=FractionCount,
        bug_class="wrong group count from the fraction policy (keeps >= 1 group per chunk)",
        reference="bugs list #20 (float floor), Megatron-LM PR #7575",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ExtraRoundTrip,
        bug_class="an extra round trip per tensor (values right, only counts show it)",
        reference="STYLE rule 14; save_on_cpu double copies",
        cpu=True,
    ),
    BrokenOffloader(
        factory=OffloadsWeights,
        bug_class="weights offloaded with the activations (parameter marks ignored)",
        reference="TE CPU offload before do-not-offload weight tags; megatron-core 0.19",
        cpu=True,
    ),
    BrokenOffloader(
        factory=Pageable,
        bug_class="pageable host buffers",
        reference="Megatron/TE pin every host buffer",
        cpu=False,
    ),
    BrokenOffloader(
        factory=NoGradWarmup,
        bug_class="a no-grad pass taken as the warmup",
        reference="NeMo-RL PR #2279 review",
        cpu=True,
    ),
    BrokenOffloader(
        factory=StructureRemap,
        bug_class="group structure change between warmup and steady state mapped silently",
        reference="Megatron-LM a976754b40 (#3043), PR #6783",
        cpu=True,
    ),
    BrokenOffloader(
        factory=HostSync,
        bug_class="host synchronisation per group in the commit path",
        reference="PyTorch CudaSyncGuard test; issue 9 sync guard",
        cpu=False,
    ),
    BrokenOffloader(
        factory=MiddleStepSkip,
        bug_class="a group left on the device in one middle step (moves only on some steps)",
        reference="issue 23: bugs confined to the steps between the warmup and the final one",
        cpu=True,
    ),
    BrokenOffloader(
        factory=LyingLog,
        bug_class="the offloader's log lies in one middle step",
        reference="issue 23: a log checked only in the final step",
        cpu=True,
    ),
    BrokenOffloader(
        factory=CorruptReload,
        bug_class="transport corruption: one bit flipped on the way back",
        reference="STYLE rule 14",
        cpu=True,
    ),
    BrokenOffloader(
        factory=EagerReload,
        bug_class="every offloaded group reloaded at the start of its pass's backward",
        reference="Megatron-LM #7575 (reload cadence, backward peak); issue 50",
        cpu=True,
    ),
    BrokenOffloader(
        factory=TwoAhead,
        bug_class="reloads prefetched two groups ahead of their backward",
        reference="Megatron-LM #7575 / dev #5101 (reloads run ahead of their backward)",
        cpu=True,
    ),
)
"""Every broken offloader, in the catalogue's order (``harness.verify.detection.CATALOGUE``)."""

for _record in OFFLOADERS:  # each backend's record: the reference's, with its own description
    _record.factory.capabilities = dataclasses.replace(
        OffloadContext.capabilities, description=f"broken: {_record.description}"
    )
del _record

BROKEN: dict[str, type[OffloadContext]] = {record.name: record.factory for record in OFFLOADERS}
"""Backend name -> factory of every broken offloader."""
