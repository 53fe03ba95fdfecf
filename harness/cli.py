"""``offload-harness``: run the case matrix (or one case) and report; list cases and backends.

    offload-harness run                       # default matrix on the best device, report
    offload-harness run --case ID             # one case of the table
    offload-harness run --pattern +E-- --offload core_attn,moe_act --schedule 1f1b
    offload-harness cases [--matrix full]     # the case ids
    offload-harness backends                  # backend names

Bad input is one line on stderr and exit code 2; a failing case is exit code 1.
"""

from __future__ import annotations

import argparse
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

from harness.cases import MATRICES, MODEL_SIZES, Case, find_case, matrix
from harness.checks import (
    disabled_problems,
    equivalence_problems,
    fidelity_problems,
    leak_problems,
    memory_problems,
    transfer_problems,
)
from harness.execute import Environment, run_case, run_memory
from harness.offload.backends import backend_names, resolve_backend
from harness.report import case_record, memory_record, run_folder, verdict_table, write_summary
from harness.spec import PRECISIONS, SCHEDULES, parse_pattern


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload-harness", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run cases and write a report")
    run.add_argument("--backend", default="reference", help="name or package.module:factory")
    run.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    run.add_argument("--matrix", default="default", choices=tuple(MATRICES))
    run.add_argument("--model-size", default="auto", choices=("auto", *MODEL_SIZES))
    run.add_argument("--report-dir", default="reports", help="parent folder of the run's report")
    run.add_argument("--case", help="run only this case id (see `offload-harness cases`)")
    run.add_argument(
        "--jobs", type=int, help="worker processes on CPU (default: one per core; CUDA: 1)"
    )
    custom = run.add_argument_group("one custom case (instead of the matrix)")
    custom.add_argument("--pattern", help="layer pattern, e.g. +-+-+-")
    custom.add_argument("--offload", help="comma-separated group names, e.g. core_attn,attn_proj")
    custom.add_argument("--steps", type=int, default=6)
    custom.add_argument("--microbatches", type=int, default=2)
    custom.add_argument("--schedule", default="sequential", choices=SCHEDULES)
    custom.add_argument("--precision", default="fp32", choices=PRECISIONS)
    custom.add_argument("--max-inflight", default="1", help="int >= 0, or none")
    listing = sub.add_parser("cases", help="list case ids")
    listing.add_argument("--matrix", default="default", choices=tuple(MATRICES))
    sub.add_parser("backends", help="list backend names")
    return parser


def _device(value: str) -> torch.device:
    if value == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible on this machine")
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(value)


def _custom_case(args: argparse.Namespace) -> Case:
    if not args.pattern or not args.offload:
        raise UsageError("a custom case needs both --pattern and --offload")
    parse_pattern(args.pattern)
    names = tuple(n.strip() for n in args.offload.split(",") if n.strip())
    if "fused_group_mlp" in names:
        family = "moe-fused"
    else:
        family = "hybrid-moe" if "E" in args.pattern else "hybrid"
    inflight = None if args.max_inflight == "none" else _int("--max-inflight", args.max_inflight)
    return Case(
        family=family,
        offload=names,
        custom_pattern=args.pattern,
        steps=args.steps,
        microbatches=args.microbatches,
        schedule=args.schedule,
        precision=args.precision,
        max_inflight=inflight,
    )


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
        return [find_case(args.case)]
    return matrix(args.matrix)


def _run_one(case: Case, env: Environment) -> dict[str, Any]:
    spec = env.spec(case)
    res = run_case(case, env)
    problems = [
        *equivalence_problems(case, res),
        *(leak_problems(case, res) if res.offload.logs else []),
        *transfer_problems(case, res, env.device),
        *disabled_problems(res),
        *fidelity_problems(case, res, spec),
    ]
    record = case_record(res)
    if env.device.type == "cuda":
        memory = run_memory(case, env)
        record.update(memory_record(memory))
        problems += memory_problems(memory)
    record.update(name=case.name, verdict="fail" if problems else "pass", problems=problems)
    return record


def _jobs(value: int | None, device: torch.device, cases: int) -> int:
    if value is not None and value < 1:
        raise UsageError(f"--jobs must be >= 1, got {value}")
    if device.type == "cuda":
        if value not in (None, 1):
            raise UsageError("--jobs > 1 needs --device cpu (one GPU runs one case at a time)")
        return 1
    return min(value or os.cpu_count() or 1, cases)


def _run_all(cases: list[Case], env: Environment, jobs: int) -> list[dict[str, Any]]:
    """Run every case (in ``jobs`` worker processes on CPU), printing a line as each ends;
    records come back in table order."""
    records: list[dict[str, Any] | None] = [None] * len(cases)
    done = 0

    def report(index: int, record: dict[str, Any], seconds: float) -> None:
        nonlocal done
        done += 1
        records[index] = record
        print(
            f"[{done}/{len(cases)}] {cases[index].name} {record['verdict']} ({seconds:.1f}s)",
            flush=True,
        )

    if jobs == 1:
        for index, case in enumerate(cases):
            began = time.perf_counter()
            report(index, _run_one(case, env), time.perf_counter() - began)
        return records  # type: ignore[return-value]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_worker_init, initargs=(jobs,)
    ) as pool:
        futures = {pool.submit(_timed_case, case, env): i for i, case in enumerate(cases)}
        for future in as_completed(futures):
            record, seconds = future.result()
            report(futures[future], record, seconds)
    return records  # type: ignore[return-value]


def _worker_init(jobs: int) -> None:
    # Each worker gets its share of the cores; more intra-op threads would spin against the
    # other workers'.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))


def _timed_case(case: Case, env: Environment) -> tuple[dict[str, Any], float]:
    began = time.perf_counter()
    return _run_one(case, env), time.perf_counter() - began


def command_run(args: argparse.Namespace) -> int:
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
    env = Environment(device=device, backend=args.backend, model_size=size)
    try:
        cases = _select(args)
        for case in cases:
            env.spec(case)  # every selected case applies to its model, before any run
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    jobs = _jobs(args.jobs, device, len(cases))
    start = time.perf_counter()
    records = _run_all(cases, env, jobs)
    folder = run_folder(Path(args.report_dir))
    path = write_summary(
        folder,
        records,
        backend=args.backend,
        device=str(device),
        model_size=size,
        seconds=round(time.perf_counter() - start, 2),
    )
    summary = json.loads(path.read_text())
    print()
    print(verdict_table(summary))
    for case in summary["cases"]:
        if case["problems"]:
            print(f"\nFAIL {case['name']}")
            print("\n".join(case["problems"]))
    failed = sum(c["verdict"] != "pass" for c in summary["cases"])
    print(
        f"\n{len(cases) - failed}/{len(cases)} cases passed in {summary['seconds']:.1f}s; "
        f"report: {path}"
    )
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command == "cases":
            print("\n".join(c.name for c in matrix(args.matrix)))
            return 0
        if args.command == "backends":
            print("\n".join(backend_names()))
            return 0
        return command_run(args)
    except UsageError as exc:
        print(f"offload-harness: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
