"""The reference offloader's per-run records of what it tracks (``harness.offload.reference``):
a group occurrence (``GroupState``: its saved tensors, its status in the iteration, its
post-warmup policy state, its copy counts and its events), a microbatch's chunk of groups
(``ChunkState``), an offloaded saved tensor (``HostCopy``) and autograd's stand-in for a tracked
one (``Tag``). Public building blocks of the reference's variants (``harness.offload.broken``),
re-exported by ``harness.offload.reference``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from harness.offload.config import MOE_EXPERT_NAMES
from harness.offload.protocol import GroupRecord
from harness.offload.ranges import Direction, profiler_range

OPEN, KEPT, OFFLOADED, RELOADING = "open", "kept", "offloaded", "reloading"
"""``GroupState.status`` values within an iteration (building blocks for reference variants)."""


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


def group_range(direction: Direction, group: GroupState) -> contextlib.AbstractContextManager[Any]:
    """Building block for reference variants: the group's named profiler range."""
    return profiler_range(direction, group.name, group.chunk.microbatch, group.layer)
