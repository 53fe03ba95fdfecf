"""Fault injection for ``offload-harness run`` (CPU): an exception in a case is its verdict and
the other cases still run; a hang is a ``timed out`` verdict with every thread's stack, in
bounded time; a worker that dies is retried once; Ctrl-C exits 130 within 3 s leaving a valid
``summary.json`` marked ``interrupted``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import warm

from harness.cases import Case, matrix
from harness.execute.environment import Environment
from harness.run import session

FAULTY = '''
import os, time
from harness.offload.reference import OffloadContext


class Hang(OffloadContext):
    """Sleeps in its second microbatch (the second step here)."""
    calls = 0

    def begin_microbatch(self, microbatch):
        Hang.calls += 1
        if Hang.calls > 1:
            time.sleep(3600)
        return super().begin_microbatch(microbatch)


class Boom(OffloadContext):
    def end_iteration(self):
        raise RuntimeError("boom in end_iteration")


class Die(OffloadContext):
    """Kills its own process in the first step (a segfault or the OOM killer would)."""
    def end_iteration(self):
        os._exit(9)
'''

SMALL = ["--pattern", "+-", "--offload", "core_attn", "--steps", "2", "--microbatches", "1"]


@pytest.fixture
def faulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "faulty.py").write_text(FAULTY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    return tmp_path


def _run(
    folder: Path, *argv: str, timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.perf_counter()
    command = [sys.executable, "-m", "harness", "run", "--device", "cpu", "--jobs", "1", *argv]
    done = warm.run(command, cwd=folder, timeout=timeout)
    return done, time.perf_counter() - began


def _summary(root: Path) -> dict[str, Any]:
    (path,) = root.glob("*/summary.json")
    return json.loads(path.read_text())


@pytest.mark.heavy
def test_a_hang_is_a_timed_out_verdict_with_every_stack(faulty: Path) -> None:
    done, seconds = _run(
        faulty, *SMALL, "--backend", "faulty:Hang", "--case-timeout", "5", "--report-dir", "r"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = _summary(faulty / "r")
    assert summary["status"] == "timed-out"
    (case,) = summary["cases"]
    assert case["problems"][0].startswith("timed out: the case ran past --case-timeout 5 s")
    (stacks,) = (faulty / "r").glob("*/stacks/*.txt")
    text = stacks.read_text()
    assert "most recent call first" in text and "faulty.py" in text and "begin_microbatch" in text
    assert seconds < 5 + 60, seconds  # the timeout, the spawn and the baselines: bounded


@pytest.mark.heavy
def test_an_error_is_the_cases_verdict_and_the_run_goes_on(faulty: Path) -> None:
    done, _ = _run(faulty, *SMALL, "--backend", "faulty:Boom", "--report-dir", "r")
    assert done.returncode == 1
    summary = _summary(faulty / "r")
    assert summary["status"] == "complete"
    (case,) = summary["cases"]
    assert any("RuntimeError: boom in end_iteration" in p for p in case["problems"])


@pytest.mark.heavy
def test_a_dying_worker_is_retried_once_then_an_error(faulty: Path) -> None:
    done, _ = _run(faulty, *SMALL, "--backend", "faulty:Die", "--report-dir", "r")
    assert done.returncode == 1, done.stdout + done.stderr
    (case,) = _summary(faulty / "r")["cases"]
    assert case["problems"] == [
        "error: worker process died twice while running the case: exit status 9; last "
        "position reported: case hybrid-+-_core_attn_sequential_fp32_2x1, step 0, "
        "microbatch 0, phase forward (begin_microbatch)"
    ]


def test_an_exception_outside_the_checks_is_an_error_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def judge(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("no such run")

    monkeypatch.setattr(session, "judge", judge)
    case = Case(family="hybrid", offload=("core_attn",), steps=1)
    env = Environment(device=__import__("torch").device("cpu"), backend="reference")
    record, _ = session.run_case(case, env, False, 0, None)
    assert record["verdict"] == "fail"
    assert record["problems"] == ["error: KeyError: 'no such run'"]
    assert "Traceback" in record["traceback"] and "no such run" in record["traceback"]


RUN_FULL = (sys.executable, "-m", "harness", "run", "--device", "cpu", "--matrix", "full")


@pytest.mark.heavy
def test_ctrl_c_exits_130_within_3_s_with_a_valid_summary(tmp_path: Path) -> None:
    process = subprocess.Popen(
        # The full matrix: cases still to run whenever the signal comes
        [*RUN_FULL, "--report-dir", "r"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as a terminal starts it: this session may run where SIGINT is ignored (a shell's
        # background job), which the child would inherit and never see the Ctrl-C; on this
        # test process's share of the cores (tests/helpers/warm.py)
        preexec_fn=warm.confine_interruptible,
    )
    # Cases running: the run's start line (its pool made, the cases queued) and a worker
    # forked by the run's forkserver - not a fixed sleep that must outlast a loaded machine,
    # nor a finished case, which would cost this test one of the matrix's longest cases.
    assert process.stdout is not None
    seen: list[str] = []
    watchdog = threading.Timer(120, process.kill)  # a run that never prints ends the reads
    watchdog.start()
    try:
        while not (seen and seen[-1].startswith("running ")):
            line = process.stdout.readline()
            assert line, "the run ended before its cases started:\n" + "".join(seen)
            seen.append(line)
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while not workers and time.monotonic() < deadline and process.poll() is None:
            workers = [w for c in _children(process.pid) for w in _children(c)]
            time.sleep(0.05)
    finally:
        watchdog.cancel()
    assert workers, "no worker process was running:\n" + "".join(seen)
    children = _children(process.pid)
    assert process.poll() is None, "the run ended before the signal:\n" + "".join(seen)
    ignored = _ignores_sigint(process.pid)  # inherited SIG_IGN: Python then never raises
    began = time.perf_counter()
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    seconds = time.perf_counter() - began
    out = "".join(seen) + rest
    assert process.returncode == 130, f"exit {process.returncode}, SIGINT ignored: {ignored}\n{out}"
    assert seconds < 3, seconds
    assert "Traceback" not in out
    summary = _summary(tmp_path / "r")
    assert summary["status"] == "interrupted"
    assert len(summary["cases"]) < len(matrix("full"))
    time.sleep(0.5)
    alive = [pid for pid in [*children, *workers] if _running(pid)]
    assert not alive, f"the forkserver or workers outlived the interrupted run: {alive}"


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in found.split()]


def _ignores_sigint(pid: int) -> bool | None:
    """Whether process ``pid`` ignores SIGINT (its ``SigIgn`` mask; None: unreadable)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return None


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
