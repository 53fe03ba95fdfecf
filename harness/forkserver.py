"""The worker pool's forkserver (``harness.parallel``), startable before torch is imported.

Standard library only: ``offload-harness run`` starts the forkserver first thing
(``harness.entry``), so its imports of torch and the harness run while the CLI imports its
own, and the run's workers fork from a ready server. What a worker inherits from the parent
(environment, directory, import path) travels with each pool, not with the server, so an early
server is the same as a late one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

PRELOAD = ("torch", "harness.session", "harness.tools.mutation_score", "torch.distributed.fsdp")
"""What the forkserver imports before it forks any worker: what every case needs, and FSDP2
(1.3 s to import on the 2-core CPU machine, needed by the ZeRO-3 rows)."""


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its preload set (a no-op once the server runs)."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(list(PRELOAD))
    return forkserver


def start() -> None:
    """Start the forkserver now (it imports ``PRELOAD`` in its own process, in parallel)."""
    context()
    multiprocessing.forkserver.ensure_running()
