"""Broken offloaders whose fault is about pipeline stages: state keyed by microbatch where a rank
runs several model chunks of it (VPP), and reloads issued while the stage still waits for the
gradient from the next stage. Registered with the others in ``harness.offload.broken``'s
``OFFLOADERS``; their catch on a pipeline row across ranks is tested in
``tests/e2e/test_pipeline_broken.py``.

Both are the reference (``OffloadContext``) with one step overridden.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.offload.reference import OFFLOADED, GroupState, OffloadContext, Tag


class _MicrobatchTag:
    """A saved-tensor tag by microbatch, not model chunk: (microbatch, name, occurrence of the
    name in its chunk, slot)."""

    __slots__ = ("index", "microbatch", "name", "slot")

    def __init__(self, microbatch: int, name: str, index: int, slot: int) -> None:
        self.microbatch, self.name, self.index, self.slot = microbatch, name, index, slot


class MicrobatchKeyed(OffloadContext):
    """State keyed by microbatch, not by model chunk (Megatron-Core keys its offload state by
    virtual stage: a manager without it mixes up a rank's VPP chunks of one microbatch).

    A tag names the microbatch (the pass id over the model chunks, ``pass // chunks``), the
    group's name, its occurrence of that name in the chunk and the slot; backward takes the
    tensor from the first chunk of that microbatch, in forward order, that still holds one.
    Without VPP (one chunk per microbatch) that is always the right chunk. Under the
    interleaved schedule a microbatch's later chunk runs backward first and gets the earlier
    chunk's activations of the same layer kind (same shapes, other layers' data); every tensor
    is still handed out once, so nothing leaks and nothing crashes. At PP=2 x VPP=2 on the
    seed's pattern only rank 0 has an attention layer in both chunks (layers 0 and 4): the
    verdict names rank 0, stage 0."""

    name = "broken.microbatch_keyed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._per_microbatch = 1

    def model_chunk(self, chunk: int, chunks: int) -> None:
        """The runner's VPP call (``protocol.model_chunk_of``): how many passes a microbatch
        has."""
        self._per_microbatch = chunks

    def _pack(self, group: GroupState, tensor: torch.Tensor) -> Any:
        packed = super()._pack(group, tensor)
        if not isinstance(packed, Tag):
            return packed
        same = [g for g in group.chunk.groups if g.name == group.name]
        microbatch = group.chunk.microbatch // self._per_microbatch
        return _MicrobatchTag(microbatch, group.name, same.index(group), packed.slot)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _MicrobatchTag):
            return packed
        for chunk in self._chunks.values():  # forward (warmup creation) order
            if chunk.microbatch // self._per_microbatch != packed.microbatch:
                continue
            same = [g for g in chunk.groups if g.name == packed.name]
            if packed.index < len(same) and packed.slot in same[packed.index].entries:
                return super()._unpack(Tag(same[packed.index], packed.slot))
        raise RuntimeError(
            f"microbatch {packed.microbatch} holds no {packed.name} #{packed.index} slot "
            f"{packed.slot}"
        )


class ReloadBeforeGradient(OffloadContext):
    """Reloads issued before the gradient from the next stage has arrived: at the start of each
    forward in the steady state, every offloaded group of the next pass to run backward (its
    forward done) is reloaded, so it is "ready" when the gradient comes - but a stage before the
    last runs other forwards (and waits in ``recv``) before that gradient arrives, holding the
    reloaded activations all the while. Megatron-Core reloads at a group backward's end, one
    group ahead. Values stay right; the cadence check sees the reloads ahead of their backward
    (on the last stage under 1F1B nothing is in flight at a forward's start: nothing shows
    there)."""

    name = "broken.reload_before_gradient"

    def begin_microbatch(self, microbatch: int) -> None:
        super().begin_microbatch(microbatch)
        if self.warmup:
            return
        following = next(
            (c for c in self._backward_order if c.forward_done and not c.backward_started), None
        )
        if following is None:
            return
        for group in reversed(following.to_reload):  # the last committed first
            if group.status == OFFLOADED:
                self._reload(group)
        following.to_reload.clear()
