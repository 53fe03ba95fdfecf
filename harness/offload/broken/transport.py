"""Broken offloaders whose bytes travel wrongly: an extra round trip, pageable buffers, a
host synchronisation on the hot path, a flipped bit, a log that miscounts the copies."""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.offload.config import OffloadConfig
from harness.offload.pool import HostBufferPool
from harness.offload.reference import GroupState, OffloadContext, RaceDelays


class ExtraRoundTrip(OffloadContext):
    """An extra round trip per tensor (STYLE rule 14: values stay right, only counts show it;
    cf. PyTorch ``save_on_cpu`` copying a twice-saved tensor twice).

    Every tensor is copied to the host twice and back twice; the offloader's own log counts
    all of it, so only the independent prediction disagrees. Caught by transfer counts.
    """

    name = "broken.extra_round_trip"

    def _d2h_copy(self, group: GroupState, buffer: torch.Tensor, src: torch.Tensor) -> None:
        super()._d2h_copy(group, buffer, src)
        super()._d2h_copy(group, buffer, src)

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        super()._h2d_copy(group, restored, buffer)
        super()._h2d_copy(group, restored, buffer)


class Pageable(OffloadContext):
    """Pageable host buffers (bugs list, Megatron's pinned pool; TE v2 pins every buffer).

    Host buffers are not pinned: copies become staged, host-synchronous transfers. CUDA only:
    the profiler's ``Memcpy DtoH (Device -> Pageable)`` events; caught by the transfer check's
    pageable count. CPU has no pinned memory, so the class cannot show there.
    """

    name = "broken.pageable"

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self.pool = HostBufferPool(pin_memory=False)

    def _new_host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu")


class HostSync(OffloadContext):
    """A host synchronisation per group in the commit path (``.item()`` after each offload;
    the class PyTorch's ``CudaSyncGuard`` test and the harness's sync-guard case look for).

    CUDA: every offloaded commit reads a device scalar, so the host waits for the compute
    stream (and its 4-byte DtoH memcpy lies outside every group range). Caught on CUDA by the
    no-host-sync case (``cases/test_sync.py``) and by the transfer check's stray-memcpy count.
    CPU has no device to wait for, so the class cannot show there.
    """

    name = "broken.host_sync"

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
    ) -> None:
        super().__init__(config, device, delays=delays)
        self._probe = torch.zeros((), device=self.device)

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        super()._commit_forward(group, release)
        if group.iter_decision == "offloaded":
            self._probe.item()  # the bug: a host sync on the hot path


class CorruptReload(OffloadContext):
    """Transport corruption: one bit flipped on the way back (STYLE rule 14; the generic
    symptom of every race above).

    The lowest exponent bit of the first element of every reloaded floating tensor is flipped
    (the value doubles or halves). Caught by loss equivalence, classified as transport
    corruption (the hooks baseline equals plain).
    """

    name = "broken.corrupt_reload"

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        super()._h2d_copy(group, restored, buffer)
        if restored.is_floating_point() and restored.numel() and restored.is_contiguous():
            # Little-endian: exponent bit 0 sits right above the mantissa bits.
            mantissa = round(-math.log2(torch.finfo(restored.dtype).eps))
            byte = restored.view(torch.uint8)[mantissa // 8 : mantissa // 8 + 1]
            # A mask tensor, not a Python int: a wrapped scalar would add a counted copy_.
            byte.bitwise_xor_(torch.full_like(byte, 1 << (mantissa % 8)))


class LyingLog(OffloadContext):
    """An offloader whose log lies in one middle step: iteration 3's log claims one D2H copy
    more for its first offloaded group than it made (a stale or double-counted log record).

    Every copy is right; only the log of step 3 is wrong. Caught by transfer counts (the
    offloader's log against the counted copies, in the steps before the final one).
    """

    name = "broken.lying_log"

    def end_iteration(self) -> None:
        super().end_iteration()
        if len(self._logs) != 4:
            return
        log = self._logs[-1]
        records = list(log.groups)
        for i, record in enumerate(records):
            if record.d2h_copies:
                records[i] = dataclasses.replace(record, d2h_copies=record.d2h_copies + 1)
                break
        self._logs[-1] = dataclasses.replace(log, groups=tuple(records))
