"""The bundled reference offloader: Megatron-Core's fine-grained activation offloading semantics,
written from scratch around one explicit per-run ``OffloadContext``.

Vocabulary
    chunk   - the groups of one microbatch's forward (Megatron: a ChunkOffloadHandler).
    group   - one occurrence of a named group (``core_attn`` of layer 3 in microbatch 1): the
              tensors autograd saved while its ``with`` block ran.
    warmup  - the first iteration that opened a group. It records the chunk/group structure and
              offloads every selected group; at its end the post-warmup policies
              (``harness.offload.policy``) decide which groups stay on the device afterwards.

Where we deliberately differ from Megatron-Core (each difference removes a known bug class):
    * No singleton: a context per run owns streams, pool, policy state and the transfer log.
    * Tags carry their group (hence chunk): a saved tensor always comes back from the microbatch
      that saved it, however forwards and backwards interleave.
    * Every H2D waits for the D2H that filled its buffer, also when backward unpacks a tensor
      before any prefetch reloaded it (Megatron #7398's inline path has no such edge).
    * A pooled host buffer returns with the event of its H2D; its next D2H waits for that event.
    * A no-grad forward opens no groups, so it can never be taken as the warmup.
    * After the warmup, a microbatch or group the warmup did not record is an error, not a
      silent remap or a silent "no offload".

Stream discipline on CUDA (none of it blocks the host):
    commit   d2h waits for the compute stream; copies on d2h; src.record_stream(d2h); d2h event
    reload   h2d waits for the compute stream; h2d.wait_event(d2h event); copies on h2d; reload
             event
    use      compute.wait_event(reload event) before the first unpack / at commit-backward
A side stream "waits for the compute stream" through the group's own ``ready_event``, recorded
on the compute stream just before (the ordering of ``wait_stream``, without a new event per
call), and the copies are issued after a plain ``set_stream`` switch, restored after: the hot
path makes as few Python-level calls per group as it can, and makes its stream and event calls
straight to torch's C++ bindings (``_CudaCalls``).
On CPU the same bookkeeping runs with synchronous copies into separate host buffers.

Variants of the reference (``harness.offload.broken``: the reference with one bug each) subclass
``OffloadContext`` and override its steps; ``GroupState``, ``ChunkState``, ``HostCopy``, ``Tag``,
the status values (``OPEN``, ``KEPT``, ``OFFLOADED``, ``RELOADING``) and ``group_range`` are the
public building blocks they share. Module names with a leading underscore stay private.
"""

from __future__ import annotations

import contextlib
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import MOE_EXPERT_NAMES, OffloadConfig
from harness.offload.passthrough import PassThroughGroup, apply_to_first
from harness.offload.policy import apply_post_warmup
from harness.offload.pool import HostBufferPool, staging_buffer
from harness.offload.protocol import (
    Capabilities,
    GroupRecord,
    IterationLog,
    Output,
    local_tensor,
)
from harness.offload.ranges import Direction, profiler_range
from harness.offload.semantics import MEGATRON_MAIN

_MARK_CALLS_KEPT = 1024
"""Distinct ``mark_not_offloadable`` calls remembered (then forgotten at once: a model marking
fresh tensors on every call cannot grow the cache without bound)."""

# A non-contiguous view covering at least this share of its storage is copied as the whole flat
# storage (one DMA, layout restored on reload); a sparser view is gathered to contiguous.
FULL_STORAGE_MIN_COVERAGE = 0.5

_push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks

OPEN, KEPT, OFFLOADED, RELOADING = "open", "kept", "offloaded", "reloading"
"""``GroupState.status`` values within an iteration (building blocks for reference variants)."""


class StructureChangedError(RuntimeError):
    """The steady-state group sequence differs from the one the warmup recorded."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RaceDelays:
    """GPU sleep cycles injected to widen race windows (``torch.cuda._sleep``); CUDA only."""

    d2h: int = 0
    """Before each group's D2H copies, on the D2H stream."""
    h2d: int = 0
    """Before each group's H2D copies, on the H2D stream."""
    compute: int = 0
    """After each offloaded commit, on the compute stream."""

    def __post_init__(self) -> None:
        for name in ("d2h", "h2d", "compute"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RaceDelays.{name} must be an int >= 0 (cycles), got {value!r}")


class HostCopy:
    """Building block for reference variants: an offloaded saved tensor (buffer, device view)."""

    __slots__ = ("buffer", "pooled", "view")

    def __init__(
        self,
        buffer: torch.Tensor,
        view: tuple[tuple[int, ...], tuple[int, ...], int] | None,
        pooled: bool,
    ) -> None:
        self.buffer = buffer
        self.view = view
        self.pooled = pooled


class Tag:
    """Building block for reference variants: autograd's stand-in for a tracked tensor."""

    __slots__ = ("group", "slot")

    def __init__(self, group: GroupState, slot: int) -> None:
        self.group = group
        self.slot = slot


class GroupState:
    """Building block for reference variants: one group occurrence, reused after the warmup."""

    def __init__(self, chunk: ChunkState, name: str, layer: int, cuda: bool) -> None:
        self.chunk = chunk
        self.name = name
        self.layer = layer
        self.use_pool = name not in MOE_EXPERT_NAMES  # MoE shapes vary with routing
        # post-warmup policy state
        self.offload = True
        self.decision = "offloaded"
        self.warmup_bytes = 0
        self.last_of_name = False
        self.ready_event = torch.cuda.Event() if cuda else None  # compute stream, for a side one
        self.d2h_event = torch.cuda.Event() if cuda else None
        self.reload_event = torch.cuda.Event() if cuda else None
        self.pack_hook: Any = None  # the saved-tensor pack hook, made at the first enter
        self._reset()

    def _reset(self) -> None:
        self.entries: dict[int, torch.Tensor | HostCopy] = {}
        self.slots = 0  # slots handed out (entries shrink as backward pops them)
        # slots still holding the saved tensor itself -> its storage address at pack time
        self.on_device: dict[int, int] = {}
        self.status = OPEN
        self.iter_decision = "open"
        self.waited = False
        self.counts = {"d2h_copies": 0, "d2h_bytes": 0, "h2d_copies": 0, "h2d_bytes": 0}
        self.tracked = 0
        self.released = 0
        self.release_skipped = 0
        self.pool_hits = 0
        self.pool_misses = 0

    @property
    def label(self) -> str:
        return f"{self.name} (microbatch {self.chunk.microbatch}, layer {self.layer})"

    def record(self) -> GroupRecord:
        return GroupRecord(
            microbatch=self.chunk.microbatch,
            layer=self.layer,
            name=self.name,
            decision=self.iter_decision,
            tracked=self.tracked,
            released=self.released,
            pool_hits=self.pool_hits,
            pool_misses=self.pool_misses,
            **self.counts,
        )


class ChunkState:
    """Building block for reference variants: one microbatch's forward groups, in start order."""

    def __init__(self, microbatch: int) -> None:
        self.microbatch = microbatch
        self.groups: list[GroupState] = []
        self._reset()

    def _reset(self) -> None:
        self.cursor = 0  # steady state: next warmup group expected
        self.to_reload: list[GroupState] = []  # committed and offloaded, LIFO
        self.forward_done = False
        self.backward_started = False
        self.active = False  # begun in this iteration


class _Handle:
    """A selected group as model code sees it (see ``harness.offload.protocol.Group``)."""

    __slots__ = ("_ctx", "_group", "input")

    def __init__(self, ctx: OffloadContext, group: GroupState, x: torch.Tensor) -> None:
        self._ctx = ctx
        self._group = group
        self.input = _start_apply(x, ctx, group)

    def __enter__(self) -> _Handle:
        # What ``torch.autograd.graph.saved_tensors_hooks`` does, without its object per group;
        # the pack hook is made once per group occurrence and reused every iteration.
        group, ctx = self._group, self._ctx
        pack = group.pack_hook
        if pack is None:
            pack = group.pack_hook = lambda t: ctx._pack(group, t)
        _push_saved_tensors_hooks(pack, ctx._unpack)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _pop_saved_tensors_hooks()

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        return apply_to_first(output, _commit_apply, self._ctx, self._group, tuple(release))


class _GroupStart(torch.autograd.Function):
    """Identity; its backward (the end of the group's backward) prefetches the next reload."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, off: OffloadContext, group: GroupState) -> torch.Tensor:
        ctx.off, ctx.group = off, group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.off._start_backward(ctx.group)
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    """Identity; its forward offloads the group, its backward orders compute after the reload."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        off: OffloadContext,
        group: GroupState,
        release: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        ctx.off, ctx.group = off, group
        off._commit_forward(group, release)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.off._commit_backward(ctx.group)
        return grad, None, None, None


def _fast_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` without ``torch.autograd.Function.apply``'s Python layer (it rebinds
    default arguments and unwraps dead functorch wrappers: about 5 us a call on the H200 box's
    host, two calls per group), the full path kept for functorch transforms."""
    direct = super(torch.autograd.Function, function).apply  # the C++ apply
    full = function.apply
    active = torch._C._are_functorch_transforms_active

    def apply(*args: Any) -> Any:
        return full(*args) if active() else direct(*args)

    return apply


_start_apply = _fast_apply(_GroupStart)
_commit_apply = _fast_apply(_GroupCommit)


class OffloadContext:
    """Backend ``reference``: one training run's activation offloader."""

    name = "reference"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="the bundled reference offloader (Megatron-Core semantics, known bugs fixed)",
        semantics=MEGATRON_MAIN,
        race_delays=True,
    )
    """Its backend record; variants inherit it (Megatron-Core main's semantics, ``delays=``)."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        self.config = config
        self._selected = config.selected  # the config is frozen; its property builds a new set
        self.device = _normalize(torch.device(device))
        self.cuda = self.device.type == "cuda"
        self.delays = delays or RaceDelays()
        if not self.cuda and self.delays != RaceDelays():
            raise ValueError("race-provocation delays need a CUDA device")
        self._d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self._h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self._cu = _CudaCalls() if self.cuda else None  # type: ignore[assignment]
        # On CPU ``to`` would hand back the host buffer itself, which the pool reuses.
        self._fused_reload = self.cuda and type(self)._h2d_copy is OffloadContext._h2d_copy
        self._compute_key: tuple[int, int, int] | None = None  # see _compute_stream
        self._compute: torch.cuda.Stream | None = None
        self.pool = HostBufferPool(pin_memory=self.cuda)
        self.enabled = True
        self.warmup = True
        self.summary_bytes: dict[str, int] = {}
        self._chunks: dict[int, ChunkState] = {}  # by microbatch, in forward order
        self._backward_order: list[ChunkState] = []
        self._current: ChunkState | None = None
        self._microbatch: int | None = None
        self._device_refs: dict[int, int] = {}  # storage address -> saved tensors on device
        self._pending_d2h: dict[str, deque[torch.cuda.Event | None]] = {}
        self._marked: dict[tuple[str, int], torch.Tensor] = {}
        self._marked_objects: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, address)
        # mark_not_offloadable's calls: ids -> (_marks_changed then, the tensors, shard addresses)
        self._mark_calls: dict[tuple[int, ...], tuple[int, tuple[Any, ...], list[int]]] = {}
        self._marks_changed = 0
        self._logs: list[IterationLog] = []

    # ----------------------------------------------------------------- protocol: runner side
    def begin_microbatch(self, microbatch: int) -> None:
        if self._current is not None:
            self._current.forward_done = True
        self._current = None
        self._microbatch = microbatch

    def _activate(self) -> ChunkState | None:
        """The chunk of the current microbatch, created (warmup) or looked up on its first
        group: a forward that opens no group (no grad, offloading disabled) leaves no trace and
        can never become the warmup."""
        if self._current is not None or self._microbatch is None:
            return self._current
        microbatch = self._microbatch
        chunk = self._chunks.get(microbatch)
        if chunk is None:
            if not self.warmup:
                raise StructureChangedError(
                    f"microbatch {microbatch} was not run in the warmup iteration "
                    f"(it recorded microbatches {sorted(self._chunks)}); offloading needs the "
                    "same microbatches every iteration"
                )
            chunk = self._chunks[microbatch] = ChunkState(microbatch)
        elif chunk.active:
            raise RuntimeError(f"microbatch {microbatch} started twice in one iteration")
        chunk.active = True
        self._current = chunk
        return chunk

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Handle | PassThroughGroup:
        if not self._opens(name):
            return PassThroughGroup(x)
        chunk = self._activate()
        if chunk is None:
            return PassThroughGroup(x)
        if self.warmup:
            group: GroupState | None = self._new_group(chunk, name, layer)
        else:
            group = self._expect_group(chunk, name, layer)
        if group is None:
            return PassThroughGroup(x)
        group._reset()
        return _Handle(self, group, x)

    def _opens(self, name: str) -> bool:
        """Whether a start of group ``name`` opens a group (selected, enabled, grad mode on)."""
        return self.enabled and name in self._selected and torch.is_grad_enabled()

    def _new_group(self, chunk: ChunkState, name: str, layer: int) -> GroupState | None:
        """Warmup: record a new group occurrence in ``chunk`` (start order)."""
        group = GroupState(chunk, name, layer, self.cuda)
        chunk.groups.append(group)
        return group

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        # A call that repeats an earlier one (models mark each layer's parameters on every
        # forward) is one lookup and a data_ptr per tensor: the same objects (the cache keeps
        # them alive, so their ids are theirs), each where it was, no mark dropped or replaced
        # since (``_marks_changed``). Only calls of plain tensors are kept: a DTensor's shard
        # may be replaced under the same DTensor object.
        call = tuple(map(id, tensors))
        seen = self._mark_calls.get(call)
        if (
            seen is not None
            and seen[0] == self._marks_changed
            and seen[2] == [t.data_ptr() for t in seen[1]]
        ):
            return
        shards = tuple(map(local_tensor, tensors))  # a DTensor by its shard (no own storage)
        for tensor in shards:
            # Models mark every parameter on every forward: one already marked at its current
            # address needs nothing more. The fast path holds only while the tensor's mark is
            # the one at its address: a stale mark dropped by _is_marked, or another tensor
            # marked at the same address (FSDP2 re-allocating one unsharded parameter where
            # another lived), removes it, so the next call marks anew.
            known = self._marked_objects.get(id(tensor))
            if known is not None and known[0] is tensor and known[1] == tensor.data_ptr():
                continue
            self._marked_objects[id(tensor)] = (tensor, tensor.data_ptr())
            with contextlib.suppress(AttributeError, RuntimeError):
                tensor._do_not_offload = True  # type: ignore[attr-defined]
            # Saved-tensor hooks often see a fresh alias (a detached view of a parameter), not
            # this Python object, so the mark is kept per storage; the reference keeps the
            # storage alive, so its address cannot be reused by an activation.
            key = _storage_key(tensor)
            replaced = self._marked.get(key)
            if replaced is not None and replaced is not tensor:
                self._marked_objects.pop(id(replaced), None)
                self._marks_changed += 1
            self._marked[key] = tensor
        if all(shard is tensor for shard, tensor in zip(shards, tensors, strict=True)):
            if len(self._mark_calls) >= _MARK_CALLS_KEPT:
                self._mark_calls.clear()
            self._mark_calls[call] = (self._marks_changed, tensors, [t.data_ptr() for t in tensors])

    def end_iteration(self) -> None:
        active = [c for c in self._chunks.values() if c.active]
        leaked = sum(len(g.entries) for c in active for g in c.groups)
        if not self.warmup:
            for chunk in active:
                if chunk.cursor != len(chunk.groups):
                    missing = chunk.groups[chunk.cursor]
                    raise StructureChangedError(
                        f"microbatch {chunk.microbatch} ended without opening group "
                        f"{missing.name} (layer {missing.layer}) that the warmup recorded"
                    )
        records = tuple(g.record() for c in active for g in c.groups)
        summary: dict[str, int] = {}
        was_warmup = self.warmup and bool(active)
        if was_warmup:
            summary = self._post_warmup()
        self._logs.append(
            IterationLog(
                iteration=len(self._logs),
                warmup=was_warmup,
                groups=records,
                leaked_tensors=leaked,
                pool_in_use=self.pool.stats.current_in_use,
                pool_allocated=self.pool.stats.total_allocated,
                summary_bytes=summary,
            )
        )
        for chunk in self._chunks.values():
            for group in chunk.groups:
                group.entries = {}
            chunk._reset()
        self.pool.stats.current_in_use = 0
        self._pending_d2h.clear()
        self._current = None
        self._microbatch = None
        self._device_refs.clear()

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = bool(enabled)

    def iteration_logs(self) -> list[IterationLog]:
        return list(self._logs)

    def close(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h)
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        self.pool.clear()
        self._chunks.clear()
        self._marked.clear()
        self._marked_objects.clear()
        self._mark_calls.clear()

    # ------------------------------------------------------------------------- forward side
    def _expect_group(self, chunk: ChunkState, name: str, layer: int) -> GroupState | None:
        if chunk.cursor < len(chunk.groups):
            group = chunk.groups[chunk.cursor]
            if group.name == name and group.layer == layer:
                chunk.cursor += 1
                return group
            recorded = f"{group.name} (layer {group.layer})"
        else:
            recorded = "no further group"
        raise StructureChangedError(
            f"microbatch {chunk.microbatch}: group #{chunk.cursor} is {name} (layer {layer}) but "
            f"the warmup recorded {recorded}; the group structure changed after the warmup"
        )

    def _pack(self, group: GroupState, tensor: torch.Tensor) -> Any:
        if not self._trackable(tensor):
            return tensor
        slot = group.slots
        group.slots = slot + 1
        group.entries[slot] = tensor
        address = tensor.untyped_storage().data_ptr()
        group.on_device[slot] = address
        refs = self._device_refs
        refs[address] = refs.get(address, 0) + 1
        return Tag(group, slot)

    def _unhold(self, address: int) -> None:
        """One saved tensor of storage ``address`` left the device (offloaded or handed back):
        ``_device_refs`` counts those still there per storage, which forced release checks."""
        refs = self._device_refs
        count = refs.get(address, 0) - 1
        if count > 0:
            refs[address] = count
        else:
            refs.pop(address, None)

    def _trackable(self, tensor: torch.Tensor) -> bool:
        if tensor.device != self.device:
            return False
        # A plain tensor is neither a parameter nor a fake or functional tensor (subclasses all);
        # ``isinstance(t, Parameter)`` also holds for a plain tensor flagged ``_is_param``.
        if type(tensor) is torch.Tensor and not getattr(tensor, "_is_param", False):
            return True
        return not isinstance(tensor, torch.nn.Parameter) and not _is_fake_or_functional(tensor)

    def _eligible(self, tensor: torch.Tensor) -> bool:
        numel = tensor.numel()
        return (
            numel > 0
            and numel >= self.config.min_offloaded_tensor_size
            and not getattr(tensor, "_do_not_offload", False)
            and not getattr(tensor, "_TE_do_not_offload", False)
            and not self._is_marked(tensor)
        )

    def _is_marked(self, tensor: torch.Tensor) -> bool:
        """A mark counts while the marked tensor's storage still lives at the marked address:
        FSDP2 frees a layer's unsharded parameters after its forward, and a later activation may
        be allocated at the same address."""
        key = _storage_key(tensor)
        marked = self._marked.get(key)
        if marked is None:
            return False
        storage = marked.untyped_storage()
        if storage.data_ptr() == key[1] and storage.nbytes():
            return True
        del self._marked[key]
        self._marked_objects.pop(id(marked), None)  # its next mark_not_offloadable marks anew
        self._marks_changed += 1
        return False

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        group.tracked = len(group.entries)
        decision = self._decide(group)
        group.iter_decision = decision
        if decision != "offloaded":
            group.status = KEPT
            return
        self._offload(group)
        group.chunk.to_reload.append(group)
        self._release(group, release)
        self._cap_inflight(group)

    def _decide(self, group: GroupState) -> str:
        if self.warmup:
            return "offloaded"
        if not group.offload:
            return group.decision
        # Runtime margin: if this chunk's backward comes next, its last group of a name would be
        # reloaded right after being offloaded.
        if group.last_of_name and self._next_backward_chunk(group.name) is group.chunk:
            return "kept:last_of_name"
        return "offloaded"

    def _next_backward_chunk(self, name: str) -> ChunkState | None:
        for chunk in self._backward_order:
            if not chunk.backward_started and any(g.name == name for g in chunk.groups):
                return chunk
        return None

    def _offload(self, group: GroupState) -> None:
        compute = self._switch_to(self._d2h, group)
        try:
            if self.cuda and self.delays.d2h:
                torch.cuda._sleep(self.delays.d2h)
            with group_range("d2h", group):
                entries, on_device = group.entries, group.on_device
                for slot, tensor in list(entries.items()):
                    if isinstance(tensor, torch.Tensor) and self._eligible(tensor):
                        entries[slot] = self._copy_out(group, tensor)
                        self._unhold(on_device.pop(slot))
                if self.cuda:
                    self._cu.record(group.d2h_event, self._d2h)
        finally:
            self._switch_back(compute)
        group.status = OFFLOADED
        if self.cuda and self.delays.compute:
            torch.cuda._sleep(self.delays.compute)

    def _copy_out(self, group: GroupState, tensor: torch.Tensor) -> HostCopy:
        src, view = _transfer_source(tensor)
        pooled = group.use_pool
        if pooled:
            buffer, hit = self.pool.acquire(src.shape, src.dtype, self._d2h)
            group.pool_hits += hit
            group.pool_misses += not hit
        else:
            buffer = self._new_host_buffer(src.shape, src.dtype)
        self._d2h_copy(group, buffer, src)
        # The source may be freed as soon as we drop it; its memory must not be reused before
        # this copy has read it.
        self._protect_source(tensor)
        if self.warmup:
            group.warmup_bytes += buffer.nbytes
        return HostCopy(buffer, view, pooled)

    def _new_host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An unpooled host buffer (pinned on CUDA)."""
        return staging_buffer(shape, dtype, pin_memory=self.cuda)

    def _d2h_copy(self, group: GroupState, buffer: torch.Tensor, src: torch.Tensor) -> None:
        """One D2H copy into ``buffer``, counted in the group's log."""
        buffer.copy_(src, non_blocking=self.cuda)
        counts = group.counts
        counts["d2h_copies"] += 1
        counts["d2h_bytes"] += buffer.nbytes

    def _protect_source(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s memory from reuse until the D2H stream's pending work is done."""
        if self.cuda:
            tensor.record_stream(self._d2h)

    def _release(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        for tensor in release:
            if tensor is None or not self._trackable(tensor) or not self._eligible(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            if storage.data_ptr() in self._device_refs:
                # A saved tensor kept on the device (too small, marked, or in a group the policy
                # keeps) still reads this storage: freeing it would corrupt backward.
                group.release_skipped += 1
                continue
            self._protect_source(tensor)
            storage.resize_(0)
            group.released += 1

    def _cap_inflight(self, group: GroupState) -> None:
        cap = self.config.max_inflight_offloads
        if cap is None:
            return
        pending = self._pending_d2h.setdefault(group.name, deque())
        pending.append(group.d2h_event)
        while len(pending) > cap:
            event = pending.popleft()
            if event is not None:
                self._cu.wait(event, self._compute_stream())

    # ------------------------------------------------------------------------ backward side
    def _backward_begins(self, chunk: ChunkState) -> None:
        if chunk.backward_started:
            return
        chunk.backward_started = True
        if self._current is not None:
            self._current.forward_done = True  # backward never starts mid-forward
        if self.warmup:
            self._backward_order.append(chunk)

    def _commit_backward(self, group: GroupState) -> None:
        self._backward_begins(group.chunk)
        self._wait_reload(group)

    def _start_backward(self, group: GroupState) -> None:
        # The group's backward is done: prefetch the next offloaded group, LIFO within the chunk,
        # else the last offloaded group of the next chunk to run backward if its forward is done.
        nxt = _pop_offloaded(group.chunk.to_reload)
        if nxt is None:
            following = next((c for c in self._backward_order if not c.backward_started), None)
            if following is not None and following.forward_done:
                nxt = _pop_offloaded(following.to_reload)
        if nxt is not None:
            self._reload(nxt)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Tag):
            return packed
        group = packed.group
        self._backward_begins(group.chunk)
        if group.status == OFFLOADED:
            self._reload(group, inline=True)  # nobody prefetched it: reload now, after its D2H
        self._wait_reload(group)
        try:
            value = group.entries.pop(packed.slot)
        except KeyError:
            raise RuntimeError(
                f"a saved tensor of group {group.label} was unpacked twice; the offloader hands "
                "each saved tensor back once (retain_graph/double backward is not supported)"
            ) from None
        assert isinstance(value, torch.Tensor), "reloaded group still holds a host copy"
        address = group.on_device.pop(packed.slot, None)
        if address is not None:  # the original tensor, never offloaded
            self._unhold(address)
        return value

    def _wait_reload(self, group: GroupState) -> None:
        if group.status == RELOADING and not group.waited:
            if self.cuda:
                self._cu.wait(group.reload_event, self._compute_stream())
            group.waited = True

    def _reload(self, group: GroupState, *, inline: bool = False) -> None:
        """Bring ``group`` back: prefetched at the end of a group's backward, or ``inline``
        when backward unpacks a tensor of a group nobody prefetched."""
        # Reloaded tensors are allocated on the H2D stream: the switch orders this allocation
        # after all compute so far (which may still read memory the allocator is about to hand
        # out). The H2D copies wait for the D2H that filled their buffers.
        compute = self._switch_to(self._h2d, group)
        returned: dict[int, torch.Tensor] = {}
        try:
            self._await_d2h(group, inline=inline)
            if self.cuda and self.delays.h2d:
                torch.cuda._sleep(self.delays.h2d)
            with group_range("h2d", group):
                entries = group.entries
                for slot, entry in list(entries.items()):
                    if isinstance(entry, HostCopy):
                        entries[slot] = self._copy_in(group, entry)
                        if entry.pooled:
                            returned[id(entry.buffer)] = entry.buffer
                if self.cuda:
                    self._cu.record(group.reload_event, self._h2d)
        finally:
            self._switch_back(compute)
        for buffer in returned.values():
            self._return_buffer(group, buffer)
        group.status = RELOADING

    def _await_d2h(self, group: GroupState, *, inline: bool) -> None:
        """Order the group's H2D copies after the D2H that filled its host buffers (both
        paths: Megatron #7398's inline path has no such edge)."""
        if self.cuda:
            self._cu.wait(group.d2h_event, self._h2d)

    def _return_buffer(self, group: GroupState, buffer: torch.Tensor) -> None:
        """Give a pooled buffer back with the event of the H2D that still reads it."""
        self.pool.release(buffer, group.reload_event)

    def _copy_in(self, group: GroupState, entry: HostCopy) -> torch.Tensor:
        buffer = entry.buffer
        # The new device tensor is filled under deterministic mode (a device memset on the H2D
        # stream, not host time): a read that races ahead of this copy then sees NaN, not
        # whatever the block held before, which may be the activation's own old values (its
        # block freed after the D2H).
        if self._fused_reload:
            # Allocation and copy in one call instead of two (``to`` allocates through the same
            # factory, so the fill above holds).
            restored = buffer.to(self.device, non_blocking=True)
            counts = group.counts
            counts["h2d_copies"] += 1
            counts["h2d_bytes"] += buffer.nbytes
        else:
            restored = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.device)
            self._h2d_copy(group, restored, buffer)
        if entry.view is not None:
            size, stride, offset = entry.view
            restored = restored.as_strided(size, stride, offset)
        return restored

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        """One H2D copy from ``buffer``, counted in the group's log. On CUDA the reference
        itself allocates and copies in one call instead (``_copy_in``); a variant that overrides
        this method gets it called for every reloaded buffer, on either device."""
        restored.copy_(buffer, non_blocking=self.cuda)
        counts = group.counts
        counts["h2d_copies"] += 1
        counts["h2d_bytes"] += buffer.nbytes

    # ------------------------------------------------------------------------------ helpers
    def _switch_to(
        self, stream: torch.cuda.Stream | None, group: GroupState
    ) -> tuple[torch.cuda.Stream, int] | None:
        """Make ``stream`` (a side stream) current, ordered after all work enqueued on the
        compute stream so far; returns what ``_switch_back`` restores (None on CPU): the compute
        stream and the current device (``set_stream`` also makes the stream's device current).
        The ordering goes through the group's ``ready_event``, recorded and waited for at once,
        so the event is free again when the call returns."""
        if stream is None:
            return None
        cu, compute, ready = self._cu, self._compute_stream(), group.ready_event
        cu.record(ready, compute)
        cu.wait(ready, stream)
        device = cu.current_device()
        cu.set_stream(stream)
        return compute, device

    def _compute_stream(self) -> torch.cuda.Stream:
        """The device's current stream, what ``torch.cuda.current_stream(self.device)``
        returns, without its Python layer (8 us a call on the H200 box's host against 0.2 us for
        the raw query, three or more calls per group): the Stream object is made again only
        when the current stream has changed since the last call."""
        key = self._cu.current_stream(self.device.index)
        if key != self._compute_key:
            self._compute_key = key
            self._compute = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        return self._compute  # type: ignore[return-value]

    def _switch_back(self, previous: tuple[torch.cuda.Stream, int] | None) -> None:
        if previous is None:
            return
        compute, device = previous
        self._cu.set_stream(compute)
        if device != self.device.index:
            torch.cuda.set_device(device)

    def _post_warmup(self) -> dict[str, int]:
        forward = list(self._chunks.values())
        backward = self._backward_order + [c for c in forward if c not in self._backward_order]
        self._backward_order = backward
        for chunk in forward:
            last: dict[str, GroupState] = {}
            for group in chunk.groups:
                last[group.name] = group
            for group in last.values():
                group.last_of_name = True
        self.summary_bytes = self._apply_policies(forward, backward)
        self.warmup = False
        return dict(self.summary_bytes)

    def _apply_policies(
        self, forward: list[ChunkState], backward: list[ChunkState]
    ) -> dict[str, int]:
        """Margin, delta and fraction over the warmup's chunks; the per-name summary."""
        return apply_post_warmup(
            forward,
            backward,
            pp_rank=self.config.pp_rank,
            delta_bytes=self.config.delta_offload_bytes_across_pp_ranks,
            fraction=self.config.activation_offload_fraction,
        )


class _CudaCalls:
    """The hot path's stream and event calls, straight to torch's C++ bindings: the Python
    wrappers (``torch.cuda.current_stream``, ``current_device``, ``set_stream``,
    ``Event.record``, ``Stream.wait_event``) took 3-8 us each inside a training step on the H200
    box's host, the bindings 0.2-1.6 us, and a group makes about a dozen such calls. Each does
    what its wrapper does once CUDA is initialised (the offloader's streams initialise it).
    Resolved per offloader: a CPU-only build of torch has none of these bindings."""

    __slots__ = ("current_device", "current_stream", "record", "wait")

    def __init__(self) -> None:
        bindings = torch._C
        self.record = bindings._CudaEventBase.record
        """``record(event, stream)``: what ``event.record(stream)`` does."""
        self.wait = bindings._CudaEventBase.wait
        """``wait(event, stream)``: ``stream`` waits for ``event``, as ``stream.wait_event``."""
        self.current_stream = bindings._cuda_getCurrentStream
        """``current_stream(index)``: (stream id, device index, device type) of the current one."""
        self.current_device = bindings._cuda_getDevice

    @staticmethod
    def set_stream(stream: torch.cuda.Stream) -> None:
        """What ``torch.cuda.set_stream(stream)`` does (its device becomes current too)."""
        torch._C._cuda_setStream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )


def group_range(direction: Direction, group: GroupState) -> contextlib.AbstractContextManager[Any]:
    """Building block for reference variants: the group's named profiler range."""
    return profiler_range(direction, group.name, group.chunk.microbatch, group.layer)


def _pop_offloaded(stack: list[GroupState]) -> GroupState | None:
    while stack:
        group = stack.pop()
        if group.status == OFFLOADED:
            return group
    return None


def _transfer_source(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """What to copy for ``tensor``: itself, or its whole flat storage plus the view to restore."""
    if tensor.is_contiguous():
        return tensor, None
    storage = tensor.untyped_storage()
    nbytes, itemsize = storage.nbytes(), tensor.element_size()
    if nbytes % itemsize or tensor.numel() * itemsize < FULL_STORAGE_MIN_COVERAGE * nbytes:
        return tensor, None  # gather: copy_ makes it contiguous
    flat = tensor.new_empty(0).set_(storage, 0, (nbytes // itemsize,), (1,))
    return flat, (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(device index, -1 on CPU; storage address): no device object made on the hot path."""
    return (tensor.get_device(), tensor.untyped_storage().data_ptr())


def _normalize(device: torch.device) -> torch.device:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"offload device {device} requested but no CUDA device is visible")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _is_fake_or_functional(tensor: torch.Tensor) -> bool:
    # A FakeTensor/FunctionalTensor can only exist once its module is loaded; looking the
    # classes up instead of importing them keeps this hot path free of heavy imports.
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    functional = sys.modules.get("torch._subclasses.functional_tensor")
    return (fake is not None and isinstance(tensor, fake.FakeTensor)) or (
        functional is not None and isinstance(tensor, functional.FunctionalTensor)
    )
