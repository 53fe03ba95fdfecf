"""Detection power: run every broken offloader (``harness/offload/broken.py``) against the
default case matrix and report which case catches it; or run the correct offloader N times and
count false alarms.

    scripts/mutation_score                       # every broken.* backend, best device
    scripts/mutation_score --device cpu --jobs 2
    scripts/mutation_score --only broken.noop --only broken.view_dedup
    scripts/mutation_score --repeat-correct 20   # the reference over the matrix, 20 passes
    scripts/mutation_score --device cuda --jobs 8 --repeat-correct 20   # 8 workers share a GPU

A broken offloader runs its catalogue catchers' cases first, then the rest of the matrix, and
stops at the first case with a problem (any check of the judge, ``harness.judge``, the one
pytest's case files and ``offload-harness run`` use; a run that raises counts as caught, as a
failing pytest case). One line per broken offloader - name, caught or missed, the case and
check that caught it, the first line of the problem - and a last line ``caught N/M``. On CUDA
each broken offloader runs with the race delays its catalogue entry names (``--race-delays
none`` turns them off; ``d2h=N,h2d=N,compute=N`` sets them for all). Exit code 0 when every
broken offloader was caught (or, with ``--repeat-correct``, when no pass raised an alarm).

``--jobs N`` runs N worker processes (``harness.parallel``; default ``settings.default_jobs``: one
per usable core on CPU, three per four cores up to 12 on CUDA), each with cores // N intra-op
threads (``settings.usable_cores``: the process's CPU affinity). On CUDA the N workers share the one
GPU, each with its own CUDA context on the same device (``cuda`` or ``cuda:<index>``); the parent
never initialises CUDA. Cases are independent and every check reads its own process's state
(allocator stats, profiler, sync guard), so only their timing changes. ``--repeat-correct`` keeps
one pool for all passes and queues them back to back; each pass line gives the wall time since the
previous pass ended (with one job: the pass's own time), the last line the total wall time and case
runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from harness import settings
from harness.cases import Case, default_matrix
from harness.execute import Environment
from harness.judge import judge
from harness.offload.backends import parse_race_delays, resolve_backend, with_delays
from harness.offload.broken import CATALOGUE, NO_DELAYS, BrokenBackend, entry
from harness.parallel import run_ordered, threads_per_worker, worker_pool


@dataclass(frozen=True)
class Outcome:
    """What happened to one broken offloader."""

    name: str
    caught: bool
    case: str = ""
    check: str = ""
    problem: str = ""
    cases_run: int = 0
    seconds: float = 0.0
    note: str = ""


def _use(device: torch.device, threads: int) -> None:
    """This process's share of the cores; on CUDA the case's device becomes the current one
    (streams and allocator queries that name no device)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _cases_for(broken: BrokenBackend) -> list[Case]:
    """Catchers' cases first, then the rest of the default matrix."""
    rows = default_matrix()
    by_name = {row.name: row for row in rows}
    first = [by_name[case.name] for _, case in broken.catchers if case.name in by_name]
    ordered = list({row.name: row for row in [*first, *rows]}.values())
    return ordered


def _first_problem(case: Case, env: Environment) -> tuple[str, str] | None:
    """(check, first problem line) of the first check that fails, or None."""
    failed = judge(case, env, stop_at_first_failure=True).first_failure()
    return None if failed is None else (failed.name, _summary(list(failed.problems)))


def _summary(problems: list[str]) -> str:
    """The first problem line, with the first line that names a group when it is a header."""
    lines = [line for p in problems for line in p.splitlines() if line.strip()]
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:
        head = f"{head} {lines[1].strip()}"
    return head if len(head) <= 240 else head[:237] + "..."


def _backend(broken: BrokenBackend, device: torch.device, delays: str) -> str:
    if device.type != "cuda" or delays == "none":
        return broken.name
    chosen = broken.cuda_delays if delays == "auto" else parse_race_delays(delays)
    return broken.name if chosen == NO_DELAYS else with_delays(broken.name, chosen)


def score_one(name: str, device: str, model_size: str, delays: str, threads: int) -> Outcome:
    """Run one broken offloader until a case catches it."""
    _use(torch.device(device), threads)
    broken = entry(name)
    env = Environment(
        device=torch.device(device),
        backend=_backend(broken, torch.device(device), delays),
        model_size=model_size,
    )
    began = time.perf_counter()
    if torch.device(device).type != "cuda" and not broken.cpu:
        return Outcome(name, False, note="CUDA only: CPU cannot show this class; not run")
    cases = _cases_for(broken)
    for index, case in enumerate(cases, start=1):
        found = _first_problem(case, env)
        if found is not None:
            return Outcome(
                name, True, case.name, found[0], found[1], index, time.perf_counter() - began
            )
    if broken.needs:
        note = f"needs {broken.needs}"
    else:
        note = "no default case caught it"
    return Outcome(
        name, False, cases_run=len(cases), seconds=time.perf_counter() - began, note=note
    )


def _line(outcome: Outcome, width: int) -> str:
    if outcome.caught:
        where = f"by {outcome.case} [{outcome.check}]"
        return f"{outcome.name:<{width}}  caught  {where}: {outcome.problem}"
    return f"{outcome.name:<{width}}  missed  ({outcome.note}; {outcome.cases_run} cases run)"


def _batches(
    jobs: int, fn: Callable[..., object], calls: list[tuple[object, ...]], repeats: int
) -> Iterator[list]:
    """``[fn(*call) for call in calls]``, ``repeats`` times, one list per repeat as it
    completes. With jobs > 1 one pool runs them all, every repeat queued up front so no worker
    waits for a repeat's slowest case."""
    if jobs == 1:
        for _ in range(repeats):
            yield [fn(*call) for call in calls]
        return
    pool = worker_pool(jobs)
    try:
        queued = [[pool.submit(fn, *call) for call in calls] for _ in range(repeats)]
        for futures in queued:
            yield [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_correct_case(case: Case, device: str, model_size: str, threads: int) -> list[str]:
    """The reference offloader on one case: every problem of every check (empty: clean)."""
    _use(torch.device(device), threads)
    env = Environment(device=torch.device(device), backend="reference", model_size=model_size)
    return judge(case, env).problems


def repeat_correct(passes: int, device: torch.device, model_size: str, jobs: int) -> int:
    rows = default_matrix()
    threads = threads_per_worker(jobs)
    calls: list[tuple[object, ...]] = [(row, str(device), model_size, threads) for row in rows]
    print(
        f"{passes} passes x {len(rows)} cases on {device}, {jobs} job(s) x {threads} thread(s)",
        flush=True,
    )
    alarms = 0
    began = previous = time.perf_counter()
    batches = _batches(jobs, run_correct_case, calls, passes)
    for index, results in enumerate(batches, start=1):
        now = time.perf_counter()
        failed = [(row, problems) for row, problems in zip(rows, results, strict=True) if problems]
        alarms += len(failed)
        print(
            f"pass {index}/{passes}: {len(rows) - len(failed)}/{len(rows)} cases clean "
            f"({now - previous:.1f}s wall, {now - began:.1f}s total)",
            flush=True,
        )
        previous = now
        for row, problems in failed:
            print(f"  FALSE ALARM {row.name}: {_summary(problems)}", flush=True)
    total = time.perf_counter() - began
    runs = passes * len(rows)
    print(
        f"false alarms: {alarms} in {passes} passes ({runs} case runs, {total:.1f}s wall: "
        f"{total / passes:.1f}s per pass, {total / runs:.2f}s per case run; {jobs} job(s) on "
        f"{device})"
    )
    return 1 if alarms else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="offload-harness mutation-score", description=__doc__.split("\n\n")[0]
    )
    settings.add_arguments(parser, ("device", "jobs", "model_size"))
    parser.add_argument("--only", action="append", help="this broken backend only (repeatable)")
    parser.add_argument(
        "--race-delays",
        default="auto",
        help="CUDA: auto (each entry's own), none, or d2h=N,h2d=N,compute=N for all",
    )
    parser.add_argument(
        "--repeat-correct",
        type=int,
        metavar="N",
        help="instead: the reference offloader over the default matrix N times (false alarms)",
    )
    args = parser.parse_args(argv)
    try:
        device = settings.resolve_device(args.device)
        size = settings.resolve_model_size(args.model_size, device)
        jobs = settings.resolve_jobs(args.jobs, device, tasks=1 << 30)  # capped per mode below
    except settings.SettingError as exc:
        parser.error(str(exc))
    if args.race_delays not in ("auto", "none"):
        try:
            parse_race_delays(args.race_delays)
        except ValueError as exc:
            parser.error(str(exc))
    if args.repeat_correct is not None:
        if args.repeat_correct < 1:
            parser.error("--repeat-correct must be >= 1")
        return repeat_correct(args.repeat_correct, device, size, min(jobs, len(default_matrix())))
    try:
        names = [entry(name).name for name in args.only] if args.only else None
    except ValueError as exc:
        parser.error(str(exc))
    selected = [b for b in CATALOGUE if names is None or b.name in names]
    for broken in selected:
        resolve_backend(_backend(broken, device, args.race_delays))
    jobs = min(jobs, len(selected))
    threads = threads_per_worker(jobs)
    began = time.perf_counter()
    calls = [(b.name, str(device), size, args.race_delays, threads) for b in selected]
    outcomes: list[Outcome] = run_ordered(score_one, calls, jobs=jobs)
    width = max(len(b.name) for b in selected)
    for outcome in outcomes:
        print(_line(outcome, width))
    caught = sum(o.caught for o in outcomes)
    print(
        f"caught {caught}/{len(outcomes)} on {device.type} "
        f"({time.perf_counter() - began:.0f}s, {sum(o.cases_run for o in outcomes)} case runs)"
    )
    print(f"caught {caught}/{len(outcomes)}")
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
