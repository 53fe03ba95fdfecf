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
    CPU mode is proven identical both ways on real runs (``tests/e2e/test_transfers_runs.py``).
    Device mode reads the same fields the same way (tested on synthetic activities against
    torch's chrome writer), but equality on real CUDA traces is not proven yet: the H200 box's
    torch 2.11 has no ``trace_activities``, so there every count comes from the chrome trace
    (the proof, ``pytest tests/unit/test_transfers.py tests/e2e/test_transfers_runs.py -k
    memory_counts_match_chrome_trace``, skips on such a torch and is owed on a CUDA build that
    has it).

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

This module is the counter's entry points and re-exports its records; the rest lives beside
it: ``transfercounts`` (``Counts``, ``TransferCounts``, element sizes), ``traceevents`` (the
events, read from memory or from a chrome trace) and ``rangematch`` (which range each copy ran
in, device and CPU mode).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from harness.measure.rangematch import count_cpu, count_device, our_ranges
from harness.measure.traceevents import (
    SOURCE_ENV,
    Mode,
    Source,
    kineto_activities,
    memory_events,
    read_json,
    trace_events,
)
from harness.measure.transfercounts import (
    DIRECTIONS,
    ELEMENT_SIZES,
    Counts,
    TraceFormatError,
    TransferCounts,
    element_size,
)

__all__ = [
    "DIRECTIONS",
    "ELEMENT_SIZES",
    "SOURCE_ENV",
    "Counts",
    "Mode",
    "Source",
    "TraceFormatError",
    "TransferCounts",
    "count_transfers",
    "element_size",
    "load_trace",
    "profile_transfers",
    "transfer_profiler",
]


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
    activities = kineto_activities(profiled, source)
    if activities is not None:
        events, has_device = memory_events(activities, mode)
    else:
        events, has_device = trace_events(load_trace(profiled, exact=False), mode)
    if mode == "auto":
        mode = "device" if has_device else "cpu"
    ranges = our_ranges(events)
    return count_device(events, ranges) if mode == "device" else count_cpu(events, ranges)


def load_trace(
    source: profile | str | os.PathLike[str] | Mapping[str, Any], *, exact: bool = True
) -> dict[str, Any]:
    """The chrome trace of ``source`` as a dict; floats are parsed as ``Decimal`` (exact), or
    with ``exact=False`` kept as their text (``_ns`` converts the ones a counter reads,
    exactly: a profiled training step's trace holds thousands of events it never reads)."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str | os.PathLike):
        return read_json(Path(source), exact)
    if not hasattr(source, "export_chrome_trace"):
        raise TypeError(f"expected a torch.profiler.profile, a path or a dict, got {source!r}")
    with tempfile.TemporaryDirectory(prefix="offload_harness_trace_") as tmp:
        path = Path(tmp) / "trace.json"
        source.export_chrome_trace(str(path))
        return read_json(path, exact)


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
