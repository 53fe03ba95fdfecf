"""Where a run is, for the messages that must say it: an exception raised inside the
offloader's calls names the step, the microbatch (pass), the layer, the group and the phase
(``located``), and a case's worker reports its last position to the run's parent (``at``,
through the case's stack-dump file), so a worker that dies is named with where it was."""

from __future__ import annotations

from collections.abc import Callable

WHERE = "offload_where"
"""The attribute ``located`` sets on an exception: the position it was raised at."""

_sink: list[Callable[[str], None]] = []


def report_to(sink: Callable[[str], None] | None) -> None:
    """Send this process's positions to ``sink`` (None: nowhere)."""
    _sink[:] = [sink] if sink is not None else []


def at(position: str) -> None:
    """The run reached ``position`` (a new microbatch): tell the sink, if any."""
    for sink in _sink:
        sink(position)


def located(exc: BaseException, position: str) -> None:
    """Name ``position`` on ``exc`` (once: the innermost call that saw it raise knows best)."""
    if getattr(exc, WHERE, None) is None:
        try:
            setattr(exc, WHERE, position)
        except AttributeError:  # an exception type without a __dict__
            return
        exc.add_note(f"raised in the offloader's calls at {position}")


def where(exc: BaseException) -> str | None:
    """The position ``located`` named on ``exc`` (None: raised outside the offloader's calls)."""
    return getattr(exc, WHERE, None)
