"""Copies made on any thread of the process reach the copy observer.

A ``TorchDispatchMode`` is thread-local: the copy observer (``harness.measure.copyobserver``)
entered on the thread that runs the step sees that thread's ops and those of autograd's worker
threads (the mode is part of the state autograd carries into them), but not the ops of a thread
the offloader runs itself - a thread pool doing the copy out and the copy back while the hook
waits. Such an offloader is correct, yet its copies would go unseen and the case would say "the
offload did not happen".

``watch_threads`` makes every Python thread started after it carry a ``_Relay`` mode for its
whole life: a pass-through that hands each op to the observer of the step being observed now
(``observing``), if any. Threads started before it (none of the offloader's: the harness calls it
before a backend is built, and ``ThreadPoolExecutor`` starts its workers at the first submit) are
counted by ``unwatched`` so a case that saw no copy can say so.

On CUDA the profiler sees every thread's and every stream's memcpys anyway; the relay gives the
same copies their group there too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

_lock = threading.Lock()
_observer: list[TorchDispatchMode] = []
"""The observer of the step observed now (at most one)."""
_watched: set[int] = set()
"""Idents of the threads that carry a relay."""
_installed = False


class _Relay(TorchDispatchMode):
    """Hands every op of its thread to the observer of the step observed now (none: runs it)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        observer = _observer[0] if _observer else None
        if observer is None:
            return func(*args, **(kwargs or {}))
        return observer.__torch_dispatch__(func, types, args, kwargs)


def watch_threads() -> None:
    """From now on every thread started in this process relays its ops to the observed step's
    copy observer (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    # Every thread, whatever its class overrides, runs through ``_bootstrap_inner`` (CPython
    # 3.10 to 3.13), so a subclass with a ``run`` of its own is watched too.
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap(self: threading.Thread) -> None:
        ident = threading.get_ident()
        with _lock:
            _watched.add(ident)
        try:
            with _Relay():
                original(self)
        finally:
            with _lock:
                _watched.discard(ident)

    threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]


@contextmanager
def observing(observer: TorchDispatchMode) -> Iterator[None]:
    """Relay every watched thread's ops to ``observer`` inside the block."""
    with _lock:
        _observer[:] = [observer]
    try:
        yield
    finally:
        with _lock:
            _observer.clear()


def unwatched() -> list[str]:
    """Names of the live threads other than this one that carry no relay (started before
    ``watch_threads``): their copies are not seen."""
    me = threading.get_ident()
    with _lock:
        watched = set(_watched)
    return [
        t.name
        for t in threading.enumerate()
        if t.ident not in watched and t.ident != me and t is not threading.main_thread()
    ]
