"""Warm child processes for the harness's own end-to-end tests.

An end-to-end test runs a user's command - ``python -m pytest ...``, ``python -m harness run
...`` - in a process of its own, for its exit code, its output and its signals. Started fresh,
each such process imports torch, TorchDynamo and the harness again: 3-5 s of the 2-core CPU
machine, most of what a small end-to-end test costs. ``run`` and ``start`` fork it instead from
multiprocessing's forkserver (the one ``harness.run.forkserver`` configures: a process that imported
torch, TorchDynamo, FSDP2 and the harness, and here pytest too, and never computed anything), and
the child then does what the interpreter does with the same command line: ``-m module`` through
``runpy`` as ``__main__``, the working directory and ``PYTHONPATH`` first on ``sys.path``, the
environment as given, standard output and error into files the test reads, its exit status as
the process's. A worker pool the child makes (``offload-harness run``'s) forks from the same
server instead of starting a second one.

What a fork cannot show keeps a fresh interpreter: a command that is not ``python -m ...``, and
an environment that changes a variable read while the interpreter or torch start (``_STARTUP``,
``ATEN_CPU_CAPABILITY`` for one) - ``run`` and ``start`` hand those to ``subprocess`` as they are.

Either way the child runs on this test process's share of the cores (``share``: under pytest-xdist,
worker i of n takes every n-th core from the i-th), as its CPU affinity, with as many intra-op
threads: the harness sizes its workers and threads by the affinity (``settings.usable_cores``), so
n workers' children do not each spin one thread per core of the machine against the others' (on
the 16-core H200 box under 6 workers a tiny case took 52 s that way, and a 5 s case timeout ran
out before the case reached what it tested).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

import pytest

from harness.run import forkserver

PRELOAD = (*forkserver.PRELOAD, "harness.entry", "harness.cli", "pytest", "xdist")
"""The harness's own preload, and the entry points the tests' commands run."""

_STARTUP = re.compile(r"(PYTHON|ATEN_|OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|LD_|CUDA_|NVTE_|TORCH_)")
"""Variables read while the interpreter or torch start (a forked child has started already)."""

_APPLIED = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
"""Startup variables a forked child applies itself."""

COLD_VARIABLE = "OFFLOAD_HARNESS_TESTS_COLD"
"""Set to 1, every command starts in a fresh interpreter (to tell a fork's effect from the
command's own when a test fails)."""

_AFFINITY = hasattr(os, "sched_setaffinity")
"""Whether this platform sets a process's CPU affinity (Linux does)."""

_NEEDS_FRESH = 223
"""The exit status of a child whose environment needs a fresh interpreter (nothing ran)."""


class WarmProcess:
    """A started command, the parts of ``subprocess.Popen`` the tests use. Its standard output
    and error are files, read as they grow (``readline``) or whole (``communicate``)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, folder: Path) -> None:
        self._process = process
        self._folder = folder
        self._out = (folder / "stdout").open(errors="replace")

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["<warm child>"], timeout or 0)
        return self._process.exitcode

    def readline(self, timeout: float) -> str:
        """The next whole line of standard output; '' once the process ended without one, or
        ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        pending = ""
        while True:
            pending += self._out.readline()
            if pending.endswith("\n"):
                return pending
            if self._process.exitcode is not None or time.monotonic() > deadline:
                return pending + self._out.read()
            time.sleep(0.02)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end; what standard output holds after what was read, and standard
        error (empty when it went to standard output)."""
        self.wait(timeout)
        try:
            rest = self._out.read()
            errors = self._folder / "stderr"
            return rest, errors.read_text(errors="replace") if errors.exists() else ""
        finally:
            self._out.close()
            shutil.rmtree(self._folder, ignore_errors=True)


def start(
    command: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = False,
    interruptible: bool = False,
) -> WarmProcess | subprocess.Popen[str]:
    """``command`` started as ``subprocess.Popen(command, cwd=cwd, env=env, text=True)`` with
    piped output would start it: forked warm where it can be, else exactly so. Its SIGINT is
    ignored where this process ignores it (a shell's background job), as a fresh interpreter's
    would be, unless ``interruptible``: then at its default, as a terminal starts a command."""
    environ = dict(os.environ if env is None else env)
    cores = share()
    interruptible = interruptible or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    module_args = _module_command(command)
    if module_args is not None and environ.get(COLD_VARIABLE) != "1":
        warm = _fork(command, module_args, cwd, environ, merge_stderr, cores, interruptible)
        if warm is None and _startup(environ) == _startup(os.environ):
            # The server started under another environment (a test had set a startup
            # variable then): start one under this process's, as the command's is.
            forkserver.stop()
            warm = _fork(command, module_args, cwd, environ, merge_stderr, cores, interruptible)
        if warm is not None:
            return warm
    return subprocess.Popen(
        list(command),
        cwd=cwd,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        preexec_fn=confine if not interruptible else confine_interruptible,
    )


def share() -> set[int]:
    """The cores this test process's children run on: under pytest-xdist worker i of n, every
    n-th of this process's cores from the i-th (the i-th modulo the cores where there are fewer
    than n); else all of them (every core where the platform has no affinity)."""
    if not _AFFINITY:
        return set(range(os.cpu_count() or 1))
    cores = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return set(cores)
    index = int(worker.removeprefix("gw"))
    if len(cores) < count:
        return {cores[index % len(cores)]}
    return set(cores[index::count])


def confine() -> None:
    """``preexec_fn`` of a fresh child: ``share``'s cores as its CPU affinity (torch then starts
    with as many intra-op threads)."""
    if _AFFINITY:
        os.sched_setaffinity(0, share())


def confine_interruptible() -> None:
    """``confine``, with SIGINT at its default as a terminal starts a command (a preexec_fn)."""
    confine()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _fork(
    command: Sequence[str],
    module_args: list[str],
    cwd: str | Path,
    environ: dict[str, str],
    merge_stderr: bool,
    cores: set[int],
    interruptible: bool,
) -> WarmProcess | None:
    """The command forked from the server; None when it needs a fresh interpreter."""
    folder = Path(tempfile.mkdtemp(prefix="warm-"))
    process = _context().Process(
        target=_child,
        args=(module_args, str(cwd), environ, _base_path(), str(folder), merge_stderr, cores),
        kwargs={"interruptible": interruptible},
    )
    process.start()
    # The child decides within milliseconds whether it may run here (its inherited
    # environment against this one) and says so with a file; then it is this command's.
    while process.exitcode is None and not (folder / "started").exists():
        time.sleep(0.005)
    if (folder / "started").exists():
        return WarmProcess(process, folder)
    shutil.rmtree(folder, ignore_errors=True)
    if process.exitcode != _NEEDS_FRESH:
        raise RuntimeError(f"a warm child of {command} ended before it started: {process}")
    return None


def _startup(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that act while an interpreter or torch start."""
    return {k: v for k, v in environ.items() if _STARTUP.match(k) and k not in _APPLIED}


def run(
    command: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked warm where it can be."""
    process = start(command, cwd=cwd, env=env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise subprocess.TimeoutExpired(list(command), timeout) from None
    assert process.returncode is not None
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def _module_command(command: Sequence[str]) -> list[str] | None:
    """``[module, *args]`` of ``python -m module args`` in this interpreter; None otherwise."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return list(command[2:])
    return None


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context with the warm preload; the harness's own when its pool started
    the server first (then the children import pytest themselves, a fraction of a second)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


@cache
def _base_path() -> tuple[str, ...]:
    """``sys.path`` of a fresh interpreter after its first entry, without ``PYTHONPATH``."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import json, sys; print(json.dumps(sys.path[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return tuple(json.loads(done.stdout))


def _child(
    module_args: list[str],
    cwd: str,
    environ: dict[str, str],
    base_path: tuple[str, ...],
    folder: str,
    merge_stderr: bool,
    cores: set[int],
    *,
    interruptible: bool,
) -> None:
    """In the forked child: become ``python -m module args`` in ``cwd`` with ``environ``, on
    ``cores`` with as many intra-op threads (what a fresh interpreter's torch would start with
    under that affinity; the server's torch counted every core), raising KeyboardInterrupt on
    SIGINT if ``interruptible``, else ignoring it (the server's own setting is what the
    interpreter that started it inherited, not this command's)."""
    out = os.open(os.path.join(folder, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = out if merge_stderr else os.open(os.path.join(folder, "stderr"), os.O_WRONLY | os.O_CREAT)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace", buffering=1)
    if _startup(os.environ) != _startup(environ):
        os._exit(_NEEDS_FRESH)
    Path(folder, "started").touch()
    signal.signal(signal.SIGINT, signal.default_int_handler if interruptible else signal.SIG_IGN)
    import torch  # the server's preload: imported already

    if _AFFINITY:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *base_path]
    sys.dont_write_bytecode = bool(environ.get("PYTHONDONTWRITEBYTECODE"))
    _pool_from_this_server()
    _quiet_about_preloaded_plugins()
    module, *args = module_args
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        # as an interpreter ends on an uncaught Ctrl-C: killed by SIGINT
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        atexit._run_exitfuncs()
        _flush()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _pool_from_this_server() -> None:
    """Let a worker pool this child makes fork from the server this child came from: a child
    of the forkserver knows its address and holds its keep-alive pipe, but not its pid, and
    would otherwise start a second server (one more import of torch). Where multiprocessing's
    internals differ from these, the child starts its own, as a fresh process would."""
    server = multiprocessing.forkserver._forkserver
    if (
        getattr(server, "_forkserver_address", None) is not None
        and getattr(server, "_forkserver_alive_fd", None) is not None
        and getattr(server, "_forkserver_pid", 0) is None
    ):
        server.ensure_running = multiprocessing.resource_tracker.ensure_running
        # ``multiprocessing.forkserver.ensure_running`` is the same method bound at import, and
        # what ``harness.run.forkserver.start`` (``python -m harness run``'s first step) calls:
        # left alone, every warm run started a server of its own (3 s of importing torch again).
        multiprocessing.forkserver.ensure_running = server.ensure_running


def _quiet_about_preloaded_plugins() -> None:
    """pytest warns that it cannot rewrite the asserts of a plugin package imported before it
    started (``harness``, ``xdist``: the server imported them); a fresh interpreter would have
    rewritten them, so the warning is about this child's start alone and stays out of the
    output the test reads."""
    with contextlib.suppress(ImportError, AttributeError):
        from _pytest.assertion.rewrite import AssertionRewritingHook

        AssertionRewritingHook._warn_already_imported = lambda self, name: None


def runpytest(pytester: pytest.Pytester, *args: str, timeout: float) -> pytest.RunResult:
    """``pytester.runpytest_subprocess(*args, timeout=timeout)``, forked warm: the same command
    line (``--basetemp`` in the pytester folder), folder and ``PYTHONPATH``."""
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    command = [sys.executable, "-m", "pytest", f"--basetemp={basetemp}", *args]
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), environ.get("PYTHONPATH")]))
    began = time.monotonic()
    done = run(command, cwd=pytester.path, env=environ, timeout=timeout)
    return pytest.RunResult(
        done.returncode,
        done.stdout.splitlines(),
        done.stderr.splitlines(),
        time.monotonic() - began,
    )
