"""``offload-harness``: run the case matrix (or one case) and report; list cases and backends.

    offload-harness run                       # default matrix on the best device, report
    offload-harness run --case ID             # one case of the table
    offload-harness run --pattern +E-- --offload core_attn,moe_act --schedule 1f1b
    offload-harness run --update-golden       # rewrite the golden baseline traces
    offload-harness repro --case ID [--bisect]   # reproduce one case, localise a divergence
    offload-harness cases [--matrix full]     # the case ids
    offload-harness backends                  # backend names and descriptions
    offload-harness bench | mutation-score | nightly | host-profile ...   # the tools

A run writes ``<--report-dir>/<UTC time>_<sha>[_dirty]/``: summary.json, junit.xml, index.html
and plots. Bad input is one line on stderr and exit code 2; a failing case (or a divergence
under ``repro``) is exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NoReturn

import torch

from harness.cases import (
    FAMILIES,
    FAMILY_CHOICES,
    MATRICES,
    MODEL_SIZES,
    Case,
    default_backend,
    find_case,
    matrix,
    model_spec,
)
from harness.execute import Environment
from harness.html import render_index
from harness.judge import judge
from harness.offload.backends import (
    backend_names,
    backend_unavailable,
    describe,
    resolve_backend,
)
from harness.report import (
    run_folder,
    summary_text,
    verdict_table,
    write_junit,
    write_summary,
)
from harness.repro import ReproSpec, reproduce
from harness.spec import MCORE_IMPLS, PRECISIONS, PRESETS, SCHEDULES, parse_pattern, preset
from harness.tools import TOOLS


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload-harness", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run cases and write a report")
    _where_flags(run)
    run.add_argument("--matrix", default="default", choices=tuple(MATRICES))
    _family_flag(run)
    run.add_argument("--case", help="run only this case id (see `offload-harness cases`)")
    run.add_argument(
        "--jobs",
        type=int,
        help="worker processes (default: one per core on CPU, 1 on CUDA; on CUDA N workers share "
        "the GPU, each with its own context and cpu_count // N threads)",
    )
    run.add_argument(
        "--update-golden",
        action="store_true",
        help="rewrite the golden baseline traces of the cases run "
        "(cases/golden/<fingerprint>/<variant>/)",
    )
    _case_flags(run.add_argument_group("one custom case (instead of the matrix)"))
    repro = sub.add_parser("repro", help="reproduce one case: loss table, first divergence")
    _where_flags(repro)
    repro.add_argument("--case", help="a case id; the flags below override its fields")
    _case_flags(repro.add_argument_group("a custom case (or overrides of --case)"))
    repro.add_argument("--preset", choices=tuple(PRESETS), help="model preset of a custom case")
    repro.add_argument("--seed", type=int, help="seed of model and data (default: 1234)")
    repro.add_argument(
        "--bisect", action="store_true", help="on divergence, find the smallest groups/layers"
    )
    listing = sub.add_parser("cases", help="list case ids")
    listing.add_argument("--matrix", default="default", choices=tuple(MATRICES))
    _family_flag(listing)
    sub.add_parser("backends", help="list backend names, one line each with a description")
    for name, module in TOOLS.items():  # their own parsers take the rest of the line
        sub.add_parser(name, help=f"the {name} tool ({module}; --help for its options)")
    return parser


def _family_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family",
        default="harness",
        choices=FAMILY_CHOICES,
        help="whose models: harness (ours), mcore (megatron-core's HybridModel with "
        "TransformerEngine; CUDA only; backend defaults to mcore) or all",
    )


def _where_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default=None,
        help="name or package.module:factory (default: reference; mcore for megatron-core's "
        "models)",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--model-size", default="auto", choices=("auto", *MODEL_SIZES))
    parser.add_argument(
        "--report-dir",
        default="reports",
        help="parent of the report folder (default: reports; '' writes none)",
    )


def _case_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pattern", help="layer pattern, e.g. +-+-+-")
    group.add_argument("--offload", help="comma-separated group names, e.g. core_attn,attn_proj")
    group.add_argument("--steps", type=int, help=f"default {_DEFAULTS['steps']}")
    group.add_argument("--microbatches", type=int, help=f"default {_DEFAULTS['microbatches']}")
    group.add_argument("--schedule", choices=SCHEDULES, help=f"default {_DEFAULTS['schedule']}")
    group.add_argument("--precision", choices=PRECISIONS, help=f"default {_DEFAULTS['precision']}")
    group.add_argument("--max-inflight", help="int >= 0, or none (default 1)")


_DEFAULTS: dict[str, Any] = {
    name: Case.__dataclass_fields__[name].default
    for name in ("steps", "microbatches", "schedule", "precision", "max_inflight")
}
"""Custom-case values when a flag is not given: the case table's own defaults."""


def _device(value: str) -> torch.device:
    if value == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible on this machine")
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cuda":
        # current_device() would initialise CUDA in this process; until something initialises
        # it the current device is 0. Worker processes are spawned, never forked, in any case.
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return torch.device("cuda", index)
    return torch.device(value)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The case fields the flags set explicitly."""
    out = {
        k: getattr(args, k)
        for k in ("steps", "microbatches", "schedule", "precision")
        if getattr(args, k) is not None
    }
    if args.max_inflight is not None:
        value = args.max_inflight
        out["max_inflight"] = None if value == "none" else _int("--max-inflight", value)
    return out


def _row_with_overrides(args: argparse.Namespace) -> Case:
    """The ``--case`` row with the fields the flags set (``run`` and ``repro`` alike)."""
    return find_case(args.case).replace(**_overrides(args))


def _family(pattern: str, names: tuple[str, ...]) -> str:
    if "fused_group_mlp" in names:
        return "moe-fused"
    return "hybrid-moe" if "E" in pattern else "hybrid"


def _custom_case(args: argparse.Namespace, pattern: str | None = None) -> Case:
    pattern = pattern or args.pattern
    if not pattern or not args.offload:
        raise UsageError("a custom case needs both --pattern and --offload")
    parse_pattern(pattern)
    names = tuple(n.strip() for n in args.offload.split(",") if n.strip())
    impl = "mcore" if getattr(args, "family", "harness") == "mcore" else "harness"
    try:
        return Case(
            family=_family(pattern, names),
            offload=names,
            custom_pattern=pattern,
            impl=impl,
            **{**_DEFAULTS, **_overrides(args)},
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _int(option: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{option} must be an int or none, got {value!r}") from None


def _select(args: argparse.Namespace) -> list[Case]:
    if args.pattern or args.offload:
        if args.case:
            raise UsageError("--case and --pattern/--offload are exclusive")
        return [_custom_case(args)]
    if args.case:
        try:
            return [_row_with_overrides(args)]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if _overrides(args):
        raise UsageError(
            "--steps/--microbatches/--schedule/--precision/--max-inflight apply to one case "
            "(--case, or --pattern with --offload), not to the whole matrix"
        )
    return matrix(args.matrix, args.family)


def _run_one(case: Case, env: Environment, update_golden: bool = False) -> dict[str, Any]:
    """Every check of the judge on one case (the same checks pytest's case files run)."""
    return judge(case, env, update_golden=update_golden).record()


def _jobs(value: int | None, device: torch.device, cases: int) -> int:
    """Worker processes: ``--jobs``, else one per core on CPU and 1 on CUDA; never more than
    cases. On CUDA several workers share the GPU: each is its own (spawned) process with its
    own CUDA context, and every check reads only its own process's state (allocator stats,
    profiler, sync guard), so cases do not disturb each other; only their timing changes."""
    if value is not None and value < 1:
        raise UsageError(f"--jobs must be >= 1, got {value}")
    default = 1 if device.type == "cuda" else os.cpu_count() or 1
    return max(1, min(value or default, cases))


def _run_all(
    cases: list[Case], env: Environment, jobs: int, update_golden: bool = False
) -> list[dict[str, Any]]:
    """Run every case (in ``jobs`` spawned worker processes when jobs > 1, also on CUDA),
    printing a line as each ends; records come back in table order."""
    records: list[dict[str, Any] | None] = [None] * len(cases)
    done = 0

    def report(index: int, record: dict[str, Any], seconds: float) -> None:
        nonlocal done
        done += 1
        record["duration"] = round(seconds, 3)
        records[index] = record
        print(
            f"[{done}/{len(cases)}] {cases[index].name} {record['verdict']} ({seconds:.1f}s)",
            flush=True,
        )

    if jobs == 1:
        for index, case in enumerate(cases):
            began = time.perf_counter()
            report(index, _run_one(case, env, update_golden), time.perf_counter() - began)
        return records  # type: ignore[return-value]
    context = multiprocessing.get_context("spawn")  # never fork: CUDA cannot survive a fork
    with ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_worker_init, initargs=(jobs, env.device)
    ) as pool:
        futures = {
            pool.submit(_timed_case, case, env, update_golden): i for i, case in enumerate(cases)
        }
        for future in as_completed(futures):
            record, seconds = future.result()
            report(futures[future], record, seconds)
    return records  # type: ignore[return-value]


def _worker_init(jobs: int, device: torch.device | None = None) -> None:
    # Each worker gets its share of the cores; more intra-op threads would spin against the
    # other workers'. On CUDA every worker uses the parent's device (same index): make it the
    # current one too, for streams and allocator queries that do not name a device.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def _timed_case(case: Case, env: Environment, update_golden: bool) -> tuple[dict[str, Any], float]:
    began = time.perf_counter()
    return _run_one(case, env, update_golden), time.perf_counter() - began


def _environment(args: argparse.Namespace) -> Environment:
    if args.backend is None:  # megatron-core's models run megatron-core's offloader by default
        family = getattr(args, "family", "harness")
        args.backend = default_backend("mcore" if str(args.case).startswith("mcore-") else family)
    try:
        resolve_backend(args.backend)
    except ValueError as exc:
        raise UsageError(f"--backend: {exc}") from None
    device = _device(args.device)
    size = (
        args.model_size
        if args.model_size != "auto"
        else ("small" if device.type == "cuda" else "tiny")
    )
    return Environment(device=device, backend=args.backend, model_size=size)


def _unavailable(cases: list[Case], env: Environment) -> str | None:
    """Why the backend or megatron-core's models cannot run the cases here (None if they can)."""
    reason = backend_unavailable(env.backend, env.device)
    if reason is None and any(case.impl in MCORE_IMPLS for case in cases):
        from harness.mcore_models import unavailable_reason

        reason = unavailable_reason(env.device)
    return reason


def command_run(args: argparse.Namespace) -> int:
    env = _environment(args)
    try:
        cases = _select(args)
        for case in cases:
            env.spec(case)  # every selected case applies to its model, before any run
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    reason = _unavailable(cases, env)
    if reason is not None:
        raise UsageError(reason)
    table = {c.name for name in MATRICES for c in matrix(name, "all")}
    if args.update_golden and any(c.name not in table for c in cases):
        raise UsageError("--update-golden: golden traces are kept for case-table rows only")
    jobs = _jobs(args.jobs, env.device, len(cases))
    start = time.perf_counter()
    records = _run_all(cases, env, jobs, args.update_golden)
    fields: dict[str, Any] = dict(
        backend=args.backend,
        device=str(env.device),
        matrix=args.matrix if not (args.case or args.pattern or args.offload) else None,
        model_size=env.model_size,
        seconds=round(time.perf_counter() - start, 2),
    )
    if args.report_dir:
        folder = run_folder(Path(args.report_dir))
        summary = json.loads(write_summary(folder, records, **fields).read_text())
        write_junit(folder, summary)
        began = time.perf_counter()
        index = render_index(folder)
        where = f"report: {index} (rendered in {time.perf_counter() - began:.1f}s)"
    else:  # '' writes none, as in pytest
        summary = json.loads(summary_text(records, **fields))
        where = "no report (--report-dir '')"
    print()
    print(verdict_table(summary))
    for case in summary["cases"]:
        if case["problems"]:
            print(f"\nFAIL {case['name']}")
            print("\n".join(case["problems"]))
    missing = [c for c in summary["cases"] if c.get("golden", {}).get("status") == "missing"]
    if missing:
        print(
            f"\ngolden: {len(missing)} of {len(cases)} cases not compared - "
            f"{missing[0]['golden']['message']}"
        )
    failed = sum(c["verdict"] != "pass" for c in summary["cases"])
    print(
        f"\n{len(cases) - failed}/{len(cases)} cases passed in {summary['seconds']:.1f}s; {where}"
    )
    return 1 if failed else 0


def _repro_spec(args: argparse.Namespace) -> ReproSpec:
    env = _environment(args)
    try:
        if args.case:
            if args.pattern or args.offload or args.preset:
                raise UsageError("--case and --pattern/--preset/--offload are exclusive")
            case = _row_with_overrides(args)
            model = env.spec(case)
        elif args.preset:
            model = preset(args.preset)
            if args.pattern:
                model = model.replace(pattern=args.pattern)
            case = _custom_case(args, model.pattern).replace(family=_preset_family(args.preset))
            case.offload_config().check_applies_to(model)
        else:
            case = _custom_case(args)
            model = env.spec(case)
            args.preset = _preset_name(case.family, env.model_size)
        run = case.run_spec() if args.seed is None else case.run_spec(seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    reason = _unavailable([case], env)
    if reason is not None:
        raise UsageError(reason)
    return ReproSpec(
        case=case,
        model=model,
        run=run,
        backend=env.backend,
        device=env.device,
        model_size=env.model_size,
        preset=args.preset or None,
        from_case=args.case or None,
    )


def _preset_name(family: str, size: str) -> str:
    base = model_spec(family, size)
    return next(name for name in PRESETS if preset(name) == base)


def _preset_family(name: str) -> str:
    for family in FAMILIES:
        for size in MODEL_SIZES:
            if model_spec(family, size) == preset(name):
                return family
    raise UsageError(f"--preset {name}: no case family uses this preset")


def command_repro(args: argparse.Namespace) -> int:
    spec = _repro_spec(args)
    result = reproduce(spec, bisect=args.bisect, report_root=Path(args.report_dir))
    return 1 if result.diverged else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        return importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
    try:
        args = _parser().parse_args(argv)
        if args.command == "cases":
            print("\n".join(c.name for c in matrix(args.matrix, args.family)))
            return 0
        if args.command == "backends":
            names = backend_names()
            width = max(map(len, names))
            print("\n".join(f"{name:<{width}}  {describe(name)}" for name in names))
            return 0
        if args.command == "repro":
            return command_repro(args)
        return command_run(args)
    except UsageError as exc:
        print(f"offload-harness: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
