"""Black-box transfer attribution: the harness, not the offloader, says which group a copy
belongs to.

An offloader under test needs no cooperation (no profiler ranges of its own). Two pieces:

``Windowed`` (an ``Offloader`` wrapper)
    Brackets every group occurrence's forward with a *window*: it opens when the model calls
    ``group(name, x, layer=)`` and closes when that group's ``commit`` returns. The model code
    knows each group's name, layer and microbatch (``begin_microbatch``), so the window is the
    group occurrence ``(microbatch, layer, name)``.

``CopyObserver`` (a ``TorchDispatchMode``)
    Sees every aten op of an observed step, on every thread autograd runs backward on (the mode
    is part of the thread-local state autograd carries into its worker threads), and records
    each copy between memories:

    * on CUDA: ``copy_``/``_to_copy``/``_copy_from`` between a CUDA tensor and a host tensor.
      D2H when the source is on the GPU, H2D when the destination is; pageable when the host
      side is not pinned;
    * on a CPU device (activations already live on the host, so an "offload" is a copy into a
      separate host buffer): a same-dtype ``copy_``/``_to_copy`` into a fresh buffer inside a
      group's forward window is a D2H; a copy *from* a buffer that such a D2H wrote is an H2D.
      Casts, ``clone`` (``.contiguous()``) and copies outside windows are never counted.

How a copy is attributed to a group occurrence
    D2H: the group that saved its source (the wrapper swaps the pack hook the offloader pushes
    inside a group for one that notes each saved tensor's storage, and what the pack hook makes
    from it, e.g. a ``.contiguous()`` copy, then calls the offloader's), so a D2H the offloader
    issues after the group's window closed (at the next group's start, say) is still its group's;
    else the window open when the copy was issued; else ``outside`` (reported by the transfer
    check, never dropped). H2D: the group whose D2H wrote the host memory it reads
    (the last D2H into that address), so a prefetch issued during another group's backward is
    still the prefetched group's; an H2D from memory no observed D2H wrote is ``outside``.
    Bytes are the destination's ``numel * element_size``.

Weights: ``Windowed.note_model`` (the ``model_ready`` run hook) gives the observer every
parameter's storage when the run's model is built; a D2H whose source lies in one, in a cast of a
parameter a group saved (its autograd node a copy of the parameter), or in a tensor the model
marked not-offloadable carries ``Copy.weight`` (the weights check fails on it).

What it cannot see: copies that bypass the dispatcher (a C++/CUDA extension calling
``cudaMemcpyAsync`` itself). On CUDA the transfer check compares the observer's totals with the
profiler's memcpy totals, so such copies show up as a difference.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import progress
from harness.offload.protocol import (
    Group,
    IterationLog,
    Offloader,
    Output,
    Wrapper,
    local_tensor,
    model_chunk_of,
)
from harness.offload.ranges import Direction, RangeKey, current_range, watching
from harness.spec import label_pass
from harness.transfers import DIRECTIONS, Counts, TransferCounts

GroupKey = tuple[int, int, str]  # (microbatch, layer, name)

_aten = torch.ops.aten
_COPY_OPS = {
    _aten.copy_.default: "copy_",
    _aten._to_copy.default: "_to_copy",
    _aten._copy_from.default: "_copy_from",
    # One op for a list of tensors (an offloader batching a group's copies): a copy per pair.
    _aten._foreach_copy_.default: "_foreach_copy_",
    _aten._foreach_copy.default: "_foreach_copy",
}


class _WindowState:
    """The forward window open now (one model thread drives the forward)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.microbatch = 0
        self.chunks = 1
        """Model chunks per pass (``model_chunk``): how messages name a pass."""
        self.open: list[GroupKey] = []
        self.observer: CopyObserver | None = None
        """The observer of the step running now (None: the step is not observed)."""
        self.packing: GroupKey | None = None
        """The group whose saved-tensor pack hook runs now."""
        self.checksums = False
        """Whether observed steps checksum every saved tensor at pack and at unpack."""
        self.written: dict[int, _Written] = {}
        """Host address -> the storage a D2H of an observed step wrote there (weakly), its
        group and that step, across the run's steps: what of it is still alive at a step's end
        is host memory the offloader holds across iterations (``Observed.held``)."""
        self.steps = 0
        """Observed steps begun so far (every step of the offload run is observed)."""
        self.weights: dict[int, list[_Noted]] = {}
        """Storage address -> every parameter of the run's model in that storage (several where
        a framework keeps them in one buffer, e.g. megatron-core's DDP), with its byte range
        (``Windowed.note_model``): a D2H from one of them is a weight offloaded."""

        self.step = 0
        """The training step running now (``Windowed.end_iteration`` counts them)."""
        self.evaluating = False
        """Whether the microbatches running now are the forward-only evaluation pass."""

    def current(self) -> GroupKey | None:
        with self.lock:
            return self.open[-1] if self.open else None

    def position(self, phase: str, call: str, key: GroupKey | None = None) -> str:
        """``step S, microbatch M, layer L, group G, phase P (call C)`` for messages."""
        step = "the evaluation pass" if self.evaluating else f"step {self.step}"
        parts = [step]
        if key is not None:
            mb, layer, name = key
            parts += [label_pass(mb, self.chunks), f"layer {layer}", f"group {name}"]
        else:
            parts.append(label_pass(self.microbatch, self.chunks))
        return f"{', '.join(parts)}, phase {phase} ({call})"

    def locate(
        self, exc: BaseException, phase: str, call: str, key: GroupKey | None = None
    ) -> None:
        """Name where ``exc`` was raised inside the offloader's calls (``harness.progress``)."""
        progress.located(exc, self.position(phase, call, key))


def checksum(tensor: torch.Tensor) -> torch.Tensor | None:
    """A device-side checksum of ``tensor``'s values in logical order, enqueued on the current
    stream with no host synchronisation: the int64 sums of its even- and its odd-indexed 32-bit
    words (its bytes where the size is not a multiple of 8), one reduction kernel. A flipped bit,
    a wrong tensor or a stale buffer changes them; a permutation of whole words of the same
    parity can escape them. None for tensors it cannot read as bytes (sparse, meta).

    Its ops bypass every ``__torch_dispatch__`` mode (the copy observer's included): they are
    the harness's, not the run's, and cost a Python call each through a mode."""
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        flat = tensor.detach().reshape(-1)
        if flat.numel() * flat.element_size() % 8:
            raw = flat.contiguous().view(torch.uint8)
            return torch.stack((raw[::2].sum(dtype=torch.int64), raw[1::2].sum(dtype=torch.int64)))
        try:
            words = flat.view(torch.int32)
        except RuntimeError:  # a storage offset the wider element cannot start at
            words = flat.clone().view(torch.int32)
        return words.view(-1, 2).sum(dim=0, dtype=torch.int64)


class _SumRecord:
    """One saved tensor's checksum at pack time, and the one of what its unpack returned."""

    __slots__ = (
        "chunks",
        "dtype",
        "index",
        "key",
        "offset",
        "packed",
        "reloaded",
        "shape",
        "stride",
    )

    def __init__(
        self,
        key: GroupKey,
        index: int,
        tensor: torch.Tensor,
        packed: torch.Tensor | None,
        chunks: int = 1,
    ) -> None:
        self.key, self.index, self.chunks = key, index, chunks
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        self.stride = _layout(tensor)
        self.offset = tensor.storage_offset()
        self.packed, self.reloaded = packed, None

    def where(self) -> str:
        mb, layer, name = self.key
        return (
            f"{label_pass(mb, self.chunks)}, layer {layer}, group {name}, saved tensor "
            f"{self.index} of the "
            f"group: shape {list(self.shape)}, {self.dtype}, storage offset {self.offset}"
        )


def _layout(tensor: torch.Tensor) -> tuple[int, ...]:
    """A tensor's strides where they matter: those of its dimensions longer than one (a view
    and a contiguous copy of it agree on the rest)."""
    if tensor.layout != torch.strided:
        return ()
    return tuple(s for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1)


class _Summed:
    """What the harness's pack hook hands autograd: the offloader's packed object, the group
    that packed it and the checksum record (the unpack hook unwraps it before calling the
    offloader's)."""

    __slots__ = ("key", "packed", "record")

    def __init__(self, packed: Any, record: _SumRecord | None, key: GroupKey) -> None:
        self.packed, self.record, self.key = packed, record, key


class _Written:
    """A host storage an observed D2H wrote: weakly, with its group and step."""

    __slots__ = ("group", "ref", "step")

    def __init__(self, storage: torch.UntypedStorage, group: GroupKey, step: int) -> None:
        self.ref, self.group, self.step = weakref.ref(storage), group, step


def _locating(unpack: Any, state: _WindowState, key: GroupKey) -> Any:
    """``unpack`` naming the step, microbatch, layer and group of what raises in it."""

    def unpacked(item: Any) -> Any:
        try:
            return unpack(item)
        except Exception as exc:
            state.locate(exc, "backward", "unpack hook", key)
            raise

    return unpacked


def _summing(unpack: Any, state: _WindowState) -> Any:
    """``unpack`` behind the harness's wrapper: each unpack of a tensor packed through the
    swapped pack hook is counted (``Observed.unpacked``), and with checksums its value summed."""

    def unpacked(item: Any) -> Any:
        if not isinstance(item, _Summed):
            return unpack(item)
        tensor = unpack(item.packed)
        record, observer = item.record, state.observer
        if observer is not None:
            with observer.lock:
                observer.observed.unpacked[item.key] += 1
        if record is not None and record.packed is not None and observer is not None:
            if isinstance(tensor, torch.Tensor):
                record.reloaded = checksum(tensor)
                relaid = _layout(tensor) != record.stride
                with observer.lock:
                    observer.observed.summed.append(record)
                    observer.observed.relaid += relaid
        return tensor

    return unpacked


class _WindowGroup:
    """The inner offloader's group, with the harness's window around its forward."""

    def __init__(self, inner: Group, state: _WindowState, key: GroupKey) -> None:
        self.inner, self.state, self.key = inner, state, key
        self.closed = False

    @property
    def input(self) -> torch.Tensor:
        return self.inner.input

    def __enter__(self) -> _WindowGroup:
        hooks = torch._C._autograd
        below = hooks._top_saved_tensors_default_hooks(False)
        try:
            self.inner.__enter__()
        except Exception as exc:
            self.state.locate(exc, "forward", "group enter", self.key)
            raise
        if self.state.observer is None:
            return self
        pushed = hooks._top_saved_tensors_default_hooks(False)
        if pushed is not None and (below is None or pushed[0] is not below[0]):
            # Learn what the group saves: swap the pack hook the offloader pushed for one that
            # notes each saved tensor's storage, then calls it (its own __exit__ pops the top
            # pair, so the stack stays balanced), and the unpack hook for one that counts each
            # unpack (``_summing``; with checksums, sums what it returns).
            pack, unpack = pushed
            unpack = _locating(unpack, self.state, self.key)
            hooks._pop_saved_tensors_default_hooks()
            hooks._push_saved_tensors_default_hooks(
                self._noting(pack), _summing(unpack, self.state)
            )
        return self

    def _noting(self, pack: Any) -> Any:
        state, key, summed = self.state, self.key, self.state.checksums
        count = itertools.count()

        def noted(tensor: torch.Tensor) -> Any:
            observer = state.observer
            record = None
            if observer is not None:
                observer.saved_by(tensor, key)
                observer.note_cast(tensor)
                with observer.lock:
                    observer.observed.packed[key] += 1
                if summed:
                    record = _SumRecord(key, next(count), tensor, checksum(tensor), state.chunks)
            previous, state.packing = state.packing, key
            try:
                packed = pack(tensor)
            except Exception as exc:
                state.locate(exc, "forward", "pack hook", key)
                raise
            finally:
                state.packing = previous
            return _Summed(packed, record, key)

        return noted

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.inner.__exit__(exc_type, exc, tb)
        except Exception as raised:
            self.state.locate(raised, "forward", "group exit", self.key)
            raise
        if exc_type is not None:
            self.close()

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        try:
            return self.inner.commit(output, release)
        except Exception as exc:
            self.state.locate(exc, "commit", "commit", self.key)
            raise
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self.state.lock:
            if self.key in self.state.open:
                self.state.open.remove(self.key)


class Windowed(Wrapper):
    """``inner`` with a harness window around every group occurrence's forward."""

    def __init__(self, inner: Offloader, *, checksums: bool = False) -> None:
        super().__init__(inner)
        self.state = _WindowState()
        self.state.checksums = checksums

    def begin_microbatch(self, microbatch: int) -> None:
        state = self.state
        state.microbatch = microbatch
        state.evaluating = not torch.is_grad_enabled()
        progress.at(state.position("forward", "begin_microbatch"))
        try:
            self.inner.begin_microbatch(microbatch)
        except Exception as exc:
            state.locate(exc, "forward", "begin_microbatch")
            raise

    def end_iteration(self) -> None:
        state = self.state
        try:
            self.inner.end_iteration()
        except Exception as exc:
            state.locate(exc, "end of step", "end_iteration")
            raise
        finally:
            if not state.evaluating:
                state.step += 1
            state.evaluating = False

    def model_chunk(self, chunk: int, chunks: int) -> None:
        self.state.chunks = chunks
        model_chunk_of(self.inner, chunk, chunks)

    def note_model(self, model: torch.nn.Module) -> None:
        """The run's model is built: its parameters' storages are the weights no offload may
        copy out (a sharded parameter by its local shard). The ``model_ready`` run hook."""
        weights: dict[int, list[_Noted]] = {}
        for name, param in model.named_parameters():
            local = local_tensor(param)
            if local.untyped_storage().nbytes():
                weights.setdefault(_storage(local), []).append(_Noted(f"parameter {name}", local))
        self.state.weights = weights

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        observer = self.state.observer
        if observer is not None:
            observer.mark(tensors)
        self.inner.mark_not_offloadable(*tensors)

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        key = self.window_started(layer, name)
        try:
            inner = self.inner.group(name, x, layer=layer)
        except BaseException as exc:
            with self.state.lock:
                self.state.open.remove(key)
            self.state.locate(exc, "forward", "group", key)
            raise
        return _WindowGroup(inner, self.state, key)

    def iteration_logs(self) -> list[IterationLog]:
        return self.inner.iteration_logs()

    # A model that drives the offloader's groups itself (megatron-core's own layers driving its
    # own manager, ``harness.offload.mcore``) bypasses ``group``; its adapter reports the group
    # boundaries and saved tensors here instead, so the windows are the same.

    def window_started(self, layer: int, name: str) -> GroupKey:
        """A group occurrence of the current microbatch started (``group`` opens its window
        here too); its key."""
        key = (self.state.microbatch, layer, name)
        with self.state.lock:
            self.state.open.append(key)
        return key

    def window_committed(self, name: str) -> None:
        """The latest open occurrence of ``name`` committed."""
        with self.state.lock:
            for i in range(len(self.state.open) - 1, -1, -1):
                if self.state.open[i][2] == name:
                    del self.state.open[i]
                    return

    def window_saved(self, tensor: torch.Tensor, key: GroupKey) -> None:
        """Group occurrence ``key`` saved ``tensor`` (what the swapped pack hook notes)."""
        observer = self.state.observer
        if observer is not None:
            observer.saved_by(tensor, key)


@dataclass(frozen=True, slots=True)
class Copy:
    """One observed copy."""

    direction: Direction
    op: str
    nbytes: int
    group: GroupKey | None
    """The group occurrence it is attributed to (None: outside every window)."""
    pageable: bool
    thread: int
    weight: str | None = None
    """D2H only: the weight its source is (``parameter <name>``, ``a bf16 cast of parameter
    <name>`` saved by a group, or ``a tensor the model marked not-offloadable``); None for an
    activation."""


@dataclass(kw_only=True)
class Observed:
    """What one observed step copied."""

    copies: list[Copy] = field(default_factory=list)
    summed: list[_SumRecord] = field(default_factory=list)
    """With checksums: the records of the saved tensors packed and unpacked in the step, their
    checksums still on the device until ``corrupted`` or ``checksummed`` is first read (after
    the run: no host read inside a step or a profiled region)."""
    _compared: tuple[list[str], int] | None = None
    relaid: int = 0
    """With checksums: reloads whose strides differ from the saved tensor's (an offloader whose
    reload comes back contiguous, as ``save_on_cpu``'s does)."""
    packed: Counter[GroupKey] = field(default_factory=Counter)
    """Saved tensors each group occurrence packed through the harness's swapped pack hook in
    the step (none where the offloader's hooks run outside the harness's windows)."""
    unpacked: Counter[GroupKey] = field(default_factory=Counter)
    """How many of those the step's backward unpacked, by the group that packed them."""
    held: list[tuple[int, GroupKey, int]] = field(default_factory=list)
    """(step written, group, bytes) of every host storage a D2H of this or an earlier observed
    step wrote that is still alive at this step's end (after its iteration ended): the host
    memory the offloader holds across iterations."""

    ranged: list[tuple[RangeKey, int]] = field(default_factory=list)
    """On a CPU device: every copy op issued inside one of the offloader's own ranges
    (``harness.offload.ranges.profiler_range``), with the destination's bytes, keyed by the
    innermost range open on the issuing thread - what the profiler's CPU-mode counter counts
    (``harness.transfers``), read without a profiler."""

    @property
    def corrupted(self) -> list[str]:
        """With checksums: each saved tensor whose reload's checksum differs from its pack-time
        one, where it was saved (``_SumRecord.where``), in unpack order."""
        return self._compare()[0]

    @property
    def checksummed(self) -> int:
        """With checksums: how many saved tensors were compared (packed and unpacked in the
        step)."""
        return self._compare()[1]

    def _compare(self) -> tuple[list[str], int]:
        """One host read per device of every pack and unpack checksum, mismatches named (a
        saved tensor may live on the host, e.g. a MoE layer's token counts)."""
        if self._compared is None:
            records = [r for r in self.summed if r.packed is not None and r.reloaded is not None]
            bad: set[int] = set()
            by_device: dict[torch.device, list[int]] = defaultdict(list)
            for i, record in enumerate(records):
                by_device[record.packed.device].append(i)  # type: ignore[union-attr]
            for indices in by_device.values():
                packed = torch.stack([records[i].packed for i in indices])  # type: ignore[misc]
                reloaded = torch.stack(
                    [records[i].reloaded.to(packed.device) for i in indices]  # type: ignore[union-attr]
                )
                packed, reloaded = packed.cpu(), reloaded.cpu()
                differs = (packed != reloaded).any(dim=1).tolist()
                bad.update(i for i, d in zip(indices, differs, strict=True) if d)
            self._compared = ([r.where() for i, r in enumerate(records) if i in bad], len(records))
            self.summed = []
        return self._compared

    def ranged_counts(self) -> TransferCounts:
        """The copies inside the offloader's own ranges (CPU device), as the profiler counter's
        CPU-mode record."""
        by_range: dict[RangeKey, Counts] = defaultdict(Counts)
        for key, nbytes in self.ranged:
            by_range[key] += Counts(1, nbytes)
        return TransferCounts(dict(by_range), mode="cpu")

    def counts(self, mode: str) -> TransferCounts:
        """The same record the profiler counter gives (``harness.transfers``), attributed by
        harness windows; copies outside every window are ``unattributed``."""
        by_range: dict[RangeKey, Counts] = defaultdict(Counts)
        outside = {d: Counts() for d in DIRECTIONS}
        pageable = 0
        for copy in self.copies:
            one = Counts(1, copy.nbytes)
            if copy.group is None:
                outside[copy.direction] += one
                continue
            mb, layer, name = copy.group
            by_range[RangeKey(copy.direction, name, mb, layer)] += one
            pageable += copy.pageable
        return TransferCounts(dict(by_range), outside, pageable, mode=mode)  # type: ignore[arg-type]

    def outside(self) -> list[Copy]:
        return [c for c in self.copies if c.group is None]

    def weight_copies(self) -> list[Copy]:
        """The D2H copies whose source is a weight (``Copy.weight``)."""
        return [c for c in self.copies if c.weight is not None]

    def without(self, own: Observed, *, any_window: bool = False) -> Observed:
        """These copies less the model's own: each copy of ``own`` (the same step of a run
        that moves nothing, e.g. a MoE layer's token counts copied to the host inside its
        group's window) removes one copy with the same group, direction, op and bytes.
        ``any_window``: the group may differ (a run with the offloader disabled, where a model
        driving its offloader's groups itself opens no window, so its own copies land outside
        every one)."""
        left = Counter(_signature(c, any_window) for c in own.copies)
        kept = []
        for copy in self.copies:
            signature = _signature(copy, any_window)
            if left[signature]:
                left[signature] -= 1
            else:
                kept.append(copy)
        return Observed(
            copies=kept, ranged=self.ranged, _compared=self._compare(), relaid=self.relaid
        )


def corrupted_reloads(seen: Sequence[Observed]) -> list[tuple[int, str]]:
    """(step, where) of every reload whose checksum differs from its pack-time one, over a
    run's observed steps in order (``Observed.corrupted``)."""
    return [(step, where) for step, observed in enumerate(seen) for where in observed.corrupted]


def _signature(copy: Copy, any_window: bool = False) -> tuple[Any, ...]:
    return None if any_window else copy.group, copy.direction, copy.op, copy.nbytes


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's: its local shard's)."""
    return local_tensor(t).untyped_storage().data_ptr()


class _Noted:
    """A weight the observer knows: what to call it, the tensor and its byte range."""

    __slots__ = ("end", "name", "ref", "start")

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name, self.ref = name, weakref.ref(tensor)
        self.start = tensor.data_ptr()
        self.end = self.start + _nbytes(tensor)


def _owns(noted: torch.Tensor | None, address: int) -> bool:
    """Whether the tensor noted at ``address`` still lives and still owns that memory (not
    freed, not resized to nothing and the address reused by another tensor)."""
    if noted is None:
        return False
    storage = noted.untyped_storage()
    return storage.data_ptr() == address and storage.nbytes() > 0


def _live(table: dict[int, list[_Noted]], t: torch.Tensor) -> str | None:
    """What ``table`` calls ``t`` (the entry whose bytes hold ``t``'s first element, else the
    first entry of its storage) while the tensor it was noted for lives and still owns that
    memory: a storage freed or resized to nothing (FSDP2's resharded parameters) and reused by
    an activation is never mistaken for it."""
    address = _storage(t)
    live = [entry for entry in table.get(address, ()) if _owns(entry.ref(), address)]
    if not live:
        return None
    first = t.data_ptr()
    holding = next((e for e in live if e.start <= first < e.end), None)
    return holding.name if holding is not None else f"the storage of {live[0].name}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CopyObserver(TorchDispatchMode):
    """Records the copies between memories of the ops run while it is active (see the module
    docstring); ``state`` gives the forward window open at each copy."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling frame unless this says
        # no: two more Python calls per op; the observed runs are eager, never compiled
        return False

    def __init__(self, state: _WindowState, device: torch.device) -> None:
        super().__init__()
        self.state = state
        self.host_device = device.type != "cuda"
        self.observed = Observed()
        self.written: dict[int, GroupKey] = {}
        """Host address a D2H wrote -> its group (the latest D2H into that address)."""
        self.keep: list[torch.UntypedStorage] = []
        """Every host storage a D2H wrote, held until the step ends: no address a D2H wrote
        can be freed and reused by another tensor while the step is observed (host memory
        only; device memory and what the offloader frees are untouched)."""
        self.saved: dict[int, tuple[GroupKey, weakref.ref[torch.Tensor]]] = {}
        """Device storage -> the group that saved it (or made it inside its pack hook, e.g. a
        ``.contiguous()`` copy), so a D2H issued after its group's window closed is still that
        group's. An entry counts only while that tensor lives: a storage address freed and reused
        by another tensor (the runner's loss, FSDP2's buffers) is never mistaken for it."""
        self.marked: dict[int, weakref.ref[torch.Tensor]] = {}
        """Device storages the model marked not-offloadable (parameters): never saved-by."""
        self.casts: dict[int, list[_Noted]] = {}
        """Storages of saved tensors that are casts of a parameter (a bf16 shadow made for the
        forward), as ``state.weights``."""
        self.lock = threading.Lock()

    def _saved_group(self, tensor: torch.Tensor) -> GroupKey | None:
        """The group that saved ``tensor``'s storage while the tensor it noted still owns that
        memory: an offloader may keep the tensor object alive after a forced release freed its
        storage, and FSDP2's later copies at the reused address are not the group's."""
        address = _storage(tensor)
        entry = self.saved.get(address)
        if entry is None:
            return None
        noted = entry[1]()
        return entry[0] if _owns(None if noted is None else local_tensor(noted), address) else None

    def mark(self, tensors: Sequence[torch.Tensor]) -> None:
        with self.lock:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self.marked[_storage(t)] = weakref.ref(local_tensor(t))

    def _is_marked(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is a marked tensor's, while that tensor still owns the
        memory (FSDP2 frees a layer's unsharded parameters after its forward; an activation
        allocated at the same address later is no marked tensor)."""
        address = _storage(tensor)
        ref = self.marked.get(address)
        return _owns(ref() if ref is not None else None, address)

    def note_cast(self, tensor: torch.Tensor) -> None:
        """A saved tensor made by casting a parameter (its autograd node a copy whose input
        accumulates into a known parameter) is a weight too."""
        node = getattr(tensor, "grad_fn", None)
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return
        for parent, _ in node.next_functions:
            param = getattr(parent, "variable", None)
            if not isinstance(param, torch.Tensor):
                continue
            entry = _live(self.state.weights, param)
            if entry is not None:
                with self.lock:
                    what = f"a {str(tensor.dtype).removeprefix('torch.')} cast of {entry}"
                    self.casts[_storage(tensor)] = [_Noted(what, tensor)]

    def _weight_of(self, src: torch.Tensor) -> str | None:
        """What weight ``src`` is (None: an activation)."""
        found = _live(self.state.weights, src) or _live(self.casts, src)
        if found is None and self._is_marked(src):
            found = "a tensor the model marked not-offloadable"
        return found

    def saved_by(self, tensor: torch.Tensor, group: GroupKey) -> None:
        """``group``'s pack hook received ``tensor``."""
        if isinstance(tensor, torch.Tensor):
            with self.lock:
                if not self._is_marked(tensor):
                    self.saved[_storage(tensor)] = (group, weakref.ref(tensor))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packing = self.state.packing
        if packing is not None:  # what a pack hook makes from a saved tensor is that group's
            for made in out if isinstance(out, tuple | list) else (out,):
                if isinstance(made, torch.Tensor) and made.device.type != "meta":
                    with self.lock:
                        if self._saved_group(made) is None and not self._is_marked(made):
                            self.saved[_storage(made)] = (packing, weakref.ref(made))
        op = _COPY_OPS.get(func)
        if op is not None:
            try:
                pairs = _endpoints(func, args, out)
            except (IndexError, TypeError):
                return out
            for src, dst in pairs:
                if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
                    continue
                if self.host_device:
                    key = current_range()
                    if key is not None:
                        with self.lock:
                            self.observed.ranged.append((key, _nbytes(dst)))
                self._note(op, src, dst)
        return out

    def _note(self, op: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.host_device:
            self._note_host(op, src, dst)
            return
        if src.device.type == "cuda" and dst.device.type == "cpu":
            with self.lock:
                group = self._saved_group(src) or self.state.current()
                if group is not None:
                    self._wrote(dst, group)
                self._add("d2h", op, dst, group, not dst.is_pinned(), self._weight_of(src))
        elif src.device.type == "cpu" and dst.device.type == "cuda":
            with self.lock:
                group = self.written.get(src.data_ptr())
                self._add("h2d", op, dst, group, not src.is_pinned())

    def _note_host(self, op: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.dtype != dst.dtype or src.device.type != "cpu" or dst.device.type != "cpu":
            return
        if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
            return  # an in-place copy within one buffer
        with self.lock:
            source_group = self.written.get(src.data_ptr())
            if source_group is not None:  # reading back a host copy
                self._add("h2d", op, dst, source_group, False)
                return
            group = self._saved_group(src) or self.state.current()
            if group is None:
                return  # a host copy of no saved tensor, outside every window: not an offload
            self._wrote(dst, group)
            self._add("d2h", op, dst, group, False, self._weight_of(src))

    def _wrote(self, dst: torch.Tensor, group: GroupKey) -> None:
        self.written[dst.data_ptr()] = group
        storage = dst.untyped_storage()
        self.keep.append(storage)
        self.state.written[storage.data_ptr()] = _Written(storage, group, self.state.steps - 1)

    def _add(
        self,
        direction: Direction,
        op: str,
        dst: torch.Tensor,
        group: GroupKey | None,
        pageable: bool,
        weight: str | None = None,
    ) -> None:
        self.observed.copies.append(
            Copy(direction, op, _nbytes(dst), group, pageable, threading.get_ident(), weight)
        )


def _endpoints(func: Any, args: tuple[Any, ...], out: Any) -> list[tuple[Any, Any]]:
    """The (source, destination) pairs of a copy op: one, or one per tensor of a foreach
    copy's lists."""
    if func is _aten.copy_.default:
        return [(args[1], args[0])]
    if func is _aten._copy_from.default:
        return [(args[0], args[1])]
    if func is _aten._foreach_copy_.default:
        return list(zip(args[1], args[0], strict=True))
    if func is _aten._foreach_copy.default:
        return list(zip(args[1], out, strict=True))
    return [(args[0], out)]  # _to_copy


@contextlib.contextmanager
def observe(offloader: Offloader, device: torch.device, sink: list[Observed]) -> Iterator[None]:
    """Observe the copies of the ops run inside, attributed by ``offloader``'s windows (a
    ``Windowed``; anything else observes nothing attributable and is refused)."""
    if not isinstance(offloader, Windowed):
        raise TypeError("observe() needs the run's offloader wrapped in harness.observe.Windowed")
    mode = CopyObserver(offloader.state, device)
    offloader.state.steps += 1
    offloader.state.observer = mode
    try:
        with watching(), mode:
            yield
    finally:
        offloader.state.observer = None
        mode.keep.clear()  # the observer's own hold on what the D2H copies wrote ends here
    mode.observed.held = held(offloader.state)
    sink.append(mode.observed)


def held(state: _WindowState) -> list[tuple[int, GroupKey, int]]:
    """(step written, group, bytes) of the host storages observed D2H copies wrote that are
    still alive now (after a collection, so a reference cycle that would be freed anyway does
    not count); dead entries are dropped."""
    gc.collect()
    alive = []
    for address, written in list(state.written.items()):
        storage = written.ref()
        if storage is None or storage.nbytes() == 0:
            del state.written[address]
        else:
            alive.append((written.step, written.group, storage.nbytes()))
    return alive
