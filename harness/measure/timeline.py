"""Where a profiled step's device time went, read from its chrome trace (``scripts/bench --trace``).

Method
    Device events are the complete (``"ph": "X"``) events of cat ``kernel``, ``gpu_memcpy`` and
    ``gpu_memset``; an event's ``(pid, tid)`` is its device and CUDA stream. The *compute stream*
    is the stream with the most kernel time. From them:

    window
        first device event's start to the last one's end, over all streams.
    compute busy
        the union of the compute stream's event intervals (kernels, memsets and any copy on it).
    idle gaps
        the compute stream's events in start order; a gap opens where every earlier event has
        ended and closes where the next one starts, and counts when longer than ``min_gap_us``
        (5 us: shorter ones are the normal distance between queued kernels). A gap is
        *launch-bound* when the CUDA runtime/driver call that enqueued the event after it (cat
        ``cuda_runtime``/``cuda_driver``, the same ``args.correlation``) returned after the gap
        opened: the stream had run dry and the device waited for the host. Otherwise it is
        *waiting*: the work was queued in time and the stream waited for something else (an
        event on a copy stream, a cross-stream dependency). A gap whose launch call is not in
        the trace counts as waiting.
    copies
        per direction, the ``gpu_memcpy`` events named ``Memcpy DtoH ...`` or ``Memcpy HtoD ...``
        (``harness.measure.transfers``' direction rule), on any stream: count, bytes
        (``args.bytes``),
        summed duration, rate (bytes / summed duration) and *hidden* time, the part of each
        copy's duration during which the compute stream was
        busy with something other than a DtoH/HtoD copy (so a copy issued on the compute stream
        itself, as ``save_on_cpu`` does, hides nothing). Hidden means overlapped, not free: a
        concurrent copy can still slow the kernels it overlaps. The busy intervals are merged
        once in time order with running sums, so each copy's overlap is two binary searches
        (busy time up to its end minus busy time up to its start), not a scan of the stream.

Phases (``phase_busy``)
    the compute stream's busy time for the work launched inside named host ranges (the
    bench's ``bench.forward|mb=N`` and ``bench.backward|mb=N``): each launch call that starts
    inside such a range, on any thread, brings its correlated compute-stream events. That is
    the device compute a phase has to hide its copies behind, whatever its wall time: a
    launch-bound step's phases last longer than their compute.

Host side (``host_self_times``, ``host_increase``)
    the *self time* of every host event (cat ``cpu_op``, ``user_annotation``,
    ``python_function``, ``cuda_runtime``, ``cuda_driver``): its duration less the time of
    the events nested in it on the same thread, summed per name up to its first ``|`` (so
    ``bench.forward|mb=0`` and ``offload_harness.d2h|core_attn|mb=0|layer=2`` aggregate). A
    range's self time is the Python between its ops. Compared between two variants' traces, the
    names whose self time grew most say where an offloader's extra host time went (on the H200,
    ``aten::fill_`` inside the reference's commits on ``moe-small``: the deterministic mode's
    fill of new host buffers).

Times are exact integer nanoseconds while computing (the trace is read as
``harness.measure.transfers``
reads it: floats as ``Decimal``) and seconds in the result. One device per trace is assumed for
the window; streams of other devices only count there.
"""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.measure.transfers import (
    _LAUNCH_CATS,
    _Event,
    _events,
    _memcpy_bytes,
    _memcpy_direction,
    load_trace,
)

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RANGE_CATS = frozenset({"user_annotation"})
"""Host ranges (``torch.profiler.record_function``)."""
HOST_CATS = frozenset(
    {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"}
)
COPY_KINDS = {"d2h": "DtoH", "h2d": "HtoD"}
"""A copy direction and its label."""
MIN_GAP_US = 5.0
MIB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class Copies:
    """The host/device copies of one direction in a trace, on any stream."""

    kind: str
    """``DtoH`` or ``HtoD``."""
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Summed durations of the copies."""
    hidden_s: float = 0.0
    """Of ``seconds``, the time the compute stream was busy with other work (see the module
    docstring)."""

    @property
    def gbs(self) -> float | None:
        """Bytes / summed duration, GB/s (None without copies)."""
        return self.bytes / self.seconds / 1e9 if self.seconds else None

    @property
    def hidden_fraction(self) -> float | None:
        return self.hidden_s / self.seconds if self.seconds else None

    def summary(self) -> str:
        if not self.count:
            return f"{self.kind} none"
        text = f"{self.kind} {self.bytes / MIB:.1f} MiB in {self.seconds * 1e3:.2f} ms"
        return f"{text} ({self.gbs:.1f} GB/s), {self.hidden_fraction:.0%} hidden"


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """One trace's device timeline, in seconds (see the module docstring for each figure)."""

    compute_stream: Any
    """The compute stream's ``tid``."""
    streams: int
    """Streams with device events."""
    window_s: float
    busy_s: float
    """Compute stream busy time (union of its events)."""
    idle_s: float
    """Sum of the compute stream's gaps longer than the threshold, inside the window."""
    launch_bound_s: float
    """Of ``idle_s``, the gaps in which the device waited for the host's launch call."""
    gaps: int
    launch_bound_gaps: int
    d2h: Copies
    h2d: Copies
    phase_busy_s: dict[str, float] = field(default_factory=dict)
    """Per prefix asked for (``analyse``'s ``phases``), the compute stream's busy time for the
    work launched inside the host ranges whose names start with it (module docstring)."""

    @property
    def waiting_s(self) -> float:
        """Of ``idle_s``, the gaps with the next work already queued."""
        return self.idle_s - self.launch_bound_s

    def summary(self) -> str:
        """One line: busy/window, idle (launch-bound), then each direction's copies."""
        return (
            f"compute busy {self.busy_s * 1e3:.2f} of {self.window_s * 1e3:.2f} ms, "
            f"idle {self.idle_s * 1e3:.2f} ms ({self.launch_bound_s * 1e3:.2f} launch-bound); "
            f"{self.d2h.summary()}; {self.h2d.summary()}"
        )

    def to_json(self) -> dict[str, Any]:
        """The fields, the derived figures and the summary line, JSON-ready."""
        out = asdict(self)
        out["waiting_s"] = self.waiting_s
        for key, copies in (("d2h", self.d2h), ("h2d", self.h2d)):
            out[key]["gbs"] = copies.gbs
            out[key]["hidden_fraction"] = copies.hidden_fraction
        out["summary"] = self.summary()
        return out


def analyse(
    trace: str | os.PathLike[str] | Mapping[str, Any],
    *,
    min_gap_us: float = MIN_GAP_US,
    phases: Sequence[str] = (),
) -> Timeline | None:
    """The device timeline of a chrome trace (a ``.json``/``.json.gz`` path or a loaded dict),
    with the busy time of each of ``phases`` (``phase_busy``); None when the trace has no device
    events (a CPU-only profile)."""
    events = list(_events(load_trace(trace)))
    device = [e for e in events if e.cat in DEVICE_CATS]
    if not device:
        return None
    by_stream: dict[tuple[Any, Any], list[_Event]] = defaultdict(list)
    for event in device:
        by_stream[event.thread].append(event)
    compute = max(by_stream, key=lambda s: _kernel_ns(by_stream[s]))
    stream = sorted(by_stream[compute], key=lambda e: e.start)
    launched = [e for e in events if e.cat in _LAUNCH_CATS and "correlation" in e.args]
    launches = {e.args["correlation"]: e for e in launched}
    launch_bound, waiting = _gaps(stream, launches, round(min_gap_us * 1e3))
    other_work = _BusyTime(e for e in stream if _copy_kind(e) is None)
    copies = {kind: _copies(kind, device, other_work) for kind in COPY_KINDS.values()}
    return Timeline(
        compute_stream=compute[1],
        streams=len(by_stream),
        window_s=_seconds(max(e.end for e in device) - min(e.start for e in device)),
        busy_s=_seconds(_BusyTime(stream).total),
        idle_s=_seconds(sum(launch_bound) + sum(waiting)),
        launch_bound_s=_seconds(sum(launch_bound)),
        gaps=len(launch_bound) + len(waiting),
        launch_bound_gaps=len(launch_bound),
        d2h=copies["DtoH"],
        h2d=copies["HtoD"],
        phase_busy_s=_phase_busy(phases, events, launched, stream) if phases else {},
    )


def phase_busy(
    trace: str | os.PathLike[str] | Mapping[str, Any], prefixes: Sequence[str]
) -> dict[str, float] | None:
    """Per prefix, the compute stream's busy seconds for the device work launched inside the
    host ranges whose names start with it (``bench.forward``: every microbatch's forward):
    a launch call (cat ``cuda_runtime``/``cuda_driver``, any thread: the autograd engine
    launches a backward's kernels from its own thread) that starts within such a range's span
    counts its correlated events on the compute stream. None without device events.
    (``analyse(trace, phases=prefixes)`` gives the same with the rest of the timeline.)"""
    found = analyse(trace, phases=prefixes)
    return None if found is None else found.phase_busy_s


def _phase_busy(
    prefixes: Sequence[str],
    events: Sequence[_Event],
    launched: Sequence[_Event],
    stream: Sequence[_Event],
) -> dict[str, float]:
    """``phase_busy`` from a parsed trace: all its ``events``, the launch calls among them and
    the compute stream's events."""
    on_compute = {e.args["correlation"]: e for e in stream if "correlation" in e.args}
    launched = sorted(launched, key=lambda e: e.start)
    starts = [e.start for e in launched]
    out: dict[str, float] = {}
    for prefix in prefixes:
        work: list[_Event] = []
        for span in (e for e in events if e.cat in RANGE_CATS and e.name.startswith(prefix)):
            first = bisect.bisect_left(starts, span.start)
            last = bisect.bisect_right(starts, span.end)
            for launch in launched[first:last]:
                event = on_compute.get(launch.args["correlation"])
                if event is not None:
                    work.append(event)
        out[prefix] = _seconds(_BusyTime(work).total)
    return out


def _seconds(ns: int) -> float:
    return ns / 1e9


def _kernel_ns(events: Iterable[_Event]) -> int:
    return sum(e.end - e.start for e in events if e.cat == "kernel")


def _copy_kind(event: _Event) -> str | None:
    if event.cat != "gpu_memcpy":
        return None
    direction = _memcpy_direction(event.name)
    return None if direction is None else COPY_KINDS[direction]


def _gaps(
    stream: Sequence[_Event], launches: Mapping[Any, _Event], min_gap_ns: int
) -> tuple[list[int], list[int]]:
    """The idle gaps (ns) of ``stream`` (sorted by start) longer than ``min_gap_ns``: launch-bound
    ones and waiting ones."""
    launch_bound: list[int] = []
    waiting: list[int] = []
    opened = stream[0].end  # the gap opens when every earlier event has ended
    for event in stream[1:]:
        gap = event.start - opened
        if gap > min_gap_ns:
            launch = launches.get(event.args.get("correlation"))
            late = launch is not None and launch.end > opened
            (launch_bound if late else waiting).append(gap)
        opened = max(opened, event.end)
    return launch_bound, waiting


class _BusyTime:
    """The union of some events' intervals, answering "busy time between a and b" by binary
    search: merged disjoint intervals in time order and the busy time before each."""

    def __init__(self, events: Iterable[_Event]) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        for event in sorted(events, key=lambda e: e.start):
            if self.ends and event.start <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], event.end)
            else:
                self.starts.append(event.start)
                self.ends.append(event.end)
        self.before = [0]
        for start, end in zip(self.starts, self.ends, strict=True):
            self.before.append(self.before[-1] + end - start)

    @property
    def total(self) -> int:
        return self.before[-1]

    def until(self, t: int) -> int:
        """Busy time before instant ``t``."""
        i = bisect.bisect_right(self.starts, t)  # intervals that start at or before t
        if i == 0:
            return 0
        return self.before[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def between(self, start: int, end: int) -> int:
        return self.until(end) - self.until(start)


def _copies(kind: str, device: Iterable[_Event], busy: _BusyTime) -> Copies:
    found = [e for e in device if _copy_kind(e) == kind]
    return Copies(
        kind=kind,
        count=len(found),
        bytes=sum(_memcpy_bytes(e) for e in found),
        seconds=_seconds(sum(e.end - e.start for e in found)),
        hidden_s=_seconds(sum(busy.between(e.start, e.end) for e in found)),
    )


def host_self_times(trace: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, float]:
    """Seconds of host self time per event name (up to its first ``|``) in a chrome trace: each
    host event's duration less what is nested in it on its thread (module docstring)."""
    by_thread: dict[tuple[Any, Any], list[_Event]] = defaultdict(list)
    for event in _events(load_trace(trace)):
        if event.cat in HOST_CATS:
            by_thread[event.thread].append(event)
    self_ns: dict[str, int] = defaultdict(int)

    def close(event: _Event, nested: int) -> None:
        self_ns[event.name.split("|", 1)[0]] += max(0, event.end - event.start - nested)

    for events in by_thread.values():
        events.sort(key=lambda e: (e.start, -e.end))  # a parent before what it contains
        stack: list[list[Any]] = []  # [event, nested ns]
        for event in events:
            while stack and stack[-1][0].end <= event.start:
                close(*stack.pop())
            if stack:  # nested in the innermost open event (clipped if it overhangs)
                stack[-1][1] += min(event.end, stack[-1][0].end) - event.start
            stack.append([event, 0])
        while stack:
            close(*stack.pop())
    return {name: _seconds(ns) for name, ns in self_ns.items()}


def host_increase(
    baseline: Mapping[str, float], other: Mapping[str, float], top: int = 5
) -> list[tuple[str, float]]:
    """The ``top`` names whose host self time (``host_self_times``) grew most from
    ``baseline`` to ``other``, with the growth in seconds, largest first; only growths."""
    grown = ((name, other[name] - baseline.get(name, 0.0)) for name in other)
    return sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:top]
