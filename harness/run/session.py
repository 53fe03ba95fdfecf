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
from concurrent.futures import Future, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from harness.cases import Case
from harness.execute.baselines import sharing_groups
from harness.execute.environment import Environment
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
    if the case outlives it, and the worker exits."""
    began = time.perf_counter()
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
    trains and the others reuse), in order, in one worker."""
    return [
        run_case(case, env, update_golden, timeout, dump)
        for case, dump in zip(cases, dumps, strict=True)
    ]


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
) -> str:
    """Run every case (see the module docstring); ``on_start(workers)`` once the first pool's
    cases are queued, ``on_record(index, record, seconds)`` as each ends. Returns ``complete``
    or ``timed-out``; Ctrl-C propagates after the workers are gone."""
    # The workers' dumps go to a scratch folder, never into the report folder: the run and its
    # timeouts work on whatever happens to that folder (disk full, removed); a timed-out
    # case's dump is copied into the report's stacks/ (``_keep_dump``).
    scratch = Path(tempfile.mkdtemp("-stacks"))
    dumps = {i: scratch / f"{slug(case.name)}.txt" for i, case in enumerate(cases)}
    pending = list(range(len(cases)))
    deaths: Counter[int] = Counter()
    exitcodes: dict[int, int | None] = {}
    timed_out: list[Path] = []
    status = "complete"
    began: dict[int, float] = {}

    def finish(index: int, record: dict[str, Any], seconds: float) -> None:
        text = record.pop("traceback", None)
        if text and folder is not None:
            path = folder / "errors" / f"{slug(cases[index].name)}.txt"
            try:  # the report folder may be gone or full: the verdict stands without it
                path.parent.mkdir(exist_ok=True)
                path.write_text(text, encoding="utf-8")
            except OSError:
                pass
            else:
                record["problems"] = [f"{record['problems'][0]} (traceback: {path})"]
        pending.remove(index)
        on_record(index, record, seconds)

    try:
        while pending:
            bundles = _bundles(cases, env, pending)
            workers = min(jobs, len(bundles))
            pool = worker_pool(workers, env.device)
            futures: dict[Future[Any], list[int]] = {}
            for bundle in bundles:
                for index in bundle:
                    began.setdefault(index, time.perf_counter())
                call = (
                    [cases[i] for i in bundle],
                    env,
                    update_golden,
                    timeout,
                    [str(dumps[i]) for i in bundle],
                )
                futures[pool.submit(run_bundle, *call)] = bundle
            if on_start is not None:
                on_start(workers)
                on_start = None
            broken = False
            try:
                for future in as_completed(futures):
                    bundle = futures[future]
                    try:
                        results = future.result()
                    except BrokenProcessPool:
                        broken = True
                        exitcodes = _exitcodes(pool)
                        break
                    except Exception as exc:  # e.g. a result that cannot be pickled back
                        problem = f"error: {type(exc).__name__}: {exc}"
                        results = [
                            (error_record(cases[i], problem), time.perf_counter() - began[i])
                            for i in bundle
                        ]
                    for index, (record, seconds) in zip(bundle, results, strict=True):
                        finish(index, record, seconds)
            except BaseException:
                kill_pool(pool)
                raise
            if not broken:
                kill_pool(pool)  # every call reported; what a backend left running ends here
                continue
            kill_pool(pool)
            for index in list(pending):
                path = dumps[index]
                text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
                seconds = time.perf_counter() - began[index]
                if _DUMP_MARK in text:
                    status = "timed-out"
                    path = _keep_dump(path, folder)
                    timed_out.append(path)
                    problem = (
                        f"timed out: the case ran past --case-timeout {timeout:g} s; every "
                        f"thread's stack: {path}"
                    )
                    finish(index, error_record(cases[index], problem), seconds)
                elif text:  # it was running when a worker died
                    deaths[index] += 1
                    path.unlink()
                    if deaths[index] > 1:
                        problem = (
                            "error: worker process died twice while running the case: "
                            f"{_death(text, exitcodes)}"
                        )
                        finish(index, error_record(cases[index], problem), seconds)
    finally:  # a stopped run's dumps are of nothing: only a timed-out case's may stay
        kept = set(timed_out)
        for path in dumps.values():
            if path not in kept:
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            scratch.rmdir()  # only when no timed-out case's dump stayed there
    return status


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
