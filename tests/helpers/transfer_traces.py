"""The transfer counter read two ways (``harness.measure.transfers``): in memory and from the
exported chrome trace, which must agree. Shared by ``tests/unit/test_transfers.py``,
``tests/unit/test_transfer_traces.py`` and ``tests/e2e/test_transfers_runs.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.measure.transfers import TransferCounts, count_transfers, transfer_profiler

NEEDS_IN_MEMORY_ACTIVITIES = pytest.mark.skipif(
    not hasattr(torch._C._autograd._ProfilerResult, "trace_activities"),
    reason=f"torch {torch.__version__} keeps no Kineto activities in memory (no "
    "trace_activities; on the H200 box's torch 2.11): counting reads the chrome trace there",
)


def both_ways(
    prof: Any, tmp_path: Path, modes: tuple[str, ...] = ("auto",), python_writer: bool = True
) -> TransferCounts:
    """Counts read in memory; asserts they equal the counts of the exported chrome trace, as
    Kineto's writer makes it (``export_chrome_trace``; once per profiler) and as torch's Python
    writer makes it. Returns the counts of the first mode."""
    paths = [tmp_path / "kineto_trace.json"]
    prof.export_chrome_trace(str(paths[0]))
    if python_writer:
        paths.append(tmp_path / "python_trace.json")
        prof.profiler.export_chrome_trace(str(paths[1]), use_python_export=True)
    out = []
    for mode in modes:
        memory = count_transfers(prof, mode=mode, source="memory")  # type: ignore[arg-type]
        for path in paths:
            from_file = count_transfers(path, mode=mode)  # type: ignore[arg-type]
            assert memory.by_range == from_file.by_range, path.name
            assert memory.unattributed == from_file.unattributed, path.name
            assert memory.pageable == from_file.pageable, path.name
            assert memory == from_file, path.name  # mode too
        assert count_transfers(prof, mode=mode) == memory  # type: ignore[arg-type]
        out.append(memory)
    return out[0]


def cuda_check_memory_matches_trace(work: Callable[[], object], tmp_path: Path) -> TransferCounts:
    with transfer_profiler("cuda") as prof:
        work()
    # Kineto's writer only: it is the reference, and the Python writer's device properties
    # block is beside the point here
    counts = both_ways(prof, tmp_path, ("auto", "device"), python_writer=False)
    assert counts.mode == "device"
    return counts
