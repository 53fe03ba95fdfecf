"""Model-state comparisons shared by ``tests/unit/test_models.py`` (building) and
``tests/e2e/test_models_runs.py`` (training): the tiny presets and bitwise equality of state
dicts."""

from __future__ import annotations

import torch

TINY_PRESETS = ("hybrid-tiny", "moe-tiny", "moe-tiny-fused", "hybrid-moe")


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys, and every tensor equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
