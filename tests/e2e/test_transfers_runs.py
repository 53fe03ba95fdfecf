"""``harness.measure.transfers`` on training runs (moved from ``tests/unit/test_transfers.py``,
whose tests train nothing): the in-memory reader agrees with the chrome trace on a CPU run of
the reference offloader, and in device mode on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transfer_traces import NEEDS_IN_MEMORY_ACTIVITIES
from transfer_traces import both_ways as _both_ways
from transfer_traces import cuda_check_memory_matches_trace as _cuda_check_memory_matches_trace

from harness.measure.transfers import transfer_profiler
from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext
from harness.vocab.spec import RunSpec, preset


@NEEDS_IN_MEMORY_ACTIVITIES
def test_memory_reader_matches_chrome_trace_on_a_training_run(tmp_path: Path) -> None:
    spec = preset("hybrid-tiny")
    run = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="bf16")
    config = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=0)
    off = OffloadContext(config, "cpu")
    with transfer_profiler("cpu") as prof:
        train(spec, run, off, "cpu")
    off.close()
    counts = _both_ways(prof, tmp_path)
    assert counts.mode == "cpu"
    moved = {(key.direction, key.name) for key, c in counts.by_range.items() if c.bytes}
    assert moved == {(d, n) for d in ("d2h", "h2d") for n in ("core_attn", "attn_proj")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@NEEDS_IN_MEMORY_ACTIVITIES
def test_cuda_training_memory_counts_match_chrome_trace(tmp_path: Path) -> None:
    spec = preset("hybrid-tiny")
    run = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="bf16")
    config = OffloadConfig(
        offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=1024
    )
    off = OffloadContext(config, "cuda")
    counts = _cuda_check_memory_matches_trace(lambda: train(spec, run, off, "cuda"), tmp_path)
    off.close()
    assert counts.totals()["d2h"].bytes > 0 and counts.totals()["h2d"].bytes > 0
