"""Per-rank consoles under torchrun: the rank layout of this process (``DistEnv``), and each
rank's pytest terminal output, which goes to ``rank<R>.log`` in the session's report folder, and
rank 0's to the console too
(``harness.plugin.dist`` installs it)."""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import pytest
import torch

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Rank layout of this process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class RankLog(io.TextIOBase):
    """Text sink for one rank's pytest terminal output: buffered until the report folder is
    known (``attach``), then written to ``rank<R>.log``; rank 0 also writes to the console."""

    def __init__(self, rank: int, console: TextIO | None, fallback: Path | None = None) -> None:
        self.rank = rank
        self.console = console
        self.fallback = fallback
        """Where the log goes when the session writes no report folder: ``<report
        dir>/rank-logs/``, or None (``--report-dir ''``: no file; rank 0's console only)."""
        self._buffer: list[str] = []
        self._file: TextIO | None = None
        self.path: Path | None = None
        self._detached = False

    def attach(self, folder: Path | None) -> None:
        if self._file is not None or self._detached:
            return
        if folder is None:  # no report, no log file: keep nothing
            self._detached = True
            self._buffer = []
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{self.rank}.log"
        self._file = self.path.open("w", encoding="utf-8", buffering=1)  # lines survive a kill -9
        self._file.write("".join(self._buffer))
        self._buffer = []

    def write(self, text: str) -> int:
        if self.console is not None:
            self.console.write(text)
        plain = _ANSI.sub("", text)
        if self._file is not None:
            self._file.write(plain)
        elif self.path is None and not self._detached:
            self._buffer.append(plain)
        return len(text)

    def flush(self) -> None:
        if self.console is not None:
            self.console.flush()
        if self._file is not None:
            self._file.flush()

    def fileno_or_none(self) -> int | None:
        """The log file's descriptor (for a stack dump written past Python), flushed first."""
        if self._file is None:
            return None
        self._file.flush()
        return self._file.fileno()

    def isatty(self) -> bool:
        return self.console is not None and self.console.isatty()

    def finish(self) -> None:
        """Write everything out and close the file (later writes reach the console only)."""
        if self._file is None:
            self.attach(self.fallback)
        file, self._file = self._file, None
        if file is not None:
            file.close()
        self._buffer = []  # nothing more is kept for a file


def redirect_terminal(config: pytest.Config, rank: int, fallback: Path | None) -> RankLog:
    """Replace pytest's terminal reporter with one writing to this rank's log (and, on rank 0,
    to the console as well)."""
    log = RankLog(rank, sys.stdout if rank == 0 else None, fallback)
    manager = config.pluginmanager
    old = manager.get_plugin("terminalreporter")
    if old is not None:
        manager.unregister(old)
    manager.register(pytest.TerminalReporter(config, log), "terminalreporter")
    return log
