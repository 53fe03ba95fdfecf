"""``scripts/host_profile`` on CPU: a short profile prints the self-time table and writes stats
that ``pstats`` reads; bad input is one line and exit code 2."""

from __future__ import annotations

import importlib
import pstats
from pathlib import Path
from types import ModuleType

import pytest

from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext
from harness.vocab.spec import RunSpec


@pytest.fixture(scope="module")
def host_profile() -> ModuleType:
    return importlib.import_module("harness.tools.host_profile")


def test_cpu_profile_of_the_reference(
    host_profile: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reference.pstats"
    argv = ["--device", "cpu", "--model", "hybrid-tiny", "--warmup", "1", "--steps", "2"]
    argv += ["--callees", r"\(_offload\)", "--out", str(out)]
    assert host_profile.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("host_profile: hybrid-tiny, backend reference, offload ")
    assert "2 profiled steps after 1" in text and "tottime" in text
    assert "_copy_out" in text  # the callees of the reference's _offload
    stats = pstats.Stats(str(out))
    (calls,) = [v[0] for k, v in stats.stats.items() if k[2] == "_offload"]  # type: ignore[attr-defined]
    # The profile covers the steady steps only: as many offloads as the reference's own log
    # shows for steps 1-2 of the same run (the warmup step 0 offloads more groups).
    bench = importlib.import_module("harness.tools.bench.models")
    model = bench.bench_model("hybrid-tiny")
    config = OffloadConfig(
        offload_modules=bench.selection(model, None), min_offloaded_tensor_size=1024
    )
    run = RunSpec(steps=3, microbatches=2, precision="bf16")
    logs = train(model.spec, run, OffloadContext(config, "cpu"), "cpu").logs
    steady = sum(1 for log in logs[1:] for g in log.groups if g.decision == "offloaded")
    assert calls == steady > 0
    assert sum(1 for g in logs[0].groups if g.decision == "offloaded") > steady / 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--backend", "nope"], "nope"),
        (["--steps", "0"], "--warmup and --steps must be >= 1"),
    ],
)
def test_bad_input_is_one_line(
    host_profile: ModuleType, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert host_profile.main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("host_profile: ") and says in err and "\n" not in err
