"""The ``offload-harness`` console script and ``python -m harness``: for ``run``, the worker
pool's forkserver starts before the CLI imports torch (``harness.forkserver``); then the CLI;
last, whatever happened, the forkserver (if one was started) is killed, and a thread left
running in this process (a backend's, started when its probe built it) is named and not
waited for: the command ends when its work does."""

from __future__ import annotations

import os
import sys
import threading
import time

GRACE_S = 1.0
"""How long the threads left running at the end may take to end by themselves."""


def main() -> int:
    from harness import forkserver

    try:
        if sys.argv[1:2] == ["run"]:
            forkserver.start()
        from harness.cli import main as cli_main

        code = cli_main()
    finally:
        forkserver.stop()
    _leave_stray_threads(code)
    return code


def _leave_stray_threads(code: int) -> None:
    """Exit now with ``code`` when a non-daemon thread outlives ``GRACE_S``: the interpreter
    would join it at exit, forever if it never ends."""
    deadline = time.monotonic() + GRACE_S
    stray = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    for thread in stray:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [repr(t.name) for t in stray if t.is_alive()]
    if not alive:
        return
    print(
        f"offload-harness: note: not waiting for thread(s) {', '.join(alive)} left running "
        "in this process (by the backend)",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
