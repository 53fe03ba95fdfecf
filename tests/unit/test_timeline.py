"""``harness.measure.timeline`` on small synthetic chrome traces whose figures are worked out by
hand (times in microseconds, as the profiler writes them)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

from harness.measure.timeline import Copies, Timeline, analyse, phase_busy

MIB = 2**20
COMPUTE, D2H_STREAM, H2D_STREAM = 7, 20, 21


def device(
    tid: int, ts: float, dur: float, corr: int, *, cat: str = "kernel", name: str = "k", **args: Any
) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr, **args},
    }


def launch(corr: int, ts: float, dur: float, cat: str = "cuda_runtime") -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr},
    }


def memcpy(tid: int, ts: float, dur: float, corr: int, kind: str, nbytes: int) -> dict[str, Any]:
    return device(
        tid, ts, dur, corr, cat="gpu_memcpy", name=f"Memcpy {kind} (x -> y)", bytes=nbytes
    )


def step_trace() -> dict[str, Any]:
    """Compute stream 7: kernels [100,110] [112,120] [140,160], a memset [170,175], a kernel
    [200,250]. Gaps: 2 us (under the threshold), 20 us (the driver call that launched [140,160]
    returned at 130, after the gap opened at 120: launch-bound), 10 us (launch returned at 105:
    waiting), 25 us (no launch event: waiting). A DtoH copy [150,190] on stream 20 overlaps
    busy [150,160] and [170,175] (15 us); an HtoD copy [240,260] on stream 21 overlaps [240,250]
    (10 us); a small kernel [262,265] on 21 ends the window; a DtoD copy is no DtoH/HtoD copy."""
    events = [
        device(COMPUTE, 100, 10, 1),
        device(COMPUTE, 112, 8, 2),
        device(COMPUTE, 140, 20, 3),
        device(COMPUTE, 170, 5, 4, cat="gpu_memset", name="Memset (Device)"),
        device(COMPUTE, 200, 50, 5),
        memcpy(D2H_STREAM, 150, 40, 6, "DtoH", 4 * MIB),
        memcpy(D2H_STREAM, 101, 1, 7, "DtoD", MIB),
        memcpy(H2D_STREAM, 240, 20, 8, "HtoD", 2 * MIB),
        device(H2D_STREAM, 262, 3, 9),
        launch(1, 90, 5),
        launch(2, 96, 5),
        launch(3, 125, 5, cat="cuda_driver"),  # e.g. cuLaunchKernel
        launch(4, 100, 5),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 999},
        {"ph": "s", "cat": "ac2g", "name": "flow", "pid": 1, "tid": 1, "ts": 96, "id": 3},
    ]
    return {"traceEvents": events}


def test_busy_gaps_and_copies_by_hand() -> None:
    t = analyse(step_trace())
    assert t is not None
    assert t.compute_stream == COMPUTE and t.streams == 3
    assert t.window_s == pytest.approx(165e-6)  # 100 .. 265
    assert t.busy_s == pytest.approx(93e-6)  # 10 + 8 + 20 + 5 + 50
    assert t.gaps == 3 and t.launch_bound_gaps == 1
    assert t.idle_s == pytest.approx(55e-6)  # 20 + 10 + 25
    assert t.launch_bound_s == pytest.approx(20e-6)
    assert t.waiting_s == pytest.approx(35e-6)
    assert t.d2h == Copies(kind="DtoH", count=1, bytes=4 * MIB, seconds=40e-6, hidden_s=15e-6)
    assert t.h2d == Copies(kind="HtoD", count=1, bytes=2 * MIB, seconds=20e-6, hidden_s=10e-6)
    assert t.d2h.gbs == pytest.approx(4 * MIB / 40e-6 / 1e9)
    assert t.h2d.hidden_fraction == pytest.approx(0.5)


def test_summary_line_and_json() -> None:
    t = analyse(step_trace())
    assert t is not None
    assert t.summary() == (
        "compute busy 0.09 of 0.17 ms, idle 0.06 ms (0.02 launch-bound); "
        "DtoH 4.0 MiB in 0.04 ms (104.9 GB/s), 38% hidden; "
        "HtoD 2.0 MiB in 0.02 ms (104.9 GB/s), 50% hidden"
    )
    out = t.to_json()
    assert json.loads(json.dumps(out)) == out
    assert out["summary"] == t.summary() and out["waiting_s"] == pytest.approx(35e-6)
    assert out["d2h"]["bytes"] == 4 * MIB and out["d2h"]["hidden_fraction"] == pytest.approx(0.375)


def test_gap_threshold_is_strict_and_settable() -> None:
    """A 5 us gap is not idle at the default threshold; at 1 us it is, along with the 2 us one."""
    events = [device(COMPUTE, 0, 10, 1), device(COMPUTE, 15, 10, 2), device(COMPUTE, 27, 3, 3)]
    trace = {"traceEvents": events}
    default = analyse(trace)
    finer = analyse(trace, min_gap_us=1)
    assert default is not None and finer is not None
    assert default.gaps == 0 and default.idle_s == 0
    assert finer.gaps == 2 and finer.idle_s == pytest.approx(7e-6)
    assert finer.launch_bound_s == 0  # no launch events: both waiting


def test_gap_opens_after_every_earlier_event_ended() -> None:
    """[0,100] spans [10,20] and [30,40]: no gap between the short two; the gap runs from 100
    (not 40) to 120."""
    events = [
        device(COMPUTE, 0, 100, 1),
        device(COMPUTE, 10, 10, 2),
        device(COMPUTE, 30, 10, 3),
        device(COMPUTE, 120, 10, 4),
        launch(4, 50, 60),  # returned at 110: after 100, so launch-bound
    ]
    t = analyse({"traceEvents": events})
    assert t is not None
    assert t.gaps == 1 and t.idle_s == pytest.approx(20e-6)
    assert t.launch_bound_s == pytest.approx(20e-6)
    assert t.busy_s == pytest.approx(110e-6)  # the union, not the 130 us sum of durations


def test_compute_stream_has_most_kernel_time() -> None:
    """Stream 9's one 60 us kernel beats stream 7's ten 5 us kernels and stream 3's 500 us copy
    (the busiest stream, but no kernel time)."""
    events = [memcpy(3, 0, 500, 100, "HtoD", MIB), device(9, 0, 60, 101)]
    events += [device(COMPUTE, 10 * i, 5, i) for i in range(10)]
    t = analyse({"traceEvents": events})
    assert t is not None and t.compute_stream == 9 and t.streams == 3
    assert t.busy_s == pytest.approx(60e-6)
    assert t.h2d.hidden_s == pytest.approx(60e-6)  # [0,500] over the kernel [0,60]


def test_copy_on_the_compute_stream_hides_nothing() -> None:
    """save_on_cpu's copies run on the compute stream: they are busy time there, hidden 0."""
    events = [
        device(COMPUTE, 0, 100, 1),
        memcpy(COMPUTE, 100, 50, 2, "DtoH", 8 * MIB),
        device(COMPUTE, 150, 100, 3),
        memcpy(COMPUTE, 250, 50, 4, "HtoD", 8 * MIB),
    ]
    t = analyse({"traceEvents": events})
    assert t is not None
    assert t.busy_s == pytest.approx(300e-6)
    assert t.d2h.seconds == pytest.approx(50e-6) and t.d2h.hidden_s == 0
    assert t.h2d.count == 1 and t.h2d.hidden_s == 0


def test_hidden_time_matches_brute_force() -> None:
    """Many kernels, overlapping copies (two streams per direction): the binary-search overlap
    equals the pairwise sum."""
    rng = random.Random(3)
    events, kernels, copies = [], [], []
    t = 0
    for i in range(300):
        t += rng.randint(0, 20)
        dur = rng.randint(1, 30)
        events.append(device(COMPUTE, t, dur, i))
        kernels.append((t, t + dur))
        t += dur
    for j in range(40):
        start, dur = rng.randint(0, t), rng.randint(1, 400)
        events.append(memcpy(30 + j % 2, start, dur, 1000 + j, "DtoH", MIB))
        copies.append((start, start + dur))
    brute = sum(max(0, min(ce, ke) - max(cs, ks)) for cs, ce in copies for ks, ke in kernels)
    found = analyse({"traceEvents": events})
    assert found is not None and found.d2h.count == 40
    assert found.d2h.hidden_s == pytest.approx(brute * 1e-6)
    assert 0 < found.d2h.hidden_s < found.d2h.seconds


def test_no_device_events_is_none() -> None:
    cpu_only = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5}
        ]
    }
    assert analyse(cpu_only) is None


@pytest.mark.parametrize("name", ["t.json", "t.pt.trace.json.gz"])
def test_reads_files(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    text = json.dumps(step_trace())
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    from_file = analyse(path)
    assert isinstance(from_file, Timeline)
    assert from_file == analyse(str(path)) == analyse(step_trace())


def host(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_host_self_time_subtracts_what_is_nested() -> None:
    """A commit [0,100] holding an empty [10,50] that holds a fill [12,48], then a copy [60,70]
    holding a runtime call [61,65]; a range's Python between its ops is its self time; names
    aggregate up to their first '|'; another thread's events nest only among themselves; a
    child overhanging its parent counts only its part inside; device events are not host."""
    from harness.measure.timeline import host_self_times

    events = [
        host("_GroupCommit", 0, 100),
        host("aten::empty", 10, 40),
        host("aten::fill_", 12, 36),
        host("aten::copy_", 60, 10),
        host("cudaMemcpyAsync", 61, 4, cat="cuda_runtime"),
        host("offload_harness.d2h|core_attn|mb=0|layer=0", 200, 30, cat="user_annotation"),
        host("offload_harness.d2h|attn_proj|mb=0|layer=0", 240, 10, cat="user_annotation"),
        host("aten::copy_", 205, 10),
        host("aten::fill_", 0, 500, tid=2),  # another thread: not inside the commit
        host("aten::mm", 290, 20),  # overhangs the next event's start? no: sibling
        host("aten::add", 300, 50),  # starts inside mm [290,310]: 10 us of it nested there
        device(COMPUTE, 0, 1000, 1),
    ]
    times = {k: round(v * 1e6, 3) for k, v in host_self_times({"traceEvents": events}).items()}
    assert times == {
        "_GroupCommit": 100 - 40 - 10,
        "aten::empty": 40 - 36,
        "aten::fill_": 36 + 500,
        "aten::copy_": (10 - 4) + 10,
        "cudaMemcpyAsync": 4,
        "offload_harness.d2h": (30 - 10) + 10,
        "aten::mm": 20 - 10,
        "aten::add": 50,
    }


def test_host_increase_ranks_growth_only() -> None:
    from harness.measure.timeline import host_increase

    base = {"aten::mm": 5.0, "aten::fill_": 1.0, "gone": 2.0}
    other = {"aten::mm": 4.0, "aten::fill_": 24.0, "_GroupCommit": 2.5, "aten::copy_": 0.5}
    assert host_increase(base, other) == [
        ("aten::fill_", 23.0),
        ("_GroupCommit", 2.5),
        ("aten::copy_", 0.5),
    ]
    assert host_increase(base, other, top=1) == [("aten::fill_", 23.0)]
    assert host_increase(other, other) == []


def annotation(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
    }


def test_phase_busy_by_hand() -> None:
    """On ``step_trace``'s compute stream: a forward range [85,110] holds the launches of
    kernels 1, 2 (at 90, 96) and the memset 4 (at 100); a backward range [120,135] on the main
    thread holds the launch of kernel 3 made by another thread (at 125); kernel 5 has no launch.
    Forward busy 10 + 8 + 5 = 23 us, backward 20 us, a phase without ranges 0; the copy launched
    inside the forward (correlation 6) is on another stream and not compute."""
    trace = step_trace()
    trace["traceEvents"] += [
        annotation("bench.forward|mb=0", 85, 25),
        annotation("bench.backward|mb=0", 120, 15),
        launch(6, 108, 1),
    ]
    trace["traceEvents"][11]["tid"] = 2  # kernel 3's launch: the autograd engine's thread
    busy = phase_busy(trace, ["bench.forward", "bench.backward", "bench.optimizer"])
    assert busy == pytest.approx(
        {"bench.forward": 23e-6, "bench.backward": 20e-6, "bench.optimizer": 0.0}
    )


def test_phase_busy_counts_overlapping_work_once() -> None:
    """Two forward ranges whose launches share one event (correlation) count it once."""
    trace = step_trace()
    trace["traceEvents"] += [
        annotation("bench.forward|mb=0", 85, 10),  # launch 1 (90)
        annotation("bench.forward|mb=1", 89, 12),  # launches 1, 2, 4 again
    ]
    assert phase_busy(trace, ["bench.forward"]) == pytest.approx({"bench.forward": 23e-6})


def test_phase_busy_without_device_events_is_none() -> None:
    assert phase_busy({"traceEvents": [annotation("bench.forward|mb=0", 0, 5)]}, ["x"]) is None
