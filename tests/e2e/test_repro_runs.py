"""``offload-harness repro`` and the bisection on real runs (moved from
``tests/unit/test_repro.py``, whose tests train nothing): a clean case reports ``first
divergence: none`` and a bundle; a transport bug (``broken.corrupt_reload``) is reported with its
first divergence, gradient, layer output and cause, and bisected to one group on one layer. The
routing wrapper and the layer-output capture are checked on their own runs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from repro_args import CUSTOM

from harness.cases import Case
from harness.cli import main
from harness.diagnose.bisect import RoutedOffloader, localise
from harness.diagnose.repro import capture_layer_outputs
from harness.execute.environment import Environment
from harness.models.train import schedule_order, train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.verify.golden import parse_trace
from harness.vocab.spec import ModelSpec, RunSpec

BROKEN = "broken.corrupt_reload"


def _bundle(report_dir: Path) -> Path:
    (folder,) = report_dir.iterdir()
    return folder / "repro"


def test_clean_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*CUSTOM, "--report-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "first divergence: none" in out
    assert re.search(r"checksums: all [1-9]\d* reloads equal what was saved", out), out
    assert "ulps fp32" in out  # the shared loss table
    bundle = _bundle(tmp_path)
    files = sorted(p.name for p in bundle.iterdir())
    assert files == ["baseline.txt", "command.txt", "offload.txt", "output.txt", "spec.json"]
    baseline = (bundle / "baseline.txt").read_text()
    assert baseline == (bundle / "offload.txt").read_text()
    assert [line.split()[:2] for line in baseline.splitlines()] == [
        ["0", "0"],
        ["0", "1"],
        ["1", "0"],
        ["1", "1"],
    ]
    assert parse_trace(baseline).shape == (2, 2)
    spec = json.loads((bundle / "spec.json").read_text())
    assert spec["run"]["steps"] == 2 and spec["model"]["pattern"] == "+-+-"
    assert spec["case"]["offload"] == ["core_attn", "attn_proj"]


def test_transport_bug_is_reported_and_bisected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*CUSTOM, "--backend", BROKEN, "--bisect", "--report-dir", str(tmp_path)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 1 microbatch 0" in out
    # Named in the first run, before any bisection: the checksums at pack and unpack.
    assert re.search(
        r"first reload that differs from what was saved \(checksums at pack and unpack; \d+ of "
        r"\d+\): step 0, microbatch \d, layer \d, group \w+, saved tensor \d+ of the group: "
        r"shape \[[\d, ]+\], torch\.float32, storage offset \d+",
        out,
    ), out
    assert out.index("first reload that differs") < out.index("bisect:")
    assert "first parameter gradient that differs: step 0," in out
    assert "first layer output that differs at step 1 microbatch 0: layers.0" in out
    assert "plain and hooks baselines agree: transport bug" in out
    assert "bisect: smallest diverging set: group core_attn on layer 0" in out
    bundle = _bundle(tmp_path)
    assert (bundle / "baseline.txt").read_text() != (bundle / "offload.txt").read_text()
    command = shlex.split((bundle / "command.txt").read_text())
    assert command[:2] == ["offload-harness", "repro"] and "--bisect" in command
    assert command[command.index("--backend") + 1] == BROKEN


def test_localise_names_groups_and_layers() -> None:
    case = Case(family="hybrid", offload=("core_attn", "attn_proj"), steps=2)
    env = Environment(device=torch.device("cpu"), backend=BROKEN)
    lines = localise(case, env)
    assert lines[0].startswith("all selected groups (core_attn+attn_proj): diverges")
    assert lines[-1].startswith("smallest diverging set: group core_attn on layer 0")
    clean = localise(case, Environment(device=torch.device("cpu"), backend="reference"))
    assert clean[-1].endswith("nothing diverges to localise")


class _Counting(NoOffload):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []
        self.closed = False

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> PassThroughGroup:
        self.seen.append((name, layer))
        return PassThroughGroup(x)

    def close(self) -> None:
        self.closed = True


def test_routed_offloader_passes_only_selected_groups() -> None:
    inner = _Counting()
    routed = RoutedOffloader(inner, lambda name, layer: name == "core_attn" and layer == 2)
    spec = ModelSpec(pattern="+-+-")
    result = train(spec, RunSpec(steps=1, microbatches=2), routed, "cpu")
    plain = train(spec, RunSpec(steps=1, microbatches=2), NoOffload(), "cpu")
    assert inner.seen == [("core_attn", 2), ("core_attn", 2)]  # one per microbatch
    assert torch.equal(result.losses, plain.losses)
    routed.close()
    assert inner.closed and routed.name == "none(routed)"


def test_layer_capture_takes_one_forward_and_leaves_no_hooks() -> None:
    spec, run = ModelSpec(pattern="+-E"), RunSpec(steps=2, microbatches=2, schedule="1f1b")
    before = len(torch.nn.modules.module._global_forward_hooks)
    with capture_layer_outputs(1, 1, schedule_order(run.schedule, 2)) as seen:
        train(spec, run, NoOffload(), "cpu")
    assert len(torch.nn.modules.module._global_forward_hooks) == before
    assert list(seen) == ["layers.0", "layers.1", "layers.2", "final_norm", "logits"]
    assert seen["logits"].shape == (2, 32, 128)
    config = OffloadConfig(offload_modules=("core_attn",))
    assert config.offload_modules == ("core_attn",)
