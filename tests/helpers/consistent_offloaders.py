"""A second corpus of offloaders declaring nothing: styles that make the same choice every step.

Like ``undeclared_offloaders.py`` (whose ``_Group`` and ``StorageSkip`` they reuse),
each is written from ``harness/offload/protocol.py`` alone: no ``Capabilities``, no log. On a CPU
device an offload is a ``copy_`` into a separate host buffer and a reload a ``copy_`` back into
a fresh tensor with the saved strides; on CUDA the host buffers are pinned and the copies
``non_blocking``. Marked tensors and tensors sharing their storage never move.

==================  ===========================================================================
``ThreadCopier``    every copy is issued on a one-thread ``ThreadPoolExecutor`` (CUDA: on its own
                    stream, ordered by events both ways, no host synchronisation)
``LayerSubset``     offloads the selected groups of the first two distinct layers it saw in its
                    first iteration only (TransformerEngine's ``num_layers`` style)
``BatchedCopy``     one copy per group occurrence each way: the commit packs the group's saved
                    tensors into one flat byte buffer; the first unpack brings all of it back
``PrefetchAll``     the first unpack of a tensor still on the host reloads every pending one
``TwoAhead``        the first unpack of an occurrence reloads it and the two committed before it
``ByteThreshold``   ``min_offloaded_tensor_size`` read as 4 bytes an element (a bf16 tensor
                    needs twice the elements of a float32 one)
``ChunkedCopy``     copies each tensor in pieces of at most 4096 elements, each way
==================  ===========================================================================

Flawed, trusting raw storage addresses: ``AddressMarks`` (wrong where parameter addresses are
freed and reused, as under FSDP2) and ``AddressDedup`` (wrong wherever a freed activation's
address is reused within an iteration, which allocators do on every row). Broken twins (each
must be caught without a declaration): ``SubsetDrifts``, ``BatchedDropsBytes``,
``ThreadStaleBuffer``, at the end.
"""

from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor

import torch
from undeclared_offloaders import StorageSkip, _Group


def _reload(device: torch.device, stride: tuple[int, ...], host: torch.Tensor) -> torch.Tensor:
    """A fresh device tensor with the saved strides holding ``host``'s values (``_Base.unpack``)."""
    out = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)
    return out.copy_(host, non_blocking=True)


class ThreadCopier(StorageSkip):
    """Every D2H and H2D copy is issued on a one-thread pool while the hook waits for the worker
    to return; on CUDA the worker issues the copy on a stream of its own after an event of the
    caller's stream and returns an event after it (no host synchronisation): the H2D waits on
    the D2H's event, the caller's stream on the H2D's."""

    name = "consistent.thread-copier"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copier")
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def _ready(self) -> torch.cuda.Event | None:
        """An event on the caller's current stream (CUDA), for the worker to wait on."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, waits) -> tuple[torch.Tensor, object]:
        """The worker's job: ``dst.copy_(src)`` issued after ``waits`` (CUDA events), and an
        event after it (None on a CPU device, where the copy is done when it returns)."""
        with torch.no_grad():
            if self.stream is None:
                return dst.copy_(src), None
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                for event in waits:
                    self.stream.wait_event(event)
                dst.copy_(src, non_blocking=True)
                for t in (dst, src):
                    if t.is_cuda:  # device memory the side stream uses lives until it is done
                        t.record_stream(self.stream)
                done = torch.cuda.Event()
                done.record(self.stream)
            return dst, done

    def _d2h(self, t: torch.Tensor, waits, host: torch.Tensor | None = None):
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return self._copy(host, t, waits)

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        host, done = self.pool.submit(self._d2h, t, [e for e in [self._ready()] if e]).result()
        return (t.device, t.stride(), host, done)

    def _h2d(self, host: torch.Tensor, device, stride, done) -> torch.Tensor:
        # allocated on the caller's stream; the worker's copy waits for the caller's work so far
        # and for the D2H that filled the host buffer, the caller's stream for the copy
        out = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)
        waits = [e for e in (self._ready(), done) if e is not None]
        out, back = self.pool.submit(self._copy, out, host, waits).result()
        if back is not None:
            torch.cuda.current_stream(self.device).wait_event(back)
        return out

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, stride, host, done = packed
        return self._h2d(host, device, stride, done)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        super().close()


class LayerSubset(StorageSkip):
    """Offloads the selected groups of the first two distinct layers that open a selected group
    in its first iteration (learned once, kept for every later one); other layers' selected
    groups pass through."""

    name = "consistent.layer-subset"
    learn = 2
    """How many distinct layers it learns (a subclass may learn more than it offloads)."""

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.layers: list[int] = []
        self.learning = True

    def offloads(self, layer: int) -> bool:
        return layer in self.layers[:2]

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        if not (self.enabled and name in self.selected and torch.is_grad_enabled()):
            return _Group(contextlib.nullcontext(), x)
        if self.learning and layer not in self.layers and len(self.layers) < self.learn:
            self.layers.append(layer)
        if not self.offloads(layer):
            return _Group(contextlib.nullcontext(), x)
        return super().group(name, x, layer=layer)

    def end_iteration(self) -> None:
        if self.layers:
            self.learning = False  # the first iteration that saw a selected group decided
        super().end_iteration()


class _Batch:
    """The saved tensors of one group occurrence: device tensors until the commit, then one host
    byte buffer; in backward one device byte buffer that every unpack slices."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor | None] = []
        self.layout: list[tuple[torch.Size, tuple[int, ...], torch.dtype, int, int]] = []
        self.device: torch.device | None = None
        self.host: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.left = 0  # tensors still to unpack before the device buffer is dropped


class _Handle:
    __slots__ = ("batch", "index")

    def __init__(self, batch: _Batch, index: int) -> None:
        self.batch, self.index = batch, index


class _BatchGroup(_Group):
    def __init__(self, hooks, x: torch.Tensor, owner: BatchedCopy, batch: _Batch) -> None:
        super().__init__(hooks, x)
        self.owner, self.batch = owner, batch

    def commit(self, output, release=()):
        self.owner.flush(self.batch)
        return output


class BatchedCopy(StorageSkip):
    """One copy per group occurrence each way: the commit packs the group's saved tensors into one
    flat byte buffer copied to the host at once; the first unpack brings all of it back in one
    copy and each unpack rebuilds its tensor with the saved strides."""

    name = "consistent.batched-copy"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.microbatch = 0

    def begin_microbatch(self, microbatch: int) -> None:
        self.microbatch = microbatch

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        if not (self.enabled and name in self.selected and torch.is_grad_enabled()):
            return _Group(contextlib.nullcontext(), x)
        batch = _Batch()

        def pack(t: torch.Tensor):
            if self.stays(t):
                return t
            batch.tensors.append(t)
            return _Handle(batch, len(batch.tensors) - 1)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)
        return _BatchGroup(hooks, x, self, batch)

    def kept(self, batch: _Batch) -> int:
        """How many of the batch's last tensors stay on the device (none: a subclass's bug)."""
        return 0

    def flush(self, batch: _Batch) -> None:
        """The commit: the batch's tensors into one host byte buffer with one copy."""
        if not batch.tensors or batch.host is not None:
            return
        moved = len(batch.tensors) - self.kept(batch)
        batch.device = batch.tensors[0].device
        pieces, offset = [], 0
        for t in batch.tensors[:moved]:
            raw = t.contiguous().view(-1).view(torch.uint8)
            batch.layout.append((t.shape, t.stride(), t.dtype, offset, raw.numel()))
            pieces.append(raw)
            offset += raw.numel()
        if pieces:
            with torch.no_grad():
                flat = torch.cat(pieces)
                cuda = flat.is_cuda
                batch.host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=cuda)
                batch.host.copy_(flat, non_blocking=cuda)
        for i in range(moved):
            batch.tensors[i] = None  # the device copies go; what stays is kept
        batch.left = moved

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        batch, index = packed.batch, packed.index
        if batch.tensors[index] is not None:  # never committed, or kept on the device
            return batch.tensors[index]
        if batch.buffer is None:
            batch.buffer = torch.empty(batch.host.numel(), dtype=torch.uint8, device=batch.device)
            batch.buffer.copy_(batch.host, non_blocking=True)
        shape, stride, dtype, start, size = batch.layout[index]
        raw = batch.buffer[start : start + size]
        if start % dtype.itemsize:
            raw = raw.clone()  # a start the wider element cannot be viewed at
        data = raw.view(dtype).view(shape)
        out = torch.empty_strided(shape, stride, dtype=dtype, device=batch.device).copy_(data)
        batch.left -= 1
        if batch.left <= 0:
            batch.buffer = None
        return out


class AddressMarks(StorageSkip):
    """Keeps its marks as raw storage addresses and compares a saved tensor's storage address to
    them. Flawed: FSDP2 frees and reuses parameter addresses, so activations can be skipped at
    random; the harness should flag it on ZeRO-3/FSDP rows only (elsewhere it is StorageSkip)."""

    name = "broken.address-marks"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.addresses: set[int] = set()

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        self.addresses |= {
            getattr(t, "_local_tensor", t).untyped_storage().data_ptr()
            for t in tensors
            if isinstance(t, torch.Tensor)
        }

    def stays(self, t: torch.Tensor) -> bool:
        if t.device.type != self.device.type:
            return True
        return getattr(t, "_local_tensor", t).untyped_storage().data_ptr() in self.addresses

    def end_iteration(self) -> None:
        self.addresses.clear()
        super().end_iteration()

    def close(self) -> None:
        self.addresses.clear()
        super().close()


class AddressDedup(StorageSkip):
    """Copies a saved tensor once per iteration, keyed by storage address, offset, shape, strides
    and dtype; a repeat key gets the same host copy. Flawed: a freed address reused by a new
    tensor gets the stale copy; equivalence (reload checksums) should catch it on any row."""

    name = "broken.address-dedup"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.copies: dict[tuple, object] = {}

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key not in self.copies:
            self.copies[key] = super().pack(t)
        return self.copies[key]

    def end_iteration(self) -> None:
        self.copies.clear()
        super().end_iteration()

    def close(self) -> None:
        self.copies.clear()
        super().close()


class _Pending:
    """One offloaded tensor: its host copy, and its reloaded tensor from its reload until its
    unpack takes it."""

    __slots__ = ("device", "host", "occurrence", "out", "reloaded", "stride")

    def __init__(self, t: torch.Tensor, host: torch.Tensor, occurrence=None) -> None:
        self.device, self.stride, self.host = t.device, t.stride(), host
        self.occurrence, self.out, self.reloaded = occurrence, None, False

    def reload(self) -> None:
        if not self.reloaded:
            self.out = _reload(self.device, self.stride, self.host)
            self.reloaded = True

    def take(self) -> torch.Tensor:
        out, self.out = self.out, None
        if out is None:  # unpacked a second time: one more copy from the host
            out = _reload(self.device, self.stride, self.host)
        return out


class PrefetchAll(StorageSkip):
    """The first unpack of a tensor still on the host reloads every tensor packed and not yet
    reloaded (all groups and microbatches so far, one copy each) and caches them; each unpack
    hands back its cached tensor."""

    name = "consistent.prefetch-all"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.pending: list[_Pending] = []

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        handle = _Pending(t, host)
        self.pending.append(handle)
        return handle

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if not packed.reloaded:
            for handle in self.pending:
                handle.reload()
            self.pending.clear()
        return packed.take()

    def end_iteration(self) -> None:
        self.pending.clear()
        super().end_iteration()

    def close(self) -> None:
        self.pending.clear()
        super().close()


class _Occurrence:
    __slots__ = ("handles", "position")

    def __init__(self) -> None:
        self.handles: list[_Pending] = []
        self.position: int | None = None  # its place in commit order, once committed


class _OccurrenceGroup(_Group):
    def __init__(self, hooks, x: torch.Tensor, owner: TwoAhead, occurrence: _Occurrence) -> None:
        super().__init__(hooks, x)
        self.owner, self.occurrence = owner, occurrence

    def commit(self, output, release=()):
        self.occurrence.position = len(self.owner.committed)
        self.owner.committed.append(self.occurrence)
        return output


class TwoAhead(StorageSkip):
    """The first unpack of a group occurrence reloads that occurrence's tensors and those of the
    two occurrences committed just before it (depth 2: the next two backward reaches) still on
    the host; each unpack hands back its reloaded tensor."""

    name = "consistent.two-ahead"
    depth = 2

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.committed: list[_Occurrence] = []

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        if not (self.enabled and name in self.selected and torch.is_grad_enabled()):
            return _Group(contextlib.nullcontext(), x)
        occurrence = _Occurrence()

        def pack(t: torch.Tensor):
            if self.stays(t):
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=t.is_cuda)
            handle = _Pending(t, host, occurrence)
            occurrence.handles.append(handle)
            return handle

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)
        return _OccurrenceGroup(hooks, x, self, occurrence)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if not packed.reloaded:
            occurrence = packed.occurrence
            ahead = [occurrence]
            if occurrence.position is not None:
                first = max(occurrence.position - self.depth, 0)
                ahead += self.committed[first : occurrence.position][::-1]
            for each in ahead:
                for handle in each.handles:
                    handle.reload()
        return packed.take()

    def end_iteration(self) -> None:
        self.committed.clear()
        super().end_iteration()

    def close(self) -> None:
        self.committed.clear()
        super().close()


class ByteThreshold(StorageSkip):
    """Keeps a tensor of fewer than ``4 * min_offloaded_tensor_size`` bytes on the device: a
    bf16 tensor needs twice the elements of a float32 one to move."""

    name = "consistent.byte-threshold"

    def stays(self, t: torch.Tensor) -> bool:
        return super().stays(t) or t.numel() * t.element_size() < 4 * self.min_size


class ChunkedCopy(StorageSkip):
    """Copies each offloaded tensor's contiguous data in pieces of at most 4096 elements (one
    ``copy_`` each, into one host buffer) and reloads it the same way; a tensor saved with other
    strides is then copied once more on the device into them."""

    name = "consistent.chunked-copy"
    chunk = 4096

    def _pieces(self, numel: int):
        return ((a, min(a + self.chunk, numel)) for a in range(0, numel, self.chunk))

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        flat = t.contiguous().view(-1)
        host = torch.empty(flat.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
        for a, b in self._pieces(flat.numel()):
            host[a:b].copy_(flat[a:b], non_blocking=t.is_cuda)
        return (t.device, t.shape, t.stride(), host)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, shape, stride, host = packed
        flat = torch.empty(host.numel(), dtype=host.dtype, device=device)
        for a, b in self._pieces(host.numel()):
            flat[a:b].copy_(host[a:b], non_blocking=True)
        data = flat.view(shape)
        if data.stride() == stride:
            return data
        return torch.empty_strided(shape, stride, dtype=host.dtype, device=device).copy_(data)


CORRECT = (
    ThreadCopier,
    LayerSubset,
    BatchedCopy,
    PrefetchAll,
    TwoAhead,
    ByteThreshold,
    ChunkedCopy,
)
FLAWED = (AddressMarks, AddressDedup)


class SubsetDrifts(LayerSubset):
    """LayerSubset that from step 3 on offloads the second and third distinct layers instead of
    the first two; values stay right. Consistency should catch it (the groups moved differ from
    the first steady step's)."""

    name = "broken.subset-drifts"
    learn = 3

    def offloads(self, layer: int) -> bool:
        chosen = self.layers[1:3] if self.step >= 3 else self.layers[:2]
        return layer in chosen


class BatchedDropsBytes(BatchedCopy):
    """BatchedCopy that in microbatch 1 of step 3 leaves the last tensor of every batch on the
    device (its unpack hands back the device tensor), so that batch's one copy carries fewer
    bytes; values stay right. The transfers/consistency checks should catch it."""

    name = "broken.batched-drops-bytes"

    def kept(self, batch: _Batch) -> int:
        return 1 if self.step == 3 and self.microbatch == 1 else 0


class ThreadStaleBuffer(ThreadCopier):
    """ThreadCopier with two host buffers per (microbatch, layer, group, index) slot, alternated
    by step; from step 1 on its unpack reads the slot's other buffer, the previous step's
    values. The equivalence check (checksums, losses) should catch it."""

    name = "broken.thread-stale-buffer"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.buffers: dict[tuple, list[torch.Tensor | None]] = {}
        self.microbatch = 0

    def begin_microbatch(self, microbatch: int) -> None:
        self.microbatch = microbatch

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        group = super().group(name, x, layer=layer)
        if isinstance(group.hooks, contextlib.nullcontext):
            return group
        index, microbatch = itertools.count(), self.microbatch

        def pack(t: torch.Tensor):
            if self.stays(t):
                return t
            slot = self.buffers.setdefault((microbatch, layer, name, next(index)), [None, None])
            parity = self.step % 2
            held = slot[parity]
            if held is not None and (held.shape != t.shape or held.dtype != t.dtype):
                held = None
            waits = [e for e in [self._ready()] if e is not None]
            slot[parity], done = self.pool.submit(self._d2h, t, waits, held).result()
            return (t.device, t.stride(), slot, parity, done)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, stride, slot, parity, done = packed
            host = slot[parity]
            stale = slot[parity ^ 1] if self.step >= 1 else None  # the bug: last step's buffer
            if stale is not None and stale.shape == host.shape and stale.dtype == host.dtype:
                host = stale
            return self._h2d(host, device, stride, done)

        group.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        return group

    def close(self) -> None:
        self.buffers.clear()
        super().close()


BROKEN = (SubsetDrifts, BatchedDropsBytes, ThreadStaleBuffer)
