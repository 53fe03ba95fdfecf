"""Gloo ranks forked from the harness's forkserver for the pipeline tests, bounded in time.

``run_ranks`` starts ``nprocs`` processes of ``target(rank, *args)`` and waits for them to end:
past ``deadline_s`` the test fails naming ``what``; however the wait ends, every rank still alive
is killed, so no process outlives the test. ``join_errors``: a rank that raised fails the test
with its traceback at once (torch's ``ProcessContext.join``); without it a rank may end any way
(the failure tests read what each rank wrote instead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp

from harness.run import forkserver


def run_ranks(
    target: Callable[..., None],
    args: tuple[Any, ...],
    nprocs: int,
    deadline_s: float,
    what: str,
    *,
    join_errors: bool = True,
) -> float:
    """Run the ranks to their end (module docstring); the seconds it took."""
    start = time.monotonic()
    forkserver.context()  # its preload (torch, TorchDynamo) unless a server runs already
    context = mp.start_processes(
        target, args=args, nprocs=nprocs, join=False, start_method="forkserver"
    )
    try:
        while True:
            if join_errors:
                if context.join(timeout=1.0):
                    break
            elif not any(p.is_alive() for p in context.processes):
                break
            else:
                time.sleep(0.2)
            if time.monotonic() - start > deadline_s:
                pytest.fail(f"{what} ran past {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return time.monotonic() - start
