"""Broken offloaders that hand backward the wrong tensor: one of another microbatch, of
another model chunk, or another view of the same storage (values wrong, shapes right)."""

from __future__ import annotations

from typing import Any

import torch

from harness.offload.config import OffloadConfig
from harness.offload.reference import (
    OFFLOADED,
    ChunkState,
    GroupState,
    HostCopy,
    OffloadContext,
    RaceDelays,
    Tag,
)


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
