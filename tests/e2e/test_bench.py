"""``scripts/bench`` on CPU: a one-step smoke run of every variant on a tiny model writes a
complete ``bench.json``; bad input is one line and exit code 2. (Rates are meaningless on CPU;
the GPU run is the real benchmark.)"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import harness
from harness.measure import timeline
from harness.offload.config import OffloadConfig
from harness.tools.bench import driver, main, trace
from harness.tools.bench.cli import parser
from harness.tools.bench.driver import bench_one
from harness.tools.bench.measure import VariantResult, combine_rounds
from harness.tools.bench.models import bench_model, selection
from harness.tools.bench.output import render, render_breakdown, render_compute
from harness.tools.bench.peers import VARIANTS
from harness.tools.bench.targets import host_time_targets, targets
from harness.tools.bench.trace import baseline_compute, host_vs_baseline, trace_line, trace_timeline


def test_cpu_smoke_run_writes_every_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--steps", "1", "--warmup", "1"]
    argv += ["--microbatches", "1", "--precision", "fp32", "--rounds", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    (model,) = report["models"]
    variants = model["variants"]
    assert list(variants) == ["baseline", "reference", "mcore", "save_on_cpu"]
    base = variants["baseline"]["step_s"]
    for name in ("baseline", "reference", "save_on_cpu"):
        v = variants[name]
        assert v["status"] == "ok", v
        assert len(v["step_s_all"]) == 1 and v["round_step_s"] == [v["step_s"]]
        assert v["ratio"] == v["step_s"] / base and v["round_ratio"] == [v["ratio"]]
        assert "breakdown" not in v and "trace" not in v and "timeline" not in v
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("var"))
    assert header.split()[:6] == ["variant", "step", "ms", "x", "base", "D2H"]  # one round
    for name in ("reference", "save_on_cpu"):  # proof the offload happened
        assert variants[name]["d2h_bytes"] > 0 and variants[name]["h2d_bytes"] > 0
    assert variants["mcore"]["status"] in ("ok", "not installed") or variants["mcore"][
        "status"
    ].startswith("unavailable")
    verdicts = {t["target"]: t["verdict"] for t in report["targets"]}
    assert "reference faster than save_on_cpu" in verdicts
    assert set(verdicts.values()) <= {"PASS", "SHORT", "n/a"}
    assert report["machine"]["torch"] == torch.__version__
    assert report["commit"] == _expected_commit(report["harness_version"])


def _expected_commit(version: str) -> dict[str, Any]:
    """The commit a report must record here (docs/reports.md): git's, where a checkout tracks
    the harness package; else ``$OFFLOAD_HARNESS_COMMIT``'s (a copy of the tree without
    ``.git`` that was given it); else the unknown form (no sha, source ``package``)."""
    folder = Path(harness.__file__).resolve().parent

    def git(*args: str) -> str | None:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    given = os.environ.get("OFFLOAD_HARNESS_COMMIT", "").strip().lower()
    if shutil.which("git") and git("ls-files", "--error-unmatch", "__init__.py"):
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        sha, source = git("rev-parse", "HEAD"), "git"
    elif given:
        sha, dirty, source = given, None, "environment"
    else:
        sha, dirty, source = None, None, "package"
    return {"sha": sha, "dirty": dirty, "source": source, "version": version}


def test_cpu_rounds_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--rounds 2``: every variant that runs has two rounds of step times and ratios, the
    table a range column, the targets their range; the breakdown is the rounds' medians."""
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--rounds", "2", "--steps", "1"]
    argv += ["--breakdown", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    (model,) = report["models"]
    assert model["rounds"] == 2 and report["args"]["rounds"] == 2
    variants = model["variants"]
    base = variants["baseline"]["round_step_s"]
    for name in ("baseline", "reference", "save_on_cpu"):
        v = variants[name]
        assert v["status"] == "ok", v
        assert (
            len(v["step_s_all"]) == len(v["round_step_s"]) == 2
            and v["round_step_s"] == (v["step_s_all"])
        )  # one timed step per round: its median is that step
        assert v["step_s"] == pytest.approx(sum(v["round_step_s"]) / 2)
        assert v["round_ratio"] == [a / b for a, b in zip(v["round_step_s"], base, strict=True)]
        assert v["ratio"] == pytest.approx(sum(v["round_ratio"]) / 2)
        assert v["ratio_range"] == [min(v["round_ratio"]), max(v["round_ratio"])]
        b = v["breakdown"]
        assert b["rounds"] == 2 and b["timed_steps"] == 1 and len(b["steps"]) == 2
        assert b["step_s"] == pytest.approx(v["step_s"])
    assert variants["baseline"]["round_ratio"] == [1.0, 1.0]
    out = capsys.readouterr().out
    assert "medians of 2 rounds" in out and "median of 2 rounds" in out
    header = next(line for line in out.splitlines() if line.startswith("variant"))
    assert header.split()[:6] == ["variant", "step", "ms", "x", "base", "range"], header
    lo, hi = variants["reference"]["ratio_range"]
    assert f"{lo:.3f}-{hi:.3f}" in out
    (peer,) = [t for t in report["targets"] if t["target"] == "reference faster than save_on_cpu"]
    assert peer["measured"].endswith("over 2 rounds) its step"), peer


def test_rounds_interleave_and_ratio_per_round(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rounds run every variant in order, again and again; a variant that is missing or fails
    is not run again. Ratios are per round: reference's median ratio 1.02 (range 1.00-1.05)
    passes the 1.03 target, although its median step over the baseline's would be 1.05."""
    steps_ms = {"baseline": [10.0, 12.0, 11.0], "reference": [10.2, 12.0, 11.55]}
    steps_ms["save_on_cpu"] = [20.0]  # fails in round 2
    calls: list[str] = []

    def fake_run_variant(factory: str, *args: object, **kwargs: object) -> object:
        calls.append(factory)
        if factory == "mcore":
            return VariantResult(status="not installed")
        done = calls.count(factory)
        if done > len(steps_ms[factory]):
            return VariantResult(status="failed: RuntimeError: boom")
        step = steps_ms[factory][done - 1] / 1e3
        return VariantResult(step_s=step, step_s_all=[step], d2h_bytes=1, h2d_bytes=1)

    monkeypatch.setattr(driver, "run_variant", fake_run_variant)
    args = parser().parse_args(["--device", "cpu", "--models", "hybrid-tiny"])
    args.min_tensor_size = 1024
    found = {v: v for v in VARIANTS}
    entry = bench_one("hybrid-tiny", args, torch.device("cpu"), found)
    round_1 = ["baseline", "reference", "mcore", "save_on_cpu"]
    assert calls == [*round_1, "baseline", "reference", "save_on_cpu", "baseline", "reference"]
    v = entry["variants"]
    assert v["baseline"].step_s == 0.011 and v["baseline"].round_step_s == [0.01, 0.012, 0.011]
    assert v["reference"].step_s == pytest.approx(0.01155)
    assert v["reference"].round_ratio == pytest.approx([1.02, 1.0, 1.05])
    assert v["reference"].ratio == pytest.approx(1.02)
    assert v["reference"].ratio_range == pytest.approx((1.0, 1.05))
    assert v["mcore"].status == "not installed" and v["mcore"].ratio is None
    assert v["save_on_cpu"].status == "round 2: failed: RuntimeError: boom"
    assert v["save_on_cpu"].step_s is None and v["save_on_cpu"].ratio is None

    entry["raw_copy_s"] = 0.001  # hideable: the 1.03 target applies
    verdicts = {t.target: t for t in targets("hybrid-tiny", entry)}
    hideable = verdicts["reference step <= 1.03x baseline (hideable)"]
    # the baseline's rounds (10-12 ms) differ by more than the target's 3%: said with the ratio
    measured = "1.020x (1.000-1.050 over 3 rounds); baseline rounds 10.0-12.0 ms"
    assert (hideable.measured, hideable.verdict) == (measured, "PASS")
    v["baseline"].round_step_s = [0.010, 0.0102, 0.0101]  # within 3%: nothing added
    quiet = {t.target: t for t in targets("hybrid-tiny", entry)}
    assert quiet["reference step <= 1.03x baseline (hideable)"].measured.endswith("rounds)")
    v["baseline"].round_step_s = [0.010, 0.012, 0.011]
    assert verdicts["reference faster than save_on_cpu"].verdict == "n/a"
    lines = render(entry, list(verdicts.values())).splitlines()
    assert lines[2].split()[:4] == ["baseline", "11.00", "1.000", "1.000-1.000"]
    assert lines[3].split()[:4] == ["reference", "11.55", "1.020", "1.000-1.050"]
    assert lines[4].split()[:4] == ["mcore", "-", "-", "-"]


def test_rounds_with_different_bytes_fail() -> None:
    """Every round moves the same bytes per step (same spec, seed and steps), or the variant is
    failed."""
    rounds = [
        VariantResult(step_s=0.01, step_s_all=[0.01], d2h_bytes=4 * 2**20, h2d_bytes=0),
        VariantResult(step_s=0.01, step_s_all=[0.01], d2h_bytes=2 * 2**20, h2d_bytes=0),
    ]
    merged = combine_rounds(rounds)
    assert merged.status.startswith("failed: bytes per step differ between rounds"), merged
    assert "4.0/0.0, 2.0/0.0" in merged.status
    assert combine_rounds(rounds[:1]).status == "ok"


def test_rounds_zero_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--rounds", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "offload-harness bench: error: argument --rounds: must be >= 1, got 0", err
    assert sum("error" in line for line in err) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cpu", "--models", "no-such-model"], "unknown model 'no-such-model'"),
        (["--device", "cpu", "--models", "moe-tiny", "--offload", "attn_norm"], "opens none"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        (["--device", "cuda:x"], "--device must be auto, cpu, cuda or cuda:N; got 'cuda:x'"),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench: ") and err.count("\n") == 1 and message in err, err


def test_malformed_commit_variable_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any training, not when ``bench.json`` is written at the end."""
    monkeypatch.setenv("OFFLOAD_HARNESS_COMMIT", "v1.2")
    assert main(["--device", "cpu", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "bench: OFFLOAD_HARNESS_COMMIT must be a git commit sha (7 to 64 hex digits); the "
        "environment has 'v1.2'\n"
    ), err
    assert not (tmp_path / "b").exists()


def test_device_defaults_to_auto() -> None:
    """``--device`` is the shared setting (``harness.run.settings.resolve_device``): ``auto`` picks
    cuda when one is visible, else cpu (where the default model is the smoke test's)."""
    assert parser().parse_args([]).device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_without_cuda_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "bench: --device cuda: no CUDA device is visible on this machine\n", err


def test_cpu_breakdown_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--breakdown``: per variant, per microbatch forward/backward and the step's other phases
    (medians) in the table and bench.json; ``--trace DIR``: one gzipped chrome trace per variant
    that ran, with the phases as ``bench.*`` ranges. 1F1B, so the backwards are not in
    microbatch order after the forwards."""
    original_backward = torch.Tensor.backward
    traces = tmp_path / "traces"
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--steps", "1", "--warmup", "1"]
    argv += ["--microbatches", "2", "--schedule", "1f1b", "--precision", "fp32", "--rounds", "1"]
    argv += ["--breakdown", "--trace", str(traces), "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert torch.Tensor.backward is original_backward  # the timing hook is gone
    report = json.loads((tmp_path / "bench.json").read_text())
    (model,) = report["models"]
    variants = model["variants"]
    for name in ("baseline", "reference", "save_on_cpu"):
        b = variants[name]["breakdown"]
        assert b["timed_steps"] == 1 and b["clock"] == "host" and len(b["steps"]) == 1
        assert len(b["forward_s"]) == len(b["backward_s"]) == 2
        assert all(t > 0 for t in [*b["forward_s"], *b["backward_s"], b["optimizer_s"]]), b
        assert b["end_iteration_s"] >= 0 and b["drain_s"] >= 0 and b["other_s"] >= 0, b
        parts = sum(b["forward_s"]) + sum(b["backward_s"]) + b["optimizer_s"]
        assert parts <= b["step_s"] == variants[name]["step_s"]
        path = Path(variants[name]["trace"])
        assert path.parent == traces and path.name == f"hybrid-tiny_{name}.pt.trace.json.gz"
        with gzip.open(path, "rt") as f:
            names = {str(e.get("name")) for e in json.load(f)["traceEvents"]}
        phases = {f"bench.{p}|mb={mb}" for p in ("forward", "backward") for mb in (0, 1)}
        assert phases | {"bench.end_iteration", "bench.optimizer"} <= names
        moved = any(n.startswith("offload_harness.d2h|") for n in names)
        assert moved == (name == "reference"), name  # the reference's ranges: profiler only
        assert variants[name]["timeline"] == "no device events (CPU-only trace)"
        assert f"trace hybrid-tiny/{name}: no device events (CPU-only trace)" in out
    if variants["mcore"]["status"] != "ok":
        assert "breakdown" not in variants["mcore"]
        assert variants["mcore"]["trace"].startswith("not traced")
    assert sorted(p.name for p in traces.iterdir()) == sorted(
        f"hybrid-tiny_{v}.pt.trace.json.gz" for v, r in variants.items() if r["status"] == "ok"
    )


def test_breakdown_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The breakdown table: one row per variant (its status when it did not run), then each
    variant's difference to the baseline; nothing without ``--breakdown``."""

    def phases(forward: float, step: float) -> dict[str, object]:
        return {
            "step_s": step,
            "forward_s": [forward, forward],
            "backward_s": [0.002, 0.003],
            "end_iteration_s": 0.0,
            "optimizer_s": 0.001,
            "drain_s": 0.0,
            "other_s": 0.0,
            "timed_steps": 3,
            "clock": "cuda",
        }

    result = VariantResult
    variants = {
        "baseline": result(step_s=0.010, breakdown=phases(0.001, 0.010)),
        "reference": result(step_s=0.011, breakdown=phases(0.0015, 0.011)),
        "mcore": result(status="not installed"),
        "save_on_cpu": result(step_s=0.02),
    }
    entry = {"variants": variants, "run": {"microbatches": 2}}
    lines = render_breakdown(entry)
    assert "medians of 3 timed steps, CUDA events" in lines[0]
    columns = "variant step ms fwd0 fwd1 bwd0 bwd1 end_it optim drain other"
    assert lines[1].split() == columns.split()
    assert lines[2].split()[:4] == ["baseline", "10.00", "1.00", "1.00"]
    assert lines[4].split() == ["mcore", "-", "not", "installed"]
    assert lines[6] == "minus baseline (ms):"
    assert lines[7].split()[:4] == ["reference", "+1.00", "+0.50", "+0.50"]
    assert len(lines) == 8
    for r in variants.values():
        r.breakdown = None
    assert render_breakdown(entry) == []


def test_trace_timeline_of_a_device_trace(tmp_path: Path) -> None:
    """A trace with device events: its ``harness.measure.timeline`` figures and summary line (the
    figures themselves: tests/unit/test_timeline.py); an unreadable one: why, in one line."""
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 0, "dur": 100}
    copy = {**kernel, "cat": "gpu_memcpy", "name": "Memcpy DtoH", "tid": 9, "dur": 50}
    copy["args"] = {"bytes": 2**20}
    path = tmp_path / "m_reference.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [kernel, copy]}, f)
    found, host = trace_timeline(path)
    assert host == {}  # no host events in this trace
    assert found["busy_s"] == pytest.approx(100e-6) and found["d2h"]["hidden_s"] == (
        pytest.approx(50e-6)
    )
    result = VariantResult(trace=str(path), timeline=found)
    assert trace_line(result) == found["summary"]
    assert trace_line(result).endswith(
        "DtoH 1.0 MiB in 0.05 ms (21.0 GB/s), 100% hidden; HtoD none"
    )
    broken = tmp_path / "broken.pt.trace.json.gz"
    broken.write_bytes(b"not gzip")
    assert trace_timeline(broken)[0].startswith("not analysed: ")
    assert trace_timeline(broken)[1] is None
    assert trace_line(VariantResult(trace="not traced: x")) == "not traced: x"


def test_host_self_time_against_the_baseline(tmp_path: Path) -> None:
    """``--trace``: each traced variant's host self time minus the baseline's, in total and by
    the names that grew most, in its timeline and its trace line; untraced variants and a run
    without a traced baseline get nothing."""
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 0, "dur": 100}

    def op(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    ops = {
        "baseline": [op("aten::mm", 0, 40)],
        "reference": [op("aten::mm", 0, 40), op("_GroupCommit", 50, 30), op("aten::fill_", 55, 20)],
    }
    variants, self_times = {}, {}
    for name, events in ops.items():
        path = tmp_path / f"m_{name}.pt.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": [kernel, *events]}, f)
        found, self_times[name] = trace_timeline(path)
        variants[name] = VariantResult(trace=str(path), timeline=found)
    variants["mcore"] = VariantResult(status="not installed", trace="not traced: x")
    host_vs_baseline(variants, self_times)
    host = variants["reference"].timeline["host_vs_baseline"]
    assert host["total_s"] == pytest.approx(30e-6)
    assert host["top"] == [
        ["aten::fill_", pytest.approx(20e-6)],
        ["_GroupCommit", pytest.approx(10e-6)],
    ]
    assert trace_line(variants["reference"]).endswith(
        "; host self time vs baseline +0.03 ms (aten::fill_ +0.02, _GroupCommit +0.01)"
    )
    assert "host_vs_baseline" not in variants["baseline"].timeline
    assert trace_line(variants["mcore"]) == "not traced: x"
    del variants["baseline"], self_times["baseline"]
    variants["reference"].timeline.pop("host_vs_baseline")
    host_vs_baseline(variants, self_times)  # no traced baseline: nothing to compare with
    assert "host_vs_baseline" not in variants["reference"].timeline


def test_variants_run_without_the_deterministic_fill(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every variant runs with the deterministic mode's fill of new memory off (it filled each
    new pinned buffer of the peers on the host); the flag is back afterwards."""
    import torch.utils.deterministic as det

    seen: list[bool] = []

    def fake_run_variant(factory: object, *args: object, **kwargs: object) -> object:
        seen.append(det.fill_uninitialized_memory)
        return VariantResult(step_s=0.01, step_s_all=[0.01], d2h_bytes=1, h2d_bytes=1)

    monkeypatch.setattr(driver, "run_variant", fake_run_variant)
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--rounds", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert seen and not any(seen)
    assert det.fill_uninitialized_memory is True


def test_cpu_host_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--host-time N``: one clocked run per variant that ran, its per-step host time inside
    the offloader by entry point in bench.json and one line each; the reference's commits,
    packs and unpacks are there, the baseline's no-op never packs."""
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--steps", "1", "--warmup", "1"]
    argv += ["--rounds", "1", "--host-time", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (model,) = json.loads((tmp_path / "bench.json").read_text())["models"]
    variants = model["variants"]
    for name in ("baseline", "reference", "save_on_cpu"):
        found = variants[name]["host_time"]
        assert found["steps"] == [1, 2], found
        assert 0 < found["total_s"] < found["host_step_s"]
        assert f"host time hybrid-tiny/{name}: offloader host " in out
    ref = variants["reference"]["host_time"]
    assert {"commit", "pack", "unpack", "backward"} <= set(ref["seconds"])
    assert ref["calls"]["pack"] == ref["calls"]["unpack"] > 0
    assert "pack" not in variants["baseline"]["host_time"]["calls"]
    assert "ms vs baseline" in next(
        line for line in out.splitlines() if line.startswith("host time hybrid-tiny/reference")
    )
    if variants["mcore"]["status"] != "ok":
        assert variants["mcore"]["host_time"].startswith("not clocked")


def _entry(base_ms: float, ref_ms: float) -> dict[str, Any]:
    """A one-model entry with a baseline and a reference of one round each."""
    base = VariantResult(step_s=base_ms / 1e3, round_step_s=[base_ms / 1e3])
    ref = VariantResult(step_s=ref_ms / 1e3, round_step_s=[ref_ms / 1e3], d2h_bytes=1, h2d_bytes=1)
    ref.round_ratio = [ref_ms / base_ms]
    missing = VariantResult(status="not installed")
    return {
        "variants": {"baseline": base, "reference": ref, "mcore": missing, "save_on_cpu": missing},
        "raw_d2h_s": 0.016,
        "raw_h2d_s": 0.016,
        "raw_copy_s": 0.032,
    }


HIDEABLE = "reference step <= 1.03x baseline (hideable)"


@pytest.mark.parametrize(
    ("forward_ms", "backward_ms", "verdict", "says"),
    [
        (20.0, 20.0, "SHORT", "1.200x"),  # compute hides both directions: the target applies
        (16.0, 16.0, "SHORT", "1.200x"),  # exactly as long: still hidden
        (
            13.0,
            20.0,
            "n/a",
            "not hideable: D2H copies at the raw rate 16.0 ms > forward compute 13.0 ms; not "
            "copy-bound either (copies at the raw rate 32.0 ms < baseline step 45.0 ms): the "
            "step is host-bound; reference 1.200x",
        ),
        (20.0, 10.0, "n/a", "H2D copies at the raw rate 16.0 ms > backward compute 10.0 ms"),
    ],
)
def test_hideable_needs_the_compute_to_hide_each_direction(
    forward_ms: float, backward_ms: float, verdict: str, says: str
) -> None:
    """The 1.03x target applies when the baseline's forward compute covers the D2H copies at
    the raw rate and its backward compute the H2D copies; otherwise a model that is not
    copy-bound is host-bound and the line says so, with the ratio, as n/a."""
    entry = _entry(45.0, 54.0)
    entry["baseline_compute"] = {
        "step_s": (forward_ms + backward_ms + 5) / 1e3,
        "forward_s": forward_ms / 1e3,
        "backward_s": backward_ms / 1e3,
    }
    found = {t.target: t for t in targets("m", entry)}[HIDEABLE]
    assert found.verdict == verdict and says in found.measured, found
    line = next(x for x in render_compute(entry) if x.startswith("device compute of a traced"))
    assert f"forwards {forward_ms:.2f}" in line and "D2H 16.00, H2D 16.00" in line


HOST_BOUND = "reference step <= 1.15x baseline (host-bound)"
HOST_BOUND_MCORE = "reference step <= 0.75x mcore (host-bound)"


def _host_bound(base_ms: list[float], ref_ms: list[float], mcore_ms: list[float]) -> dict:
    """A host-bound entry (the compute hides neither direction; copies shorter than the step)
    with one value per round for each variant."""
    entry = _entry(45.0, 54.0)
    v = entry["variants"]
    for name, rounds in (("baseline", base_ms), ("reference", ref_ms), ("mcore", mcore_ms)):
        v[name] = VariantResult(step_s=statistics.median(rounds) / 1e3)
        v[name].round_step_s = [ms / 1e3 for ms in rounds]
    entry["baseline_compute"] = {"step_s": 0.02, "forward_s": 0.005, "backward_s": 0.008}
    return entry


def test_host_bound_targets_need_five_rounds() -> None:
    """On a host-bound model the reference's step is judged against 1.15x the baseline's and
    0.75x megatron-core's, by the median of the per-round ratios, only with >= 5 rounds."""
    base, ref, mcore = [50.0] * 5, [56.0, 57.0, 55.0, 60.0, 56.5], [70.0, 80.0, 75.0, 90.0, 75.0]
    found = {t.target: t for t in targets("m", _host_bound(base, ref, mcore))}
    assert found[HIDEABLE].verdict == "n/a"
    assert (found[HOST_BOUND].verdict, found[HOST_BOUND].measured) == (
        "PASS",
        "1.130x (1.100-1.200 over 5 rounds)",
    )  # 56.5/50, the median of the per-round ratios
    assert found[HOST_BOUND_MCORE].verdict == "PASS", found[HOST_BOUND_MCORE]  # median 0.733
    assert "reference step <= 1.05x mcore" not in found
    slow = {t.target: t for t in targets("m", _host_bound(base, [60.0] * 5, [70.0] * 5))}
    assert slow[HOST_BOUND].verdict == slow[HOST_BOUND_MCORE].verdict == "SHORT"
    few = {t.target: t for t in targets("m", _host_bound(base[:3], ref[:3], mcore[:3]))}
    assert few[HOST_BOUND].verdict == few[HOST_BOUND_MCORE].verdict == "n/a"
    assert few[HOST_BOUND].measured.endswith("over 3 rounds)")


def test_host_time_target_is_set_on_hybrid_small() -> None:
    entry = _entry(45.0, 54.0)
    assert host_time_targets("moe-small", entry) == []
    (unclocked,) = host_time_targets("hybrid-small", entry)
    assert (unclocked.verdict, unclocked.measured) == ("n/a", "not clocked")
    entry["variants"]["reference"].host_time = {"total_s": 0.0036, "steps": (2, 3, 4)}
    (short,) = host_time_targets("hybrid-small", entry)
    assert (short.verdict, short.measured) == ("SHORT", "3.60 ms (median of 3 steady steps)")
    entry["variants"]["reference"].host_time = {"total_s": 0.0031, "steps": (2, 3, 4)}
    assert host_time_targets("hybrid-small", entry)[0].verdict == "PASS"


def test_copy_bound_and_unmeasured_compute_keep_their_rules() -> None:
    """Copies longer than the baseline step: copy-bound, whatever the compute; no compute
    figure (a failed trace, CPU): the step rule alone decides."""
    entry = _entry(30.0, 36.0)  # 32 ms of copies > 30 ms step
    entry["baseline_compute"] = {"step_s": 0.05, "forward_s": 0.025, "backward_s": 0.025}
    found = {t.target: t for t in targets("m", entry)}
    assert found[HIDEABLE].verdict == "n/a" and found[HIDEABLE].measured.startswith("copy-bound")
    entry = _entry(45.0, 46.0)
    entry["baseline_compute"] = "failed: RuntimeError: no trace"
    found = {t.target: t for t in targets("m", entry)}
    assert (found[HIDEABLE].verdict, found[HIDEABLE].measured) == ("PASS", "1.022x")
    assert render_compute(entry) == [
        "device compute of the baseline: failed: RuntimeError: no trace"
    ]


def test_offload_config_rules_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A selection the offload config refuses (attn_proj without core_attn) stops before any
    run with the config's one line, not a traceback from inside the first model."""
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--offload", "qkv_linear,attn_proj"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench: offload module 'attn_proj' requires 'core_attn'"), err
    assert "\n" not in err


def test_hybrid_bench_offloads_what_its_config_allows() -> None:
    """The bench-only hybrid model's default selection passes the config rules and opens
    groups on its pattern (its figures are GPU-only)."""
    model = bench_model("hybrid-bench")
    assert model.spec.pattern == "+-+-+-"
    names = selection(model, None)
    assert names == ("attn_norm", "qkv_linear")
    OffloadConfig(offload_modules=names).check_applies_to(model.spec)


def test_baseline_compute_without_phase_work_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced baseline whose forward or backward ranges hold no compute (ranges missing from
    the trace) gives a reason, not a zero that would call every model not hideable."""
    busy = {"bench.forward": 0.0, "bench.backward": 0.004}

    def fake_trace(
        factory: object,
        spec: object,
        run: object,
        config: object,
        device: object,
        warmup: int,
        path: Path,
    ) -> str:
        path.write_bytes(b"")
        return str(path)

    def fake_analyse(trace: object, *, phases: tuple[str, ...]) -> object:
        assert set(phases) == set(busy)
        return SimpleNamespace(busy_s=0.009, phase_busy_s=dict(busy))

    monkeypatch.setattr(trace, "trace_variant", fake_trace)
    monkeypatch.setattr(timeline, "analyse", fake_analyse)
    args = (object(), None, None, None, torch.device("cpu"), 1)
    found = baseline_compute(*args)
    assert found == "no compute found inside the baseline trace's forward or backward ranges"
    busy["bench.forward"] = 0.003
    assert baseline_compute(*args) == {
        "step_s": 0.009,
        "forward_s": 0.003,
        "backward_s": 0.004,
    }
