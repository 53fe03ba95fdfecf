"""``scripts/bench`` on CPU: a one-step smoke run of every variant on a tiny model writes a
complete ``bench.json``; bad input is one line and exit code 2. (Rates are meaningless on CPU;
the GPU run is the real benchmark.)"""

from __future__ import annotations

import gzip
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench"


def _load() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("bench_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("bench_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load()


def test_cpu_smoke_run_writes_every_variant(bench: ModuleType, tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--steps", "1", "--warmup", "1"]
    argv += ["--microbatches", "1", "--precision", "fp32", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    (model,) = report["models"]
    variants = model["variants"]
    assert list(variants) == ["baseline", "reference", "mcore", "save_on_cpu"]
    for name in ("baseline", "reference", "save_on_cpu"):
        assert variants[name]["status"] == "ok", variants[name]
        assert len(variants[name]["step_s_all"]) == 1
        assert "breakdown" not in variants[name] and "trace" not in variants[name]
    for name in ("reference", "save_on_cpu"):  # proof the offload happened
        assert variants[name]["d2h_bytes"] > 0 and variants[name]["h2d_bytes"] > 0
    assert variants["mcore"]["status"] in ("ok", "not installed") or variants["mcore"][
        "status"
    ].startswith("unavailable")
    verdicts = {t["target"]: t["verdict"] for t in report["targets"]}
    assert "reference faster than save_on_cpu" in verdicts
    assert set(verdicts.values()) <= {"PASS", "SHORT", "n/a"}
    assert report["commit"]["sha"] and report["machine"]["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cpu", "--models", "no-such-model"], "unknown model 'no-such-model'"),
        (["--device", "cpu", "--models", "moe-tiny", "--offload", "attn_norm"], "opens none"),
        (["--device", "tpu"], "--device must be"),
    ],
)
def test_bad_input_is_one_line(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_without_cuda_fails_in_one_line(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err, err


def test_cpu_breakdown_and_trace(bench: ModuleType, tmp_path: Path) -> None:
    """``--breakdown``: per variant, per microbatch forward/backward and the step's other phases
    (medians) in the table and bench.json; ``--trace DIR``: one gzipped chrome trace per variant
    that ran, with the phases as ``bench.*`` ranges. 1F1B, so the backwards are not in
    microbatch order after the forwards."""
    original_backward = torch.Tensor.backward
    traces = tmp_path / "traces"
    argv = ["--device", "cpu", "--models", "hybrid-tiny", "--steps", "1", "--warmup", "1"]
    argv += ["--microbatches", "2", "--schedule", "1f1b", "--precision", "fp32"]
    argv += ["--breakdown", "--trace", str(traces), "--out", str(tmp_path)]
    assert bench.main(argv) == 0
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
    if variants["mcore"]["status"] != "ok":
        assert "breakdown" not in variants["mcore"]
        assert variants["mcore"]["trace"].startswith("not traced")
    assert sorted(p.name for p in traces.iterdir()) == sorted(
        f"hybrid-tiny_{v}.pt.trace.json.gz" for v, r in variants.items() if r["status"] == "ok"
    )


def test_breakdown_table(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
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

    result = bench.VariantResult
    variants = {
        "baseline": result(step_s=0.010, breakdown=phases(0.001, 0.010)),
        "reference": result(step_s=0.011, breakdown=phases(0.0015, 0.011)),
        "mcore": result(status="not installed"),
        "save_on_cpu": result(step_s=0.02),
    }
    entry = {"variants": variants, "run": {"microbatches": 2}}
    lines = bench.render_breakdown(entry)
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
    assert bench.render_breakdown(entry) == []
