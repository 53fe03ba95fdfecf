"""Where an offloader's host time goes, function by function: cProfile over steady steps.

Trains one bench model (``scripts/bench``'s models and presets) with one backend, ``--warmup``
steps unprofiled (the offloader's warmup iteration allocates its buffers there), then
``--steps`` steps under ``cProfile``, and prints the functions with the most self time, the
offloader's own Python and the torch/CUDA calls it makes (``copy_``, ``record_stream``, event
records, pinned allocations) alike. cProfile slows every Python call, the model's too, so read
the order and the per-call counts, not the absolute step time; ``scripts/bench --host-time``
measures the offloader's host time without it.

    scripts/host_profile --model hybrid-small --backend reference [--steps 5] [--top 30]
                         [--restrict 'harness/offload|torch'] [--callees '_offload|_reload']
                         [--out FILE.pstats]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.models.train import RunHooks, train
from harness.offload.backends import resolve_backend
from harness.offload.pool import no_deterministic_fill
from harness.run import settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-harness host-profile", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default="hybrid-small", help="a bench model or preset")
    p.add_argument("--backend", default="reference", help="backend spec (default reference)")
    settings.add_arguments(p, ("device",))
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (default 2)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    p.add_argument("--top", type=int, default=30, help="functions to print (default 30)")
    p.add_argument(
        "--restrict", default=None, help="regex on 'file:line(function)' of the printed rows"
    )
    p.add_argument(
        "--callees",
        default=None,
        metavar="REGEX",
        help="also print what the functions matching REGEX called, with their times",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the raw stats here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from harness.tools.bench import cli as bench

    try:
        if args.warmup < 1 or args.steps < 1:
            raise ValueError("--warmup and --steps must be >= 1")
        device = bench.select_device(args.device)
        # The bench's own model, selection, offload config and run for these steps.
        options = bench.parser().parse_args(
            ["--warmup", str(args.warmup), "--steps", str(args.steps)]
        )
        options.min_tensor_size = bench.default_min_tensor_size(device)
        model, names, config, run = bench._setup(args.model, options, device)
        run = run.replace(steps=args.warmup + args.steps)  # without the bench's memory step
        factory = resolve_backend(args.backend)
    except ValueError as exc:
        print(f"host_profile: {exc}", file=sys.stderr)
        return 2
    profile = cProfile.Profile()

    @contextlib.contextmanager
    def step_context(step: int) -> Iterator[None]:
        if step < args.warmup:
            yield
            return
        profile.enable()
        try:
            yield
        finally:
            profile.disable()

    offloader = factory(config, device)
    try:
        with no_deterministic_fill():
            train(model.spec, run, offloader, device, hooks=RunHooks(step_context=step_context))
    finally:
        offloader.close()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
    restrictions: list[object] = [args.restrict] if args.restrict else []
    stats.print_stats(*restrictions, args.top)
    if args.callees:
        stats.sort_stats("cumulative").print_callees(args.callees)
    print(
        f"host_profile: {args.model}, backend {args.backend}, offload {'+'.join(names)}, "
        f"{args.steps} profiled steps after {args.warmup}; self time per function (tottime):"
    )
    print(text.getvalue().split("\n\n", 1)[-1].strip())
    if args.out is not None:
        stats.dump_stats(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
