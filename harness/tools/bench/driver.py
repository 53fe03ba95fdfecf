"""One model's bench: every variant's rounds, interleaved, combined into one result each, with
the copy-only rates and the baseline's device compute on CUDA."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from harness.offload.backends import Factory
from harness.tools.bench.common import GB
from harness.tools.bench.copies import copy_rates
from harness.tools.bench.measure import VariantResult, combine_rounds, round_ratios, run_variant
from harness.tools.bench.models import _setup
from harness.tools.bench.peers import VARIANTS
from harness.tools.bench.trace import baseline_compute


def bench_one(
    name: str, args: argparse.Namespace, device: torch.device, found: dict[str, Factory | str]
) -> dict[str, Any]:
    """Every variant on one model, its copy rates and derived figures."""
    model, offload, config, run = _setup(name, args, device)
    breakdown = bool(getattr(args, "breakdown", False))
    rounds: dict[str, list[VariantResult]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # interleaved: every variant once per round, in VARIANTS order
        for v, done in rounds.items():
            if done and done[-1].status != "ok":
                continue  # missing or failed: not retried in later rounds
            done.append(
                run_variant(
                    found[v], model.spec, run, config, device, args.warmup, breakdown=breakdown
                )
            )
    variants = {v: combine_rounds(done) for v, done in rounds.items()}
    for result in variants.values():
        result.round_ratio = round_ratios(result, variants["baseline"])
    sizes = variants["reference"].group_bytes
    entry: dict[str, Any] = {
        "model": name,
        "rounds": args.rounds,
        "pattern": model.spec.pattern,
        "note": model.note,
        "offload": list(offload),
        "spec": {f: getattr(model.spec, f) for f in model.spec.__dataclass_fields__},
        "run": {
            "microbatches": run.microbatches,
            "schedule": run.schedule,
            "precision": run.precision,
        },
        "variants": variants,
        "copy_rates": None,
        "raw_copy_s": None,
    }
    if device.type == "cuda" and variants["baseline"].status == "ok":
        entry["baseline_compute"] = baseline_compute(
            found["baseline"], model.spec, run, config, device, args.warmup
        )
    if device.type == "cuda" and sizes:
        rates = copy_rates(int(statistics.mean(sizes)), found, args.repeats)
        entry["copy_rates"] = rates
        ref = variants["reference"]
        entry["raw_d2h_s"] = (ref.d2h_bytes or 0) / (rates["raw"]["d2h_gbs"] * GB)
        entry["raw_h2d_s"] = (ref.h2d_bytes or 0) / (rates["raw"]["h2d_gbs"] * GB)
        entry["raw_copy_s"] = entry["raw_d2h_s"] + entry["raw_h2d_s"]
    return entry
