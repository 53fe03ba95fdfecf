"""Detection power: run every broken offloader (``harness/offload/broken/``) against the
default case matrix, with the reference offloader on the same rows as the control, and report
which case catches each; or run the correct offloader N times and count false alarms.

    scripts/mutation_score                       # every broken.* backend, best device
    scripts/mutation_score --device cpu --jobs 2
    scripts/mutation_score --only broken.noop --only broken.view_dedup
    scripts/mutation_score --repeat-correct 20   # the reference over the matrix, 20 passes
    scripts/mutation_score --device cuda --jobs 8 --repeat-correct 20   # 8 workers share a GPU

A broken offloader is judged on its catalogue catchers' rows first, one after another, then -
if none caught it - on the rest of the matrix at once; its catch is the first row, in that
order, that catches it. Only the checks its catalogue entry names are judged
(``harness.verify.judge``, the one judge pytest's case files and ``offload-harness run`` use; never
``golden``, which reads the plain baseline alone), and a check's failure is a catch only when
one of its problem lines matches the entry's expected pattern for that check
(``BrokenBackend.reasons``): a failure for another reason is no catch, and a case whose runs
raised is reported apart (``raised``), never as a catch. One line per broken offloader - name,
caught or missed, the case and check that caught it, the problem line that matched - then the
control's line and a last line ``caught N/M``.

The control (``harness.tools.mutation_control``): the reference is judged with every check on
every row a broken offloader is judged on, same device and model size. A failure of any check
but ``golden`` there makes the score invalid: ``invalid: the control fails N rows``, each row
with its failing checks, and exit code 1. Its judgement shares the row's plain baseline with
the broken offloaders judged after it on the same worker: the rows' judgements are grouped by
row, at most ``MAX_ROWS_SHARING`` a worker call, the control first.

``--undeclared`` judges every backend, the control included, as if it declared no semantics:
each is held to the rule learned from its steps 0 and 1, or to its own first steady step where
no rule fits (``harness.execute.consistency``); an entry whose fault learning takes for a rule
of its own (``BrokenBackend.learnable``) is judged on its catchers only. On CUDA each broken
offloader runs with the race delays its catalogue entry names (``--race-delays none`` turns them
off; ``d2h=N,h2d=N,compute=N`` sets them for all, the control included). Exit code 0 when the
control is clean and every broken offloader was caught (or, with ``--repeat-correct``, when no
pass raised an alarm).

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
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from harness.cases import Case, default_matrix
from harness.execute.baselines import MAX_ROWS_SHARING
from harness.offload.backends import parse_race_delays, resolve_backend
from harness.run import settings
from harness.run.parallel import kill_pool, threads_per_worker, worker_pool
from harness.tools.mutation_control import (
    ControlRow,
    InvalidScore,
    control_backend,
    first_line,
    invalid_lines,
    noted_lines,
    summary_line,
)
from harness.tools.mutation_rows import (
    Catch,
    Finding,
    Judged,
    RowResult,
    RowTask,
    Where,
    broken_backend,
    environment,
    find,
    named_checks,
    run_row,
)
from harness.tools.mutation_rows import use as _use
from harness.verify.detection import CATALOGUE, BrokenBackend, entry
from harness.verify.judge import judge

__all__ = [
    "Catch",
    "Finding",
    "InvalidScore",
    "Outcome",
    "environment",
    "find",
    "main",
    "named_checks",
    "score",
    "score_one",
]


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
    """Wall seconds of its judgements (worker time; its rows' plain baselines were trained by
    whichever judgement of the row came first on the worker, the control's as a rule)."""
    note: str = ""
    raised: str = ""
    """A case whose runs raised: the exception (reported apart; never a catch)."""
    absorbed: bool = False
    """Missed because its fault is a rule of its own with the declarations hidden
    (``BrokenBackend.learnable``, ``--undeclared``)."""


def rows_for(broken: BrokenBackend, undeclared: bool) -> tuple[list[Case], int]:
    """The rows ``broken`` may be judged on, in order - its catchers' rows, then the rest of the
    default matrix (none with the declarations hidden where learning absorbs its fault) - and
    how many are its catchers'."""
    rows = default_matrix()
    by_name = {row.name: row for row in rows}
    first = list(
        {c.name: by_name[c.name] for _, c in broken.catchers if c.name in by_name}.values()
    )
    if undeclared and broken.learnable:
        return first, len(first)
    return list({row.name: row for row in [*first, *rows]}.values()), len(first)


class Scoring:
    """The schedule of a score. In waves: the broken offloaders' first catcher rows, then the
    second ones of those not caught yet, ..., then the rest of the matrix at once for those
    still not caught. Each wave's judgements are grouped by row into worker calls of at most
    ``MAX_ROWS_SHARING`` judgements (fewer where that leaves workers idle), the control first
    on every row it has not been judged on yet, so a row's plain baseline is trained once per
    call and the control adds one judgement per row, not one per broken offloader."""

    def __init__(self, entries: list[BrokenBackend], where: Where, jobs: int) -> None:
        self.entries, self.where, self.jobs = entries, where, jobs
        self.rows: dict[str, list[Case]] = {}
        self.catchers: dict[str, int] = {}
        for broken in entries:
            self.rows[broken.name], self.catchers[broken.name] = rows_for(broken, where.undeclared)
        self.controls: dict[str, ControlRow] = {}
        self.judged: dict[str, dict[str, Judged]] = {b.name: {} for b in entries}

    def waves(self) -> Iterator[list[tuple[Case, str]]]:
        """Each wave's (row, broken offloader) judgements, made after the previous wave ran."""
        depth = max(self.catchers.values(), default=0)
        for wave in range(depth + 1):
            wanted = []
            for name, rows in self.rows.items():
                if self.catch_of(name) is not None:
                    continue
                if wave < self.catchers[name]:
                    wanted.append((rows[wave], name))
                elif wave == self.catchers[name]:  # its catchers missed: the rest at once
                    wanted.extend((row, name) for row in rows[wave:])
            yield wanted

    def tasks(self, wanted: list[tuple[Case, str]], jobs: int) -> list[RowTask]:
        """The worker calls of one wave."""
        by_row: dict[str, tuple[Case, list[str]]] = {}
        for row, name in wanted:
            by_row.setdefault(row.name, (row, []))[1].append(name)
        units = len(wanted) + sum(name not in self.controls for name in by_row)
        size = max(1, min(MAX_ROWS_SHARING, -(-units // jobs)))
        tasks = []
        for row, names in by_row.values():
            control = row.name not in self.controls
            calls: list[str | None] = [None] * control + list(names)  # None: the control
            for start in range(0, len(calls), size):
                chunk = calls[start : start + size]
                named = tuple(n for n in chunk if n is not None)
                tasks.append(RowTask(row, None in chunk, named))
        return tasks

    def take(self, result: RowResult) -> None:
        if result.control is not None:
            self.controls[result.row] = result.control
        for judged in result.judged:
            self.judged[judged.name][judged.row] = judged

    def run_all(self) -> None:
        """Every wave, on one pool of workers sized by the first wave (in this process with
        one job)."""
        pool: ProcessPoolExecutor | None = None
        jobs = 0
        try:
            for wanted in self.waves():
                if not wanted:
                    continue
                if not jobs:  # at most one worker per judgement of the first wave
                    jobs = min(self.jobs, len(wanted) + len({row.name for row, _ in wanted}))
                    pool = worker_pool(jobs) if jobs > 1 else None
                for result in self._run(pool, self.tasks(wanted, jobs), jobs):
                    self.take(result)
        finally:
            if pool is not None:
                kill_pool(pool)

    def _run(
        self, pool: ProcessPoolExecutor | None, tasks: list[RowTask], jobs: int
    ) -> Iterator[RowResult]:
        """The results of ``tasks`` as they end (in order in this process)."""
        if pool is None:
            for task in tasks:
                yield run_row(task, self.where)
            return
        where = dataclasses.replace(self.where, threads=threads_per_worker(jobs))
        futures = [pool.submit(run_row, task, where) for task in tasks]
        for future in as_completed(futures):
            yield future.result()

    def catch_of(self, name: str) -> tuple[Judged, Catch] | None:
        """The first row, in ``name``'s order, that caught it, and the catch."""
        for row in self.rows[name]:
            judged = self.judged[name].get(row.name)
            if judged is None:
                continue
            caught = judged.finding.catch()
            if caught is not None:
                return judged, caught
        return None

    def judged_of(self, name: str) -> list[Judged]:
        """``name``'s judgements in its rows' order."""
        return [self.judged[name][r.name] for r in self.rows[name] if r.name in self.judged[name]]

    def control_rows(self) -> list[ControlRow]:
        return list(self.controls.values())


def _outcome(broken: BrokenBackend, scoring: Scoring) -> Outcome:
    """A broken offloader's outcome from its judgements and the control's rows."""
    name = broken.name
    judged = scoring.judged_of(name)
    seconds = sum(j.seconds for j in judged)
    caught = scoring.catch_of(name)
    if caught is not None:
        where, catch = caught
        return Outcome(name, True, where.row, catch.check, catch.line, len(judged), seconds)
    raised = next((f"{j.row} {j.finding.raised}" for j in judged if j.finding.raised), "")
    other = next((f"{j.row} {j.finding.other}" for j in judged if j.finding.other), "")
    discounted = next(
        (f"{j.row} [{c.check}] {c.line}" for j in judged for c in j.finding.catches), ""
    )
    absorbed = scoring.where.undeclared and bool(broken.learnable)
    if absorbed:
        note = f"absorbed by learning: {broken.learnable}"
    else:
        note = f"needs {broken.needs}" if broken.needs else "no default case caught it"
    if discounted:
        note += f"; the control's row says it too, so no catch: {discounted}"
    if other:
        note += f"; failed for another reason: {other}"
    return Outcome(
        name,
        False,
        problem=other,
        cases_run=len(judged),
        seconds=seconds,
        note=note,
        raised=raised,
        absorbed=absorbed,
    )


@dataclass(frozen=True)
class Score:
    """Every selected broken offloader's outcome and the control's rows."""

    outcomes: list[Outcome]
    control: list[ControlRow]
    control_backend: str
    seconds: float
    """Wall seconds of the whole score."""

    @property
    def invalid(self) -> list[str]:
        return invalid_lines(self.control)


def score(
    selected: list[BrokenBackend],
    device: torch.device,
    model_size: str,
    delays: str,
    jobs: int,
    undeclared: bool = False,
    threads: int | None = None,
) -> Score:
    """Score ``selected`` with the control on the same rows, on ``jobs`` workers (``threads``:
    this process's intra-op threads when it runs them itself, one job; default all cores)."""
    began = time.perf_counter()
    runnable = [b for b in selected if device.type == "cuda" or b.cpu]
    control = control_backend(device, delays)
    own = threads if threads is not None else threads_per_worker(1)
    where = Where(str(device), model_size, delays, undeclared, control, own)
    scoring = Scoring(runnable, where, jobs)
    scoring.run_all()
    outcomes = []
    for broken in selected:
        if broken in runnable:
            outcomes.append(_outcome(broken, scoring))
        else:
            note = "CUDA only: CPU cannot show this class; not run"
            outcomes.append(Outcome(broken.name, False, note=note))
    return Score(outcomes, scoring.control_rows(), control, time.perf_counter() - began)


def score_one(
    name: str, device: str, model_size: str, delays: str, threads: int, undeclared: bool = False
) -> Outcome:
    """One broken offloader scored in this process, with its control; raises ``InvalidScore``
    where the control fails a row it was scored on."""
    result = score([entry(name)], torch.device(device), model_size, delays, 1, undeclared, threads)
    if result.invalid:
        raise InvalidScore("\n".join(result.invalid))
    return result.outcomes[0]


def _line(outcome: Outcome, width: int) -> str:
    if outcome.caught:
        where = f"by {outcome.case} [{outcome.check}]"
        return f"{outcome.name:<{width}}  caught  {where}: {outcome.problem}"
    line = f"{outcome.name:<{width}}  missed  ({outcome.note}; {outcome.cases_run} cases run)"
    if outcome.raised:
        line += f"\n{'':<{width}}  raised  {outcome.raised}"
    return line


def report(result: Score, device: torch.device, undeclared: bool) -> int:
    """Print the score: a line per broken offloader, the control's line (and notes), then
    either the control's failures or ``caught N/M``; the exit code."""
    outcomes = result.outcomes
    width = max(len(o.name) for o in outcomes)
    for outcome in outcomes:
        print(_line(outcome, width))
    print(summary_line(result.control, result.control_backend, device, undeclared))
    for line in noted_lines(result.control):
        print(line)
    if result.invalid:
        for line in result.invalid:
            print(line)
        return 1
    caught = sum(o.caught for o in outcomes)
    absorbed = sum(o.absorbed for o in outcomes)
    learned = f", {absorbed} absorbed by learning" if absorbed else ""
    runs = sum(o.cases_run for o in outcomes)
    work = sum(o.seconds for o in outcomes)
    print(
        f"caught {caught}/{len(outcomes)} on {device.type}{learned} ({result.seconds:.0f}s wall; "
        f"{runs} case runs of broken offloaders, {work:.0f}s of worker time; the control's "
        f"{len(result.control)}: {sum(r.seconds for r in result.control):.0f}s)"
    )
    print(f"caught {caught}/{len(outcomes)}")
    return 0 if caught == len(outcomes) else 1


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
            print(f"  FALSE ALARM {row.name}: {first_line(problems)}", flush=True)
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
        resolve_backend(broken_backend(broken, device, args.race_delays))
    result = score(selected, device, size, args.race_delays, jobs, args.undeclared)
    return report(result, device, args.undeclared)


if __name__ == "__main__":
    sys.exit(main())
