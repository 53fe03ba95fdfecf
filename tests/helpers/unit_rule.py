"""The watch behind the rule of ``tests/unit`` (``tests/unit/conftest.py``): a unit test trains
nothing and starts no process. ``watching()`` records, while it is open, every optimizer step
(a global ``torch.optim`` step hook, removed when it closes) and every process started
(``subprocess.Popen``, a ``multiprocessing`` process's ``start``, ``os.fork``/``forkpty``,
``os.posix_spawn``/``posix_spawnp``, ``os.system``; each wrapped while it is open, then put
back). Watches nest: only the innermost one records, so a test can watch a piece of code itself
(``tests/unit/test_unit_rule.py`` proves the guard that way)."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

RULE = "a test under tests/unit trains nothing and starts no process: move it to tests/e2e"

PROCESS_STARTS: tuple[tuple[Any, str, str], ...] = tuple(
    (owner, name, label)
    for owner, name, label in (
        (subprocess.Popen, "__init__", "subprocess.Popen"),
        (multiprocessing.process.BaseProcess, "start", "multiprocessing process start"),
        (os, "fork", "os.fork"),
        (os, "forkpty", "os.forkpty"),
        (os, "posix_spawn", "os.posix_spawn"),
        (os, "posix_spawnp", "os.posix_spawnp"),
        (os, "system", "os.system"),
    )
    if hasattr(owner, name)
)
"""(owner, attribute, what the message calls it): every way a test starts a process."""

_WATCHES: list[Watch] = []
"""The watches open now, innermost last: only that one records."""


class Watch:
    """What a watched piece of code did that a unit test must not."""

    def __init__(self) -> None:
        self.steps = 0
        self.processes: list[str] = []
        self.reported = False

    def stepped(self, *_: object) -> None:
        if _WATCHES and _WATCHES[-1] is self:
            self.steps += 1

    def started(self, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _WATCHES and _WATCHES[-1] is self:
            self.processes.append(_started(label, args, kwargs))

    def message(self, test: str) -> str | None:
        """One line naming what ``test`` did, or None when it did nothing of the kind."""
        did = []
        if self.steps:
            did.append(f"stepped an optimizer {self.steps} time(s)")
        if self.processes:
            calls = len(self.processes)
            did.append(f"started a process ({calls} call(s), the first {self.processes[0]})")
        return f"{test} {' and '.join(did)}; {RULE}" if did else None


def _started(label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``label`` and, for ``subprocess.Popen``, its command, shortened to one line."""
    if label != "subprocess.Popen":
        return label
    command = args[1] if len(args) > 1 else kwargs.get("args", "")
    if not isinstance(command, str):
        command = " ".join(map(str, command))
    command = " ".join(command.split())
    return f"{label} {command[:77] + '...' if len(command) > 80 else command}"


def _recording(watch: Watch, label: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        watch.started(label, args, kwargs)
        return original(*args, **kwargs)

    return recorded


@contextlib.contextmanager
def watching() -> Iterator[Watch]:
    """Record the optimizer steps and process starts of the code inside (see the module)."""
    watch = Watch()
    handle = register_optimizer_step_post_hook(watch.stepped)
    patched = []
    try:
        for owner, name, label in PROCESS_STARTS:
            original = getattr(owner, name)
            setattr(owner, name, _recording(watch, label, original))
            patched.append((owner, name, original))
        _WATCHES.append(watch)
        yield watch
    finally:
        if watch in _WATCHES:
            _WATCHES.remove(watch)
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
        handle.remove()
