"""The reference offloader as the tests of its rules set it up
(``tests/unit/test_offload_rules.py``, ``tests/unit/test_offload_iterations.py``): a size
threshold of ``MIN_NUMEL`` elements and activations of ``BATCH x WIDTH`` elements above it.

Shape suffixes: B batch rows, D hidden width."""

from __future__ import annotations

from typing import Any

from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext

MIN_NUMEL = 16
"""min_offloaded_tensor_size of these tests."""
BATCH, WIDTH = 4, 8
"""B x D = 32 elements per activation: above MIN_NUMEL."""
BOTH = ("core_attn", "attn_proj")


def make_offloader(names: tuple[str, ...] = ("core_attn",), **knobs: Any) -> OffloadContext:
    config = OffloadConfig(offload_modules=names, min_offloaded_tensor_size=MIN_NUMEL, **knobs)
    return OffloadContext(config, "cpu")
