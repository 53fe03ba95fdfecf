"""The ``offload-harness`` console script and ``python -m harness``: for ``run``, the worker
pool's forkserver starts before the CLI imports torch (``harness.run.forkserver``); then the CLI;
last, whatever happened, the forkserver (if one was started) is killed, and a thread left
running in this process (a backend's, started when its probe built it) is named and not
waited for: the command ends when its work does."""

from __future__ import annotations

import os
import sys


def main() -> int:
    from harness.run import forkserver

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
    """Exit now with ``code`` when a non-daemon thread outlives ``leftovers.GRACE_S``: the
    interpreter would join it at exit, forever if it never ends."""
    from harness.util import leftovers

    alive = [repr(t.name) for t in leftovers.stray_threads()]
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
