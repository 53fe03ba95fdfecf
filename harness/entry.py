"""The ``offload-harness`` console script and ``python -m harness``: for ``run``, the worker
pool's forkserver starts before the CLI imports torch (``harness.forkserver``); then the CLI."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:2] == ["run"]:
        from harness import forkserver

        forkserver.start()
    from harness.cli import main as cli_main

    return cli_main()
