"""``harness.measure.transfers``: the profiler-based copy counter agrees with the reference
offloader's own accounting and with bytes derived from the saved tensors' shapes."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import harness.measure.transfers
from harness.measure.transfers import (
    ELEMENT_SIZES,
    SOURCE_ENV,
    Counts,
    TraceFormatError,
    TransferCounts,
    count_transfers,
    element_size,
    profile_transfers,
    transfer_profiler,
)
from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.ranges import RangeKey, range_name
from harness.offload.reference import OffloadContext
from harness.vocab.spec import RunSpec, preset

NEEDS_IN_MEMORY_ACTIVITIES = pytest.mark.skipif(
    not hasattr(torch._C._autograd._ProfilerResult, "trace_activities"),
    reason=f"torch {torch.__version__} keeps no Kineto activities in memory (no "
    "trace_activities; on the H200 box's torch 2.11): counting reads the chrome trace there",
)


T, H = 8, 16  # tokens, hidden
WIDE, NARROW = 12, 4  # column slices: 12/16 >= 50% of storage (whole-storage path), 4/16 < 50%
MICROBATCHES, LAYERS = 2, 2
FIELDS = ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes")


# ---------------------------------------------------------------------------------- scenario
class Scenario:
    """A two-group toy layer stack driven through the reference offloader."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)

        def param(*shape: int) -> torch.nn.Parameter:
            value = torch.randn(*shape, generator=gen) / shape[0] ** 0.5
            return torch.nn.Parameter(value.to(device=device, dtype=dtype))

        self.w_in, self.u, self.v = param(H, H), param(NARROW, H), param(T, T)
        self.w = [param(H, H) for _ in range(LAYERS)]
        self.w_p = [param(H, H) for _ in range(LAYERS)]
        self.w_o = [param(WIDE, H) for _ in range(LAYERS)]
        self.inputs = [
            torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
            for _ in range(MICROBATCHES)
        ]
        config = OffloadConfig(
            offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=0
        )
        self.off = OffloadContext(config, device)
        self.off.mark_not_offloadable(self.w_in, self.u, self.v, *self.w, *self.w_p, *self.w_o)

    def layer(self, mb: int, i: int, x: torch.Tensor) -> torch.Tensor:
        g = self.off.group("core_attn", x, layer=i)
        with g:
            y = torch.tanh(g.input @ self.w[i])  # saves g.input (mm) and y (tanh output)
            y = y + y[:, :NARROW] @ self.u  # saves a sparse view of y: gathered
        y = g.commit(y)
        g = self.off.group("attn_proj", y, layer=i)
        with g:
            h = g.input @ self.w_p[i]  # saves g.input
            o = h[:, :WIDE].t() @ self.v  # saves a dense transposed view of h: whole storage
            out = o.t() @ self.w_o[i]  # saves o.t(): a transposed view of all of o
        return g.commit(out)

    def iteration(self) -> None:
        for mb, inp in enumerate(self.inputs):
            self.off.begin_microbatch(mb)
            x = inp @ self.w_in
            for i in range(LAYERS):
                x = self.layer(mb, i, x)
            x.float().square().mean().backward()
        self.off.end_iteration()

    def records(self) -> dict[tuple[int, int, str], dict[str, int]]:
        """The offloader's own counts for the last iteration (groups that copied anything)."""
        groups = self.off.iteration_logs()[-1].groups
        rows = {g.key: {f: getattr(g, f) for f in FIELDS} for g in groups}
        return {key: row for key, row in rows.items() if any(row.values())}


def expected_from_shapes(itemsize: int) -> dict[tuple[int, int, str], dict[str, int]]:
    """Warmup iteration: every group offloaded; each saved tensor goes out and back once."""
    per_group = {
        # g.input, tanh output, y[:, :NARROW] gathered to contiguous
        "core_attn": [T * H, T * H, T * NARROW],
        # g.input, storage of h (under h[:, :WIDE].t()), storage of o (under o.t())
        "attn_proj": [T * H, T * H, WIDE * T],
    }
    out = {}
    for mb in range(MICROBATCHES):
        for layer in range(LAYERS):
            for name, numels in per_group.items():
                copies, nbytes = len(numels), sum(numels) * itemsize
                out[(mb, layer, name)] = dict(
                    zip(FIELDS, (copies, nbytes, copies, nbytes), strict=True)
                )
    return out


def _check_against_offloader(device: str, dtype: torch.dtype) -> None:
    scenario = Scenario(device, dtype)
    counts = profile_transfers(scenario.iteration, device)  # warmup: all groups offloaded
    assert counts.by_group() == scenario.records()
    assert counts.by_group() == expected_from_shapes(torch.empty((), dtype=dtype).element_size())
    counts = profile_transfers(scenario.iteration, device)  # steady state (policies may keep)
    assert counts.by_group() == scenario.records()
    assert counts.pageable == 0
    assert all(c == Counts() for c in counts.unattributed.values())


# ------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_counts_match_offloader_and_shapes(dtype: torch.dtype) -> None:
    _check_against_offloader("cpu", dtype)


def test_cpu_aggregations() -> None:
    scenario = Scenario("cpu", torch.float32)
    counts = profile_transfers(scenario.iteration, "cpu")
    assert counts.mode == "cpu"
    expected = expected_from_shapes(4)
    d2h_bytes = sum(row["d2h_bytes"] for row in expected.values())
    assert counts.totals()["d2h"] == Counts(6 * MICROBATCHES * LAYERS, d2h_bytes)
    assert counts.totals()["h2d"] == counts.totals()["d2h"]
    core = counts.by_name()[("d2h", "core_attn")]
    assert core == Counts(
        3 * MICROBATCHES * LAYERS, MICROBATCHES * LAYERS * (2 * T * H + T * NARROW) * 4
    )
    key = RangeKey("h2d", "attn_proj", 1, 0)
    assert counts.by_range[key] == Counts(3, (2 * T * H + WIDE * T) * 4)


def test_copies_outside_our_ranges_are_not_attributed() -> None:
    src, dst = torch.ones(3, 5), torch.empty(3, 5)
    ours = range_name("d2h", "core_attn", 0, 1)

    def work() -> None:
        dst.copy_(src)  # no range at all
        with record_function("some_other_range"):
            dst.copy_(src)
        with record_function("offload_harness.d2h|core_attn|mb=x|layer=1"):  # does not parse
            dst.copy_(src)
        with record_function(ours):
            with record_function("inner_foreign_range"):
                dst[:2].copy_(src[:2])  # innermost *parsing* range is ours
            with record_function(range_name("h2d", "attn_proj", 2, 3)):
                dst[:1].copy_(src[:1])  # nested range of ours: the inner one wins
        dst.copy_(src)  # after our range closed

    counts = profile_transfers(work, "cpu")
    assert counts.by_range == {
        RangeKey("d2h", "core_attn", 0, 1): Counts(1, 2 * 5 * 4),
        RangeKey("h2d", "attn_proj", 2, 3): Counts(1, 1 * 5 * 4),
    }


def test_conversion_copy_counts_once_with_destination_bytes() -> None:
    dst, src = torch.empty(4, 6, dtype=torch.bfloat16), torch.ones(6, 4).t()

    def work() -> None:
        with record_function(range_name("d2h", "core_attn", 0, 0)):
            dst.copy_(src)  # dtype change + transposed source

    counts = profile_transfers(work, "cpu")
    assert counts.by_range == {RangeKey("d2h", "core_attn", 0, 0): Counts(1, 4 * 6 * 2)}


@pytest.mark.parametrize(
    "source", [pytest.param("memory", marks=NEEDS_IN_MEMORY_ACTIVITIES), "trace"]
)
def test_missing_shapes_raise_a_clear_error(source: str) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(range_name("d2h", "core_attn", 0, 0)):
            torch.empty(3).copy_(torch.ones(3))
    with pytest.raises(TraceFormatError, match="record_shapes=True"):
        count_transfers(prof, mode="cpu", source=source)  # type: ignore[arg-type]


def test_transfer_profiler_records_shapes() -> None:
    with transfer_profiler("cpu") as prof:
        with record_function(range_name("h2d", "attn_proj", 3, 7)):
            torch.empty(2, 3, dtype=torch.float64).copy_(torch.ones(2, 3, dtype=torch.float64))
    counts = count_transfers(prof)
    assert counts.mode == "cpu"
    assert counts.by_range == {RangeKey("h2d", "attn_proj", 3, 7): Counts(1, 6 * 8)}


# ------------------------------------------------------- in-memory reader vs the chrome trace
def _both_ways(
    prof: Any, tmp_path: Path, modes: tuple[str, ...] = ("auto",), python_writer: bool = True
) -> TransferCounts:
    """Counts read in memory; asserts they equal the counts of the exported chrome trace, as
    Kineto's writer makes it (``export_chrome_trace``; once per profiler) and as torch's Python
    writer makes it. Returns the counts of the first mode."""
    paths = [tmp_path / "kineto_trace.json"]
    prof.export_chrome_trace(str(paths[0]))
    if python_writer:
        paths.append(tmp_path / "python_trace.json")
        prof.profiler.export_chrome_trace(str(paths[1]), use_python_export=True)
    out = []
    for mode in modes:
        memory = count_transfers(prof, mode=mode, source="memory")  # type: ignore[arg-type]
        for path in paths:
            from_file = count_transfers(path, mode=mode)  # type: ignore[arg-type]
            assert memory.by_range == from_file.by_range, path.name
            assert memory.unattributed == from_file.unattributed, path.name
            assert memory.pageable == from_file.pageable, path.name
            assert memory == from_file, path.name  # mode too
        assert count_transfers(prof, mode=mode) == memory  # type: ignore[arg-type]
        out.append(memory)
    return out[0]


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
def test_memory_reader_matches_chrome_trace_on_a_training_run(tmp_path: Path) -> None:
    spec = preset("hybrid-tiny")
    run = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="bf16")
    config = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=0)
    off = OffloadContext(config, "cpu")
    with transfer_profiler("cpu") as prof:
        train(spec, run, off, "cpu")
    off.close()
    counts = _both_ways(prof, tmp_path)
    assert counts.mode == "cpu"
    moved = {(key.direction, key.name) for key, c in counts.by_range.items() if c.bytes}
    assert moved == {(d, n) for d in ("d2h", "h2d") for n in ("core_attn", "attn_proj")}


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


# -------------------------------------------------------------------------------------- CUDA
def _cuda_check_memory_matches_trace(work: Callable[[], object], tmp_path: Path) -> TransferCounts:
    with transfer_profiler("cuda") as prof:
        work()
    # Kineto's writer only: it is the reference, and the Python writer's device properties
    # block is beside the point here
    counts = _both_ways(prof, tmp_path, ("auto", "device"), python_writer=False)
    assert counts.mode == "device"
    return counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@NEEDS_IN_MEMORY_ACTIVITIES
def test_cuda_memory_counts_match_chrome_trace(tmp_path: Path) -> None:
    """Proof on the GPU box that device mode read in memory equals the chrome trace's counts:
    attributed pinned copies (forward thread and autograd's device thread), an attributed
    pageable copy, and unattributed copies both ways."""
    scenario = Scenario("cuda", torch.float32)
    host = torch.ones(1 << 12)

    def work() -> None:
        scenario.iteration()
        with record_function(range_name("h2d", "core_attn", 9, 9)):
            host.to("cuda")  # pageable HtoD inside our range
        host.to("cuda").cpu()  # outside our ranges: unattributed HtoD and DtoH

    counts = _cuda_check_memory_matches_trace(work, tmp_path)
    scenario.off.close()
    assert counts.by_range[RangeKey("h2d", "core_attn", 9, 9)] == Counts(1, 4 << 12)
    assert counts.pageable == 1
    assert counts.unattributed["h2d"].copies >= 1 and counts.unattributed["d2h"].copies >= 1
    expected = expected_from_shapes(4)
    assert {k: v for k, v in counts.by_group().items() if k != (9, 9, "core_attn")} == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@NEEDS_IN_MEMORY_ACTIVITIES
def test_cuda_training_memory_counts_match_chrome_trace(tmp_path: Path) -> None:
    spec = preset("hybrid-tiny")
    run = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="bf16")
    config = OffloadConfig(
        offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=1024
    )
    off = OffloadContext(config, "cuda")
    counts = _cuda_check_memory_matches_trace(lambda: train(spec, run, off, "cuda"), tmp_path)
    off.close()
    assert counts.totals()["d2h"].bytes > 0 and counts.totals()["h2d"].bytes > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_counts_match_offloader_and_shapes(dtype: torch.dtype) -> None:
    _check_against_offloader("cuda", dtype)
    scenario = Scenario("cuda", dtype)
    counts = profile_transfers(scenario.iteration, "cuda")
    assert counts.mode == "device"
    assert counts.pageable == 0
    assert counts.unattributed == {"d2h": Counts(), "h2d": Counts()}
    assert counts.by_group() == expected_from_shapes(torch.empty((), dtype=dtype).element_size())
    scenario.off.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_totals_without_ranges_match_the_ranged_count() -> None:
    """``transfer_profiler(ranges=False)`` (the plain and disabled runs' profiler): the same
    copies and bytes per direction as the full profiler, every one unattributed."""
    counted = []
    for ranges in (True, False):  # one fresh scenario each: both count its warmup iteration
        scenario = Scenario("cuda", torch.float32)
        with transfer_profiler("cuda", ranges=ranges) as prof:
            scenario.iteration()
        counted.append(count_transfers(prof, mode="device"))
        scenario.off.close()
    ranged, totals = counted
    assert ranged.totals()["d2h"].copies > 0 and not totals.by_range
    for direction in ("d2h", "h2d"):
        everything = ranged.totals()[direction] + ranged.unattributed[direction]
        assert totals.unattributed[direction] == everything


def test_cpu_transfer_profiler_without_ranges_still_sees_the_copies() -> None:
    """On a CPU device the counter reads CPU ops, so ``ranges=False`` keeps CPU activity."""
    scenario = Scenario("cpu", torch.float32)
    with transfer_profiler("cpu", ranges=False) as prof:
        scenario.iteration()
    scenario.off.close()
    assert count_transfers(prof).by_group() == expected_from_shapes(4)
