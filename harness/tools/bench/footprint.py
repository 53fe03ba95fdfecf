"""``--host-footprint``: one more run per variant, every step observed by the harness's copy
observer, for the host memory each offloader holds at the final step's group boundaries beside
the bytes it has in flight there (``harness.measure.footprint``): the caching host allocator's
blocks in use on CUDA, or the host storages its copies wrote, whichever is larger."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from harness.execute.attribution import observe_steps
from harness.measure.footprint import footprint
from harness.measure.observe import Observed, Windowed
from harness.models.train import train
from harness.offload.backends import Factory
from harness.offload.config import OffloadConfig
from harness.tools.bench.measure import _with_offloader
from harness.tools.bench.models import _setup
from harness.vocab.spec import ModelSpec, RunSpec

MIB = 2**20


def footprint_variant(
    factory: Factory, spec: ModelSpec, run: RunSpec, config: OffloadConfig, device: torch.device
) -> dict[str, Any] | str:
    """One observed run of a variant: its final step's footprint record, or why there is none."""

    def work(offloader: Any) -> dict[str, Any]:
        seen: list[Observed] = []
        windowed = Windowed(offloader)
        train(
            spec,
            run,
            windowed,
            device,
            hooks=observe_steps(device, set(range(run.steps)), windowed, seen),
        )
        return footprint(seen[-1]).as_record()

    return _with_offloader(factory, config, device, work)


def footprint_one(
    entry: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    found: dict[str, Factory | str],
) -> None:
    """``--host-footprint``: one observed run (warmup, then one step) per variant that ran in
    ``entry``'s timed run."""
    model, _, config, run = _setup(entry["model"], args, device)
    run = run.replace(steps=args.warmup + 1)
    for name, result in entry["variants"].items():
        factory = found[name]
        if isinstance(factory, str) or result.status != "ok":
            result.host_footprint = f"not measured: {result.status}"
            continue
        result.host_footprint = footprint_variant(factory, model.spec, run, config, device)


def footprint_line(entry: dict[str, Any], name: str) -> str:
    """What ``--host-footprint`` found for one variant."""
    found = entry["variants"][name].host_footprint
    if not isinstance(found, dict):
        return str(found or "not measured")
    if not found["peak_in_flight_bytes"]:
        return f"nothing in flight; {found['peak_held_bytes']} B held"
    return (
        f"held {found['peak_held_bytes'] / MIB:.2f} MiB for "
        f"{found['peak_in_flight_bytes'] / MIB:.2f} MiB in flight at peak: "
        f"{found['ratio']:.3f}x ({found['source']})"
    )
