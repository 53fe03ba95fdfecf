"""Profiler range names that attribute every offload copy to its group.

A backend wraps each group's copies in ``torch.profiler.record_function(range_name(...))``; the
transfer counter (``harness.measure.transfers``) finds the copies inside such ranges and parses the
name back. One format, used by both sides:

    offload_harness.d2h|core_attn|mb=1|layer=4
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.profiler import record_function

Direction = Literal["d2h", "h2d"]
PREFIX = "offload_harness."
_PATTERN = re.compile(r"^offload_harness\.(d2h|h2d)\|([a-z0-9_]+)\|mb=(\d+)\|layer=(\d+)$")


@dataclass(frozen=True, slots=True)
class RangeKey:
    direction: Direction
    name: str
    microbatch: int
    layer: int


def range_name(direction: Direction, name: str, microbatch: int, layer: int) -> str:
    """The record_function name for ``direction`` copies of one group occurrence."""
    return f"{PREFIX}{direction}|{name}|mb={microbatch}|layer={layer}"


_watchers = 0
"""How many harness copy observers watch the ranges now (``watching``)."""
_open = threading.local()
_NO_RANGE = contextlib.nullcontext()
"""The range where none is kept: stateless, so one object serves every ``with``."""


def profiler_range(
    direction: Direction, name: str, microbatch: int, layer: int
) -> contextlib.AbstractContextManager[Any]:
    """The group occurrence's named profiler range while a profiler runs, and the range on this
    thread's stack of open ranges (``current_range``) while a harness copy observer watches;
    nothing otherwise (a range costs tens of microseconds per group even unprofiled)."""
    profiling = torch._C._autograd._profiler_enabled()
    if not profiling and not _watchers:
        return _NO_RANGE
    inner: contextlib.AbstractContextManager[Any] = (
        record_function(range_name(direction, name, microbatch, layer)) if profiling else _NO_RANGE
    )
    if not _watchers:
        return inner
    return _on_stack(RangeKey(direction, name, microbatch, layer), inner)


@contextlib.contextmanager
def _on_stack(key: RangeKey, inner: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    stack = getattr(_open, "stack", None)
    if stack is None:
        stack = _open.stack = []
    stack.append(key)
    try:
        with inner:
            yield
    finally:
        stack.pop()


def current_range() -> RangeKey | None:
    """The innermost range open on this thread while ``watching`` (None: none)."""
    stack = getattr(_open, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """While inside, ``profiler_range`` keeps its thread's stack of open ranges even when no
    profiler runs, so a copy observer can read the offloader's own ranges without one."""
    global _watchers
    _watchers += 1
    try:
        yield
    finally:
        _watchers -= 1


def parse_range_name(text: str) -> RangeKey | None:
    """Inverse of ``range_name``; None for any other range."""
    match = _PATTERN.match(text)
    if match is None:
        return None
    direction, name, microbatch, layer = match.groups()
    return RangeKey(direction, name, int(microbatch), int(layer))  # type: ignore[arg-type]
