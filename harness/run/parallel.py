"""The one worker pool of the CLI and the tools: worker processes, each with its share of the
cores and, on CUDA, the run's device as its current one.

Workers are forked from a forkserver (``multiprocessing``'s, ``harness.run.forkserver``): a fresh
process that imported torch, the harness and FSDP2 once and never touches CUDA, so every worker
starts with them imported - about 2.5 s of CPU each on the 2-core CPU machine - and pools of
later passes (``mutation-score --repeat-correct``) start at once. Never forked from the parent:
a child forked from a process that initialised CUDA cannot use it. Each worker takes the
parent's environment variables, current directory, import path and CPU affinity as they are
when its pool is made (``use_share``), as a spawned one would, whenever the forkserver started;
its intra-op threads are its share of the cores that affinity allows.
On CUDA several workers share the GPU, each with its own context; every check reads only its
own process's state (allocator statistics, profiler, sync guard), so cases do not disturb each
other, only their timing.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from harness.run import forkserver, lifeline
from harness.run.settings import usable_cores
from harness.util import sanitizer


def threads_per_worker(jobs: int) -> int:
    """Intra-op threads of one of ``jobs`` workers: more would spin against the others'."""
    return max(1, usable_cores() // jobs)


@dataclass(frozen=True)
class Inherited:
    """What a worker takes from the parent when its pool is made."""

    environ: dict[str, str]
    cwd: str
    path: list[str]
    cores: frozenset[int] | None = None
    """The parent's CPU affinity (None where the platform has none): a server started before
    the parent was confined (``taskset``, a test's share) would fork workers with its own."""
    owner: int | None = None
    """The pool's owner (the run's main process): the worker dies with it (``lifeline``)."""

    @classmethod
    def now(cls) -> Inherited:
        cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(dict(os.environ), os.getcwd(), list(sys.path), cores, os.getpid())

    def adopt(self) -> None:
        """Make this process's environment, directory, import path and CPU affinity the
        parent's; enable the CUDA stream sanitizer if it is on (torch enables it from the
        variable only at import, which in a forked worker was before)."""
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        if self.cores is not None:
            # a mask this process may not take (a cpuset changed since) leaves its own
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.cores)
        if self.environ.get("TORCH_CUDA_SANITIZER") == "1":
            sanitizer.enable()


def use_share(
    jobs: int, device: torch.device | None = None, inherited: Inherited | None = None
) -> None:
    """Make this process one of ``jobs`` workers (the parent's environment; threads; the CUDA
    device as current one). A worker ignores SIGINT, SIGTERM and SIGHUP: Ctrl-C (or a
    terminal's hangup, a runner's stop) reaches the whole process group, and the parent, not
    each worker, decides to stop (``kill_pool``) - a worker that took it would go on to its next
    queued call, or die as a crash the parent would retry. It dies with its forkserver and with
    the pool's owner, however they end (``harness.run.lifeline``). What a worker holds before
    its first call is kept out of the garbage collector's walks (``freeze_imported``)."""
    if inherited is not None:
        inherited.adopt()
    if multiprocessing.parent_process() is not None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        lifeline.die_with_parent(os.getppid())
        if inherited is not None and inherited.owner is not None:
            lifeline.die_with(inherited.owner)
        freeze_imported()
    torch.set_num_threads(threads_per_worker(jobs))
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def freeze_imported() -> None:
    """Collect, then move every object left (torch, TorchDynamo, FSDP2 and the harness as
    imported: about 290,000 objects in a worker) into the collector's permanent generation,
    which no collection walks. Every observed step ends with a full collection
    (``harness.measure.observe.held``: a host storage kept only by a reference cycle is not
    held); walking the imports made each one 0.13 s of CPU on the 2-core CPU machine, eight per
    case, two thirds of a case's CPU time. What a case makes comes after the freeze and is
    collected as before; only what existed before the first case (modules, classes, functions)
    is never freed."""
    gc.collect()
    gc.freeze()


def worker_pool(jobs: int, device: torch.device | None = None) -> ProcessPoolExecutor:
    """``jobs`` workers forked from the forkserver, each initialised by ``use_share`` with
    what it inherits now."""
    return ProcessPoolExecutor(
        jobs,
        mp_context=forkserver.context(),
        initializer=use_share,
        initargs=(jobs, device, Inherited.now()),
    )


def kill_pool(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now: queued calls cancelled, every worker killed (SIGKILL), no waiting for
    running calls. Also how a pool ends once every call has reported: a worker that a call
    left a non-daemon thread in would never exit by itself (its interpreter joins the thread),
    and ``shutdown(wait=True)`` would wait for it forever."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        if process.is_alive():
            process.kill()
    for process in workers:
        process.join(timeout=5)


def run_all(
    fn: Callable[..., Any],
    calls: Sequence[tuple[Any, ...]],
    *,
    jobs: int,
    device: torch.device | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(index, fn(*calls[index]))`` as each call ends: in this process when ``jobs`` is 1
    (in order), else in a ``worker_pool`` (in completion order)."""
    if jobs == 1:
        for index, call in enumerate(calls):
            yield index, fn(*call)
        return
    pool = worker_pool(jobs, device)
    futures: dict[Future[Any], int] = {
        pool.submit(fn, *call): index for index, call in enumerate(calls)
    }
    try:
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:  # the workers have reported: whatever a call left running in one ends with it
        kill_pool(pool)


def run_ordered(
    fn: Callable[..., Any],
    calls: Sequence[tuple[Any, ...]],
    *,
    jobs: int,
    device: torch.device | None = None,
) -> list[Any]:
    """``[fn(*call) for call in calls]`` through ``run_all``."""
    results: list[Any] = [None] * len(calls)
    for index, result in run_all(fn, calls, jobs=jobs, device=device):
        results[index] = result
    return results
