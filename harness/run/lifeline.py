"""No process of a run outlives it, however the run's main process ends (SIGKILL, the OOM
killer, a CI runner's hard stop included): nothing the run started would ever be told.

* The worker pool's forkserver is the main process's child: it asks the kernel for SIGKILL when
  its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, armed by ``harness.run.forkserver_guard`` as
  the server imports its preload).
* A worker is the forkserver's child, and the forkserver may outlive the run (a test's server
  that forks the run itself too), so a worker watches the pool's owner instead: a daemon thread
  blocks on a pidfd of the owner (Linux >= 5.3; elsewhere it polls every half second) and
  kills its own process when the owner is gone, whatever the worker is doing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (``parent``, the pid it expects) dies; at once when
    it already has (re-parented before the request was made). A no-op off Linux."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(owner: int) -> None:
    """SIGKILL this process as soon as process ``owner`` ends (a daemon thread waits for it)."""
    if owner == os.getpid():
        return
    threading.Thread(target=_watch, args=(owner,), name="lifeline", daemon=True).start()


def _watch(owner: int) -> None:
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):  # no pidfd here (or the owner is gone already)
        while _alive(owner):
            select.select([], [], [], 0.5)
    else:
        with contextlib.suppress(OSError):
            select.select([fd], [], [])  # readable once the owner has exited
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True
