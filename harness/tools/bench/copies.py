"""Copy-only rates: the raw pinned ``copy_`` and each offloader on the microbenchmark of
``harness/tools/bench_offload.py``, at one group size."""

from __future__ import annotations

from typing import Any

from harness.offload.backends import Factory
from harness.tools import bench_offload
from harness.tools.bench.common import GB, MIB, _line

COPY_BENCH_BUDGET = 4 * 2**30
"""Device bytes per copy-only measurement (groups x size)."""


def copy_rates(
    group_bytes: int, factories_: dict[str, Factory | str], repeats: int
) -> dict[str, Any]:
    """Raw pinned copy_ and each installed offloader's copy-only rates (GB/s) at one size."""
    size = max(MIB, group_bytes // MIB * MIB)
    count = max(2, min(16, COPY_BENCH_BUDGET // size))
    raw_d2h, raw_h2d = bench_offload.raw_rates(size, count, repeats)
    moved = size * count / GB
    out: dict[str, Any] = {
        "size_bytes": size,
        "groups": count,
        "raw": {"d2h_gbs": moved / raw_d2h, "h2d_gbs": moved / raw_h2d},
    }
    for name, factory in factories_.items():
        if name == "baseline" or isinstance(factory, str):
            continue
        try:
            d2h, h2d = bench_offload.offload_rates(size, count, repeats, factory)
        except Exception as exc:
            out[name] = {"status": f"failed: {type(exc).__name__}: {_line(exc)}"}
            continue
        out[name] = {"d2h_gbs": moved / d2h, "h2d_gbs": moved / h2d}
    return out
