"""How a plain pytest session (no torchrun) ends on SIGTERM or SIGHUP: as on Ctrl-C, with the
report's status ``terminated`` and the exit status 128 + the signal (``harness.plugin.dist``
installs the handler, ``harness.plugin.report`` writes the status)."""

from __future__ import annotations

import faulthandler
import signal
from collections.abc import Callable

from harness.util import leftovers

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a plain pytest session as Ctrl-C does (``terminated``)."""

_STOPPED: list[int] = []
"""The stop signal that ended this session, if one did."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP stopped the session: pytest unwinds it as it does Ctrl-C."""


def stopped_by() -> int | None:
    """The stop signal that ended this session (None: none did)."""
    return _STOPPED[0] if _STOPPED else None


def stopping(console_fd: int) -> Callable[[int, object], None]:
    """The handler of a stop signal: every thread's stack to ``console_fd``, then
    ``Terminated``."""

    def stop(signum: int, frame: object) -> None:
        faulthandler.dump_traceback(file=console_fd, all_threads=True)
        _STOPPED[:] = [signum]
        raise Terminated(signal.Signals(signum).name)

    return stop


_EXIT: list[int] = [0]


def exit_status(status: int) -> None:
    """The session's exit status, for ``leftovers.exit_past_stray_threads``."""
    _EXIT[0] = status


def leave_past_stray_threads() -> None:
    """A session whose cases' backends left a non-daemon thread running still ends, with its
    exit status, naming the thread (``harness.util.leftovers``)."""
    leftovers.exit_past_stray_threads(lambda: _EXIT[0], "offload-harness")
