"""``--host-time``: one more run per variant with the host time inside each offloader entry
point on ``harness.measure.hostclock``'s clock (no profiler)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from harness.measure import hostclock
from harness.offload.backends import Factory
from harness.offload.config import OffloadConfig
from harness.tools.bench.measure import _with_offloader
from harness.tools.bench.models import _setup
from harness.vocab.spec import ModelSpec, RunSpec


def host_time_variant(
    factory: Factory,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
) -> dict[str, Any] | str:
    """One run of a variant with its entry points on ``harness.measure.hostclock``'s clock after the
    warmup steps: the per-step medians, or why there are none."""
    clocked = set(range(warmup, run.steps))
    found = _with_offloader(
        factory,
        config,
        device,
        lambda offloader: hostclock.run_clocked(spec, run, offloader, device, clocked=clocked),
    )
    return found if isinstance(found, str) else {**found.__dict__, "summary": found.summary()}


def host_time_one(
    entry: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    found: dict[str, Factory | str],
) -> None:
    """``--host-time``: one clocked run (warmup, then ``--host-time`` steps) per variant that
    ran in ``entry``'s timed run."""
    model, _, config, run = _setup(entry["model"], args, device)
    run = run.replace(steps=args.warmup + args.host_time)
    for name, result in entry["variants"].items():
        factory = found[name]
        if isinstance(factory, str) or result.status != "ok":
            result.host_time = f"not clocked: {result.status}"
            continue
        result.host_time = host_time_variant(factory, model.spec, run, config, device, args.warmup)


def host_time_line(entry: dict[str, Any], name: str) -> str:
    """What ``--host-time`` found for one variant, with its step's increase over the
    baseline's for scale."""
    variants = entry["variants"]
    found = variants[name].host_time
    if not isinstance(found, dict):
        return str(found or "not clocked")
    line = found["summary"]
    base, own = variants["baseline"], variants[name]
    if name != "baseline" and base.step_s is not None and own.step_s is not None:
        line += f"; timed step {(own.step_s - base.step_s) * 1e3:+.2f} ms vs baseline"
    return line
