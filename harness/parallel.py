"""The one worker pool of the CLI and the tools: spawned processes, each with its share of the
cores and, on CUDA, the run's device as its current one.

Never forked: a forked child cannot use CUDA, and the parent only names the device. On CUDA
several workers share the GPU, each with its own context; every check reads only its own
process's state (allocator statistics, profiler, sync guard), so cases do not disturb each
other, only their timing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import Any

import torch


def threads_per_worker(jobs: int) -> int:
    """Intra-op threads of one of ``jobs`` workers: more would spin against the others'."""
    return max(1, (os.cpu_count() or 1) // jobs)


def use_share(jobs: int, device: torch.device | None = None) -> None:
    """Make this process one of ``jobs`` workers (threads; the CUDA device as current one).
    A worker ignores SIGINT: Ctrl-C reaches the whole process group, and the parent, not each
    worker, decides to stop (``kill_pool``) - a worker that took it would go on to its next
    queued call."""
    if multiprocessing.parent_process() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads_per_worker(jobs))
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def worker_pool(jobs: int, device: torch.device | None = None) -> ProcessPoolExecutor:
    """``jobs`` spawned workers, each initialised by ``use_share``."""
    return ProcessPoolExecutor(
        jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=use_share,
        initargs=(jobs, device),
    )


def kill_pool(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now: queued calls cancelled, every worker killed (SIGKILL), no waiting for
    running calls."""
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
    with worker_pool(jobs, device) as pool:
        futures: dict[Future[Any], int] = {
            pool.submit(fn, *call): index for index, call in enumerate(calls)
        }
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        except KeyboardInterrupt:
            kill_pool(pool)
            raise
        finally:
            for future in futures:
                future.cancel()


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
