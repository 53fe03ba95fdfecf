"""Checksums of saved tensors (``harness.measure.observe``): a device-side checksum of each saved
tensor at pack and of what its unpack returned, compared after the run (``Observed.corrupted``,
``corrupted_reloads``). The window wrapper's unpack hook (``_summing``) counts and sums the
reloads; ``harness.measure.observe`` re-exports every name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from harness.offload.semantics import GroupKey
from harness.vocab.spec import label_pass


class _Compared(Protocol):
    """What ``corrupted_reloads`` reads of an observed step
    (``harness.measure.observe.Observed``)."""

    @property
    def corrupted(self) -> list[str]: ...


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
        "reused",
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
        self.reused = ""
        """Where its storage address held an earlier saved tensor, freed since
        (``harness.measure.observe._reused_address``): named with a corrupted reload."""

    def where(self) -> str:
        mb, layer, name = self.key
        return (
            f"{label_pass(mb, self.chunks)}, layer {layer}, group {name}, saved tensor "
            f"{self.index} of the "
            f"group: shape {list(self.shape)}, {self.dtype}, storage offset {self.offset}"
            + (f" ({self.reused})" if self.reused else "")
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


def _summing(unpack: Any, state: Any) -> Any:
    """``unpack`` behind the harness's wrapper: each unpack of a tensor packed through the
    swapped pack hook is counted (``Observed.unpacked``), and with checksums its value summed.
    ``state`` is the window wrapper's (``harness.measure.observe._WindowState``)."""

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


def corrupted_reloads(seen: Sequence[_Compared]) -> list[tuple[int, str]]:
    """(step, where) of every reload whose checksum differs from its pack-time one, over a
    run's observed steps in order (``Observed.corrupted``)."""
    return [(step, where) for step, observed in enumerate(seen) for where in observed.corrupted]
