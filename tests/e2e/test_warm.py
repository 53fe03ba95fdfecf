"""``tests/helpers/warm.py``: a forked child runs a ``python -m`` command as a fresh interpreter
would - exit status, separate output streams, working directory, environment, ``PYTHONPATH``,
Ctrl-C - and a command it cannot run that way gets a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import warm

PROBE = """
import os, sys, time
print("cwd", os.getcwd())
print("path0", sys.path[0])
print("torch-before", "torch" in sys.modules)
print("var", os.environ.get("WARM_PROBE_VAR"))
print("cores", sorted(os.sched_getaffinity(0)))
if "torch" in sys.modules:
    print("threads", sys.modules["torch"].get_num_threads())
print("to stderr", file=sys.stderr)
if os.environ.get("WARM_PROBE_WAIT"):
    try:  # before the line the test waits for: a Ctrl-C right after it is caught too
        print("waiting", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
sys.exit(int(os.environ.get("WARM_PROBE_EXIT", "0")))
"""


@pytest.fixture
def probe(tmp_path: Path) -> tuple[list[str], dict[str, str], Path]:
    """``python -m warm_probe`` importable through ``PYTHONPATH`` alone, run in a folder of
    its own."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "warm_probe.py").write_text(PROBE)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != warm.COLD_VARIABLE}
    env["PYTHONPATH"] = os.pathsep.join([str(modules), env.get("PYTHONPATH", "")])
    return [sys.executable, "-m", "warm_probe"], env, cwd


def _fields(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


def test_a_warm_child_runs_the_command_as_an_interpreter_would(probe) -> None:
    command, env, cwd = probe
    done = warm.run(
        command, cwd=cwd, env={**env, "WARM_PROBE_VAR": "x", "WARM_PROBE_EXIT": "3"}, timeout=120
    )
    fields = _fields(done.stdout)
    assert done.returncode == 3, done
    assert fields["torch-before"] == "True", "forked from the server that imported torch"
    assert fields["cwd"] == str(cwd) and fields["path0"] == str(cwd), fields
    assert fields["var"] == "x"
    assert done.stderr == "to stderr\n" and "to stderr" not in done.stdout
    without = warm.run(command, cwd=cwd, env=env, timeout=120)
    assert without.returncode == 0 and _fields(without.stdout)["var"] == "None"


def test_a_variable_read_at_startup_gets_a_fresh_interpreter(probe) -> None:
    command, env, cwd = probe
    fresh = warm.run(command, cwd=cwd, env={**env, "ATEN_CPU_CAPABILITY": "default"}, timeout=120)
    assert fresh.returncode == 0, fresh
    assert _fields(fresh.stdout)["torch-before"] == "False"
    cold = warm.run(command, cwd=cwd, env={**env, warm.COLD_VARIABLE: "1"}, timeout=120)
    assert _fields(cold.stdout)["torch-before"] == "False"


def test_a_child_runs_on_this_xdist_workers_share_of_the_cores(
    probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker gw1 of 2 gives its children every second core from the second (the one core
    there is on a 1-core machine), warm or fresh, and a warm child as many threads: the
    children of two workers do not spin against each other."""
    command, env, cwd = probe
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    cores = sorted(os.sched_getaffinity(0))
    expected = cores[1::2] if len(cores) >= 2 else cores
    assert sorted(warm.share()) == expected
    forked = _fields(warm.run(command, cwd=cwd, env=env, timeout=120).stdout)
    assert forked["torch-before"] == "True"
    assert (forked["cores"], forked["threads"]) == (str(expected), str(len(expected))), forked
    fresh = warm.run(command, cwd=cwd, env={**env, warm.COLD_VARIABLE: "1"}, timeout=120)
    assert _fields(fresh.stdout)["cores"] == str(expected)


def test_a_warm_child_takes_ctrl_c(probe) -> None:
    command, env, cwd = probe
    # as a terminal starts it, also where this session ignores SIGINT (a background job)
    process = warm.start(command, cwd=cwd, env={**env, "WARM_PROBE_WAIT": "1"}, interruptible=True)
    assert isinstance(process, warm.WarmProcess)
    # cwd, path0, torch-before, var, cores, threads, waiting
    seen = [process.readline(timeout=60) for _ in range(7)]
    assert seen[-1] == "waiting\n", seen
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in rest


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "fresh"])
@pytest.mark.parametrize("interruptible", [False, True], ids=["inherited", "interruptible"])
def test_a_child_of_a_session_that_ignores_ctrl_c(probe, cold: bool, interruptible: bool) -> None:
    """Started from a process that ignores SIGINT (a shell's background job), a command ignores
    it too, warm as fresh, as a fresh interpreter inherits it; ``interruptible`` starts it as a
    terminal would, taking Ctrl-C all the same."""
    command, env, cwd = probe
    env = {**env, "WARM_PROBE_WAIT": "1", **({warm.COLD_VARIABLE: "1"} if cold else {})}
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = warm.start(command, cwd=cwd, env=env, interruptible=interruptible)
    finally:
        signal.signal(signal.SIGINT, before)
    assert isinstance(process, warm.WarmProcess) != cold
    watchdog = threading.Timer(60, process.kill)  # a child that never says "waiting" ends the reads
    watchdog.start()
    try:
        seen = [process.stdout.readline() if cold else process.readline(timeout=60)]
        while seen[-1] not in ("waiting\n", ""):  # no "threads" line where torch is not in
            seen.append(process.stdout.readline() if cold else process.readline(timeout=60))
        watchdog.cancel()
        assert seen[-1] == "waiting\n", seen
        process.send_signal(signal.SIGINT)
        if interruptible:
            rest, _ = process.communicate(timeout=60)
            assert process.returncode == 130 and "interrupted" in rest
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                process.wait(timeout=1)
    finally:
        process.kill()
        process.wait(timeout=60)


def test_a_server_started_under_a_startup_variable_is_replaced(probe, monkeypatch) -> None:
    """A test that set a startup variable when the forkserver started (a pool of an in-process
    run under the sanitizer, say) leaves a server later commands cannot fork from: the next
    warm command starts another under this process's environment."""
    command, env, cwd = probe
    monkeypatch.setenv("TORCH_WARM_PROBE", "1")
    warm.forkserver.stop()
    # The server under the variable imports torch alone (what the probe reads): the test is
    # about which environment a server started under, not what it preloaded. The new server
    # that replaces it preloads everything, as any other (it serves the tests that follow).
    with monkeypatch.context() as light:
        light.setattr(warm, "PRELOAD", ("harness.run.forkserver_guard", "torch"))
        first = warm.run(command, cwd=cwd, env={**env, "TORCH_WARM_PROBE": "1"}, timeout=120)
    assert _fields(first.stdout)["torch-before"] == "True"
    monkeypatch.delenv("TORCH_WARM_PROBE")
    later = warm.run(command, cwd=cwd, env=env, timeout=120)
    assert _fields(later.stdout)["torch-before"] == "True", "forked from a new server"
