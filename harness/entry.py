"""The ``offload-harness`` console script and ``python -m harness``: for ``run``, the worker
pool's forkserver starts before the CLI imports torch (``harness.forkserver``); then the CLI;
last, whatever happened, the forkserver (if one was started) is killed."""

from __future__ import annotations

import sys


def main() -> int:
    from harness import forkserver

    try:
        if sys.argv[1:2] == ["run"]:
            forkserver.start()
        from harness.cli import main as cli_main

        return cli_main()
    finally:
        forkserver.stop()
