"""``harness.measure.transfers``' readers: the in-memory reader agrees with the exported chrome
trace (copies in and out of our ranges, other threads, which source is read), and the trace
reader on synthetic traces (dtype names, element sizes, thread and time boundaries, device-mode
attribution, in memory and from the file). The copy counter against the reference offloader's
own accounting is in ``test_transfers.py``; on a training run in
``tests/e2e/test_transfers_runs.py``."""

from __future__ import annotations

import gzip
import json
import threading
import time
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transfer_traces import NEEDS_IN_MEMORY_ACTIVITIES
from transfer_traces import both_ways as _both_ways

import harness.measure.transfers
from harness.measure.transfers import (
    ELEMENT_SIZES,
    SOURCE_ENV,
    Counts,
    TraceFormatError,
    count_transfers,
    element_size,
    transfer_profiler,
)
from harness.offload.ranges import RangeKey, range_name


# ------------------------------------------------------- in-memory reader vs the chrome trace
@NEEDS_IN_MEMORY_ACTIVITIES
def test_memory_reader_matches_chrome_trace_on_copies_in_ranges(tmp_path: Path) -> None:
    src, dst = torch.ones(6, 5), torch.empty(6, 5)
    half, wide = torch.empty(5, 6, dtype=torch.bfloat16), torch.ones(6, 5, dtype=torch.float64)

    def work() -> None:
        dst.copy_(src)  # outside our ranges
        with record_function(range_name("d2h", "core_attn", 0, 1)):
            dst.copy_(src)
            dst[:2].copy_(src[:2])
            half.copy_(wide.t())  # conversion: a copy_ nested in a copy_ counts once
            with record_function("foreign"):
                dst[:3].copy_(src[:3])  # innermost *parsing* range: the d2h one
            with record_function(range_name("h2d", "attn_proj", 1, 0)):
                dst[:1].copy_(src[:1])
                src.to(torch.float16)
        with record_function("offload_harness.d2h|core_attn|mb=x|layer=1"):  # does not parse
            dst.copy_(src)

    with transfer_profiler("cpu") as prof:
        work()
    counts = count_transfers(prof)
    assert counts.mode == "cpu"
    assert counts.by_range == {
        RangeKey("d2h", "core_attn", 0, 1): Counts(4, (30 + 10 + 15) * 4 + 30 * 2),
        RangeKey("h2d", "attn_proj", 1, 0): Counts(2, 5 * 4 + 30 * 2),
    }
    assert _both_ways(prof, tmp_path, ("auto", "device")) == counts  # device mode: nothing


@NEEDS_IN_MEMORY_ACTIVITIES
def test_memory_reader_matches_chrome_trace_on_other_threads(tmp_path: Path) -> None:
    """Profiling all threads: both readers tell the threads apart the same way (a copy on
    another thread during our range is not in it; that thread's own range is)."""
    src, dst = torch.ones(4, 4), torch.empty(4, 4)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        pytest.skip("this torch cannot profile all threads")
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        release.wait(10)
        dst[:1].copy_(src[:1])  # during the main thread's range, but not inside it
        with record_function(range_name("h2d", "attn_proj", 0, 3)):
            dst[:2].copy_(src[:2])

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(10)
    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=config
    ) as prof:
        with record_function(range_name("d2h", "core_attn", 0, 3)):
            release.set()
            thread.join(10)
            dst.copy_(src)
    assert _both_ways(prof, tmp_path).by_range == {
        RangeKey("d2h", "core_attn", 0, 3): Counts(1, 64),
        RangeKey("h2d", "attn_proj", 0, 3): Counts(1, 32),
    }


@NEEDS_IN_MEMORY_ACTIVITIES
def test_source_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    with transfer_profiler("cpu") as prof:
        with record_function(range_name("d2h", "core_attn", 0, 0)):
            torch.empty(3).copy_(torch.ones(3))
    expected = {RangeKey("d2h", "core_attn", 0, 0): Counts(1, 12)}
    trace = {"traceEvents": [_x(range_name("d2h", "core_attn", 0, 0), "user_annotation", 1, 9)]}
    trace["traceEvents"].append(_copy(2, 1, "float", [3]))
    loaded: list[Any] = []

    def fake_load(source: Any, *, exact: bool = True) -> dict[str, Any]:  # exported only once
        assert not exact  # the counter reads floats as text, converting only what it counts
        loaded.append(source)
        return trace

    monkeypatch.setattr(harness.measure.transfers, "load_trace", fake_load)
    assert count_transfers(prof).by_range == expected
    assert count_transfers(prof, source="memory").by_range == expected
    assert loaded == []  # read in memory (repeatably)
    assert count_transfers(prof, source="trace").by_range == expected
    assert loaded == [prof]
    monkeypatch.setenv(SOURCE_ENV, "trace")
    assert count_transfers(prof).by_range == expected
    assert loaded == [prof, prof]
    assert count_transfers(prof, source="memory").by_range == expected  # explicit wins
    assert loaded == [prof, prof]
    monkeypatch.delenv(SOURCE_ENV)
    with pytest.raises(TypeError, match="source='memory' needs a finished profiler"):
        count_transfers(trace, source="memory")
    with pytest.raises(ValueError, match="source must be"):
        count_transfers(prof, source="json")  # type: ignore[arg-type]
    # a profiler object without in-memory activities (older torch): its chrome trace is read
    old = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace()))
    assert count_transfers(old).by_range == expected  # type: ignore[arg-type]
    assert loaded[-1] is old
    with pytest.raises(TypeError, match="does not expose its Kineto activities"):
        count_transfers(old, source="memory")  # type: ignore[arg-type]


# ------------------------------------------------------------------------- synthetic traces
def _x(name: str, cat: str, ts: str | float, dur: str | float, tid: Any = 1, **args: Any) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def _copy(ts: float, dur: float, type_name: str, dims: list[int], tid: int = 1) -> dict:
    return _x(
        "aten::copy_",
        "cpu_op",
        ts,
        dur,
        tid,
        **{"Input type": [type_name, type_name, "Scalar"], "Input Dims": [dims, dims, []]},
    )


# Type names as torch 2.13 (Linux) writes them in ``Input type``, and their element sizes.
TYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.int64: "long int",
    torch.int32: "int",
    torch.int16: "short int",
    torch.int8: "signed char",
    torch.uint8: "unsigned char",
    torch.bool: "bool",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
    torch.float8_e4m3fn: "c10::Float8_e4m3fn",
    torch.float8_e5m2: "c10::Float8_e5m2",
}


@pytest.mark.parametrize("dtype", list(TYPE_NAMES), ids=str)
def test_dtype_name_mapping_on_synthetic_trace(dtype: torch.dtype) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert element_size(TYPE_NAMES[dtype]) == itemsize
    trace = {
        "traceEvents": [
            _x(range_name("d2h", "core_attn", 0, 0), "user_annotation", 100.0, 50.0),
            _copy(110.0, 10.0, TYPE_NAMES[dtype], [3, 5]),
            _copy(111.0, 2.0, TYPE_NAMES[dtype], [3, 5]),  # nested in the one above: not counted
            _copy(130.0, 5.0, TYPE_NAMES[dtype], []),  # 0-dim: one element
        ]
    }
    counts = count_transfers(trace)
    assert counts.by_range == {RangeKey("d2h", "core_attn", 0, 0): Counts(2, 16 * itemsize)}


def test_element_size_table_and_unknown_names() -> None:
    assert element_size("c10::dummy_uint1_7_t<4>") == 1
    assert all(size in (1, 2, 4, 8, 16) for size in ELEMENT_SIZES.values())
    with pytest.raises(TraceFormatError, match="unknown tensor type name 'mystery'"):
        element_size("mystery")


def test_cpu_copies_on_other_threads_and_boundaries() -> None:
    rng = range_name("h2d", "attn_proj", 1, 2)
    trace = {
        "traceEvents": [
            _x(rng, "user_annotation", "5168092192453.407", "10.000"),
            _copy("5168092192453.407", "10.000", "float", [4]),  # exactly the range: inside
            _copy("5168092192453.408", "10.000", "float", [4]),  # ends 1 ns after: outside
            _copy("5168092192455", "1", "float", [4], tid=2),  # other thread: outside
        ]
    }
    counts = count_transfers(trace)
    assert counts.by_range == {RangeKey("h2d", "attn_proj", 1, 2): Counts(1, 16)}


def _device_trace() -> dict:
    d2h = range_name("d2h", "core_attn", 0, 1)
    h2d = range_name("h2d", "core_attn", 0, 1)
    runtime, memcpy = "cuda_runtime", "gpu_memcpy"
    return {
        "traceEvents": [
            _x(d2h, "user_annotation", "1000.000", "100.000"),
            _x(d2h, "gpu_user_annotation", "1000.000", "999.000", tid="stream 7"),  # GPU side
            _x("cudaMemcpyAsync", runtime, "1010.500", "5.0", correlation=11),
            _x("cudaMemcpyAsync", runtime, "1020.000", "5.0", correlation=12),
            _x("cudaMemcpyAsync", runtime, "1030.000", "5.0", correlation=13),  # DtoD: ignored
            _x("cudaMemcpyAsync", runtime, "1040.000", "5.0", correlation=14),  # HtoD in d2h rng
            _x(h2d, "user_annotation", "2000.000", "100.000"),
            _x("cudaMemcpyAsync", runtime, "2010.000", "5.0", correlation=21),
            _x("cudaMemcpyAsync", runtime, "2020.000", "5.0", correlation=22, tid=9),  # thread
            _x("cudaMemcpyAsync", runtime, "3000.000", "5.0", correlation=31),  # no range
            # device events: their own timestamps are on the GPU timeline (after the ranges)
            _x("Memcpy DtoH (Device -> Pinned)", memcpy, 5000, 1, "s7", correlation=11, bytes=64),
            _x("Memcpy DtoH (Device -> Pinned)", memcpy, 5001, 1, "s7", correlation=12, bytes=32),
            _x("Memcpy DtoD (Device -> Device)", memcpy, 5002, 1, "s7", correlation=13, bytes=8),
            _x("Memcpy HtoD (Pinned -> Device)", memcpy, 5003, 1, "s7", correlation=14, bytes=4),
            _x("Memcpy HtoD (Pageable -> Device)", memcpy, 5004, 1, "s8", correlation=21, bytes=96),
            _x("Memcpy HtoD (Pinned -> Device)", memcpy, 5005, 1, "s8", correlation=22, bytes=16),
            _x("Memcpy DtoH (Device -> Pageable)", memcpy, 5006, 1, "s8", correlation=31, bytes=2),
            _x("Memcpy DtoH (Device -> Pinned)", memcpy, 5007, 1, "s8", correlation=99, bytes=1),
        ]
    }


def test_device_mode_attribution_on_synthetic_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump(_device_trace(), handle)
    for source in (_device_trace(), path, str(path)):
        counts = count_transfers(source)
        assert counts.mode == "device"
        assert counts.by_range == {
            RangeKey("d2h", "core_attn", 0, 1): Counts(2, 96),
            RangeKey("h2d", "core_attn", 0, 1): Counts(1, 96),
        }
        assert counts.pageable == 1
        # misdirected HtoD (4) + other thread (16); no range (2) + no launch event (1)
        assert counts.unattributed == {"d2h": Counts(2, 3), "h2d": Counts(2, 20)}


def test_device_memcpy_without_bytes_raises() -> None:
    trace = _device_trace()
    del trace["traceEvents"][-1]["args"]["bytes"]
    with pytest.raises(TraceFormatError, match="no 'bytes'"):
        count_transfers(trace)
    with pytest.raises(TraceFormatError, match="no 'bytes'"):
        count_transfers(_fake_profiler(_activities_of(trace)))


class _FakeActivity:
    """What ``kineto_results.trace_activities()`` yields (``torch._C._autograd._ITraceActivity``),
    for a synthetic device trace."""

    def __init__(self, event: dict, base_ns: int, tids: dict[Any, int]) -> None:
        self.event, self.base_ns, self.tids = event, base_ns, tids

    def name(self) -> str:
        return self.event["name"]

    def type(self) -> str:
        return self.event["cat"]

    def device_id(self) -> int:
        return self.event["pid"]

    def resource_id(self) -> int:
        return self.tids.setdefault(self.event["tid"], len(self.tids) + 1)

    def timestamp(self) -> int:
        return self.base_ns + int(Decimal(str(self.event["ts"])) * 1000)

    def duration(self) -> int:
        return int(Decimal(str(self.event["dur"])) * 1000)

    def metadata_json(self) -> str:
        return json.dumps(self.event["args"])[1:-1]

    def correlation_id(self) -> int:
        return self.event["args"].get("correlation", 0)

    def linked_correlation_id(self) -> int:
        return 0

    def linked_activity(self) -> None:
        return None

    def flow_id(self) -> int:
        return 0

    def flow_type(self) -> int:
        return 0

    def flow_start(self) -> bool:
        return False


def _activities_of(trace: dict) -> list[_FakeActivity]:
    base_ns, tids = time.time_ns(), {}  # (real timestamps: ns since the epoch)
    return [_FakeActivity(event, base_ns, tids) for event in trace["traceEvents"]]


def _fake_profiler(activities: list[_FakeActivity]) -> Any:
    result = SimpleNamespace(trace_activities=lambda: activities, trace_start_ns=lambda: 0)
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=result))


def test_device_mode_in_memory_on_synthetic_activities(tmp_path: Path) -> None:
    """Device mode read in memory equals the counts of the chrome trace torch's own (Python)
    chrome writer makes of the same activities, and of the synthetic trace itself."""
    activities = _activities_of(_device_trace())
    memory = count_transfers(_fake_profiler(activities), source="memory")
    assert memory == count_transfers(_device_trace())
    exporter = pytest.importorskip("torch.profiler._chrome_trace_export")
    path = tmp_path / "trace.json"
    exporter.export_chrome_trace(_fake_profiler(activities).profiler.kineto_results, str(path))
    assert count_transfers(path) == memory
    assert memory.mode == "device" and memory.pageable == 1
