"""Fault injection for how ``offload-harness run`` ends (CPU), one test per row of issue #47's
table: every run ends, every report survives, every error says where. The offloaders that
provoke the rows are the small backends of ``tests/helpers/offloaders.py``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import warm
from child_pytest import CHILD_OPTIONS, pytest_command

from harness.cli import main

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
HELPERS = HERE.parent / "helpers"
ZERO3 = (
    "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16_zero3",
    "hybrid-moe-+E+-+E_expert_fc1+moe_act_1f1b_bf16_inflight-none_zero3",
)
RUN = (sys.executable, "-m", "harness", "run", "--device", "cpu")
SMALL = ["--pattern", "+-", "--offload", "core_attn", "--steps", "2", "--microbatches", "1"]


@pytest.fixture
def backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder to run in, with ``tests/helpers/offloaders.py`` importable by the run."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(HERE.parents[1]), str(HELPERS), *sys.path])
    )
    return tmp_path


def _run(folder: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "harness", "run", "--device", "cpu", "--jobs", "1", *argv]
    return warm.run(command, cwd=folder, timeout=timeout)


def _summary(root: Path) -> dict[str, Any]:
    (path,) = root.glob("*/summary.json")
    return json.loads(path.read_text())


@pytest.mark.heavy
def test_kept_references_are_no_transfers_of_the_group_on_zero3_and_every_case_runs(
    backends: Path,
) -> None:
    """An offloader that keeps the activations it offloaded (their memory freed by a forced
    release) passes both default ZeRO-3 rows; both ``--case`` values run."""
    argv = [arg for name in ZERO3 for arg in ("--case", name)]
    done = _run(backends, *argv, "--backend", "offloaders:Keep", "--report-dir", "r")
    cases = _summary(backends / "r")["cases"]
    assert sorted(c["name"] for c in cases) == sorted(ZERO3), done.stdout
    for case in cases:
        assert case["checks"]["transfers"]["status"] == "pass", case["problems"]
    assert done.returncode == 0, done.stdout + done.stderr


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--backend", "reference", "--backend", "hooks"], "--backend was given twice"),
        (["run", "--jobs", "1", "--jobs", "2"], "--jobs was given twice"),
        (["run", *SMALL, "--steps", "3"], "--steps was given twice"),
        (["run", "--case", ZERO3[0], "--case", ZERO3[0]], f"--case {ZERO3[0]} was given twice"),
        (["repro", "--case", ZERO3[0], "--case", ZERO3[1]], "--case was given twice"),
        (["repro", *SMALL, "--seed", "1", "--seed", "2"], "--seed was given twice"),
    ],
)
def test_a_repeated_single_value_flag_is_refused_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*argv, "--report-dir", str(tmp_path)]) == 2
    assert needle in _error_line(capsys)
    assert not list(tmp_path.iterdir()), "a refused run must not write a report"


def test_several_cases_are_all_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--case A --case B`` selects both, in order (before any run)."""
    import harness.cli as cli

    chosen: list[list[str]] = []

    def run_cases(cases: list[Any], *args: Any, **kwargs: Any) -> str:
        chosen.append([c.name for c in cases])
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_cases", run_cases)
    argv = ["run", "--device", "cpu", "--report-dir", "", "--case", ZERO3[1], "--case", ZERO3[0]]
    assert main(argv) == 130
    assert chosen == [[ZERO3[1], ZERO3[0]]]


CASE = "hybrid-+-+-+-_core_attn+attn_proj_sequential_fp32"
TWO_STEPS = ("--case", CASE, "--steps", "2")
"""``CASE`` for two steps (the warmup and a steady step): the faults below end or leave their
thread in the first step, and the row keeps its model, selection and microbatches."""
CASE_2X2 = f"{CASE}_2x2"


@pytest.mark.heavy
def test_a_thread_the_backend_never_joins_does_not_keep_the_run_alive(backends: Path) -> None:
    """A backend whose non-daemon prefetch thread never ends (in the workers, and in the run's
    own process, where the backend's probe built it): the run ends, the summary is
    ``complete`` and the case names the thread in one note."""
    began = time.perf_counter()
    done = _run(
        backends, *TWO_STEPS, "--backend", "offloaders:Prefetch", "--report-dir", "r", timeout=120
    )
    seconds = time.perf_counter() - began
    summary = _summary(backends / "r")
    assert summary["status"] == "complete", done.stdout + done.stderr
    (case,) = summary["cases"]
    assert case["verdict"] == "pass", case["problems"]
    assert case["notes"] == [
        "left running after the case: thread 'prefetch' (non-daemon), "
        "thread 'prefetch' (non-daemon) (ended with its worker)"
    ]
    assert case["name"] == CASE_2X2
    assert f"NOTE {CASE_2X2}: left running after the case: thread 'prefetch'" in done.stdout
    assert "not waiting for thread(s) 'prefetch'" in done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert seconds < 90, seconds


def _descendants(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(child) for child in found.split()]
    return [d for child in children for d in (child, *_descendants(child))]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.heavy
def test_no_process_outlives_a_run_killed_with_sigkill(backends: Path) -> None:
    """SIGKILL to ``offload-harness run`` once its workers run: its forkserver, its workers
    (and multiprocessing's resource tracker) are gone within a few seconds."""
    process, _, family = _start_run(backends, ["--report-dir", "r"], warm.confine)
    process.kill()
    process.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(map(_running, family)):
        time.sleep(0.1)
    alive = [pid for pid in family if _running(pid)]
    for pid in alive:  # never left behind by this test either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not alive, f"outlived the killed run by 5 s: {alive}"


def _start_full_matrix(folder: Path) -> tuple[subprocess.Popen[str], list[str], list[int]]:
    """``offload-harness run --matrix full`` started as a terminal would, once its workers run
    (cases still to come whenever a signal lands): the process, its output so far, the
    forkserver and workers."""
    return _start_run(folder, ["--matrix", "full", "--report-dir", "r"], warm.confine_interruptible)


def _start_run(
    folder: Path, args: list[str], preexec: Any
) -> tuple[subprocess.Popen[str], list[str], list[int]]:
    """``offload-harness run <args>`` in ``folder``, returned once it printed its start line and
    its forkserver and two workers exist (each read bounded by a watchdog)."""
    process = subprocess.Popen(
        [*RUN, *args],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec,
    )
    assert process.stdout is not None
    watchdog = threading.Timer(120, process.kill)  # a run that never prints ends the reads
    watchdog.start()
    seen: list[str] = []
    family: list[int] = []
    try:
        while not (seen and seen[-1].startswith("running ")):
            line = process.stdout.readline()
            assert line, "the run ended before its cases started:\n" + "".join(seen)
            seen.append(line)
        deadline = time.monotonic() + 60
        while len(family) < 3 and time.monotonic() < deadline:
            family = _descendants(process.pid)
            time.sleep(0.05)
    finally:
        watchdog.cancel()
    assert len(family) >= 3, f"no workers: {family}\n" + "".join(seen)
    assert process.poll() is None, "the run ended before the signal:\n" + "".join(seen)
    return process, seen, family


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("signum", "code", "status"),
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "terminated")],
    ids=["SIGTERM", "SIGHUP"],
)
def test_a_stop_signal_leaves_a_report_and_the_conventional_exit_code(
    backends: Path, signum: int, code: int, status: str
) -> None:
    process, seen, family = _start_full_matrix(backends)
    began = time.perf_counter()
    process.send_signal(signum)
    rest, _ = process.communicate(timeout=60)
    seconds = time.perf_counter() - began
    out = "".join(seen) + rest
    assert process.returncode == code, out
    assert seconds < 3, seconds
    assert "Traceback" not in out
    summary = _summary(backends / "r")
    assert summary["status"] == status
    assert f"{status} after " in out
    time.sleep(0.5)
    alive = [pid for pid in family if _running(pid)]
    assert not alive, f"the forkserver or workers outlived the stopped run: {alive}"


def _line(process: Any, timeout: float) -> str:
    """The next line of a ``warm.start`` process's standard output ('' at its end): forked
    warm, or a fresh interpreter's pipe where the command needs one (``warm.COLD_VARIABLE``)."""
    if isinstance(process, warm.WarmProcess):
        return process.readline(timeout=timeout)
    return process.stdout.readline()


@pytest.mark.heavy
def test_a_report_folder_removed_mid_run_is_one_line_and_exit_6(backends: Path) -> None:
    """The report folder disappears while a case runs (a cleanup job, a full disk's remedy):
    one line on stderr, no traceback, every verdict and the count still on the console, and
    the exit code says the report is incomplete. The case's offloader waits in its first
    microbatch until the folder is gone (``offloaders:WaitForGo``): removed mid-case, never
    after the case already ended."""
    command = [*RUN, "--jobs", "1", *SMALL, "--backend", "offloaders:WaitForGo"]
    process = warm.start([*command, "--report-dir", "r"], cwd=backends)
    watchdog = threading.Timer(120, process.kill)
    watchdog.start()
    seen: list[str] = []
    try:
        while not (seen and seen[-1].startswith("running ")):
            line = _line(process, timeout=120)
            assert line, "the run ended before its cases started:\n" + "".join(seen)
            seen.append(line)
        (folder,) = (backends / "r").iterdir()
        shutil.rmtree(folder)
        (backends / "go").touch()
        rest, err = process.communicate(timeout=120)
    finally:
        watchdog.cancel()
        process.kill()
    out = "".join(seen) + rest
    assert process.returncode == 6, out + err
    assert "Traceback" not in out + err
    (line,) = err.strip().splitlines()
    assert line.startswith("offload-harness: report incomplete: cannot write summary.json in ")
    assert folder.name in line
    assert "No such file or directory" in line
    assert "[1/1] hybrid-+-_core_attn_sequential_fp32_2x1 " in out
    assert "0/1 cases passed" in out or "1/1 cases passed" in out


def test_a_full_disk_is_one_line_and_the_rest_of_the_report_is_not_tried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    from harness.cli import _ReportWriter

    report = _ReportWriter(tmp_path)
    calls: list[str] = []

    def full() -> None:
        calls.append("summary")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert report.write("summary.json", full) is None
    assert report.write("junit.xml", lambda: calls.append("junit")) is None
    assert report.failed and calls == ["summary"]
    line = _error_line(capsys)
    assert line == (
        f"offload-harness: report incomplete: cannot write summary.json in {tmp_path}: "
        "No space left on device; the verdicts go on on the console only"
    )


WHERE = {
    "BoomPack": "step 1, microbatch 0, layer 0, group core_attn, phase forward (pack hook)",
    "BoomUnpack": "step 1, microbatch 0, layer 4, group attn_proj, phase backward (unpack hook)",
    "BoomCommit": "step 1, microbatch 0, layer 0, group core_attn, phase commit (commit)",
    "BoomBegin": "step 1, microbatch 0, phase forward (begin_microbatch)",
    "BoomEnd": "step 1, microbatch 1, phase end of step (end_iteration)",
}


def _judged(backend: str) -> dict[str, Any]:
    """``CASE``'s judgement under ``offloaders:<backend>``, in this process, trained for two
    steps (the warmup and a steady step: every fault here is raised by step 1)."""
    import torch

    from harness.cases import find_case
    from harness.execute.environment import Environment
    from harness.verify.judge import judge

    env = Environment(device=torch.device("cpu"), backend=f"offloaders:{backend}")
    return judge(find_case(CASE).replace(steps=2), env).record()


@pytest.mark.parametrize("backend", WHERE)
def test_an_offloader_error_names_where_once(backend: str) -> None:
    """An exception in the offloader's calls is one problem of the case, naming the step, the
    microbatch, the layer, the group and the phase; the other checks that read the failed run
    skip, pointing to the one that reports it."""
    record = _judged(backend)
    call = backend.removeprefix("Boom").lower()
    call = {"begin": "begin_microbatch", "end": "end_iteration"}.get(call, call)
    assert record["problems"] == [
        f"equivalence: the case's runs raised RuntimeError: boom in {call} "
        f"(raised in the offloader's calls at {WHERE[backend]})"
    ]
    assert record["verdict"] == "fail"
    pointing = {"status": "skip", "reason": "the case's runs raised: see the equivalence check"}
    for name in ("leaks", "transfers", "disabled", "fidelity", "weights"):
        assert record["checks"][name] == pointing, name


def test_a_backend_that_changes_global_state_is_named_not_a_graph_change() -> None:
    """A backend that sets torch's default dtype when built: one failure naming the setting,
    before and after (no ``graph change``), and the setting restored for what runs next."""
    import torch

    record = _judged("Float64")
    assert record["problems"] == [
        "equivalence: the backend changed torch's default dtype from torch.float32 to "
        "torch.float64 when built"
    ]
    assert torch.get_default_dtype() == torch.float32
    assert _judged("Keep")["verdict"] == "pass"  # the next case is not contaminated


def test_the_global_state_guard_names_and_restores_every_setting() -> None:
    import torch

    from harness.util import globalstate

    before = globalstate.snapshot()
    with pytest.raises(globalstate.GlobalStateChanged) as caught:
        with globalstate.guarded("when built"):
            torch.set_num_threads(torch.get_num_threads() + 1)
            torch.set_grad_enabled(False)
            torch.set_float32_matmul_precision("medium")
            torch.rand(1)
    message = str(caught.value)
    for part in (
        "the backend changed intra-op threads from",
        "the backend changed grad mode from True to False when built",
        "the backend changed float32 matmul precision from highest to medium when built",
        "the backend changed the CPU random number generator's state when built",
    ):
        assert part in message, message
    assert globalstate.changes(before, globalstate.snapshot()) == []
    with globalstate.guarded("during the offload run", rng=False):
        torch.rand(1)  # a run draws random numbers itself: no change


@pytest.mark.heavy
def test_a_dead_workers_verdict_names_its_signal_and_last_position(backends: Path) -> None:
    done = _run(backends, *TWO_STEPS, "--backend", "offloaders:Segfault", "--report-dir", "r")
    assert done.returncode == 1, done.stdout + done.stderr
    (case,) = _summary(backends / "r")["cases"]
    assert case["problems"] == [
        "error: worker process died twice while running the case: killed by signal SIGSEGV; "
        f"last position reported: case {CASE_2X2}, step 0, microbatch 1, phase forward "
        "(begin_microbatch)"
    ]


def test_pytest_report_that_cannot_be_written_is_one_line_not_an_internal_error(
    pytester: pytest.Pytester,
) -> None:
    """The session's report folder is replaced by a file mid-session: the terminal summary
    says so in one line, no INTERNALERROR, and the exit status says the report is incomplete."""
    pytester.makepyfile(
        test_inner="""
import shutil
from harness.plugin.report import report_folder

def test_ok(pytestconfig):
    folder = report_folder(pytestconfig)
    shutil.rmtree(folder)
    folder.write_text("a file is in the way")
"""
    )
    plugins = ("-p", "harness.plugin", *CHILD_OPTIONS)  # as child sessions start (no Hypothesis)
    result = pytester.runpytest(*plugins, "--device", "cpu", "--report-dir", "r")
    lines = [*result.outlines, *result.errlines]
    assert not any("INTERNALERROR" in line for line in lines), lines
    incomplete = [line for line in lines if "report incomplete" in line]
    assert len(incomplete) == 1 and "cannot write" in incomplete[0], lines
    assert result.ret == 6
    result.assert_outcomes(passed=1)


SLEEPER = """
import pathlib, time

def test_sleeps():
    pathlib.Path("started").write_text("")
    time.sleep(120)
"""


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)], ids=["SIGTERM", "SIGHUP"]
)
def test_a_stop_signal_ends_a_pytest_session_with_a_report(
    backends: Path, signum: int, code: int
) -> None:
    """Under pytest (the plugin) SIGTERM and SIGHUP end the session as Ctrl-C does: a summary
    marked ``terminated``, the conventional exit code, within 3 s, no INTERNALERROR."""
    (backends / "test_sleeper.py").write_text(SLEEPER)
    argv = pytest_command("-p", "harness.plugin", "test_sleeper.py", "--device", "cpu")
    command = [*argv, "--report-dir", "r", "-p", "no:xdist"]
    process = warm.start(command, cwd=backends, merge_stderr=True)
    deadline = time.monotonic() + 120
    while not (backends / "started").exists() and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.05)
    began = time.perf_counter()
    process.send_signal(signum)
    out, _ = process.communicate(timeout=60)
    seconds = time.perf_counter() - began
    assert process.returncode == code, out
    assert seconds < 3, seconds
    assert "INTERNALERROR" not in out
    assert _summary(backends / "r")["status"] == "terminated"


STRAY = """
import threading

def test_leaves_a_thread():
    threading.Thread(target=threading.Event().wait, name="prefetch", daemon=False).start()
"""


def _child_pytest(
    folder: Path, args: list[str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``pytest -p harness.plugin <args> --device cpu`` in ``folder``, in one process (no xdist,
    no report folder), on this worker's share of the cores (forked warm: ``warm.run``)."""
    argv = pytest_command("-p", "harness.plugin", *args, "--device", "cpu")
    return warm.run([*argv, "--report-dir", "", "-p", "no:xdist"], cwd=folder, timeout=timeout)


@pytest.mark.heavy
def test_a_pytest_session_ends_past_a_thread_nobody_joins(backends: Path) -> None:
    """A session whose in-process case leaves a non-daemon thread running still ends, with its
    own exit status, naming the thread."""
    (backends / "test_stray.py").write_text(STRAY)
    done = _child_pytest(backends, ["test_stray.py"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not waiting for thread(s) 'prefetch'" in done.stderr


@pytest.mark.heavy
def test_under_pytest_an_offloader_error_fails_one_test_naming_where(backends: Path) -> None:
    """The pytest path of the same judge: the first case test that reads the failed run fails
    with the exception and where it was raised; the case's other tests skip, pointing to it."""
    root = HERE.parents[1] / "cases"
    tests = [
        f"{root}/test_equivalence.py::test_loss_equivalence[{CASE}]",
        f"{root}/test_equivalence.py::test_no_leaks[{CASE}]",
        f"{root}/test_transfers.py::test_transfer_counts[{CASE}]",
        f"{root}/test_transfers.py::test_no_weight_offloaded[{CASE}]",
    ]
    done = _child_pytest(backends, [*tests, "-rs", "--backend", "offloaders:BoomUnpack"])
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 3 skipped" in out, out
    assert f"at {WHERE['BoomUnpack']}" in out, out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED [3]")]
    assert len(skipped) == 1, out
    assert skipped[0].endswith("the case's runs raised: see the equivalence check"), out


@pytest.mark.heavy
def test_under_pytest_kept_references_pass_the_zero3_transfer_tests(backends: Path) -> None:
    root = HERE.parents[1] / "cases"
    tests = [f"{root}/test_transfers.py::test_transfer_counts[{name}]" for name in ZERO3]
    done = _child_pytest(backends, [*tests, "--backend", "offloaders:Keep"])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "2 passed" in out, out


def test_a_backend_that_changes_global_state_while_it_runs_is_named() -> None:
    import torch

    threads = torch.get_num_threads()
    record = _judged("Threads")
    assert record["problems"] == [
        f"equivalence: the backend changed intra-op threads from {threads} to {threads + 1} "
        "during the offload run"
    ]
    assert torch.get_num_threads() == threads
