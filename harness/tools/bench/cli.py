"""Step time, copy rates and memory of the offload backends on realistic models, in one run.

For each model, every variant trains the same spec and seed with the harness runner
(``harness.models.train``):

    baseline     no offload machinery (backend ``none``)
    reference    the bundled reference offloader
    mcore        megatron-core's offloader (``not installed`` when the backend does not resolve)
    save_on_cpu  the simple peer: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around
                 each selected group (same selection; no side stream, no prefetch, no skip rules)

Each model's variants run ``--rounds`` times (default 3), interleaved: round 1 runs baseline,
reference, mcore, save_on_cpu, round 2 the same order again, and so on, every round a fresh run
(build, warmup, timed steps). Step-time ratios move by 1-2 % from run to run on an H200 (the
CPU-bound launches at the start of each step vary), too much for one median to judge a 3 %
target, so a ratio is taken per round (the variant's median step over the baseline's, both of
that round) and reported as its median and its min-max range over the rounds.

Per variant it reports the median over rounds of each round's median step time (CUDA events;
the device is synchronised at step boundaries only, never inside a timed step), the median ratio
to the baseline and its range, the D2H/H2D bytes one step moves (the backend's own log; every
round must agree), the effective rate (bytes both ways / step time), memory right after the last
forward (one extra untimed step, settled) and the timed steps' peak, both relative to what was
allocated before the run (memory figures: the first round's). In the same run it measures the
raw pinned ``copy_`` rate and each offloader's rate on a copy-only microbenchmark
(``harness/tools/bench_offload.py``) at the model's mean offloaded group size, once per model.

A model is *copy-bound* when its copies at the raw rate take longer than the baseline step. It is
*hideable* when its device compute can hide them: the D2H copies at the raw rate take no longer
than the forwards' compute and the H2D copies no longer than the backwards' (compute-stream busy
time of one traced steady baseline step, ``harness.measure.timeline.phase_busy``: a profiler slows
the host, not the device). A model that is neither is *host-bound*: the copies only fit because the
host launches work slower than the device runs it, the step is host time, and what an
offloader adds to it is its own host time (``--host-time`` measures that). Targets (printed
with PASS/SHORT; nothing is asserted; step ratios are per-round medians, their range over the
rounds printed with them):

    reference step <= 1.03 x baseline               hideable models (and where compute was not
                                                    measured: models not copy-bound)
    reference step <= 1.15 x baseline               host-bound models; n/a with < 5 rounds
    reference >= 94% of the raw copy rate           copy-only microbenchmark, each direction
    reference >= 90% of the raw copy rate           copy-bound models
    reference faster than save_on_cpu
    reference step <= 0.75 x mcore's                host-bound models (n/a with < 5 rounds);
                                                    1.05 x elsewhere; when mcore is installed
    reference host time <= 3.5 ms per steady step   hybrid-small, with --host-time
    reference host footprint <= 1.05 x in flight    with --host-footprint

Every variant runs with the harness's deterministic kernels (as the cases do) but without the
deterministic mode's fill of new memory (``torch.utils.deterministic.fill_uninitialized_memory``):
a debugging aid no training run enables, which fills each new pinned host buffer on the host (on
the H200: 78 ms per traced ``moe-small`` step for ``save_on_cpu``, 4 ms for megatron-core's
offloader), so it would slow the peers by what no user sees.

Writes ``bench.json`` into ``--out`` (default ``reports/<UTC>_<sha>[_dirty]/``) and prints the
tables. Needs CUDA; on CPU (``--device cpu``, or ``auto`` where no GPU is visible) it runs
``hybrid-tiny`` by default, a smoke test (rates meaningless).

Diagnosis (where a step's extra time goes):

    --breakdown   per variant, the medians over the timed steps of: each microbatch's forward
                  (begin_microbatch to the end of its forward) and backward (the ``backward()``
                  call), the offloader's end_iteration, the optimizer, the drain (side-stream
                  work still running once the compute stream is done) and the rest; CUDA events
                  on the compute stream, recorded in the timed steps themselves (a few events
                  per step, no synchronisation). With several rounds, each phase's median over
                  the rounds of its per-round median. A table after the step table;
                  ``breakdown`` of each variant in bench.json (its ``steps``: every round's).
    --trace DIR   one torch.profiler chrome trace (CPU and CUDA activities) of one steady step
                  per variant: ``DIR/<model>_<variant>.pt.trace.json.gz``, the phases above as
                  ``bench.*`` ranges. Traced in separate short runs (warmup steps, then the
                  traced step) after all timed rounds, so the profiler never touches a timing.
                  Each trace is then read by ``harness.measure.timeline``: compute-stream busy time
                  in the device window, its idle gaps (launch-bound or waiting) and how much of the
                  DtoH/HtoD copies overlaps compute; and the host self time of each
                  variant against the baseline's (in total, and the op or range names that
                  grew most: where an offloader's extra host time goes); one line per
                  variant, ``timeline`` in bench.json.
    --host-time N one more run per variant (warmup, then N steps) with the host time inside
                  each offloader entry point (group start, enter, pack, exit, commit, unpack,
                  the backward of its autograd nodes, begin_microbatch, end_iteration) on
                  ``harness.measure.hostclock``'s clock: ``perf_counter`` per window, no profiler (a
                  profiler inflates exactly the host time a launch-bound step is made of). One
                  line per variant with its median per step by entry point, next to its timed
                  step's increase over the baseline; ``host_time`` in bench.json.

    scripts/bench [--models hybrid-small,moe-small,moe-bench,hybrid-bench] [--steps 10] [--warmup 2]
                  [--rounds 3] [--out DIR]
    scripts/bench --models moe-bench --breakdown --trace reports/moe-bench-trace
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from harness.offload.pool import no_deterministic_fill
from harness.reporting.report import (
    HARNESS_VERSION,
    commit_info,
    given_commit,
    machine_info,
    run_folder,
)
from harness.run import settings
from harness.run.settings import resolve_device
from harness.tools.bench.driver import bench_one
from harness.tools.bench.footprint import footprint_line, footprint_one
from harness.tools.bench.hosttime import host_time_line, host_time_one
from harness.tools.bench.models import BENCH_MODELS, _setup, default_min_tensor_size
from harness.tools.bench.output import _json, render, target_line
from harness.tools.bench.peers import factories
from harness.tools.bench.targets import footprint_targets, host_time_targets, targets
from harness.tools.bench.trace import trace_line, trace_one


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return names


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _inflight(value: str) -> int | None:
    return None if value == "none" else int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-harness bench", description=(__doc__ or "").split("\n\n")[0]
    )
    settings.add_arguments(p, ("device",))
    p.add_argument(
        "--models",
        type=_names,
        default=None,
        help="comma-separated presets or bench models "
        f"({', '.join(BENCH_MODELS)}); default hybrid-small,moe-small,moe-bench,hybrid-bench "
        "(hybrid-tiny on cpu)",
    )
    p.add_argument("--steps", type=_positive, default=10, help="timed steps (default 10)")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=3,
        help="runs of every variant per model, interleaved (baseline, reference, mcore, "
        "save_on_cpu, then again); step ratios are per round, reported as median and range "
        "(default 3)",
    )
    p.add_argument(
        "--warmup",
        type=_positive,
        default=2,
        help="untimed steps first, >= 1: step 0 is the offloader's warmup (default 2)",
    )
    p.add_argument("--microbatches", type=_positive, default=2)
    p.add_argument("--schedule", default="sequential", choices=("sequential", "gpipe", "1f1b"))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--offload", type=_names, default=None, help="group names (default: per model)")
    p.add_argument(
        "--min-tensor-size",
        type=int,
        default=None,
        help="min_offloaded_tensor_size in elements (default Megatron's 1048576; 1024 on cpu)",
    )
    p.add_argument("--max-inflight", type=_inflight, default=None, help="int or none (default)")
    p.add_argument("--repeats", type=_positive, default=5, help="copy-only repeats (default 5)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench.json")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="per variant: median forward/backward time per microbatch, end_iteration, "
        "optimizer and drain over the timed steps (CUDA events; several rounds: median of the "
        "rounds' medians), in the table and bench.json",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write one torch.profiler chrome trace (CPU+CUDA) of one steady step per variant "
        "into DIR (<model>_<variant>.pt.trace.json.gz; extra runs after the timed ones) and "
        "print its device timeline (harness.measure.timeline)",
    )
    p.add_argument(
        "--host-time",
        type=_positive,
        default=None,
        metavar="STEPS",
        help="after the timed rounds, one more run per variant with STEPS steps after the "
        "warmup in which the host time inside each offloader entry point is clocked "
        "(harness.measure.hostclock; no profiler); per variant its median per step by entry point",
    )
    p.add_argument(
        "--host-footprint",
        action="store_true",
        help="after the timed rounds, one more run per variant (warmup, then one step) observed "
        "by the harness's copy observer: the host memory held at the final step's group "
        "boundaries beside the bytes in flight (harness.measure.footprint); per variant the "
        "peaks and their ratio",
    )
    return p


def select_device(text: str) -> torch.device:
    """``--device`` through ``harness.run.settings.resolve_device`` (``SettingError`` on bad input),
    made the current CUDA device: the step timer's events and synchronisations, the allocator's
    statistics and the offloaders' streams use the current device."""
    device = resolve_device(text)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # bad input (a SettingError from --device included) is one line and exit code 2
        given_commit()  # a malformed OFFLOAD_HARNESS_COMMIT now, not after the benchmark
        device = select_device(args.device)
        cpu = device.type == "cpu"
        args.models = args.models or (
            ("hybrid-tiny",) if cpu else ("hybrid-small", "moe-small", "moe-bench", "hybrid-bench")
        )
        if args.min_tensor_size is None:
            args.min_tensor_size = default_min_tensor_size(device)
        for name in args.models:
            _setup(name, args, device)  # the selection and the offload config's own rules
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    found = factories()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"bench on {where}, torch {torch.__version__}; variants: "
        + ", ".join(f"{v} ({f})" if isinstance(f, str) else v for v, f in found.items()),
        flush=True,
    )
    entries, all_targets = [], []
    with no_deterministic_fill():  # see the module docstring
        for name in args.models:
            entry = bench_one(name, args, device, found)
            found_targets = targets(name, entry)
            entries.append(entry)
            all_targets += found_targets
            print(render(entry, found_targets), flush=True)
        if args.trace is not None:
            for entry in entries:
                trace_one(entry, args, device, found)
                for name, result in entry["variants"].items():
                    print(f"trace {entry['model']}/{name}: {trace_line(result)}", flush=True)
            print(f"traces in {args.trace}/ (<model>_<variant>.pt.trace.json.gz)")
        if args.host_time:
            for entry in entries:
                host_time_one(entry, args, device, found)
                for name in entry["variants"]:
                    line = host_time_line(entry, name)
                    print(f"host time {entry['model']}/{name}: {line}", flush=True)
                for target in host_time_targets(entry["model"], entry):
                    all_targets.append(target)
                    print(target_line(target), flush=True)
        if args.host_footprint:
            for entry in entries:
                footprint_one(entry, args, device, found)
                for name in entry["variants"]:
                    print(f"host footprint {entry['model']}/{name}: {footprint_line(entry, name)}")
                for target in footprint_targets(entry):
                    all_targets.append(target)
                    print(target_line(target), flush=True)
    out = args.out if args.out is not None else run_folder(Path("reports"))
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "harness_version": HARNESS_VERSION,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "commit": commit_info(),
        "device": str(device),
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "models": entries,
        "targets": all_targets,
    }
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2, default=_json) + "\n")
    print(f"wrote {path}")
    failed = [
        f"{e['model']}/{v}"
        for e in entries
        for v, r in e["variants"].items()
        if r.status.startswith("failed")
    ]
    if failed:
        print(f"bench: failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
