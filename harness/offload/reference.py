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

The mechanics (saved-tensor hooks, copies, host buffers, streams and events, the hot path's
shortcuts) live in ``harness.offload.copies``: ``OffloadContext`` inherits them from its base
``CopyEngine`` and keeps the rules here. On CPU the same bookkeeping runs with synchronous copies
into separate host buffers.

Variants of the reference (``harness.offload.broken``: the reference with one bug each) subclass
``OffloadContext`` and override its steps, the rules' and the mechanics' alike; ``GroupState``,
``ChunkState``, ``HostCopy``, ``Tag``, the status values (``OPEN``, ``KEPT``, ``OFFLOADED``,
``RELOADING``) and ``group_range`` (``harness.offload.groupstate``) are the public building blocks
they share, importable from here. Module names with a leading underscore stay private.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.copies import (
    FULL_STORAGE_MIN_COVERAGE,
    CopyEngine,
    RaceDelays,
    _fast_apply,
    _is_fake_or_functional,
    _pop_saved_tensors_hooks,
    _push_saved_tensors_hooks,
    _storage_key,
)
from harness.offload.groupstate import (
    KEPT,
    OFFLOADED,
    OPEN,
    RELOADING,
    ChunkState,
    GroupState,
    HostCopy,
    Tag,
    group_range,
)
from harness.offload.passthrough import PassThroughGroup, apply_to_first
from harness.offload.policy import apply_post_warmup
from harness.offload.protocol import Capabilities, IterationLog, Output, local_tensor
from harness.offload.semantics import MEGATRON_MAIN

__all__ = [
    "FULL_STORAGE_MIN_COVERAGE",
    "KEPT",
    "OFFLOADED",
    "OPEN",
    "RELOADING",
    "ChunkState",
    "GroupState",
    "HostCopy",
    "OffloadContext",
    "RaceDelays",
    "StructureChangedError",
    "Tag",
    "group_range",
]

_MARK_CALLS_KEPT = 1024
"""Distinct ``mark_not_offloadable`` calls remembered (then forgotten at once: a model marking
fresh tensors on every call cannot grow the cache without bound)."""


class StructureChangedError(RuntimeError):
    """The steady-state group sequence differs from the one the warmup recorded."""


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


_start_apply = _fast_apply(_GroupStart)
_commit_apply = _fast_apply(_GroupCommit)


HOST_BOUND = 1.05
"""The host memory the reference may hold per byte in flight at its final step's peak: its pool
keeps what its first steady step needed at once, in buffers of their own size (on CUDA pinned
pages of their own, not the caching host allocator's power-of-two blocks;
``harness.offload.pool``)."""


class OffloadContext(CopyEngine):
    """Backend ``reference``: one training run's activation offloader."""

    name = "reference"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="the bundled reference offloader (Megatron-Core semantics, known bugs fixed)",
        semantics=MEGATRON_MAIN,
        race_delays=True,
        host_pool=True,
        host_bound=HOST_BOUND,
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
        self._init_copies()  # streams, pool, copy bookkeeping (harness.offload.copies)
        self.enabled = True
        self.warmup = True
        self._trim_due = False
        """The warmup ended and the pool has not been trimmed to a steady iteration's needs yet
        (``HostBufferPool.trim`` at the end of the first steady iteration)."""
        self.summary_bytes: dict[str, int] = {}
        self._chunks: dict[int, ChunkState] = {}  # by microbatch, in forward order
        self._backward_order: list[ChunkState] = []
        self._current: ChunkState | None = None
        self._microbatch: int | None = None
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
                pool_exhausted=self.pool.stats.exhausted,
                summary_bytes=summary,
            )
        )
        for chunk in self._chunks.values():
            for group in chunk.groups:
                group.entries = {}
            chunk._reset()
        self.pool.stats.current_in_use = 0
        if was_warmup:
            self.pool.count_peaks()
            self._trim_due = True
        elif self._trim_due and active:  # the first steady iteration: what a steady one needs
            self.pool.trim()
            self._trim_due = False
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

    # ------------------------------------------------------------------------------ helpers
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


def _pop_offloaded(stack: list[GroupState]) -> GroupState | None:
    while stack:
        group = stack.pop()
        if group.status == OFFLOADED:
            return group
    return None


def _normalize(device: torch.device) -> torch.device:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"offload device {device} requested but no CUDA device is visible")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
