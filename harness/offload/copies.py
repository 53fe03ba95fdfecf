"""The reference offloader's mechanics (``harness.offload.reference``): the saved-tensor
pack/unpack hooks, the D2H and H2D copies, the host buffers (pooled and pinned on CUDA), the
side streams and events, and the hot path's shortcuts past torch's Python layer. The rules
(which groups are offloaded, the warmup, the post-warmup policies, what a group tracks) live in
``OffloadContext``, which inherits these steps from ``CopyEngine``; a variant
(``harness.offload.broken``) overrides them on its ``OffloadContext`` subclass.

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
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from harness.offload.config import OffloadConfig
from harness.offload.groupstate import (
    OFFLOADED,
    RELOADING,
    ChunkState,
    GroupState,
    HostCopy,
    Tag,
    group_range,
)
from harness.offload.pool import HostBufferPool, staging_buffer

# A non-contiguous view covering at least this share of its storage is copied as the whole flat
# storage (one DMA, layout restored on reload); a sparser view is gathered to contiguous.
FULL_STORAGE_MIN_COVERAGE = 0.5

_push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


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


LONG_DELAY = 20_000_000
"""Sleep cycles per group (about 10 ms on an H200): far longer than any copy of a test model.
The race delays of ``<backend>+delays`` (``harness.offload.backends.DEFAULT_RACE_DELAYS``) and of
the broken offloaders that need them (``harness.offload.broken.OFFLOADERS``)."""


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


class CopyEngine:
    """The copy steps of ``OffloadContext`` (its base class): pack and unpack, offload and
    reload, host buffers, streams and events. ``_init_copies`` makes their state; the rules
    supply ``config``, ``device``, ``cuda``, ``delays`` and ``warmup`` and the checks it calls
    back (``_trackable``, ``_eligible``, ``_backward_begins``)."""

    config: OffloadConfig
    device: torch.device
    cuda: bool
    delays: RaceDelays
    warmup: bool

    def _init_copies(self) -> None:
        """The streams, the pool and the per-iteration bookkeeping of the copies."""
        self._d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self._h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self._cu = _CudaCalls() if self.cuda else None  # type: ignore[assignment]
        # On CPU ``to`` would hand back the host buffer itself, which the pool reuses.
        self._fused_reload = self.cuda and type(self)._h2d_copy is CopyEngine._h2d_copy
        self._compute_key: tuple[int, int, int] | None = None  # see _compute_stream
        self._compute: torch.cuda.Stream | None = None
        self.pool = HostBufferPool(pin_memory=self.cuda, cap=self.config.pinned_pool_buffers)
        self._device_refs: dict[int, int] = {}  # storage address -> saved tensors on device
        self._pending_d2h: dict[str, deque[torch.cuda.Event | None]] = {}

    # ----------------------------------------------------------------- rules it calls back
    def _trackable(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError  # OffloadContext

    def _eligible(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError  # OffloadContext

    def _backward_begins(self, chunk: ChunkState) -> None:
        raise NotImplementedError  # OffloadContext

    # ------------------------------------------------------------------------- forward side
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

    # ------------------------------------------------------------------------------ streams
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


def _is_fake_or_functional(tensor: torch.Tensor) -> bool:
    # A FakeTensor/FunctionalTensor can only exist once its module is loaded; looking the
    # classes up instead of importing them keeps this hot path free of heavy imports.
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    functional = sys.modules.get("torch._subclasses.functional_tensor")
    return (fake is not None and isinstance(tensor, fake.FakeTensor)) or (
        functional is not None and isinstance(tensor, functional.FunctionalTensor)
    )
