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
    is part of the thread-local state autograd carries into its worker threads) and on every
    thread the offloader starts itself (``harness.measure.threads`` relays them), and records
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

Backward marks: in an observed step each window also hangs an autograd hook on the group's input
(``end``: its gradient is complete, the group's backward is over) and on its commit's output
(``start``: its gradient arrived, the group's backward begins), and notes each commit in order;
the observer numbers the marks with the copies (``Observed.marks``, ``Observed.commits``,
``Copy.seq``), which the cadence check (``harness.execute.cadence``) orders reloads by. The hooks
return nothing, so no gradient changes.

Weights: ``Windowed.note_model`` (the ``model_ready`` run hook) gives the observer every
parameter's storage when the run's model is built; a D2H whose source lies in one, in a cast of a
parameter a group saved (its autograd node a copy of the parameter), or in a tensor the model
marked not-offloadable carries ``Copy.weight`` (the weights check fails on it).

What it cannot see: copies that bypass the dispatcher (a C++/CUDA extension calling
``cudaMemcpyAsync`` itself). On CUDA the transfer check compares the observer's totals with the
profiler's memcpy totals, so such copies show up as a difference.

The observer lives in ``harness.measure.copyobserver``, the checksums of saved tensors in
``harness.measure.checksums``; this module keeps the windows and ``observe`` and re-exports every
name.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import torch

from harness.measure.checksums import (
    _layout,
    _Summed,
    _summing,
    _SumRecord,
    checksum,
    corrupted_reloads,
)
from harness.measure.copyobserver import (
    _COPY_OPS,
    Boundary,
    Copy,
    CopyObserver,
    Observed,
    _endpoints,
    _live,
    _nbytes,
    _Noted,
    _owns,
    _signature,
    _storage,
    _Written,
    host_allocator_stats,
)
from harness.measure.threads import observing, watch_threads
from harness.offload.protocol import (
    Group,
    IterationLog,
    Offloader,
    Output,
    Wrapper,
    local_tensor,
    model_chunk_of,
)
from harness.offload.ranges import watching
from harness.offload.semantics import GroupKey
from harness.util import progress
from harness.vocab.spec import label_pass

__all__ = [
    "_COPY_OPS",
    "Boundary",
    "Copy",
    "CopyObserver",
    "GroupKey",
    "Observed",
    "Windowed",
    "_Noted",
    "_SumRecord",
    "_Summed",
    "_Written",
    "_endpoints",
    "_layout",
    "_live",
    "_nbytes",
    "_owns",
    "_signature",
    "_storage",
    "_summing",
    "checksum",
    "corrupted_reloads",
    "held",
    "host_allocator_stats",
    "observe",
]


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
        self.host_base: int | None = None
        """On CUDA: the caching host allocator's bytes in use when the run's first observed step
        began (``Boundary.allocated`` is read against it)."""
        self.steps = 0
        """Observed steps begun so far (every step of the offload run is observed)."""
        self.weights: dict[int, list[_Noted]] = {}
        """Storage address -> every parameter of the run's model in that storage (several where
        a framework keeps them in one buffer, e.g. megatron-core's DDP), with its byte range
        (``Windowed.note_model``): a D2H from one of them is a weight offloaded."""

        self.marked_at: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        """Storage address -> the tensor the model last marked not-offloadable there (weakly)
        and the step it was marked in, across the run: a tensor an offloader keeps on the
        device at such an address after the marked storage is gone was skipped by a stale mark
        (``Observed.stale_marks``)."""
        self.saved_at: dict[int, tuple[weakref.ref[torch.Tensor], GroupKey, int]] = {}
        """Storage address -> the last saved tensor packed there (weakly), its group and step:
        a saved tensor packed at an address whose earlier tensor is gone reuses it, which an
        offloader keying its copies by address mistakes for the earlier one."""

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
        """Name where ``exc`` was raised inside the offloader's calls
        (``harness.util.progress``)."""
        progress.located(exc, self.position(phase, call, key))


def _stale_mark(state: _WindowState, tensor: torch.Tensor) -> int | None:
    """The step a mark was made at ``tensor``'s storage address, where the marked tensor no
    longer holds that memory (freed, or resized to nothing as FSDP2 reshards) and ``tensor`` is
    no marked tensor itself; None otherwise."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch.nn.Parameter):
        return None
    local = local_tensor(tensor)
    address = _storage(local)
    with state.lock:
        entry = state.marked_at.get(address)
    if entry is None:
        return None
    marked = entry[0]()
    if marked is local or (marked is not None and _owns(marked, address)):
        return None
    return entry[1]


REUSED = "an offloader keying its copies by address goes stale when storage is reused"
"""How a reload's record says its storage address held another saved tensor before."""


def _reused_address(state: _WindowState, tensor: torch.Tensor, key: GroupKey) -> str:
    """Where ``tensor``'s storage address held an earlier saved tensor that no longer owns it
    (empty: it did not), and note ``tensor`` there: what names an address-keyed dedup's stale
    hit when the reload comes back wrong."""
    if not isinstance(tensor, torch.Tensor):
        return ""
    local = local_tensor(tensor)
    address = _storage(local)
    with state.lock:
        entry = state.saved_at.get(address)
        state.saved_at[address] = (weakref.ref(local), key, state.step)
    if entry is None:
        return ""
    earlier = entry[0]()
    if earlier is not None and _owns(earlier, address):
        return ""
    mb, layer, name = entry[1]
    return (
        f"its storage address held a tensor saved by group {name} (microbatch {mb}, layer "
        f"{layer}) in step {entry[2]}, freed since; {REUSED}"
    )


def _locating(unpack: Any, state: _WindowState, key: GroupKey) -> Any:
    """``unpack`` naming the step, microbatch, layer and group of what raises in it."""

    def unpacked(item: Any) -> Any:
        try:
            return unpack(item)
        except Exception as exc:
            state.locate(exc, "backward", "unpack hook", key)
            raise

    return unpacked


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A group's output as its commit marks it: the tensor, or a tuple's or list's first."""
    if isinstance(output, tuple | list):
        output = output[0] if output else None
    return output if isinstance(output, torch.Tensor) else None


def mark_backward(state: _WindowState, tensor: Any, kind: str, key: GroupKey) -> None:
    """Have the observed step note where ``key``'s backward starts (``kind`` ``start``: a hook
    on the window's output, run when its gradient arrives, before any of the group's backward)
    or ends (``end``: a hook on the window's input, run when its gradient is complete, after the
    whole group's backward). The hook returns nothing, so it changes no gradient; a tensor that
    needs no gradient gets none (that group's backward is then not ordered)."""
    observer = state.observer
    if observer is not None and kind == "start":
        observer.committed(key)
    if observer is None or not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
        return
    if not torch.is_grad_enabled():
        return

    def hook(grad: torch.Tensor) -> None:
        live = state.observer
        if live is not None:
            live.mark_backward(kind, key)

    tensor.register_hook(hook)


class _WindowGroup:
    """The inner offloader's group, with the harness's window around its forward."""

    def __init__(self, inner: Group, state: _WindowState, key: GroupKey) -> None:
        self.inner, self.state, self.key = inner, state, key
        self.closed = False
        mark_backward(state, inner.input, "end", key)

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
            reused = _reused_address(state, tensor, key)
            if observer is not None:
                observer.saved_by(tensor, key)
                observer.note_cast(tensor)
                with observer.lock:
                    observer.observed.packed[key] += 1
                if summed:
                    record = _SumRecord(key, next(count), tensor, checksum(tensor), state.chunks)
                    record.reused = reused
            previous, state.packing = state.packing, key
            try:
                packed = pack(tensor)
            except Exception as exc:
                state.locate(exc, "forward", "pack hook", key)
                raise
            finally:
                state.packing = previous
            if packed is tensor and observer is not None:  # kept on the device
                stale = _stale_mark(state, tensor)
                if stale is not None:
                    with observer.lock:
                        observer.observed.stale_marks.append(
                            (key, _nbytes(tensor), stale, state.step)
                        )
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
            out = self.inner.commit(output, release)
        except Exception as exc:
            self.state.locate(exc, "commit", "commit", self.key)
            raise
        finally:
            self.close()
        mark_backward(self.state, _first_tensor(out), "start", self.key)
        return out

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
        with self.state.lock:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    local = local_tensor(t)
                    self.state.marked_at[_storage(local)] = (weakref.ref(local), self.state.step)
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

    def window_input(self, key: GroupKey, tensor: Any) -> None:
        """The tensor group occurrence ``key``'s modules read (what its start returned): the
        gradient completing there ends its backward (the cadence check's ``end`` mark)."""
        mark_backward(self.state, tensor, "end", key)

    def window_committed(self, name: str, output: Any = None) -> None:
        """The latest open occurrence of ``name`` committed; ``output`` (what its commit
        returned), where given, starts its backward when its gradient arrives."""
        with self.state.lock:
            for i in range(len(self.state.open) - 1, -1, -1):
                if self.state.open[i][2] == name:
                    key = self.state.open.pop(i)
                    break
            else:
                return
        mark_backward(self.state, _first_tensor(output), "start", key)

    def window_saved(self, tensor: torch.Tensor, key: GroupKey) -> None:
        """Group occurrence ``key`` saved ``tensor`` (what the swapped pack hook notes)."""
        observer = self.state.observer
        if observer is not None:
            observer.saved_by(tensor, key)


@contextlib.contextmanager
def observe(offloader: Offloader, device: torch.device, sink: list[Observed]) -> Iterator[None]:
    """Observe the copies of the ops run inside, attributed by ``offloader``'s windows (a
    ``Windowed``; anything else observes nothing attributable and is refused)."""
    if not isinstance(offloader, Windowed):
        raise TypeError(
            "observe() needs the run's offloader wrapped in harness.measure.observe.Windowed"
        )
    watch_threads()  # an offloader's own threads' copies are seen too (harness.measure.threads)
    mode = CopyObserver(offloader.state, device)
    cuda = device.type == "cuda"
    allocs = host_allocator_stats() if cuda else None
    if allocs is not None and offloader.state.host_base is None:
        offloader.state.host_base = allocs["allocated"]
    offloader.state.steps += 1
    offloader.state.observer = mode
    try:
        with watching(), mode, observing(mode):
            yield
    finally:
        offloader.state.observer = None
        mode.keep.clear()  # the observer's own hold on what the D2H copies wrote ends here
        mode.kept.clear()
    if allocs is not None:
        mode.observed.host_allocs = host_allocator_stats()["host_allocs"] - allocs["host_allocs"]
    mode.observed.held = held(offloader.state)
    mode.observed.overdrawn = mode.overdrawn()
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
