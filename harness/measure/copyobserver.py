"""The copy observer (``harness.measure.observe``): a ``TorchDispatchMode`` that records every copy
between memories of an observed step and attributes it to a group occurrence (``CopyObserver``,
``Copy``, ``Observed``). How it sees and attributes copies is told in ``harness.measure.observe``'s
docstring; the windows it reads are that module's, which re-exports every name."""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.measure.checksums import _SumRecord
from harness.measure.transfers import DIRECTIONS, Counts, TransferCounts
from harness.offload.protocol import local_tensor
from harness.offload.ranges import Direction, RangeKey, current_range
from harness.offload.semantics import GroupKey

_aten = torch.ops.aten
_COPY_OPS = {
    _aten.copy_.default: "copy_",
    _aten._to_copy.default: "_to_copy",
    _aten._copy_from.default: "_copy_from",
    # One op for a list of tensors (an offloader batching a group's copies): a copy per pair.
    _aten._foreach_copy_.default: "_foreach_copy_",
    _aten._foreach_copy.default: "_foreach_copy",
}


class _Written:
    """A host storage an observed D2H wrote: weakly, with its group and step."""

    __slots__ = ("group", "ref", "step")

    def __init__(self, storage: torch.UntypedStorage, group: GroupKey, step: int) -> None:
        self.ref, self.group, self.step = weakref.ref(storage), group, step


class _Windows(Protocol):
    """What the observer reads of the windows (``harness.measure.observe._WindowState``)."""

    packing: GroupKey | None
    weights: dict[int, list[_Noted]]
    written: dict[int, _Written]
    host_base: int | None
    steps: int

    def current(self) -> GroupKey | None: ...


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
    seq: int = -1
    """Its place in the step's sequence of copies and backward marks (``Observed.marks``):
    what the cadence check (``harness.execute.cadence``) orders reloads by."""


@dataclass(frozen=True, slots=True)
class Boundary:
    """The host memory at one group boundary of an observed step: a group occurrence's commit
    returned (``commit``, the forward), its backward started (``start``) or ended (``end``).
    ``harness.measure.footprint`` sets it beside the bytes in flight at the same point."""

    seq: int
    """Its place in the step's sequence of copies and marks (``Copy.seq``)."""
    kind: str
    group: GroupKey
    held: int
    """Bytes of the host storages the run's observed D2H copies wrote (this step's and earlier
    steps') that something other than the observer holds now: the offloader's host copies and
    pool buffers, found through the harness's copies."""
    allocated: int | None = None
    """On CUDA: the caching host allocator's bytes in use (``allocated_bytes.current``: whole
    power-of-two blocks) less its reading when the run's first observed step began; None on
    CPU."""


def host_allocator_stats() -> dict[str, int]:
    """The caching host allocator's counters (``torch.cuda.host_memory_stats``): bytes in
    use and reserved, and how many pinned blocks it has asked the driver for."""
    stats = torch.cuda.host_memory_stats()
    return {
        "allocated": int(stats.get("allocated_bytes.current", 0)),
        "reserved": int(stats.get("reserved_bytes.current", 0)),
        "host_allocs": int(stats.get("num_host_alloc", 0)),
    }


def _held_elsewhere(storage: torch.UntypedStorage, kept: bool) -> bool:
    """Whether something other than the observer holds ``storage``: a tensor on it (the
    storage's C++ use count counts each tensor and the one Python object) or another Python
    reference to its object (the references here: the caller's, this call's, ``getrefcount``'s
    argument, and the observer's ``keep`` list where ``kept``)."""
    return torch._C._storage_Use_Count(storage._cdata) > 1 or sys.getrefcount(storage) > 3 + kept


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

    overdrawn: list[tuple[GroupKey | None, int, int]] = field(default_factory=list)
    """(group, bytes copied out, bytes saved) of every saved storage the step's D2H copies read
    more bytes from than its saves hold (each save of a tensor allows its whole storage once):
    the same data copied out twice, which no rule of any offloader explains
    (``CopyObserver.overdrawn``, set when the step's observation ends)."""
    stale_marks: list[tuple[GroupKey, int, int, int]] = field(default_factory=list)
    """(group, bytes, step marked, step) of every saved tensor the offloader kept on the device
    (its pack returned it) at an address where the model had marked a storage that no longer
    holds that memory: a mark kept by address gone stale (``harness.measure.observe``)."""
    marks: list[tuple[int, str, GroupKey]] = field(default_factory=list)
    """(seq, ``start`` or ``end``, group occurrence): where each group occurrence's backward
    started (the gradient of its window's output arrived) and ended (the gradient of its
    window's input is complete), in the same sequence as ``Copy.seq``; the harness's own
    autograd hooks, no cooperation from the offloader."""
    boundaries: list[Boundary] = field(default_factory=list)
    """The host memory held at every group boundary of the step (``Boundary``)."""
    new_host: list[tuple[GroupKey, int]] = field(default_factory=list)
    """(group, bytes) of every host storage a D2H of the step wrote that no D2H of an earlier
    observed step of the run wrote (a new storage, even at an address the allocator reused):
    host memory new to the offloader's copies; empty in the run's first observed step."""
    host_allocs: int | None = None
    """On CUDA: pinned blocks the caching host allocator asked the driver for during the step
    (its ``num_host_alloc``, any caller); None on CPU."""
    commits: list[GroupKey] = field(default_factory=list)
    """Group occurrences in the order their commits returned in the step's forwards (groups
    nest: attn_norm starts before the attention groups and commits after them), the order
    Megatron's rule reloads in, last committed first."""
    ranged: list[tuple[RangeKey, int]] = field(default_factory=list)
    """On a CPU device: every copy op issued inside one of the offloader's own ranges
    (``harness.offload.ranges.profiler_range``), with the destination's bytes, keyed by the
    innermost range open on the issuing thread - what the profiler's CPU-mode counter counts
    (``harness.measure.transfers``), read without a profiler."""

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
        """The same record the profiler counter gives (``harness.measure.transfers``), attributed by
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
            copies=kept,
            ranged=self.ranged,
            _compared=self._compare(),
            relaid=self.relaid,
            marks=self.marks,
            commits=self.commits,
            stale_marks=self.stale_marks,
            overdrawn=self.overdrawn,
            boundaries=self.boundaries,
            new_host=self.new_host,
            host_allocs=self.host_allocs,
        )


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

    def __init__(self, state: _Windows, device: torch.device) -> None:
        super().__init__()
        self.state = state
        self.host_device = device.type != "cuda"
        self.observed = Observed()
        self.written: dict[int, GroupKey] = {}
        """Host address a D2H wrote -> its group (the latest D2H into that address)."""
        self.keep: list[torch.UntypedStorage] = []
        self.kept: set[int] = set()
        """``id`` of each storage in ``keep``."""
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
        self.allowed: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        """Source storage -> bytes the step's D2H copies may read from it: its whole storage
        once per save (or per tensor a pack hook made from a saved one)."""
        self.drawn: dict[int, int] = {}
        """Source storage -> bytes the step's D2H copies read from it."""
        self.over: dict[int, tuple[GroupKey | None, int, int]] = {}
        self.settled: list[tuple[GroupKey | None, int, int]] = []
        """Overdraws of storages whose address has since been given to another tensor."""
        self.lock = threading.Lock()
        self._seq = itertools.count()

    def committed(self, key: GroupKey) -> None:
        """Group occurrence ``key``'s commit returned (``Observed.commits``)."""
        with self.lock:
            self.observed.commits.append(key)
            self._boundary(next(self._seq), "commit", key)

    def mark_backward(self, kind: str, key: GroupKey) -> None:
        """Group occurrence ``key``'s backward started or ended (``Observed.marks``)."""
        with self.lock:
            seq = next(self._seq)
            self.observed.marks.append((seq, kind, key))
            self._boundary(seq, kind, key)

    def _boundary(self, seq: int, kind: str, key: GroupKey) -> None:
        """Note the host memory held now (``Boundary``); under ``lock``."""
        held = 0
        for written in self.state.written.values():
            storage = written.ref()
            if storage is not None and _held_elsewhere(storage, id(storage) in self.kept):
                held += storage.nbytes()
        allocated = None
        if not self.host_device and self.state.host_base is not None:
            allocated = host_allocator_stats()["allocated"] - self.state.host_base
        self.observed.boundaries.append(Boundary(seq, kind, key, held, allocated))

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
                self._allow(tensor)
                if not self._is_marked(tensor):
                    self.saved[_storage(tensor)] = (group, weakref.ref(tensor))

    def _allow(self, tensor: torch.Tensor) -> None:
        """One more save of ``tensor``: its whole storage may be copied out once more. An entry
        whose tensor no longer holds that address (freed, the address reused) starts over."""
        local = local_tensor(tensor)
        address = _storage(local)
        nbytes = local.untyped_storage().nbytes()
        entry = self.allowed.get(address)
        if entry is not None and _owns(entry[0](), address):
            self.allowed[address] = (entry[0], entry[1] + nbytes)
            return
        self._forget(address)
        self.allowed[address] = (weakref.ref(local), nbytes)

    def _forget(self, address: int) -> None:
        """The storage noted at ``address`` is gone: its bound and reads end there, and its
        overdraw, if any, stays reported (``settled``)."""
        self.allowed.pop(address, None)
        self.drawn.pop(address, None)
        settled = self.over.pop(address, None)
        if settled is not None:
            self.settled.append(settled)

    def overdrawn(self) -> list[tuple[GroupKey | None, int, int]]:
        """Every saved storage the step's D2H copies read more of than its saves hold
        (``Observed.overdrawn``, filled when the step's observation ends)."""
        return [*self.settled, *self.over.values()]

    def _draw(self, src: torch.Tensor, nbytes: int, group: GroupKey | None) -> None:
        """A D2H read ``nbytes`` of ``src``: past what its saves allow, the step notes it
        (one entry per storage, updated as more is read). Only a saved storage still held by a
        tensor it was saved as is bounded: a buffer the offloader packed itself at an address a
        freed saved tensor had is not."""
        address = _storage(src)
        entry = self.allowed.get(address)
        if entry is None:
            return
        if not _owns(entry[0](), address):
            self._forget(address)
            return
        drawn = self.drawn[address] = self.drawn.get(address, 0) + nbytes
        if drawn > entry[1]:
            self.over[address] = (group, drawn, entry[1])

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
                            self._allow(made)
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
                self._draw(src, _nbytes(dst), group)
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
            self._draw(src, _nbytes(dst), group)
            self._add("d2h", op, dst, group, False, self._weight_of(src))

    def _wrote(self, dst: torch.Tensor, group: GroupKey) -> None:
        self.written[dst.data_ptr()] = group
        storage = dst.untyped_storage()
        if id(storage) not in self.kept:
            self.keep.append(storage)
            self.kept.add(id(storage))
        address = storage.data_ptr()
        prior = self.state.written.get(address)
        if self.state.steps > 1 and (prior is None or prior.ref() is not storage):
            # no storage an earlier step wrote lives at this address: memory allocated since
            # (even where the allocator handed back the same address)
            self.observed.new_host.append((group, storage.nbytes()))
        self.state.written[address] = _Written(storage, group, self.state.steps - 1)

    def _add(
        self,
        direction: Direction,
        op: str,
        dst: torch.Tensor,
        group: GroupKey | None,
        pageable: bool,
        weight: str | None = None,
    ) -> None:
        seq = next(self._seq)
        self.observed.copies.append(
            Copy(direction, op, _nbytes(dst), group, pageable, threading.get_ident(), weight, seq)
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
