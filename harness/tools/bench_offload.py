#!/usr/bin/env python3
"""Effective D2H/H2D bandwidth of the reference offloader next to raw pinned ``copy_``.

For each tensor size S, one microbatch opens K groups that each save one tensor of S bytes and
a last tiny group (which the margin policy keeps on the device). After a warmup iteration (pool
buffers allocated), steady iterations are timed with CUDA events from an idle device (synchronised
before) to every stream drained (synchronised after, then the end event):

    offload D2H   the K groups' forward (start, save, commit: the D2H copies), until done
    offload H2D   their backward (reload prefetches and on-demand reloads), until done
    raw D2H/H2D   K back-to-back ``copy_(non_blocking=True)`` between device and pinned memory

Both measurements include everything the host enqueues, so the ratio is the offloader's
overhead. Prints a table and, with --json, writes the figures. Needs CUDA. ``scripts/bench``
imports ``raw_rates`` and ``offload_rates`` for its copy-bound figures.

    python -m harness.tools.bench_offload [--min-mib 1] [--max-mib 1024] [--repeats 5] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from harness.offload.backends import Factory
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext

MIB = 2**20
BUDGET_BYTES = 4 * 2**30  # device bytes per measurement (K * S), capped for the biggest sizes


class _Save(torch.autograd.Function):
    """Saves its input for backward (the tensor the group offloads); backward unpacks it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _ = ctx.saved_tensors  # the unpack: reload (or wait for the prefetched one)
        return grad


class _Sink(torch.autograd.Function):
    """All group outputs to one scalar; backward hands each a stride-0 gradient, so the graph
    around the offloader costs one node per group and no device work."""

    @staticmethod
    def forward(ctx: Any, *outs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [o.shape for o in outs]
        return outs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(grad.expand(shape) for shape in ctx.shapes)


def _timed(fn: Callable[[], object]) -> float:
    return _timed_call(fn)[0]


def _timed_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds from an idle device to the device finishing what ``fn`` enqueued on any stream,
    and its value. The end event is recorded after a synchronize: an event on the current
    stream alone would miss copies still running on an offloader's side streams."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    value = fn()
    torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, value


def raw_rates(nbytes: int, count: int, repeats: int) -> tuple[float, float]:
    """Median seconds of ``count`` back-to-back pinned D2H copies, and of H2D copies."""
    device = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(count)]
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]

    def d2h() -> None:
        for h, d in zip(host, device, strict=True):
            h.copy_(d, non_blocking=True)

    def h2d() -> None:
        for h, d in zip(host, device, strict=True):
            d.copy_(h, non_blocking=True)

    d2h(), h2d()  # warm
    return (
        statistics.median(_timed(d2h) for _ in range(repeats)),
        statistics.median(_timed(h2d) for _ in range(repeats)),
    )


def offload_rates(
    nbytes: int, count: int, repeats: int, factory: Factory = OffloadContext
) -> tuple[float, float]:
    """Median seconds of ``count`` groups' D2H (forward) and H2D (backward) through the
    offloader ``factory`` builds (the reference by default), steady state."""
    config = OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=1)
    off = factory(config, torch.device("cuda", torch.cuda.current_device()))
    numel = nbytes // 2
    inputs = [
        torch.zeros(numel, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        for _ in range(count)
    ]
    tiny = torch.zeros(8, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    d2h_times, h2d_times = [], []

    def forward() -> list[torch.Tensor]:
        off.begin_microbatch(0)
        outs = []
        for layer, x in enumerate([*inputs, tiny]):
            group = off.group("core_attn", x, layer=layer)
            with group:
                y = _Save.apply(group.input)
            outs.append(group.commit(y))
        return outs

    for iteration in range(repeats + 1):
        d2h, outs = _timed_call(forward)
        h2d = _timed(_Sink.apply(*outs).backward)
        off.end_iteration()
        for x in inputs:
            x.grad = None
        if iteration:  # the first iteration is the warmup (pool misses)
            d2h_times.append(d2h)
            h2d_times.append(h2d)
    off.close()
    return statistics.median(d2h_times), statistics.median(h2d_times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-mib", type=int, default=1)
    parser.add_argument("--max-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_offload: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    header = (
        f"{'size':>9} {'groups':>6} {'raw D2H':>9} {'off D2H':>9} {'ratio':>6} "
        f"{'raw H2D':>9} {'off H2D':>9} {'ratio':>6}   (GB/s)"
    )
    print(header)
    rows = []
    size = args.min_mib
    while size <= args.max_mib:
        nbytes = size * MIB
        count = max(2, min(16, BUDGET_BYTES // nbytes))
        raw_d2h, raw_h2d = raw_rates(nbytes, count, args.repeats)
        off_d2h, off_h2d = offload_rates(nbytes, count, args.repeats)
        moved = nbytes * count / 1e9
        row = {
            "size_mib": size,
            "groups": count,
            "raw_d2h_gbs": moved / raw_d2h,
            "offload_d2h_gbs": moved / off_d2h,
            "raw_h2d_gbs": moved / raw_h2d,
            "offload_h2d_gbs": moved / off_h2d,
        }
        rows.append(row)
        print(
            f"{size:>6} MiB {count:>6} {row['raw_d2h_gbs']:>9.1f} {row['offload_d2h_gbs']:>9.1f} "
            f"{row['offload_d2h_gbs'] / row['raw_d2h_gbs']:>6.1%} {row['raw_h2d_gbs']:>9.1f} "
            f"{row['offload_h2d_gbs']:>9.1f} {row['offload_h2d_gbs'] / row['raw_h2d_gbs']:>6.1%}",
            flush=True,
        )
        size *= 2
    big = [r for r in rows if r["size_mib"] >= 8]
    if big:
        worst = min(
            min(r["offload_d2h_gbs"] / r["raw_d2h_gbs"], r["offload_h2d_gbs"] / r["raw_h2d_gbs"])
            for r in big
        )
        print(f"worst offload/raw ratio for tensors >= 8 MiB: {worst:.1%} (target >= 90%)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
