"""The profiler events a transfer counter reads, from either source: Kineto's activities in
memory or the exported chrome trace (how each maps to the other: ``harness.measure.transfers``).
Only the events a counter can use are kept: our ranges' annotations, ``aten::copy_`` CPU ops,
CUDA runtime/driver calls and memcpys."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from harness.measure.transfercounts import TraceFormatError
from harness.offload.ranges import PREFIX, Direction

Mode = Literal["auto", "device", "cpu"]
Source = Literal["auto", "memory", "trace"]
SOURCE_ENV = "OFFLOAD_HARNESS_TRANSFERS_SOURCE"
"""Environment variable: ``trace`` makes ``source="auto"`` count from the exported chrome trace
(e.g. ``OFFLOAD_HARNESS_TRANSFERS_SOURCE=trace offload-harness run ...`` to rule the in-memory
reader out when a count looks wrong)."""

_MEMCPY_PREFIXES: dict[str, Direction] = {"Memcpy DtoH": "d2h", "Memcpy HtoD": "h2d"}
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_DEVICE_CATS = LAUNCH_CATS | {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
CPU_OP_CATS = frozenset({"cpu_op", "operator"})
# Activity types the chrome trace writer does not write as complete ("X") events.
_NOT_COMPLETE_CATS = frozenset({"cpu_instant_event", "mtia_counters", "xpu_scope_profiler"})
COPY_OP = "aten::copy_"


class Event(NamedTuple):
    """A complete ("X") trace event with times in integer nanoseconds."""

    name: str
    cat: str
    thread: tuple[Any, Any]
    start: int
    end: int
    args: Mapping[str, Any]
    correlation: Any = None
    """The CUDA correlation id, read off an in-memory activity (a trace's is in ``args``)."""

    def correlation_id(self) -> Any:
        """What links a memcpy to the runtime/driver call that enqueued it (None: nothing)."""
        return self.correlation if self.correlation is not None else self.args.get("correlation")


def read_json(path: Path, exact: bool = True) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        trace = json.load(handle, parse_float=Decimal if exact else str)
    if isinstance(trace, list):  # a bare event list is valid chrome trace JSON too
        trace = {"traceEvents": trace}
    return trace


def read_events(trace: Mapping[str, Any]) -> Iterator[Event]:
    """The complete events of ``trace``."""
    for raw in _complete(trace):
        yield _from_raw(raw, str(raw.get("cat", "")).lower(), str(raw.get("name", "")))


def trace_events(trace: Mapping[str, Any], mode: Mode) -> tuple[list[Event], bool]:
    """What ``memory_events`` keeps, from a chrome trace: the complete events a counter can
    use (every ``aten::copy_`` but in ``mode="device"``), and whether any event is device
    activity. Only the kept events' times are converted."""
    events: list[Event] = []
    launches: dict[Any, tuple[dict[str, Any], str, str]] = {}
    has_device = False
    skip_ops = mode == "device"
    for raw in _complete(trace):
        cat = str(raw.get("cat", "")).lower()
        if skip_ops and cat in CPU_OP_CATS:
            continue
        name = str(raw.get("name", ""))
        keep, device = _wanted(cat, name)
        has_device = has_device or device
        if not keep:
            continue
        if cat in LAUNCH_CATS and not name.startswith("Memcpy "):
            correlation = (raw.get("args") or {}).get("correlation")
            if correlation is not None:
                launches.setdefault(correlation, (raw, cat, name))
            continue
        events.append(_from_raw(raw, cat, name))
    events += _launches_of_memcpys(events, lambda c: _from_raw(*launches[c]), launches)
    return events, has_device


def _launches_of_memcpys(
    events: list[Event], make: Callable[[Any], Event], launches: Mapping[Any, object]
) -> list[Event]:
    """The launch events (first per correlation id) of the memcpys among ``events``, made only
    now: a profiled step launches thousands of kernels, and only its memcpys' launches are read
    (``count_device``)."""
    wanted = {
        correlation
        for e in events
        if memcpy_direction(e.name) is not None
        and (correlation := e.correlation_id()) is not None
        and correlation in launches
    }
    return [make(correlation) for correlation in wanted]


def _complete(trace: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The raw complete ("X") events of a chrome trace that have a start."""
    if "traceEvents" not in trace:
        raise TraceFormatError("not a chrome trace: no 'traceEvents' key")
    for raw in trace["traceEvents"]:
        if raw.get("ph") == "X" and "ts" in raw:
            yield raw


def _from_raw(raw: Mapping[str, Any], cat: str, name: str) -> Event:
    start = _ns(raw["ts"])
    return Event(
        name=name,
        cat=cat,
        thread=(raw.get("pid"), raw.get("tid")),
        start=start,
        end=start + _ns(raw.get("dur", 0)),
        args=raw.get("args") or {},
    )


def _ns(microseconds: int | float | Decimal | str) -> int:
    """Microseconds (as written in the trace) to integer nanoseconds, exactly."""
    if isinstance(microseconds, Decimal):
        value = microseconds
    else:  # repr: a float's shortest round-trip text, i.e. the digits the trace had
        value = Decimal(microseconds if isinstance(microseconds, str) else repr(microseconds))
    return int((value * 1000).to_integral_value())


def _wanted(cat: str, name: str) -> tuple[bool, bool]:
    """(whether a counter can use an event of ``cat`` named ``name``, whether it is device
    activity): our ranges' annotations, ``aten::copy_`` CPU ops, CUDA runtime/driver calls and
    memcpys (a memcpy by its name, whatever the cat: the device counter's test)."""
    memcpy = name.startswith("Memcpy ")
    launch = cat in LAUNCH_CATS
    keep = (
        memcpy
        or launch
        or (cat == "user_annotation" and name.startswith(PREFIX))
        or (cat in CPU_OP_CATS and name == COPY_OP)
    )
    return keep, memcpy or cat in _DEVICE_CATS


# ---------------------------------------------------------------------------- in-memory events
def kineto_activities(profiled: object, source: Source) -> Iterable[Any] | None:
    """The Kineto activities of a finished profiler when they are to be read in memory; None
    when the chrome trace is to be read instead."""
    if isinstance(profiled, Mapping | str | os.PathLike):
        if source == "memory":
            raise TypeError("source='memory' needs a finished profiler, not a trace file/dict")
        return None
    if source == "trace" or (source == "auto" and os.environ.get(SOURCE_ENV) == "trace"):
        return None
    # torch.profiler.profile wraps a torch.autograd.profiler.profile, which holds the result
    result = getattr(getattr(profiled, "profiler", profiled), "kineto_results", None)
    if result is not None and hasattr(result, "trace_activities"):
        return result.trace_activities()
    if source == "memory":
        raise TypeError(
            f"cannot read {profiled!r} in memory: not a finished profiler, or this torch "
            f"({torch.__version__}) does not expose its Kineto activities (trace_activities)"
        )
    return None


class _Metadata(Mapping[str, Any]):
    """An activity's ``metadata_json`` - what the chrome trace writes as the event's ``args`` -
    parsed on first use (most events' args are never read)."""

    __slots__ = ("_activity", "_parsed")

    def __init__(self, activity: Any) -> None:
        self._activity = activity
        self._parsed: dict[str, Any] | None = None

    def _args(self) -> dict[str, Any]:
        if self._parsed is None:
            text = self._activity.metadata_json()
            try:
                self._parsed = json.loads(f"{{{text}}}", strict=False) if text.strip() else {}
            except ValueError as error:
                raise TraceFormatError(
                    f"unreadable metadata of profiler event {self._activity.name()!r}: {text!r} "
                    "(count_transfers(..., source='trace') reads the chrome trace instead)"
                ) from error
        return self._parsed

    def __getitem__(self, key: str) -> Any:
        return self._args()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._args())

    def __len__(self) -> int:
        return len(self._args())


def _sanitize_tid(tid: int) -> int:
    """The ``tid`` the chrome trace writer prints for a resource id (Kineto's ``sanitizeTid``)."""
    return 0 if tid == -(2**63) else abs(tid)


def memory_events(activities: Iterable[Any], mode: Mode = "auto") -> tuple[list[Event], bool]:
    """The events the counters read, built from Kineto activities the way the chrome trace
    writer turns them into complete events (``pid`` = ``device_id()``, ``tid`` = sanitized
    ``resource_id()``, ``cat`` = ``type()``, ``ts``/``dur`` = ``timestamp()``/``duration()`` in
    ns, ``args`` = ``metadata_json()``), and whether any of them is device activity.

    Only the events a counter can use are kept: annotations named like our ranges, ``aten::copy_``
    CPU ops (not in ``mode="device"``, which never reads them), CUDA runtime/driver calls and
    memcpys; the rest are only checked for device activity. A profiled training step holds
    thousands of activities, so the loop asks each for no more than it needs: its type first,
    its name only where the type can keep it, and the CUDA correlation id straight from the
    activity (its metadata is parsed only where a counter reads it: a memcpy's bytes)."""
    events: list[Event] = []
    launches: dict[Any, tuple[Any, str, str]] = {}
    has_device = False
    skip_ops = mode == "device"
    for activity in activities:
        cat = activity.type().lower()
        if cat in _NOT_COMPLETE_CATS or (skip_ops and cat in CPU_OP_CATS):
            continue
        name = activity.name()
        keep, device = _wanted(cat, name)
        has_device = has_device or device
        if not keep:
            continue
        if cat in LAUNCH_CATS and not name.startswith("Memcpy "):
            correlation = activity.correlation_id() or None
            if correlation is not None:
                launches.setdefault(correlation, (activity, cat, name))
            continue
        events.append(_from_activity(activity, cat, name, device))
    events += _launches_of_memcpys(
        events, lambda c: _from_activity(*launches[c], device=True), launches
    )
    return events, has_device


def _from_activity(activity: Any, cat: str, name: str, device: bool) -> Event:
    start = activity.timestamp()
    return Event(
        name=name,
        cat=cat,
        thread=(activity.device_id(), _sanitize_tid(activity.resource_id())),
        start=start,
        end=start + max(activity.duration(), 0),
        args=_Metadata(activity),
        correlation=(activity.correlation_id() or None) if device else None,
    )


def memcpy_direction(name: str) -> Direction | None:
    """``d2h``/``h2d`` for a device memcpy event name; None for any other event (DtoD ...)."""
    for prefix, direction in _MEMCPY_PREFIXES.items():
        if name.startswith(prefix):
            return direction
    return None


def memcpy_bytes(event: Event) -> int:
    nbytes = event.args.get("bytes")
    if nbytes is None:
        raise TraceFormatError(
            f"device memcpy {event.name!r} (correlation {event.correlation_id()}) has no "
            "'bytes' in its args; this profiler/Kineto version does not record memcpy sizes"
        )
    return int(nbytes)
