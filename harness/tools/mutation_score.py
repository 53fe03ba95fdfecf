"""Detection power: run every broken offloader (``harness/offload/broken.py``) against the
default case matrix and report which case catches it; or run the correct offloader N times and
count false alarms.

    scripts/mutation_score                       # every broken.* backend, best device
    scripts/mutation_score --device cpu --jobs 2
    scripts/mutation_score --only broken.noop --only broken.view_dedup
    scripts/mutation_score --repeat-correct 20   # the reference over the matrix, 20 passes
    scripts/mutation_score --device cuda --jobs 8 --repeat-correct 20   # 8 workers share a GPU

A broken offloader runs its catalogue catchers' cases first, then the rest of the matrix, and
stops at the first case that catches it. Only the checks its catalogue entry names are judged
(``harness.verify.judge``, the one judge pytest's case files and ``offload-harness run`` use; never
``golden``, which reads the plain baseline alone), and a check's failure is a catch only when
one of its problem lines matches the entry's expected pattern for that check
(``BrokenBackend.reasons``): a failure for another reason is no catch, and a case whose runs
raised is reported apart (``raised``), never as a catch. One line per broken offloader - name,
caught or missed, the case and check that caught it, the problem line that matched - and a last
line ``caught N/M``. ``--undeclared`` judges every backend as if it declared no semantics. On CUDA
each broken offloader runs with the race delays its catalogue entry names (``--race-delays
none`` turns them off; ``d2h=N,h2d=N,compute=N`` sets them for all). Exit code 0 when every
broken offloader was caught (or, with ``--repeat-correct``, when no pass raised an alarm).

``--jobs N`` runs N worker processes (``harness.run.parallel``; default ``settings.default_jobs``:
one per usable core on CPU, three per four cores up to 12 on CUDA), each with cores // N intra-op
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
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from harness.cases import Case, default_matrix
from harness.execute.environment import Environment
from harness.offload.backends import parse_race_delays, resolve_backend, with_delays
from harness.offload.broken import NO_DELAYS
from harness.run import settings
from harness.run.parallel import run_ordered, threads_per_worker, worker_pool
from harness.verify.detection import CATALOGUE, BrokenBackend, entry, first_match
from harness.verify.judge import CHECKS, judge


@dataclass(frozen=True)
class Outcome:
    """What happened to one broken offloader."""

    name: str
    caught: bool
    case: str = ""
    check: str = ""
    problem: str = ""
    """The problem line that matched the entry's expected pattern (caught), or what failed
    instead (missed)."""
    cases_run: int = 0
    seconds: float = 0.0
    note: str = ""
    raised: str = ""
    """A case whose runs raised: the exception (reported apart; never a catch)."""


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


def named_checks(broken: BrokenBackend) -> tuple[str, ...]:
    """The checks ``broken``'s catalogue entry names, in the judge's order. Only these are
    judged: ``golden`` reads the plain baseline alone, so it can never show an offloader's
    bug, and any other check's failure would be a catch for a reason nobody stated."""
    named = {check for check, _ in broken.catchers}
    return tuple(check for check in CHECKS if check in named)


@dataclass(frozen=True)
class Finding:
    """One case's verdict on a broken offloader: the matching problem line of the check that
    caught it, else the exception its runs raised, else the first failure for another reason."""

    check: str = ""
    matched: str = ""
    raised: str = ""
    other: str = ""


def find(case: Case, env: Environment, broken: BrokenBackend) -> Finding:
    """Judge ``case`` on ``broken``'s named checks; a catch is a named check failing with the
    entry's pattern for it (``BrokenBackend.matching``)."""
    judgement = judge(case, env, checks=named_checks(broken))
    other = ""
    for outcome in judgement.outcomes:
        if outcome.status != "fail":
            continue
        line = broken.matching(outcome.name, outcome.problems)
        if line is None and env.undeclared and outcome.name == "transfers":
            line = first_match(UNEXPLAINED, outcome.problems)
        if line is not None:
            return Finding(check=outcome.name, matched=_short(line))
        first = _summary(list(outcome.problems))
        if first.startswith(RAISED):
            return Finding(check=outcome.name, raised=first)
        other = other or f"[{outcome.name}] {first}"
    return Finding(other=other)


UNEXPLAINED = re.compile(r"^no single rule explains its copies in steps? ")
"""How the transfer check says that an undeclared backend's copies fit no rule it could have
(``harness.execute.learn``): with the declarations hidden (``--undeclared``) that is the
learned-rule form of "counted vs prediction", so it counts as a transfers catch."""


RAISED = "the case's runs raised"
"""How ``harness.verify.judge.raised`` starts a problem."""


def _summary(problems: list[str]) -> str:
    """The first problem line, with the first line that names a group when it is a header."""
    lines = [line for p in problems for line in p.splitlines() if line.strip()]
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:
        head = f"{head} {lines[1].strip()}"
    return _short(head)


def _short(line: str) -> str:
    return line if len(line) <= 240 else line[:237] + "..."


def _backend(broken: BrokenBackend, device: torch.device, delays: str) -> str:
    if device.type != "cuda" or delays == "none":
        return broken.name
    chosen = broken.cuda_delays if delays == "auto" else parse_race_delays(delays)
    return broken.name if chosen == NO_DELAYS else with_delays(broken.name, chosen)


def environment(backend: str, device: str, model_size: str, undeclared: bool) -> Environment:
    """The scoring environment; ``undeclared`` (``--undeclared``) judges the backend as if it
    declared no semantics: its rule is learned from its copies (``harness.execute.learn``)."""
    return Environment(
        device=torch.device(device), backend=backend, model_size=model_size, undeclared=undeclared
    )


def score_one(
    name: str, device: str, model_size: str, delays: str, threads: int, undeclared: bool = False
) -> Outcome:
    """Run one broken offloader until a case catches it for its named reason."""
    _use(torch.device(device), threads)
    broken = entry(name)
    backend = _backend(broken, torch.device(device), delays)
    env = environment(backend, device, model_size, undeclared)
    began = time.perf_counter()
    if torch.device(device).type != "cuda" and not broken.cpu:
        return Outcome(name, False, note="CUDA only: CPU cannot show this class; not run")
    cases = _cases_for(broken)
    raised = other = ""
    for index, case in enumerate(cases, start=1):
        found = find(case, env, broken)
        if found.matched:
            seconds = time.perf_counter() - began
            return Outcome(name, True, case.name, found.check, found.matched, index, seconds)
        raised = raised or (f"{case.name} [{found.check}]: {found.raised}" if found.raised else "")
        other = other or (f"{case.name} {found.other}" if found.other else "")
    note = f"needs {broken.needs}" if broken.needs else "no default case caught it"
    if other:
        note += f"; failed for another reason: {other}"
    seconds = time.perf_counter() - began
    return Outcome(
        name, False, problem=other, cases_run=len(cases), seconds=seconds, note=note, raised=raised
    )


def _line(outcome: Outcome, width: int) -> str:
    if outcome.caught:
        where = f"by {outcome.case} [{outcome.check}]"
        return f"{outcome.name:<{width}}  caught  {where}: {outcome.problem}"
    line = f"{outcome.name:<{width}}  missed  ({outcome.note}; {outcome.cases_run} cases run)"
    if outcome.raised:
        line += f"\n{'':<{width}}  raised  {outcome.raised}"
    return line


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


def run_correct_case(
    case: Case, device: str, model_size: str, threads: int, undeclared: bool = False
) -> list[str]:
    """The reference offloader on one case: every problem of every check (empty: clean)."""
    _use(torch.device(device), threads)
    return judge(case, environment("reference", device, model_size, undeclared)).problems


def repeat_correct(
    passes: int, device: torch.device, model_size: str, jobs: int, undeclared: bool = False
) -> int:
    rows = default_matrix()
    threads = threads_per_worker(jobs)
    calls: list[tuple[object, ...]] = [
        (row, str(device), model_size, threads, undeclared) for row in rows
    ]
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


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``offload-harness mutation-score``."""
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
    parser.add_argument(
        "--undeclared",
        action="store_true",
        help="judge every backend as if it declared no semantics (the learned-semantics path)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
        jobs = min(jobs, len(default_matrix()))
        return repeat_correct(args.repeat_correct, device, size, jobs, args.undeclared)
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
    calls = [
        (b.name, str(device), size, args.race_delays, threads, args.undeclared) for b in selected
    ]
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
