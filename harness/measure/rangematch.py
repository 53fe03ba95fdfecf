"""Which of our ranges each copy ran in: device mode matches a memcpy to the call that
enqueued it and that call to the innermost range around it; CPU mode takes the outermost
``aten::copy_`` ops inside a range (the rules: ``harness.measure.transfers``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from harness.measure.traceevents import (
    COPY_OP,
    CPU_OP_CATS,
    LAUNCH_CATS,
    Event,
    memcpy_bytes,
    memcpy_direction,
)
from harness.measure.transfercounts import (
    DIRECTIONS,
    Counts,
    TraceFormatError,
    TransferCounts,
    element_size,
)
from harness.offload.ranges import RangeKey, parse_range_name


class Span(NamedTuple):
    start: int
    end: int
    key: RangeKey | None


def our_ranges(events: Iterable[Event]) -> dict[tuple[Any, Any], list[Span]]:
    """Our offload ranges (CPU ``user_annotation`` events that parse), per thread."""
    ranges: dict[tuple[Any, Any], list[Span]] = defaultdict(list)
    for event in events:
        if event.cat != "user_annotation":
            continue
        key = parse_range_name(event.name)
        if key is not None:
            ranges[event.thread].append(Span(event.start, event.end, key))
    return ranges


# -------------------------------------------------------------------------------- attribution
def _innermost(ranges: list[Span], queries: list[Span]) -> list[RangeKey | None]:
    """For each query interval (one thread), the key of the innermost range containing it.

    A sweep in start order keeps the stack of ranges open at the current time; ranges on one
    thread nest like a call stack, so the topmost open range that outlasts the query wins."""
    spans = sorted(ranges, key=lambda s: (s.start, -s.end))
    out: list[RangeKey | None] = [None] * len(queries)
    stack: list[Span] = []
    j = 0
    for i in sorted(range(len(queries)), key=lambda i: queries[i].start):
        query = queries[i]
        while j < len(spans) and spans[j].start <= query.start:
            _close(stack, spans[j].start)
            stack.append(spans[j])
            j += 1
        _close(stack, query.start)
        out[i] = next((s.key for s in reversed(stack) if s.end >= query.end), None)
    return out


def _close(stack: list[Span], now: int) -> None:
    """Pop the ranges that ended before ``now``."""
    while stack and stack[-1].end < now:
        stack.pop()


def _attribute(
    ranges: Mapping[tuple[Any, Any], list[Span]], items: list[tuple[tuple[Any, Any], Span]]
) -> list[RangeKey | None]:
    """``_innermost`` for (thread, interval) items on any threads, in the items' order."""
    by_thread: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for index, (thread, _) in enumerate(items):
        by_thread[thread].append(index)
    out: list[RangeKey | None] = [None] * len(items)
    for thread, indices in by_thread.items():
        keys = _innermost(ranges.get(thread, []), [items[i][1] for i in indices])
        for index, key in zip(indices, keys, strict=True):
            out[index] = key
    return out


def _attribute_launches(
    ranges: Mapping[tuple[Any, Any], list[Span]], launches: list[Event | None]
) -> list[RangeKey | None]:
    """The range each launching API call started in (None for a memcpy with no launch event)."""
    found = [(i, e) for i, e in enumerate(launches) if e is not None]
    keys = _attribute(ranges, [(e.thread, Span(e.start, e.start, None)) for _, e in found])
    out: list[RangeKey | None] = [None] * len(launches)
    for (index, _), key in zip(found, keys, strict=True):
        out[index] = key
    return out


def count_device(
    events: list[Event], ranges: Mapping[tuple[Any, Any], list[Span]]
) -> TransferCounts:
    """Device mode: memcpy -> (correlation id) -> launching API call -> enclosing range."""
    launches: dict[Any, Event] = {}
    for event in events:
        if event.cat in LAUNCH_CATS and (correlation := event.correlation_id()) is not None:
            launches.setdefault(correlation, event)
    memcpys = [(e, d) for e in events if (d := memcpy_direction(e.name)) is not None]
    keys = _attribute_launches(ranges, [launches.get(e.correlation_id()) for e, _ in memcpys])
    by_range: dict[RangeKey, Counts] = defaultdict(Counts)
    unattributed = {d: Counts() for d in DIRECTIONS}
    pageable = 0
    for (event, direction), key in zip(memcpys, keys, strict=True):
        counts = Counts(1, memcpy_bytes(event))
        if key is None or key.direction != direction:
            unattributed[direction] += counts
            continue
        by_range[key] += counts
        pageable += "Pageable" in event.name
    return TransferCounts(dict(by_range), unattributed, pageable, mode="device")


# ------------------------------------------------------------------------------------- CPU mode
def _outermost_copies(events: Iterable[Event]) -> list[Event]:
    """The ``aten::copy_`` CPU ops not nested inside another ``aten::copy_`` on their thread."""
    by_thread: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for event in events:
        if event.cat in CPU_OP_CATS and event.name == COPY_OP:
            by_thread[event.thread].append(event)
    outer: list[Event] = []
    for copies in by_thread.values():
        stack: list[Event] = []
        for event in sorted(copies, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1].end < event.start:
                stack.pop()
            if stack and stack[-1].end >= event.end:
                continue  # a copy_ inside a copy_ (e.g. a dtype/layout conversion): counted once
            stack.append(event)
            outer.append(event)
    return outer


def _copy_bytes(event: Event) -> int:
    """Bytes written by an ``aten::copy_`` op: numel(self) * element size of self."""
    dims, types = event.args.get("Input Dims"), event.args.get("Input type")
    if not dims or not types:
        raise TraceFormatError(
            "aten::copy_ inside an offload range has no recorded shapes/types; profile with "
            "record_shapes=True (e.g. harness.measure.transfers.transfer_profiler)"
        )
    return math.prod(int(n) for n in dims[0]) * element_size(str(types[0]))


def count_cpu(events: list[Event], ranges: Mapping[tuple[Any, Any], list[Span]]) -> TransferCounts:
    """CPU mode: outermost ``aten::copy_`` ops inside our innermost range on their thread."""
    copies = _outermost_copies(events)
    items = [(e.thread, Span(e.start, e.end, None)) for e in copies]
    by_range: dict[RangeKey, Counts] = defaultdict(Counts)
    for event, key in zip(copies, _attribute(ranges, items), strict=True):
        if key is not None:
            by_range[key] += Counts(1, _copy_bytes(event))
    return TransferCounts(dict(by_range), mode="cpu")
