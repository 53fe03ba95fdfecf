"""The run the host-clock tests clock (``tests/unit/test_hostclock.py``, and the clocked runs
of ``tests/e2e/test_hostclock_runs.py``): the tiny hybrid model, the reference offloading
``core_attn`` and ``attn_proj``, three sequential fp32 steps of two microbatches."""

from __future__ import annotations

import torch

from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.offload.reference import OffloadContext
from harness.vocab.spec import RunSpec, preset

CPU = torch.device("cpu")
SPEC = preset("hybrid-tiny")
CONFIG = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=1024)
RUN = RunSpec(steps=3, microbatches=2, schedule="sequential", precision="fp32")


def reference() -> Offloader:
    """A fresh reference offloader of ``CONFIG`` on the CPU."""
    return OffloadContext(CONFIG, CPU)
