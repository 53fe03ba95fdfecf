"""A corpus of correct activation offloaders written from the protocol alone, declaring nothing.

Each is what a new user might write after reading ``harness/offload/protocol.py``: no
``Capabilities``, no ``Semantics``, no log, no profiler range. They differ in the freedoms the
protocol leaves an offloader, one style each:

==================  ===========================================================================
``StorageSkip``     skips every tensor sharing a storage with a marked one; gathers views and
                    reloads them with the saved strides (``empty_strided``)
``ObjectSkip``      skips by identity: ``Parameter`` objects, marked tensors and views whose
                    ``_base`` is one; compares no storage; reloads contiguous
``SizeThreshold``   honours ``min_offloaded_tensor_size``, skips ``Parameter`` objects and marked
                    storages, and on a CPU device hands the host copy back from its unpack
``WholeStorage``    copies a view's whole storage and rebuilds the view from it on reload
``HandBack``        on a CPU device returns the host copy itself (``.to(device)`` is a no-op)
``PinnedStreams``   CUDA: pinned host buffers, its own D2H/H2D streams, events between them
==================  ===========================================================================

Broken variants (each must be caught without a declaration) are at the end of the file.
"""

from __future__ import annotations

import contextlib
import itertools

import torch


class _Group:
    def __init__(self, hooks: contextlib.AbstractContextManager[object], x: torch.Tensor) -> None:
        self.hooks, self.input = hooks, x

    def __enter__(self) -> _Group:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    def commit(self, output, release=()):
        return output


class _Base:
    """Selection, enable switch and the marked tensors; a subclass writes ``pack``/``unpack``."""

    name = "undeclared"

    def __init__(self, config, device) -> None:
        self.selected = set(config.offload_modules)
        self.min_size = config.min_offloaded_tensor_size
        self.device = torch.device(device)
        self.enabled = True
        self.marked: list[torch.Tensor] = []
        self.step = 0

    # what stays on the device: subclasses choose
    def stays(self, t: torch.Tensor) -> bool:
        return t.device.type != self.device.type or self._marked_storage(t)

    def _marked_storage(self, t: torch.Tensor) -> bool:
        local = getattr(t, "_local_tensor", t)
        ptrs = {getattr(m, "_local_tensor", m).untyped_storage().data_ptr() for m in self.marked}
        return local.untyped_storage().data_ptr() in ptrs

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        return (t.device, t.stride(), host)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, stride, host = packed
        out = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)
        return out.copy_(host, non_blocking=True)

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        if self.enabled and name in self.selected and torch.is_grad_enabled():
            return _Group(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), x)
        return _Group(contextlib.nullcontext(), x)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        self.marked += [t for t in tensors if isinstance(t, torch.Tensor)]

    def begin_microbatch(self, microbatch: int) -> None:
        return None  # nothing is keyed by microbatch

    def end_iteration(self) -> None:
        self.marked.clear()
        self.step += 1

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def iteration_logs(self) -> list:
        return []

    def close(self) -> None:
        self.marked.clear()


class StorageSkip(_Base):
    """Skips by storage; gathers a view and reloads it with the saved strides."""

    name = "storage-skip"


class ObjectSkip(_Base):
    """Skips by object identity, never comparing storages: a ``Parameter``, a marked tensor, or
    a view whose ``_base`` is one (autograd saves ``W.t()`` for a linear); reloads contiguous."""

    name = "object-skip"

    def stays(self, t: torch.Tensor) -> bool:
        if t.device.type != self.device.type:
            return True
        return any(self._weight(x) for x in (t, t._base) if x is not None)

    def _weight(self, t: torch.Tensor) -> bool:
        local = getattr(t, "_local_tensor", t)
        return isinstance(t, torch.nn.Parameter) or any(
            t is m or local is getattr(m, "_local_tensor", m) for m in self.marked
        )

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, _, host = packed
        return host.to(device, copy=True)


class SizeThreshold(_Base):
    """``min_offloaded_tensor_size`` honoured, ``Parameter``s skipped, hand-back on CPU."""

    name = "size-threshold"

    def stays(self, t: torch.Tensor) -> bool:
        return (
            super().stays(t)
            or isinstance(t, torch.nn.Parameter)
            or t.numel() < max(self.min_size, 1)
        )

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        # The saved strides where dense; device="cpu" or empty_like makes a CUDA tensor, which
        # cannot be pinned ("Only dense CPU tensors can be pinned").
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        return (t.device, t.stride(), host.copy_(t, non_blocking=t.is_cuda))

    def unpack(self, packed):
        if not isinstance(packed, torch.Tensor) and packed[0].type == "cpu":
            return packed[2]  # already where backward wants it
        return super().unpack(packed)


class WholeStorage(_Base):
    """Copies a non-contiguous view's whole storage and rebuilds the view on reload."""

    name = "whole-storage"

    def pack(self, t: torch.Tensor):
        if self.stays(t) or t.is_contiguous():
            return super().pack(t)
        storage = t.untyped_storage()
        base = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
        host = torch.empty(base.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(base, non_blocking=t.is_cuda)
        return ("view", t.device, t.shape, t.stride(), t.storage_offset(), host)

    def unpack(self, packed):
        if isinstance(packed, tuple) and packed[0] == "view":
            _, device, shape, stride, offset, host = packed
            base = torch.empty(host.shape, dtype=host.dtype, device=device)
            base.copy_(host, non_blocking=True)
            return base.as_strided(shape, stride, offset)
        return super().unpack(packed)


class HandBack(_Base):
    """On a CPU device the unpack returns the host copy (made with the saved strides)."""

    name = "hand-back"

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        return (t.device, host)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)  # on CPU: the host copy itself


class PinnedStreams(_Base):
    """CUDA: D2H on a stream of its own after an event on the compute stream, H2D on another
    stream, and the compute stream waits for the reload's event; pinned host buffers. On a CPU
    device it behaves like ``StorageSkip``."""

    name = "pinned-streams"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        cuda = self.device.type == "cuda"
        self.d2h = torch.cuda.Stream(self.device) if cuda else None
        self.h2d = torch.cuda.Stream(self.device) if cuda else None

    def pack(self, t: torch.Tensor):
        if self.d2h is None or self.stays(t):
            return super().pack(t)
        ready = torch.cuda.Event()
        ready.record()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.d2h)  # t must live until the copy is done
            done = torch.cuda.Event()
            done.record()
        return (t.device, t.stride(), host, done)

    def unpack(self, packed):
        if self.h2d is None or isinstance(packed, torch.Tensor) or len(packed) != 4:
            return super().unpack(packed)
        device, stride, host, done = packed
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(done)
            out = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)
            out.copy_(host, non_blocking=True)
            back = torch.cuda.Event()
            back.record()
        torch.cuda.current_stream().wait_event(back)
        out.record_stream(torch.cuda.current_stream())
        return out


CORRECT = (StorageSkip, ObjectSkip, SizeThreshold, WholeStorage, HandBack, PinnedStreams)


# ---------------------------------------------------------------------- broken variants


class DropsOneReload(StorageSkip):
    """Hands back the host copy of the second tensor each group saves instead of copying it
    back (on CPU: one reload missing per group, the values still right)."""

    name = "broken.drops-one-reload"

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        group = super().group(name, x, layer=layer)
        if isinstance(group.hooks, contextlib.nullcontext):
            return group
        count = itertools.count()

        def unpack(packed):
            if not isinstance(packed, torch.Tensor) and next(count) == 1:
                device, stride, host = packed
                return torch.as_strided(host, host.shape, stride).to(device)
            return self.unpack(packed)

        group.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)
        return group


class EvenStepsOnly(StorageSkip):
    """Moves ``attn_proj`` on even steps only."""

    name = "broken.even-steps-only"

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        if name == "attn_proj" and self.step % 2:
            return _Group(contextlib.nullcontext(), x)
        return super().group(name, x, layer=layer)


class MovesMarked(StorageSkip):
    """Ignores ``mark_not_offloadable``: the weights a group saves move too."""

    name = "broken.moves-marked"

    def stays(self, t: torch.Tensor) -> bool:
        return t.device.type != self.device.type


class ThresholdDrifts(SizeThreshold):
    """Honours the size threshold in the warmup step, then one 64 times larger."""

    name = "broken.threshold-drifts"

    def stays(self, t: torch.Tensor) -> bool:
        if self.step == 0:
            return super().stays(t)
        return (
            _Base.stays(self, t)
            or isinstance(t, torch.nn.Parameter)
            or t.numel() < 64 * max(self.min_size, 1)
        )


BROKEN = (DropsOneReload, EvenStepsOnly, MovesMarked, ThresholdDrifts)
