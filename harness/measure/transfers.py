"""Count the offload copies a profiled run really made, per offload group, from its profiler trace.

Where the events come from
    The counters read the profiler's chrome-trace events: complete events with a ``name``, a
    ``cat``, a ``pid``/``tid``, ``ts``/``dur`` and ``args``. Two readers produce the same event
    stream (``count_transfers(..., source=...)``):

    in memory (default for a finished profiler, when torch exposes it) - Kineto's activity list,
        ``prof.profiler.kineto_results.trace_activities()``: the very list that
        ``export_chrome_trace`` serializes. Kineto's chrome writer (``ChromeTraceLogger``, and
        torch's Python port ``torch.profiler._chrome_trace_export``) prints ``cat`` =
        ``type()``, ``pid`` = ``device_id()``, ``tid`` = ``sanitizeTid(resource_id())``,
        ``ts``/``dur`` = ``timestamp()``/``max(duration(), 0)`` (ns, shifted by one constant),
        ``args`` = ``metadata_json()``; we build the same events from the same getters, with
        integer ns and no JSON round trip (``metadata_json`` is parsed only for the few events
        whose ``args`` a counter reads). ``kineto_results.events()`` is deliberately not used:
        it renumbers threads (RecordFunction ids; a runtime call inherits the thread of the op it
        is linked to, an unlinked one the thread that stopped the profiler) and holds memcpy
        sizes only with ``expose_kineto_event_metadata``, so it is not the chrome trace's data.
    chrome trace - ``export_chrome_trace`` to a temporary file, parsed back (``Decimal`` for
        exact ns); also how trace files and dicts (golden traces, tests) are always read. Several
        times slower; kept as the reference, for torch builds without ``trace_activities``, and
        to diagnose a suspected in-memory mismatch (``source="trace"``, or the environment
        variable ``OFFLOAD_HARNESS_TRANSFERS_SOURCE=trace`` for a whole ``offload-harness``
        run).
    CPU mode is proven identical both ways on real runs (``tests/unit/test_transfers.py``). Device
    mode reads the same fields the same way (tested on synthetic activities against torch's
    chrome writer), but equality on real CUDA traces is not proven yet: the H200 box's torch
    2.11 has no ``trace_activities``, so there every count comes from the chrome trace (the
    proof, ``pytest tests/unit/test_transfers.py -k memory_counts_match_chrome_trace``, skips on
    such a torch and is owed on a CUDA build that has it).

How a copy is attributed to a group (``harness.offload.ranges.RangeKey``)
    Every backend runs a group's copies inside
    ``record_function(range_name(direction, name, microbatch, layer))``; the profiler records that
    as a CPU ``user_annotation`` event on the issuing thread. We attribute:

    device (CUDA) mode - each device memcpy (``Memcpy DtoH ...`` / ``Memcpy HtoD ...``):
        1. ``args.correlation`` links the memcpy to the CUDA runtime/driver call that enqueued
           it (``cat`` ``cuda_runtime``/``cuda_driver``, e.g. ``cudaMemcpyAsync``). The memcpy
           itself runs later on a GPU stream, so its own timestamps say nothing about ranges;
        2. the call's start lies inside our annotation on the same pid/tid: the innermost one
           whose name parses with ``parse_range_name`` is the group.
        Bytes come from the memcpy's ``args["bytes"]``. A memcpy outside our ranges (or inside a
        range of the other direction) is ``unattributed`` for its direction; DtoD/PtoP copies
        are ignored; attributed memcpys from/to pageable host memory are counted in ``pageable``.

    CPU mode (no device activity) - each ``aten::copy_`` CPU op that is not nested in another
        ``aten::copy_`` and whose interval lies inside our innermost range on the same pid/tid.
        Bytes = numel(destination) * element size, from the op's recorded ``Input Dims``/
        ``Input type`` (needs ``record_shapes=True``). Direction comes from the range (host to
        host copies have none), so ``unattributed`` is always zero in this mode.

Timestamps are compared as exact integer nanoseconds (a chrome trace is parsed with ``Decimal``):
trace timestamps are large microsecond values whose nanosecond digits do not survive a float.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from harness.offload.ranges import PREFIX, Direction, RangeKey, parse_range_name

Mode = Literal["auto", "device", "cpu"]
Source = Literal["auto", "memory", "trace"]
SOURCE_ENV = "OFFLOAD_HARNESS_TRANSFERS_SOURCE"
"""Environment variable: ``trace`` makes ``source="auto"`` count from the exported chrome trace
(e.g. ``OFFLOAD_HARNESS_TRANSFERS_SOURCE=trace offload-harness run ...`` to rule the in-memory
reader out when a count looks wrong)."""
DIRECTIONS: tuple[Direction, ...] = ("d2h", "h2d")

_MEMCPY_PREFIXES: dict[str, Direction] = {"Memcpy DtoH": "d2h", "Memcpy HtoD": "h2d"}
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_DEVICE_CATS = _LAUNCH_CATS | {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
_CPU_OP_CATS = frozenset({"cpu_op", "operator"})
# Activity types the chrome trace writer does not write as complete ("X") events.
_NOT_COMPLETE_CATS = frozenset({"cpu_instant_event", "mtia_counters", "xpu_scope_profiler"})
_COPY_OP = "aten::copy_"

# Element sizes by the C++ type name the profiler writes in ``Input type`` (c10 TypeMeta names,
# demangled; checked against torch 2.13 on Linux). "long long" variants cover other platforms.
ELEMENT_SIZES: dict[str, int] = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "c10::complex<c10::Half>": 4,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "bool": 1,
    "signed char": 1,
    "unsigned char": 1,
    "short int": 2,
    "short unsigned int": 2,
    "int": 4,
    "unsigned int": 4,
    "long int": 8,
    "long unsigned int": 8,
    "long long int": 8,
    "long long unsigned int": 8,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2": 1,
    "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1,
    "c10::Float4_e2m1fn_x2": 1,
    "c10::qint8": 1,
    "c10::quint8": 1,
    "c10::qint32": 4,
    "c10::quint4x2": 1,
    "c10::quint2x4": 1,
    "c10::bits1x8": 1,
    "c10::bits2x4": 1,
    "c10::bits4x2": 1,
    "c10::bits8": 1,
    "c10::bits16": 2,
}


class TraceFormatError(ValueError):
    """The trace lacks what the counter needs (shapes, memcpy bytes) or has an unknown type."""


@dataclass(frozen=True, slots=True)
class Counts:
    """A number of copies and the bytes they moved."""

    copies: int = 0
    bytes: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.copies + other.copies, self.bytes + other.bytes)


@dataclass(frozen=True)
class TransferCounts:
    """What a profiled run copied, per offload range occurrence."""

    by_range: dict[RangeKey, Counts]
    """Per (direction, group name, microbatch, layer): the copies attributed to that range."""
    unattributed: dict[Direction, Counts] = field(
        default_factory=lambda: {d: Counts() for d in DIRECTIONS}
    )
    """Device mode: DtoH/HtoD memcpys outside our ranges, per direction (always 0 on CPU)."""
    pageable: int = 0
    """Device mode: attributed memcpys from/to pageable (unpinned) host memory."""
    mode: Literal["device", "cpu"] = "cpu"
    """How the copies were found (see the module docstring)."""

    def by_name(self) -> dict[tuple[Direction, str], Counts]:
        """Attributed totals per (direction, group name)."""
        out: dict[tuple[Direction, str], Counts] = defaultdict(Counts)
        for key, counts in self.by_range.items():
            out[(key.direction, key.name)] += counts
        return dict(out)

    def totals(self) -> dict[Direction, Counts]:
        """Attributed totals per direction (both directions always present)."""
        out = {d: Counts() for d in DIRECTIONS}
        for key, counts in self.by_range.items():
            out[key.direction] += counts
        return out

    def by_group(self) -> dict[tuple[int, int, str], dict[str, int]]:
        """Per ``GroupRecord.key`` (microbatch, layer, name): the GroupRecord counter fields
        ``d2h_copies``, ``d2h_bytes``, ``h2d_copies``, ``h2d_bytes``."""
        out: dict[tuple[int, int, str], dict[str, int]] = {}
        for key, counts in self.by_range.items():
            row = out.setdefault(
                (key.microbatch, key.layer, key.name),
                {f"{d}_{what}": 0 for d in DIRECTIONS for what in ("copies", "bytes")},
            )
            row[f"{key.direction}_copies"] += counts.copies
            row[f"{key.direction}_bytes"] += counts.bytes
        return out


class _Event(NamedTuple):
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


class _Span(NamedTuple):
    start: int
    end: int
    key: RangeKey | None


# ------------------------------------------------------------------------------------ public API
def count_transfers(
    profiled: profile | str | os.PathLike[str] | Mapping[str, Any],
    /,
    *,
    mode: Mode = "auto",
    source: Source = "auto",
) -> TransferCounts:
    """Count offload copies per range from a finished profiler, a chrome trace file (``.json`` or
    ``.json.gz``) or an already parsed trace dict.

    ``mode="auto"`` picks device mode when the trace holds any device activity (CUDA runtime
    calls, kernels, memcpys), else CPU mode.

    ``source`` says where a profiler's events are read: ``"memory"`` - its Kineto activities,
    in memory (the list its chrome trace is written from); ``"trace"`` - its exported chrome
    trace, parsed back (slow; the reference the in-memory reader is tested against);
    ``"auto"`` - memory when this torch exposes the activities (else the trace), unless the
    ``OFFLOAD_HARNESS_TRANSFERS_SOURCE`` environment variable says ``trace``. Files and dicts
    are always read as chrome traces. Reading in memory can be repeated and leaves the
    profiler's one ``export_chrome_trace`` (torch refuses a second: "Trace is already saved") to
    the caller; ``"trace"`` uses it up.
    """
    if mode not in ("auto", "device", "cpu"):
        raise ValueError(f"mode must be 'auto', 'device' or 'cpu', got {mode!r}")
    if source not in ("auto", "memory", "trace"):
        raise ValueError(f"source must be 'auto', 'memory' or 'trace', got {source!r}")
    activities = _activities(profiled, source)
    if activities is not None:
        events, has_device = _memory_events(activities, mode)
    else:
        events, has_device = _trace_events(load_trace(profiled, exact=False), mode)
    if mode == "auto":
        mode = "device" if has_device else "cpu"
    ranges = _our_ranges(events)
    return _count_device(events, ranges) if mode == "device" else _count_cpu(events, ranges)


def load_trace(
    source: profile | str | os.PathLike[str] | Mapping[str, Any], *, exact: bool = True
) -> dict[str, Any]:
    """The chrome trace of ``source`` as a dict; floats are parsed as ``Decimal`` (exact), or
    with ``exact=False`` kept as their text (``_ns`` converts the ones a counter reads,
    exactly: a profiled training step's trace holds thousands of events it never reads)."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str | os.PathLike):
        return _read_json(Path(source), exact)
    if not hasattr(source, "export_chrome_trace"):
        raise TypeError(f"expected a torch.profiler.profile, a path or a dict, got {source!r}")
    with tempfile.TemporaryDirectory(prefix="offload_harness_trace_") as tmp:
        path = Path(tmp) / "trace.json"
        source.export_chrome_trace(str(path))
        return _read_json(path, exact)


@contextlib.contextmanager
def transfer_profiler(device: torch.device | str, *, ranges: bool = True) -> Iterator[profile]:
    """A profiler with what ``count_transfers`` needs for ``device``: CPU activity, plus CUDA
    activity on a CUDA device, or ``record_shapes=True`` on any other (CPU mode reads a copy's
    bytes from its recorded shapes; device mode reads them from the memcpy event, and recording
    every op's shapes would only slow the profiled steps). With ``ranges=False`` a CUDA device's
    activity alone: no range is recorded, so every copy counts as unattributed - the totals a
    run with no offloader ranges to read needs, with no CPU op recorded. On CUDA it
    synchronizes the device before the profiler stops, so every enqueued copy is in the trace.
    Kineto's start/stop chatter on file descriptor 2 is silenced; Python-level warnings and
    errors are not."""
    device = torch.device(device)
    activities = [ProfilerActivity.CPU] if ranges or device.type != "cuda" else []
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=device.type != "cuda")
    with _quiet_native_stderr():
        prof.__enter__()
    try:
        yield prof
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Point fd 2 at /dev/null (native code writes there directly, bypassing sys.stderr)."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded interpreters): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_transfers(fn: Callable[[], object], device: torch.device | str) -> TransferCounts:
    """Run ``fn()`` under ``transfer_profiler(device)`` and count its copies (device mode on
    CUDA, CPU mode otherwise)."""
    with transfer_profiler(device) as prof:
        fn()
    return count_transfers(prof, mode="device" if torch.device(device).type == "cuda" else "cpu")


def element_size(type_name: str) -> int:
    """Bytes per element of a profiler ``Input type`` name (``float``, ``c10::BFloat16`` ...)."""
    size = ELEMENT_SIZES.get(type_name)
    if size is None and type_name.startswith(("c10::dummy_int1_7_t<", "c10::dummy_uint1_7_t<")):
        size = 1  # torch.int1..int7 / uint1..uint7: one byte per element in storage
    if size is None:
        raise TraceFormatError(
            f"unknown tensor type name {type_name!r} in the trace; add it to "
            "harness.measure.transfers.ELEMENT_SIZES"
        )
    return size


# ------------------------------------------------------------------------------ trace parsing
def _read_json(path: Path, exact: bool = True) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        trace = json.load(handle, parse_float=Decimal if exact else str)
    if isinstance(trace, list):  # a bare event list is valid chrome trace JSON too
        trace = {"traceEvents": trace}
    return trace


def _events(trace: Mapping[str, Any]) -> Iterator[_Event]:
    """The complete events of ``trace``."""
    for raw in _complete(trace):
        yield _from_raw(raw, str(raw.get("cat", "")).lower(), str(raw.get("name", "")))


def _trace_events(trace: Mapping[str, Any], mode: Mode) -> tuple[list[_Event], bool]:
    """What ``_memory_events`` keeps, from a chrome trace: the complete events a counter can
    use (every ``aten::copy_`` but in ``mode="device"``), and whether any event is device
    activity. Only the kept events' times are converted."""
    events: list[_Event] = []
    launches: dict[Any, tuple[dict[str, Any], str, str]] = {}
    has_device = False
    skip_ops = mode == "device"
    for raw in _complete(trace):
        cat = str(raw.get("cat", "")).lower()
        if skip_ops and cat in _CPU_OP_CATS:
            continue
        name = str(raw.get("name", ""))
        keep, device = _wanted(cat, name)
        has_device = has_device or device
        if not keep:
            continue
        if cat in _LAUNCH_CATS and not name.startswith("Memcpy "):
            correlation = (raw.get("args") or {}).get("correlation")
            if correlation is not None:
                launches.setdefault(correlation, (raw, cat, name))
            continue
        events.append(_from_raw(raw, cat, name))
    events += _launches_of_memcpys(events, lambda c: _from_raw(*launches[c]), launches)
    return events, has_device


def _launches_of_memcpys(
    events: list[_Event], make: Callable[[Any], _Event], launches: Mapping[Any, object]
) -> list[_Event]:
    """The launch events (first per correlation id) of the memcpys among ``events``, made only
    now: a profiled step launches thousands of kernels, and only its memcpys' launches are read
    (``_count_device``)."""
    wanted = {
        correlation
        for e in events
        if _memcpy_direction(e.name) is not None
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


def _from_raw(raw: Mapping[str, Any], cat: str, name: str) -> _Event:
    start = _ns(raw["ts"])
    return _Event(
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
    launch = cat in _LAUNCH_CATS
    keep = (
        memcpy
        or launch
        or (cat == "user_annotation" and name.startswith(PREFIX))
        or (cat in _CPU_OP_CATS and name == _COPY_OP)
    )
    return keep, memcpy or cat in _DEVICE_CATS


# ---------------------------------------------------------------------------- in-memory events
def _activities(profiled: object, source: Source) -> Iterable[Any] | None:
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


def _memory_events(activities: Iterable[Any], mode: Mode = "auto") -> tuple[list[_Event], bool]:
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
    events: list[_Event] = []
    launches: dict[Any, tuple[Any, str, str]] = {}
    has_device = False
    skip_ops = mode == "device"
    for activity in activities:
        cat = activity.type().lower()
        if cat in _NOT_COMPLETE_CATS or (skip_ops and cat in _CPU_OP_CATS):
            continue
        name = activity.name()
        keep, device = _wanted(cat, name)
        has_device = has_device or device
        if not keep:
            continue
        if cat in _LAUNCH_CATS and not name.startswith("Memcpy "):
            correlation = activity.correlation_id() or None
            if correlation is not None:
                launches.setdefault(correlation, (activity, cat, name))
            continue
        events.append(_from_activity(activity, cat, name, device))
    events += _launches_of_memcpys(
        events, lambda c: _from_activity(*launches[c], device=True), launches
    )
    return events, has_device


def _from_activity(activity: Any, cat: str, name: str, device: bool) -> _Event:
    start = activity.timestamp()
    return _Event(
        name=name,
        cat=cat,
        thread=(activity.device_id(), _sanitize_tid(activity.resource_id())),
        start=start,
        end=start + max(activity.duration(), 0),
        args=_Metadata(activity),
        correlation=(activity.correlation_id() or None) if device else None,
    )


def _our_ranges(events: Iterable[_Event]) -> dict[tuple[Any, Any], list[_Span]]:
    """Our offload ranges (CPU ``user_annotation`` events that parse), per thread."""
    ranges: dict[tuple[Any, Any], list[_Span]] = defaultdict(list)
    for event in events:
        if event.cat != "user_annotation":
            continue
        key = parse_range_name(event.name)
        if key is not None:
            ranges[event.thread].append(_Span(event.start, event.end, key))
    return ranges


# -------------------------------------------------------------------------------- attribution
def _innermost(ranges: list[_Span], queries: list[_Span]) -> list[RangeKey | None]:
    """For each query interval (one thread), the key of the innermost range containing it.

    A sweep in start order keeps the stack of ranges open at the current time; ranges on one
    thread nest like a call stack, so the topmost open range that outlasts the query wins."""
    spans = sorted(ranges, key=lambda s: (s.start, -s.end))
    out: list[RangeKey | None] = [None] * len(queries)
    stack: list[_Span] = []
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


def _close(stack: list[_Span], now: int) -> None:
    """Pop the ranges that ended before ``now``."""
    while stack and stack[-1].end < now:
        stack.pop()


def _attribute(
    ranges: Mapping[tuple[Any, Any], list[_Span]], items: list[tuple[tuple[Any, Any], _Span]]
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


# ---------------------------------------------------------------------------------- device mode
def _memcpy_direction(name: str) -> Direction | None:
    """``d2h``/``h2d`` for a device memcpy event name; None for any other event (DtoD ...)."""
    for prefix, direction in _MEMCPY_PREFIXES.items():
        if name.startswith(prefix):
            return direction
    return None


def _memcpy_bytes(event: _Event) -> int:
    nbytes = event.args.get("bytes")
    if nbytes is None:
        raise TraceFormatError(
            f"device memcpy {event.name!r} (correlation {event.correlation_id()}) has no "
            "'bytes' in its args; this profiler/Kineto version does not record memcpy sizes"
        )
    return int(nbytes)


def _attribute_launches(
    ranges: Mapping[tuple[Any, Any], list[_Span]], launches: list[_Event | None]
) -> list[RangeKey | None]:
    """The range each launching API call started in (None for a memcpy with no launch event)."""
    found = [(i, e) for i, e in enumerate(launches) if e is not None]
    keys = _attribute(ranges, [(e.thread, _Span(e.start, e.start, None)) for _, e in found])
    out: list[RangeKey | None] = [None] * len(launches)
    for (index, _), key in zip(found, keys, strict=True):
        out[index] = key
    return out


def _count_device(
    events: list[_Event], ranges: Mapping[tuple[Any, Any], list[_Span]]
) -> TransferCounts:
    """Device mode: memcpy -> (correlation id) -> launching API call -> enclosing range."""
    launches: dict[Any, _Event] = {}
    for event in events:
        if event.cat in _LAUNCH_CATS and (correlation := event.correlation_id()) is not None:
            launches.setdefault(correlation, event)
    memcpys = [(e, d) for e in events if (d := _memcpy_direction(e.name)) is not None]
    keys = _attribute_launches(ranges, [launches.get(e.correlation_id()) for e, _ in memcpys])
    by_range: dict[RangeKey, Counts] = defaultdict(Counts)
    unattributed = {d: Counts() for d in DIRECTIONS}
    pageable = 0
    for (event, direction), key in zip(memcpys, keys, strict=True):
        counts = Counts(1, _memcpy_bytes(event))
        if key is None or key.direction != direction:
            unattributed[direction] += counts
            continue
        by_range[key] += counts
        pageable += "Pageable" in event.name
    return TransferCounts(dict(by_range), unattributed, pageable, mode="device")


# ------------------------------------------------------------------------------------- CPU mode
def _outermost_copies(events: Iterable[_Event]) -> list[_Event]:
    """The ``aten::copy_`` CPU ops not nested inside another ``aten::copy_`` on their thread."""
    by_thread: dict[tuple[Any, Any], list[_Event]] = defaultdict(list)
    for event in events:
        if event.cat in _CPU_OP_CATS and event.name == _COPY_OP:
            by_thread[event.thread].append(event)
    outer: list[_Event] = []
    for copies in by_thread.values():
        stack: list[_Event] = []
        for event in sorted(copies, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1].end < event.start:
                stack.pop()
            if stack and stack[-1].end >= event.end:
                continue  # a copy_ inside a copy_ (e.g. a dtype/layout conversion): counted once
            stack.append(event)
            outer.append(event)
    return outer


def _copy_bytes(event: _Event) -> int:
    """Bytes written by an ``aten::copy_`` op: numel(self) * element size of self."""
    dims, types = event.args.get("Input Dims"), event.args.get("Input type")
    if not dims or not types:
        raise TraceFormatError(
            "aten::copy_ inside an offload range has no recorded shapes/types; profile with "
            "record_shapes=True (e.g. harness.measure.transfers.transfer_profiler)"
        )
    return math.prod(int(n) for n in dims[0]) * element_size(str(types[0]))


def _count_cpu(
    events: list[_Event], ranges: Mapping[tuple[Any, Any], list[_Span]]
) -> TransferCounts:
    """CPU mode: outermost ``aten::copy_`` ops inside our innermost range on their thread."""
    copies = _outermost_copies(events)
    items = [(e.thread, _Span(e.start, e.end, None)) for e in copies]
    by_range: dict[RangeKey, Counts] = defaultdict(Counts)
    for event, key in zip(copies, _attribute(ranges, items), strict=True):
        if key is not None:
            by_range[key] += Counts(1, _copy_bytes(event))
    return TransferCounts(dict(by_range), mode="cpu")
