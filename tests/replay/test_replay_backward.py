"""The memory check's backward reading (CUDA only) replayed on CPU from readings a GPU recorded
(``tests/fixtures/gpu/backward-*.json``, written by ``python -m harness.tools.replay backward``
and refreshed by ``scripts/gpu_verify``).

Two things are pinned: the order in which the sampler marks the group boundaries, which is the
same on CPU as on the GPU (the CPU run here, with the allocator reading stubbed, must mark the
boundaries the GPU's baseline and offload runs marked, in their order), and the judgement of a
recorded reading (matched by boundary, against its predicted drops)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.cases import matrix
from harness.execute import backwardpeak
from harness.execute.backwardpeak import BackwardReading, BackwardSampler
from harness.execute.environment import Environment, closing
from harness.execute.memory import memory_run_spec
from harness.models.train import RunHooks, train
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Offloader

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"
CPU = torch.device("cpu")


def _recorded() -> list[tuple[str, str, dict[str, Any]]]:
    """(fixture file, row, its recording) of every backward fixture."""
    found = []
    for path in sorted(FIXTURES.glob("backward-*.json")):
        for row, recording in json.loads(path.read_text())["rows"].items():
            found.append((path.name, row, recording))
    return found


OWED = (
    "no GPU recording of the backward reading yet (tests/fixtures/gpu/backward-*.json): on a GPU "
    "run `OFFLOAD_HARNESS_COMMIT=$(git rev-parse HEAD) scripts/gpu_verify --part 1` and unpack "
    "its fixtures.tgz into tests/fixtures/gpu (docs/gpu.md)"
)
RECORDED = _recorded()
IDS = [f"{file}:{row}" for file, row, _ in RECORDED]
# Without a recording every replay below is reported as skipped, with the device call owed, and
# never as passed: a replay with nothing to replay would otherwise pass by saying nothing.
PARAMS = [pytest.param(*r, id=i) for r, i in zip(RECORDED, IDS, strict=True)] or [
    pytest.param(None, None, None, id="no-recording", marks=pytest.mark.skip(reason=OWED))
]


def _boundaries(samples: list[list[Any]]) -> list[tuple[str, tuple[int, int, str]]]:
    return [(kind, (mb, layer, name)) for kind, mb, layer, name, _ in samples]


def _cpu_order(row: str, offloader: Offloader, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The boundaries the sampler marks in the final step of ``row``'s memory run on CPU."""
    reads = iter(range(1, 1_000_000))
    monkeypatch.setattr(backwardpeak, "requested_bytes", lambda device: next(reads))
    case = {c.name: c for c in matrix("full")}[row]
    run = memory_run_spec(case)
    sampler = BackwardSampler(offloader, CPU)

    @contextlib.contextmanager
    def step_context(step: int):
        sampler.armed = step == run.steps - 1
        yield
        sampler.armed = False

    spec = Environment(device=CPU).spec(case)
    train(spec, run, sampler, CPU, hooks=RunHooks(step_context=step_context))
    return [s[:2] for s in sampler.samples]


@pytest.mark.parametrize(("file", "row", "recording"), PARAMS)
def test_the_cpu_marks_the_boundaries_the_gpu_marked_in_its_order(
    file: str, row: str, recording: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = recording["backward"]["samples"]
    case = {c.name: c for c in matrix("full")}[row]
    env = Environment(device=CPU)
    assert _cpu_order(row, NoOffload(), monkeypatch) == _boundaries(samples["baseline"])
    with closing(env.offloader(case.offload_config())) as offloader:
        assert _cpu_order(row, offloader, monkeypatch) == _boundaries(samples["offload"])


@pytest.mark.parametrize(("file", "row", "recording"), PARAMS)
def test_a_recorded_reading_is_judged_as_on_the_gpu(
    file: str, row: str, recording: dict[str, Any]
) -> None:
    record = recording["backward"]
    reading = BackwardReading.from_record(record)
    assert not reading.unmatched and reading.predicted is not None
    # the recorded drops, boundary by boundary, are what was predicted: no problem
    assert reading.problems == [], reading.problems
    assert recording["memory"]["status"] == "pass", recording["memory"]
    assert reading.record() == record


@pytest.mark.parametrize(("file", "row", "recording"), PARAMS[:1])
def test_one_block_more_at_a_recorded_boundary_is_named(
    file: str, row: str, recording: dict[str, Any]
) -> None:
    record = json.loads(json.dumps(recording["backward"]))
    offload = record["samples"]["offload"]
    index = len(offload) // 2
    offload[index][4] += 512  # the offload run holds one more allocator block there
    kind, mb, layer, name, _ = offload[index]
    problems = BackwardReading.from_record(record).problems
    assert len(problems) == 2, problems
    assert problems[1].startswith(f"backward {kind} of {name} (microbatch {mb}, layer {layer}):")
    assert problems[1].endswith(
        f"a drop of {record['samples']['predicted'][index] - 512} B, "
        f"predicted {record['samples']['predicted'][index]} B"
    )


@pytest.mark.parametrize(("file", "row", "recording"), PARAMS[:1])
def test_boundaries_match_by_kind_and_group_not_by_position(
    file: str, row: str, recording: dict[str, Any]
) -> None:
    record = json.loads(json.dumps(recording["backward"]))
    base = record["samples"]["baseline"]
    base[0], base[1] = base[1], base[0]  # the baseline's first two boundaries swapped
    assert BackwardReading.from_record(record).problems == []
    missing = base.pop()
    reading = BackwardReading.from_record(record)
    kind, mb, layer, name, _ = missing
    assert reading.problems == []  # undecided, not a failure
    assert reading.unmatched == (
        "1 group boundaries are marked in one run only (the first: the backward "
        f"{kind} of {name} (microbatch {mb}, layer {layer}), in the offload run alone)"
    )
