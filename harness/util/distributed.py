"""Process-group helpers that are no-ops in a single process.

Everything here works with or without a default process group: without one the world is a
single rank, ``broadcast_object`` is the identity and ``all_gather_object`` wraps its argument
in a list. Case verdicts go through ``collective_problems`` so that every rank raises the same
assertion (one failing rank must never leave the others waiting in the next collective).

``ensure_process_group`` starts a single-rank group on a ``HashStore`` (no port, no file) for
runs that need one in a plain process - FSDP2 needs a group even at world size 1. Groups started
here are destroyed by ``shutdown`` (called at the end of a pytest session, and at exit).
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

_started_here: list[bool] = []  # a group this module started (destroyed by ``shutdown``)


def initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if initialized() else 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a group)."""
    if world_size() > 1:
        dist.barrier()


_CLIENTS: dict[str, dist.Store] = {}


def _store(client: str = "main") -> dist.Store:
    """The harness's own store client ``client`` (keys under ``offload-harness/``): a client of
    torchrun's TCP store per thread that uses it, so a watchdog thread can read while the main
    thread blocks in a wait on its own client; the default group's store when torchrun's
    address is not in the environment."""
    if client not in _CLIENTS:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port:
            base: dist.Store = dist.TCPStore(
                host, int(port), is_master=False, timeout=DEFAULT_TIMEOUT, wait_for_workers=False
            )
        else:
            base = dist.distributed_c10d._get_default_store()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _CLIENTS[client] = dist.PrefixStore(f"offload-harness/attempt-{attempt}", base)
    return _CLIENTS[client]


def mark_arrived(tag: str, value: str = "1") -> None:
    """Note in the process group's store that this rank reached ``tag`` (e.g. the barrier
    after a test), with ``value`` for the others to read (``gather_arrivals``), so a rank that
    waits there can later name the ones that never came."""
    if world_size() > 1:
        _store().set(f"arrived/{tag}/{rank()}", value)


def missing_ranks(tag: str, client: str = "watch") -> list[int]:
    """The ranks that have not marked ``tag`` (``mark_arrived``), read through store client
    ``client``; [] without a group or when the store cannot be read (it lives on torchrun's
    agent: a dead job takes it along)."""
    if world_size() == 1:
        return []
    try:
        store = _store(client)
        return [r for r in range(world_size()) if not store.check([f"arrived/{tag}/{r}"])]
    except Exception:
        return []


def gather_arrivals(tag: str, timeout: datetime.timedelta) -> list[str]:
    """Every rank's ``mark_arrived`` value under ``tag``, waiting up to ``timeout`` for the
    missing ones. A store rendezvous, not a collective: a rank stuck in a collective elsewhere
    is not matched against it. Raises ``RuntimeError`` (``DistStoreError``) past the timeout."""
    if world_size() == 1:
        return []
    store = _store()
    keys = [f"arrived/{tag}/{r}" for r in range(world_size())]
    store.wait(keys, timeout)
    return [store.get(key).decode("utf-8", "replace") for key in keys]


def broadcast_object(obj: T, src: int = 0) -> T:
    """``src``'s ``obj`` on every rank (picklable objects; identity without a group)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` in rank order (``[obj]`` without a group)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def collective_problems(problems: list[str]) -> list[str]:
    """Every rank's problems combined, the same list on every rank.

    At world size > 1 each line is prefixed ``rank R: `` (a multi-line problem keeps its
    continuation lines under the same prefix); at world size 1 the list is returned unchanged.
    Assert on the result (``assert not combined, "\\n".join(combined)``) so every rank raises
    the same message, naming each failing rank and its first divergence.
    """
    if world_size() == 1:
        return list(problems)
    gathered = all_gather_object([str(p) for p in problems])
    return [
        "\n".join(f"rank {r}: {line}" for line in problem.splitlines() or [""])
        for r, rank_problems in enumerate(gathered)
        for problem in rank_problems
    ]


def collectives_released() -> None:
    """Return once the process group has let go of the tensors of its finished collectives.

    ProcessGroupNCCL keeps each collective's tensors alive (its allocator safety, in place of
    ``record_stream``) until the work is waited on or its watchdog thread drops it, up to a
    tenth of a second after it completed; a memory reading must not count them, nor see them
    freed halfway through its runs. Call it after the device is synchronised (a finished device
    finishes every collective, so this only waits for the watchdog); no group, or gloo, returns
    at once. On the H200 it did not, on its own, clear the earlier blocks ZeRO-3 memory readings
    found freed during their runs (``docs/multi-rank.md``)."""
    if initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._get_default_group()._wait_for_pending_works()


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(device: torch.device, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> bool:
    """Start the default group from torchrun's environment (``env://``) when ``WORLD_SIZE`` > 1
    and no group exists yet; returns whether it started one."""
    if initialized() or env_int("WORLD_SIZE", 1) <= 1:
        return False
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds NCCL to this rank's GPU (eager init)
    dist.init_process_group(backend=backend_for(device), timeout=timeout, **kwargs)
    _mark_started()
    return True


def ensure_process_group(
    device: torch.device, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> None:
    """A default group for ``device``'s backend: the existing one, or a single-rank group on an
    in-memory ``HashStore`` (no port, no file) when this process is not under torchrun."""
    if initialized():
        return
    if env_int("WORLD_SIZE", 1) > 1:
        raise RuntimeError(
            "WORLD_SIZE > 1 but no process group is initialised; start it with "
            "harness.util.distributed.init_from_env first"
        )
    dist.init_process_group(
        backend=backend_for(device), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
    )
    _mark_started()


def _mark_started() -> None:
    if not _started_here:
        atexit.register(shutdown)
    _started_here[:] = [True]


def shutdown() -> None:
    """Destroy the default group if this module started it."""
    if _started_here and _started_here[0] and initialized():
        dist.destroy_process_group()
    _started_here[:] = [False]


def env_int(name: str, default: int) -> int:
    """An integer environment variable (``default`` when unset); a one-line error otherwise."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an int") from None
