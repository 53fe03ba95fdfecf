"""A worker's side of the GPU memory budget (``harness.run.budget``): the peak a case held,
the memory it leaves behind, and whether it ran out.

* ``CaseMemory`` reads the caching allocator's peak reserved bytes over one case. The memory
  check resets the allocator's peak statistics in the case's last step
  (``harness.execute.memory``), so the worker folds the peak into its own maximum before every
  reset (``PeakFold``, wrapped around ``torch._C._cuda_resetPeakMemoryStats``, which every
  ``torch.cuda`` reset calls); the reading is the case's whole peak, its fragmentation
  included, without the CUDA context (``budget.CONTEXT_BYTES``).
* ``release`` returns what a case left cached to the card (collect cycles, empty the cache),
  so an idle worker holds its context only, as the budget assumes.
* ``out_of_memory`` finds a case whose runs ran out of memory: the problem line that names
  ``torch.OutOfMemoryError`` (``CUDA out of memory``), a CUDA error ``out of memory`` or a
  library's failed allocation. The session retries such a case alone
  (``harness.run.session``).
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

OUT_OF_MEMORY = re.compile(
    r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|"
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
)
"""What a problem line says when the case's runs could not allocate device memory: torch's
``OutOfMemoryError`` (its message begins ``CUDA out of memory``), a kernel launch's
``CUDA error: out of memory`` and cuBLAS's or cuDNN's failed workspace."""


def out_of_memory(problems: Iterable[str]) -> str | None:
    """The first of ``problems`` that says the runs ran out of memory, its first line; None
    if none does."""
    for problem in problems:
        if OUT_OF_MEMORY.search(problem):
            return problem.splitlines()[0]
    return None


@dataclass
class PeakFold:
    """The highest peak reserved bytes seen since ``clear``, across the resets of the
    allocator's peak statistics in between (``install``)."""

    read: Callable[[int], int]
    """The allocator's peak reserved bytes of a device index (``max_memory_reserved``)."""
    reset: Callable[[int], None]
    """The reset it wraps (``torch._C._cuda_resetPeakMemoryStats``)."""
    highest: int = 0

    def folded_reset(self, device: int) -> None:
        """The reset, with the peak it erases kept first."""
        self.highest = max(self.highest, self.read(device))
        self.reset(device)

    def clear(self, device: int) -> None:
        """Start a new reading: the peak statistics and the fold both from now."""
        self.reset(device)
        self.highest = 0

    def peak(self, device: int) -> int:
        return max(self.highest, self.read(device))


_FOLD: dict[str, PeakFold] = {}
"""This process's fold, once installed (one per worker)."""


def install() -> PeakFold:
    """Wrap torch's peak reset in this process so no reset loses a case's peak (once)."""
    fold = _FOLD.get("cuda")
    if fold is None:
        fold = PeakFold(read=torch.cuda.max_memory_reserved, reset=_original_reset())
        torch._C._cuda_resetPeakMemoryStats = fold.folded_reset  # type: ignore[attr-defined]
        _FOLD["cuda"] = fold
    return fold


def _original_reset() -> Callable[[int], None]:
    return torch._C._cuda_resetPeakMemoryStats  # type: ignore[attr-defined,no-any-return]


@dataclass
class CaseMemory:
    """One case's reading on a CUDA device."""

    device: torch.device
    fold: PeakFold = field(default_factory=install)

    @classmethod
    def start(cls, device: torch.device) -> CaseMemory | None:
        """A reading from now on ``device``; None off CUDA."""
        if device.type != "cuda":
            return None
        reading = cls(device)
        reading.fold.clear(_index(device))
        return reading

    def peak(self) -> int:
        """The case's peak reserved bytes so far."""
        return self.fold.peak(_index(self.device))

    def record(self) -> dict[str, Any]:
        """The case record's ``device_memory`` field."""
        return {"peak_reserved": self.peak()}


def release(device: torch.device) -> None:
    """Give back to the card what this worker's cases left cached: collect the cycles that
    hold device tensors, then empty the allocator's cache (a no-op off CUDA)."""
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
