"""How ``offload-harness run`` runs its cases so that the run survives its own failures.

* Every case runs in a worker process (``harness.run.parallel``), ``jobs`` at a time, so a
  case that hangs or crashes cannot take the run with it. The rows that share a plain baseline
  (``harness.execute.baselines.plain_key``) go to one worker in one call, which trains that baseline
  once; the calls start longest first.
* An exception inside a case is that case's failed verdict (``error: Type: message``); the
  traceback goes to ``<report folder>/errors/<case>.txt``; the other cases still run.
* ``--case-timeout`` (the setting pytest uses too) arms ``faulthandler`` in the worker: past it,
  every thread's stack is written to a scratch file and the worker exits; the file moves to
  ``<report folder>/stacks/<case>.txt`` (stays in the temporary folder without a report); the
  case's verdict is ``timed out`` with that file, and the cases the dead pool took with it run
  again in a new pool (once; a case whose worker dies twice without a dump is an ``error:
  worker process died``, with the worker's exit status or signal and the last position it
  reported).
* On CUDA the workers share the card's memory (``harness.run.budget``): a case starts only when
  its budgeted peak and those of the cases running fit the run's memory budget (``memory``);
  each worker gives back what a case left cached and records the case's peak
  (``harness.run.workermemory``). A case whose runs still ran out of memory
  (``workermemory.out_of_memory``) is not judged by that: it runs again alone, in a pool of
  one worker once every other case has ended, and that run's record is its verdict (with a
  note). Out of memory alone as well, it is an ``error: out of memory ... with no other case
  running`` record: the machine's limit, no check of the offloader failed (``checks`` is
  empty), and, like every error record, it fails the run - a skip would pass a run that
  verified nothing of the case, and an offloader that keeps device memory it should free
  runs out alone too.
* Ctrl-C, SIGTERM and SIGHUP kill the workers at once (they ignore all three; the parent stops
  them), cancel the queued cases and leave what finished.

The caller gets every record through ``on_record`` as it ends, so it can rewrite
``summary.json`` after each case; ``run_cases`` returns how the run ended: ``complete``,
``timed-out`` (a case timed out) or raises ``KeyboardInterrupt`` (``interrupted``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cases import Case
from harness.execute.baselines import forget_plain_baselines, sharing_groups
from harness.execute.environment import Environment
from harness.run import workermemory
from harness.run.budget import MemoryGate, Plan
from harness.run.parallel import kill_pool, worker_pool
from harness.util import leftovers, progress
from harness.verify.judge import judge

_HEADER = "offload-harness case worker"
_AT = "at: "
"""How a worker's position lines in a case's dump file begin (``harness.util.progress``)."""
_DUMP_MARK = "most recent call first"
"""Text faulthandler writes in every thread's dump: the case's file holds a stack dump."""


def slug(name: str) -> str:
    """A case id as a file name."""
    return re.sub(r"[^\w+.-]", "_", name)


def error_record(case: Case, problem: str) -> dict[str, Any]:
    """The report record of a case that ended without a judgement."""
    return {"name": case.name, "verdict": "fail", "problems": [problem], "checks": {}}


def run_case(
    case: Case, env: Environment, update_golden: bool, timeout: float, dump: str | None
) -> tuple[dict[str, Any], float]:
    """One case in a worker: the judge's record (or an error record with the traceback under
    ``"traceback"``) and its seconds. With a timeout, ``dump`` receives every thread's stack
    if the case outlives it, and the worker exits. On CUDA the record has the case's peak
    (``device_memory``) and the worker gives back what the case left cached; a case whose
    runs ran out of memory has that problem's line under ``"out_of_memory"``."""
    began = time.perf_counter()
    memory = workermemory.CaseMemory.start(env.device)
    stream = None
    if timeout and dump is not None:
        stream = open(dump, "w", encoding="utf-8")
        stream.write(f"{_HEADER} pid {os.getpid()}: case {case.name}, timeout {timeout:g} s\n")
        stream.flush()
        faulthandler.dump_traceback_later(timeout, exit=True, file=stream)
        progress.report_to(lambda position: _report(stream, f"{_AT}case {case.name}, {position}"))
    running = leftovers.Running.now()
    try:
        record = judge(case, env, update_golden=update_golden).record()
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        record = error_record(case, f"error: {type(exc).__name__}: {first}")
        record["traceback"] = traceback.format_exc()
    finally:
        if stream is not None:
            faulthandler.cancel_dump_traceback_later()
            progress.report_to(None)
            stream.close()
            Path(stream.name).unlink(missing_ok=True)
    note = leftovers.left_running(running)
    if note is not None:
        record.setdefault("notes", []).append(note)
    if memory is not None:
        record["device_memory"] = memory.record()
        workermemory.release(env.device)
    line = workermemory.out_of_memory(record.get("problems", ()))
    if line is not None:
        record["out_of_memory"] = line
    return record, time.perf_counter() - began


def _report(stream: Any, line: str) -> None:
    """A position line into the case's dump file, at once (the worker may die next)."""
    stream.write(line + "\n")
    stream.flush()


def _death(text: str, exitcodes: dict[int, int | None]) -> str:
    """What the dump file ``text`` of a case whose worker died says: the worker's exit status
    or signal (``exitcodes``: pid -> exit code of the pool's workers) and the last position it
    reported."""
    found = re.search(r"pid (\d+)", text)
    code = exitcodes.get(int(found.group(1))) if found else None
    if code is None:
        how = "exit status unknown"
    elif code < 0:
        how = f"killed by signal {_signal_name(-code)}"
    else:
        how = f"exit status {code}"
    positions = [line for line in text.splitlines() if line.startswith(_AT)]
    last = positions[-1].removeprefix(_AT) if positions else "before its first microbatch"
    return f"{how}; last position reported: {last}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def run_bundle(
    cases: list[Case], env: Environment, update_golden: bool, timeout: float, dumps: list[str]
) -> list[tuple[dict[str, Any], float]]:
    """``run_case`` for each of ``cases`` (rows sharing one plain baseline, which the first one
    trains and the others reuse), in order, in one worker. On CUDA the shared baseline is
    dropped after the last (an idle worker holds its context only: the memory budget)."""
    results = [
        run_case(case, env, update_golden, timeout, dump)
        for case, dump in zip(cases, dumps, strict=True)
    ]
    if env.device.type == "cuda":
        forget_plain_baselines()
        workermemory.release(env.device)
    return results


def _bundles(cases: list[Case], env: Environment, indices: list[int]) -> list[list[int]]:
    """``indices`` grouped as ``harness.execute.baselines.sharing_groups`` groups them (rows of one
    plain
    baseline, at most ``MAX_ROWS_SHARING`` each), the groups longest first: a long case started
    last would leave the other workers idle at the end."""
    groups: dict[str, list[int]] = {}
    names = sharing_groups(cases, env)
    for index in indices:
        groups.setdefault(names[index], []).append(index)
    return sorted(groups.values(), key=lambda group: -sum(cases[i].work for i in group))


def run_cases(
    cases: list[Case],
    env: Environment,
    *,
    jobs: int,
    timeout: float,
    folder: Path | None,
    on_record: Callable[[int, dict[str, Any], float], None],
    update_golden: bool = False,
    on_start: Callable[[int], None] | None = None,
    memory: Plan | None = None,
) -> str:
    """Run every case (see the module docstring), ``jobs`` at a time and, with ``memory`` (a
    CUDA run's ``harness.run.budget.Plan``), only as many as its budget holds;
    ``on_start(workers)`` once the first pool is made, ``on_record(index, record, seconds)``
    as each ends. Returns ``complete`` or ``timed-out``; Ctrl-C propagates after the workers
    are gone."""
    run = _Run(
        cases=cases,
        env=env,
        timeout=timeout,
        folder=folder,
        on_record=on_record,
        update_golden=update_golden,
        memory=memory,
    )
    try:
        while run.pending:
            alone = run.waiting_alone()
            bundles = [[i] for i in alone] if alone else _bundles(cases, env, run.others())
            workers = 1 if alone else min(jobs, len(bundles))
            pool = worker_pool(workers, env.device)
            if on_start is not None:
                on_start(workers)
                on_start = None
            exitcodes = run.dispatch(pool, bundles, workers)
            kill_pool(pool)  # every call reported; what a backend left running ends here
            if exitcodes is not None:
                run.settle_dead_pool(exitcodes)
    finally:
        run.remove_dumps()
    return run.status


@dataclass(kw_only=True)
class _Run:
    """One ``run_cases`` call across its pools: the cases still pending, each one's dump file
    and start, the deaths seen so far, and how the run ends."""

    cases: list[Case]
    env: Environment
    timeout: float
    folder: Path | None
    on_record: Callable[[int, dict[str, Any], float], None]
    update_golden: bool
    # The workers' dumps go to a scratch folder, never into the report folder: the run and its
    # timeouts work on whatever happens to that folder (disk full, removed); a timed-out
    # case's dump is copied into the report's stacks/ (``_keep_dump``).
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp("-stacks")))
    dumps: dict[int, Path] = field(init=False)
    pending: list[int] = field(init=False)
    deaths: Counter[int] = field(default_factory=Counter)
    timed_out: list[Path] = field(default_factory=list)
    began: dict[int, float] = field(default_factory=dict)
    status: str = "complete"
    memory: Plan | None = None
    short: dict[int, str] = field(default_factory=dict)
    """Cases that ran out of memory beside others, waiting to run alone: the line it said."""

    def __post_init__(self) -> None:
        self.dumps = {i: self.scratch / f"{slug(c.name)}.txt" for i, c in enumerate(self.cases)}
        self.pending = list(range(len(self.cases)))

    def others(self) -> list[int]:
        """The pending cases not waiting to run alone."""
        return [i for i in self.pending if i not in self.short]

    def waiting_alone(self) -> list[int]:
        """The cases to run alone now: those that ran out of memory beside others, once no
        other case is pending."""
        return [] if self.others() else [i for i in self.pending if i in self.short]

    def submit(self, pool: Any, bundle: list[int]) -> Future[Any]:
        """Start ``bundle`` as one ``run_bundle`` call; its cases' clocks start now (on their
        first pool only: a case run again keeps its first start)."""
        for index in bundle:
            self.began.setdefault(index, time.perf_counter())
        call = (
            [self.cases[i] for i in bundle],
            self.env,
            self.update_golden,
            self.timeout,
            [str(self.dumps[i]) for i in bundle],
        )
        return pool.submit(run_bundle, *call)

    def dispatch(
        self, pool: Any, bundles: list[list[int]], workers: int
    ) -> dict[int, int | None] | None:
        """Run ``bundles`` on ``pool``'s ``workers``: each started when a worker is free and,
        with a memory plan, when its peak fits the budget beside the running ones
        (``MemoryGate``); each case finished as its call returns. None when every call
        reported, the exit codes of the pool's workers when the pool broke (a worker died).
        Any other exception (Ctrl-C) kills the pool and propagates."""
        plan = self.memory
        gate = MemoryGate(plan.limit if plan is not None else 0)

        def cost(bundle: list[int]) -> int:
            return plan.bundle_cost(bundle) if plan is not None else 0

        queue = list(bundles)
        running: dict[Future[Any], list[int]] = {}
        try:
            while queue or running:
                for bundle in gate.pick(queue, cost, workers - len(running)):
                    running[self.submit(pool, bundle)] = bundle
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    bundle = running.pop(future)
                    gate.give(cost(bundle))
                    try:
                        results = future.result()
                    except BrokenProcessPool:
                        return _exitcodes(pool)
                    except Exception as exc:  # e.g. a result that cannot be pickled back
                        results = self._unreturned(bundle, exc)
                    for index, (record, seconds) in zip(bundle, results, strict=True):
                        self.settle(index, record, seconds, alone=workers == 1)
        except BaseException:
            kill_pool(pool)
            raise
        return None

    def _unreturned(self, bundle: list[int], exc: Exception) -> list[tuple[dict[str, Any], float]]:
        problem = f"error: {type(exc).__name__}: {exc}"
        now = time.perf_counter()
        return [(error_record(self.cases[i], problem), now - self.began[i]) for i in bundle]

    def settle(self, index: int, record: dict[str, Any], seconds: float, *, alone: bool) -> None:
        """A case's call returned: its record is final, unless its runs ran out of memory
        beside other cases for the first time (it then waits to run alone)."""
        line = record.pop("out_of_memory", None)
        earlier = self.short.pop(index, None)
        if self.memory is not None and "device_memory" in record:  # what it was budgeted
            record["device_memory"]["estimate"] = self.memory.estimates[index]
            record["device_memory"]["budgeted"] = self.memory.costs[index]
        if line is not None and earlier is None and not alone:
            self.short[index] = line
            return
        if line is not None:
            record = self._out_of_memory(index, line, record)
        elif earlier is not None:
            record.setdefault("notes", []).append(
                f"ran out of memory while other cases ran ({earlier}); run again alone, "
                "this is that run's verdict"
            )
        self.finish(index, record, seconds)

    def _out_of_memory(self, index: int, line: str, record: dict[str, Any]) -> dict[str, Any]:
        """The error record of a case out of memory with no other case running."""
        plan, case = self.memory, self.cases[index]
        budget = ""
        if plan is not None:
            free = plan.card.free / (1 << 30)
            budget = f"; budgeted {plan.costs[index] / (1 << 30):.1f} GiB, {free:.1f} GiB free"
        problem = (
            f"error: out of memory on {self.env.device} with no other case running, so the "
            f"case was not judged (the machine's limit, not a check of the offloader; a "
            f"backend that keeps device memory does this too){budget}: {line}"
        )
        out = error_record(case, problem)
        if "device_memory" in record:
            out["device_memory"] = record["device_memory"]
        return out

    def finish(self, index: int, record: dict[str, Any], seconds: float) -> None:
        """A case's record is final: its traceback goes to ``errors/`` (named in its problem)
        and the caller gets the record."""
        text = record.pop("traceback", None)
        if text and self.folder is not None:
            path = self.folder / "errors" / f"{slug(self.cases[index].name)}.txt"
            try:  # the report folder may be gone or full: the verdict stands without it
                path.parent.mkdir(exist_ok=True)
                path.write_text(text, encoding="utf-8")
            except OSError:
                pass
            else:
                record["problems"] = [f"{record['problems'][0]} (traceback: {path})"]
        self.pending.remove(index)
        self.on_record(index, record, seconds)

    def settle_dead_pool(self, exitcodes: dict[int, int | None]) -> None:
        """After a pool broke: a pending case whose dump holds a stack dump timed out; one that
        was running when a worker died runs again in the next pool, or fails on its second
        death; one that had not started runs in the next pool."""
        for index in list(self.pending):
            path = self.dumps[index]
            text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
            seconds = time.perf_counter() - self.began.get(index, time.perf_counter())
            if _DUMP_MARK in text:
                self.status = "timed-out"
                path = _keep_dump(path, self.folder)
                self.timed_out.append(path)
                problem = (
                    f"timed out: the case ran past --case-timeout {self.timeout:g} s; every "
                    f"thread's stack: {path}"
                )
                self.finish(index, error_record(self.cases[index], problem), seconds)
            elif text:  # it was running when a worker died
                self.deaths[index] += 1
                path.unlink()
                if self.deaths[index] > 1:
                    problem = (
                        "error: worker process died twice while running the case: "
                        f"{_death(text, exitcodes)}"
                    )
                    self.finish(index, error_record(self.cases[index], problem), seconds)

    def remove_dumps(self) -> None:
        """A stopped run's dumps are of nothing: only a timed-out case's may stay."""
        kept = set(self.timed_out)
        for path in self.dumps.values():
            if path not in kept:
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.scratch.rmdir()  # only when no timed-out case's dump stayed there


def _exitcodes(pool: Any) -> dict[int, int | None]:
    """Pid -> exit code (None: still running) of a broken pool's workers, before they are
    killed (a signal's is its negative number)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    deadline = time.monotonic() + 1.0  # the dead one's status travels through the forkserver
    while time.monotonic() < deadline and all(w.exitcode is None for w in workers):
        time.sleep(0.02)
    return {w.pid: w.exitcode for w in workers}


def _keep_dump(path: Path, folder: Path | None) -> Path:
    """A timed-out case's dump, moved into the report's ``stacks/`` (where the report cannot
    be written, or there is none, it stays in the scratch folder)."""
    if folder is None:
        return path
    kept = folder / "stacks" / path.name
    try:
        kept.parent.mkdir(exist_ok=True)
        shutil.move(path, kept)
    except OSError:
        return path
    return kept
