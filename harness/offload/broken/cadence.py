"""Broken offloaders whose fault is *when* they reload: every byte moves, every value comes
back right, and only the order of reloads against the group backwards shows it (the cadence
check, ``harness.execute.cadence``). Registered with the others in ``harness.offload.broken``'s
``OFFLOADERS``.

Both are the reference (``OffloadContext``) with one step overridden. On CUDA they hold more
reloaded activations on the device during backward than Megatron's rule does, so the backward
peak rises while the losses stay bitwise (Megatron-LM #7575's class); on CPU the order alone
shows them.
"""

from __future__ import annotations

from harness.offload.reference import OFFLOADED, ChunkState, GroupState, OffloadContext


class EagerReload(OffloadContext):
    """Every offloaded group of a pass reloaded as soon as the pass's backward begins (its first
    group's backward starts), instead of one group ahead at a time: the peak during backward is
    the baseline's again, so the offload saved nothing where it mattered."""

    name = "broken.eager_reload"

    def _backward_begins(self, chunk: ChunkState) -> None:
        first = not chunk.backward_started
        super()._backward_begins(chunk)
        if not first:
            return
        for group in reversed(chunk.to_reload):  # the last committed first, as backward runs
            if group.status == OFFLOADED:
                self._reload(group)
        chunk.to_reload.clear()


class TwoAhead(OffloadContext):
    """Each group's backward end prefetches two offloaded groups instead of one: reloads run
    one group further ahead of their backward than Megatron's rule allows."""

    name = "broken.two_ahead"

    def _start_backward(self, group: GroupState) -> None:
        super()._start_backward(group)
        super()._start_backward(group)  # the second prefetch: one group too far ahead
