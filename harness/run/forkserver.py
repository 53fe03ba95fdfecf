"""The worker pool's forkserver (``harness.run.parallel``), startable before torch is imported.

Standard library only: ``offload-harness run`` starts the forkserver first thing
(``harness.entry``), so its imports of torch and the harness run while the CLI imports its
own, and the run's workers fork from a ready server. What a worker inherits from the parent
(environment, directory, import path) travels with each pool, not with the server, so an early
server is the same as a late one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal

PRELOAD = (
    "harness.run.forkserver_guard",
    "torch",
    "torch._dynamo",
    "harness.run.session",
    "harness.tools.mutation_score",
    "torch.distributed.fsdp",
)
"""What the forkserver imports before it forks any worker: what every case needs; TorchDynamo,
which ``torch.optim`` imports at its first step (1.1 s on the 2-core CPU machine, 6.4 s on the
H200 box, whose torch has no bytecode cache); and FSDP2 (1.3 s on the CPU machine, needed by the
ZeRO-3 rows). None of them starts a thread, so forking after them is safe. The guard comes
first: the server dies with the process that started it, even one killed with SIGKILL."""

OWNER_VARIABLE = "OFFLOAD_HARNESS_FORKSERVER_OWNER"
"""The pid of the process that starts the forkserver, set by ``context``: the server's guard
(``harness.run.forkserver_guard``) arms itself only under that parent."""


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its preload set (a no-op once the server runs)."""
    os.environ[OWNER_VARIABLE] = str(os.getpid())
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(list(PRELOAD))
    return forkserver


def start() -> None:
    """Start the forkserver now (it imports ``PRELOAD`` in its own process, in parallel)."""
    context()
    multiprocessing.forkserver.ensure_running()


def stop() -> None:
    """Kill the forkserver if this process started one, and forget it. It holds the parent's
    standard output and error, and left to stop by itself it would finalise torch for over a
    second after the parent exited - a pipe reading the CLI's output (``| tee``, a test's
    ``communicate``) would wait for that. It keeps no state: a later pool starts a new one."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()  # reaps it and resets the bookkeeping
