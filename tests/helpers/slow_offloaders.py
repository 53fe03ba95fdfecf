"""Correct offloaders that cost more than they should: what the trend gate must flag
(``tests/e2e/test_trend_gate.py``), while every check of the case still passes.

==================  ===========================================================================
``SlowPack``        ``StorageSkip`` that sleeps ``DELAY_S`` (20 ms: well above the run-to-run
                    noise of the shared 2-core machine) in every pack hook that offloads: a
                    slower step, the same copies, the same numbers
``HoldsTwice``      ``StorageSkip`` that keeps a second reference to every host copy it made
                    until the end of the next step: while a step runs it holds its own copies
                    and the whole previous step's (twice a correct offloader's host memory),
                    and at every step's end one step's copies, where a correct one holds none.
                    It frees the older step's at each step's end, so what it holds does not
                    grow and the leaks check passes
==================  ===========================================================================
"""

from __future__ import annotations

import time
from typing import Any

import torch
from undeclared_offloaders import StorageSkip

DELAY_S = 0.02
"""Seconds ``SlowPack`` sleeps per offloaded tensor."""


class SlowPack(StorageSkip):
    """``StorageSkip`` sleeping ``DELAY_S`` in each pack hook that copies."""

    name = "slow-pack"

    def pack(self, t: torch.Tensor) -> Any:
        packed = super().pack(t)
        if packed is not t:
            time.sleep(DELAY_S)
        return packed


class HoldsTwice(StorageSkip):
    """``StorageSkip`` keeping each step's host copies alive until the next step ends."""

    name = "holds-twice"

    def __init__(self, config: Any, device: Any) -> None:
        super().__init__(config, device)
        self.this_step: list[torch.Tensor] = []
        self.last_step: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> Any:
        packed = super().pack(t)
        if packed is not t:
            self.this_step.append(packed[2])  # the host copy, kept past its reload
        return packed

    def end_iteration(self) -> None:
        super().end_iteration()
        self.last_step, self.this_step = self.this_step, []

    def close(self) -> None:
        super().close()
        self.this_step, self.last_step = [], []
