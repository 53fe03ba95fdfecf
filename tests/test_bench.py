"""``scripts/bench`` on CPU: a one-step smoke run of every variant on a tiny model writes a
complete ``bench.json``; bad input is one line and exit code 2. (Rates are meaningless on CPU;
the GPU run is the real benchmark.)"""

from __future__ import annotations

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
