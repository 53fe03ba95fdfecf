"""Units and the one-line texts that every module of the bench writes."""

from __future__ import annotations

MIB = 2**20
GB = 1e9


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"
