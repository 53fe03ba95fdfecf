"""What a case left running in its worker once it was judged: threads, child processes, CUDA
work still queued. They end with the worker (``harness.run.parallel.kill_pool``), so the run ends
whatever a backend left behind; the case's record names them in one line (``notes``)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

GRACE_S = 0.5
"""How long a thread or process the case started may take to end by itself before it counts."""


@dataclass(frozen=True, kw_only=True)
class Running:
    """The threads and child processes of this process at one moment."""

    threads: frozenset[int]
    children: frozenset[int]

    @classmethod
    def now(cls) -> Running:
        idents = frozenset(t.ident for t in threading.enumerate() if t.ident is not None)
        return cls(threads=idents, children=frozenset(_children()))


def left_running(before: Running) -> str | None:
    """One line naming what runs now that did not at ``before`` (None: nothing)."""
    deadline = time.monotonic() + GRACE_S
    threads = [t for t in threading.enumerate() if t.ident not in before.threads]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    found = [
        f"thread {t.name!r} ({'daemon' if t.daemon else 'non-daemon'})"
        for t in threads
        if t.is_alive()
    ]
    while time.monotonic() < deadline and set(_children()) - before.children:
        time.sleep(0.05)
    found += [f"process {pid} ({_comm(pid)})" for pid in sorted(set(_children()) - before.children)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if not torch.cuda.current_stream().query():
            found.append("CUDA work queued on the current stream")
    if not found:
        return None
    return f"left running after the case: {', '.join(found)} (ended with its worker)"


def _children() -> list[int]:
    """This process's child processes (Linux ``/proc``; none elsewhere)."""
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "ended"


def stray_threads(grace: float = GRACE_S) -> list[threading.Thread]:
    """The non-daemon threads besides the main one still running after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    stray = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    for thread in stray:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in stray if t.is_alive()]


def exit_past_stray_threads(code: Callable[[], int], who: str) -> None:
    """At interpreter exit, before it joins the non-daemon threads (forever, if one never
    ends: a backend's prefetch thread nobody joins), name the ones still running on stderr and
    exit at once with ``code()`` (a pytest session's in-process cases)."""

    def leave() -> None:
        alive = [repr(t.name) for t in stray_threads()]
        if not alive:
            return
        print(
            f"{who}: note: not waiting for thread(s) {', '.join(alive)} left running in this "
            "process (by the backend)",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code())

    threading._register_atexit(leave)  # type: ignore[attr-defined]
