"""Profiler range names that attribute every offload copy to its group.

A backend wraps each group's copies in ``torch.profiler.record_function(range_name(...))``; the
transfer counter (``harness.transfers``) finds the copies inside such ranges and parses the name
back. One format, used by both sides:

    offload_harness.d2h|core_attn|mb=1|layer=4
"""

from __future__ import annotations

import contextlib
import re
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


def profiler_range(
    direction: Direction, name: str, microbatch: int, layer: int
) -> contextlib.AbstractContextManager[Any]:
    """The group occurrence's named profiler range, or nothing when no profiler runs (a range
    costs tens of microseconds per group even unprofiled)."""
    if not torch._C._autograd._profiler_enabled():
        return contextlib.nullcontext()
    return record_function(range_name(direction, name, microbatch, layer))


def parse_range_name(text: str) -> RangeKey | None:
    """Inverse of ``range_name``; None for any other range."""
    match = _PATTERN.match(text)
    if match is None:
        return None
    direction, name, microbatch, layer = match.groups()
    return RangeKey(direction, name, int(microbatch), int(layer))  # type: ignore[arg-type]
