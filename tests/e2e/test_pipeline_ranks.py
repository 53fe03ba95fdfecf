"""The pipeline across ranks (``harness.models.pipeline``) on gloo CPU ranks, against the same
model trained on one rank (``harness.models.train``) with the same schedule: the losses every
rank reports, each stage's gradients of every step and its final weights, bitwise - with the
no-op offloader (``none``) and with the reference offloader, each rank driving its own.

Each row is one job of two ranks forked from the harness's forkserver (``mp.start_processes``
as in ``tests/e2e/test_distributed.py``'s two-rank test; ``harness.run.forkserver``'s preload,
so a rank imports nothing of torch's at its optimizer's first step), meeting on a ``FileStore``
in the test's folder (no port). The ranks write their results there; this process trains the
one-rank runs and compares. Bounded: a receive that waits past ``GLOO_TIMEOUT_S`` raises on its
rank, which ends the job (``ProcessContext.join`` stops the other rank); the job as a whole may
take ``JOB_DEADLINE_S``, then the test fails; and however the test ends, its ranks still alive
are killed (by process) before it returns. Both ranks and this process compute on one thread, so
the kernels reduce alike in all three (a CPU kernel may split a reduction by the thread count).

The rows: the seed's pattern ``+-+-+-`` at PP=2 under GPipe and 1F1B, under interleaved 1F1B at
PP=2 with VPP=2 (4 virtual stages), and at PP=4 under 1F1B (four ranks, each its own warmup);
the ``hybrid-moe`` model's experts at PP=2 under 1F1B;
3 steps of 4 microbatches in bf16 (fp32 main weights), gradient clip 1.0 (active: the tiny
models' gradient norms are above 1 in these steps, so the clip's norm across stages matters).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from forked_ranks import run_ranks

from harness.cases import MOE_ZERO3_CASE, PIPELINE_ROWS, SEED_CASE, Case
from harness.models import pipeline
from harness.models.p2p import PipelineLayout
from harness.models.pipeline import stage_layers, stage_order, train_pipeline
from harness.models.train import clip_locally, train
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import IterationLog, Offloader, Wrapper
from harness.offload.reference import OffloadContext
from harness.vocab.spec import model_chunks

GLOO_TIMEOUT_S = 30
"""The process group's timeout: a receive (or collective) waiting longer raises on its rank."""
JOB_DEADLINE_S = 90
"""How long one row's job may take in all (about 3 s on the 2-core CPU machine)."""

ROWS: dict[str, tuple[Case, int]] = {
    "hybrid_gpipe_pp2": (SEED_CASE.replace(schedule="gpipe", microbatches=4, steps=3), 2),
    "hybrid_1f1b_pp2": (SEED_CASE.replace(schedule="1f1b", microbatches=4, steps=3), 2),
    "hybrid_interleaved_pp2_vpp2": (PIPELINE_ROWS[0].replace(steps=3), 2),
    "moe_1f1b_pp2": (MOE_ZERO3_CASE.replace(sharding="none", microbatches=4, steps=3), 2),
    "hybrid_1f1b_pp4": (SEED_CASE.replace(schedule="1f1b", microbatches=4, steps=3), 4),
}
"""Each row's case and its ranks (pipeline stages)."""
OFFLOADERS = ("none", "reference")
CONTROL = "local-clip"
"""A control run (no-op offloader) whose stages clip by their own gradients' norm only."""


class _Calls(Wrapper):
    """Records the runner's calls into a rank's offloader, in order."""

    def __init__(self, inner: Offloader) -> None:
        super().__init__(inner)
        self.calls: list[tuple[Any, ...]] = []

    def model_chunk(self, chunk: int, chunks: int) -> None:
        self.calls.append(("chunk", chunk, chunks))
        super().model_chunk(chunk, chunks)

    def begin_microbatch(self, microbatch: int) -> None:
        self.calls.append(("begin", microbatch))
        super().begin_microbatch(microbatch)

    def end_iteration(self) -> None:
        self.calls.append(("end",))
        super().end_iteration()


def _offloader(name: str, case: Case) -> Offloader:
    return NoOffload() if name != "reference" else OffloadContext(case.offload_config(), "cpu")


def _local_clip(whole: list[str], mine: list[str], group: object = None) -> Any:
    """Stands in for ``ClipAcrossStages`` in the control run: each stage its own norm."""
    return clip_locally


def _rank(rank: int, store: str, folder: str, row: str, runs: tuple[str, ...]) -> None:
    """One rank of a row's job: the pipeline with each offloader of ``runs`` (or the control),
    results into ``folder``."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    case, ranks = ROWS[row]
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, ranks), rank=rank, world_size=ranks, timeout=timeout
    )
    try:
        for name in runs:
            if name == CONTROL:
                pipeline.ClipAcrossStages = _local_clip  # type: ignore[assignment,misc]
            spy = _Calls(_offloader(name, case))
            result = train_pipeline(
                case.model_spec("tiny"),
                case.run_spec(),
                spy,
                "cpu",
                keep_grads=True,
                keep_final_state=True,
            )
            saved = {"losses": result.losses, "grads": result.grads, "final": result.final_state}
            saved |= {"calls": spy.calls, "warmup": _copies_by_layer(result.logs)}
            saved |= {"leaked": [log.leaked_tensors for log in result.logs]}
            torch.save(saved, Path(folder, f"{name}-rank{rank}.pt"))
            spy.close()
    finally:
        dist.destroy_process_group()


def _copies_by_layer(logs: list[IterationLog]) -> dict[int, int]:
    """The warmup iteration's copies out, per layer (none without logs)."""
    copies: dict[int, int] = {}
    for group in logs[0].groups if logs else ():
        copies[group.layer] = copies.get(group.layer, 0) + group.d2h_copies
    return {layer: count for layer, count in copies.items() if count}


def _stage_copies(case: Case, ranks: int, stage: int, copies: dict[int, int]) -> dict[int, int]:
    """``copies`` (per layer) of the layers ``stage`` runs."""
    layout = PipelineLayout(ranks, model_chunks(case.schedule))
    count = len(case.model_spec("tiny").layers)
    mine = {index for chunk in stage_layers(count, layout, stage) for index in chunk}
    return {layer: n for layer, n in copies.items() if layer in mine}


def _run_job(row: str, folder: Path, runs: tuple[str, ...] = OFFLOADERS) -> float:
    """Run ``row``'s job to its end (see the module docstring); seconds."""
    args = (str(folder / "store"), str(folder), row, runs)
    ranks = ROWS[row][1]
    return run_ranks(_rank, args, ranks, JOB_DEADLINE_S, f"the {ranks}-rank job of {row}")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _one_rank(case: Case, name: str) -> Any:
    with _one_thread():
        return train(
            case.model_spec("tiny"),
            case.run_spec(),
            _offloader(name, case),
            "cpu",
            keep_grads=True,
            keep_final_state=True,
        )


def _differences(one: Any, ranks: list[dict[str, Any]]) -> list[str]:
    """Where the ranks' results differ from the one-rank run's (bitwise), and whether the stages
    together hold every parameter exactly once."""
    problems = []
    for rank, got in enumerate(ranks):
        if not torch.equal(got["losses"], one.losses):
            problems.append(
                f"rank {rank}: losses {got['losses'].tolist()} vs {one.losses.tolist()}"
            )
        for step, grads in enumerate(got["grads"]):
            problems += [
                f"rank {rank}: gradient of {name} at step {step}"
                for name, grad in grads.items()
                if not torch.equal(grad, one.grads[step][name])
            ]
        problems += [
            f"rank {rank}: final weight {name}"
            for name, weight in got["final"].items()
            if not torch.equal(weight, one.final_state[name])
        ]
    held = [name for got in ranks for name in got["final"]]
    if sorted(held) != sorted(one.final_state):
        problems.append(f"the stages hold {sorted(held)}, the model {sorted(one.final_state)}")
    return problems


def _expected_calls(case: Case, ranks: int, stage: int) -> list[tuple[Any, ...]]:
    """What the one-rank runner would tell an offloader for this stage's passes, per step."""
    chunks = model_chunks(case.schedule)
    step: list[tuple[Any, ...]] = []
    for kind, p in stage_order(case.schedule, case.microbatches, ranks, stage):
        if kind == "F":
            step += [("chunk", p % chunks, chunks)] if chunks > 1 else []
            step.append(("begin", p))
    return [*step, ("end",)] * case.steps


@pytest.mark.heavy
@pytest.mark.parametrize("row", list(ROWS))
def test_pipeline_across_ranks_is_bitwise_the_one_rank_run(row: str, tmp_path: Path) -> None:
    """Losses, gradients and final weights bitwise; each rank's offloader told the passes of its
    own order; the reference's warmup copied out on each stage what the one-rank warmup copied
    out of that stage's layers (the warmup offloads every selected group), and nothing leaked."""
    seconds = _run_job(row, tmp_path)
    case, ranks = ROWS[row]
    for name in OFFLOADERS:
        one = _one_rank(case, name)
        results = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(ranks)]
        problems = _differences(one, results)
        assert not problems, f"{row}, offloader {name}:\n" + "\n".join(problems[:20])
        copies = _copies_by_layer(one.logs)
        assert bool(copies) is (name == "reference")
        for stage, got in enumerate(results):
            assert got["calls"] == _expected_calls(case, ranks, stage), (row, name, stage)
            assert got["warmup"] == _stage_copies(case, ranks, stage, copies), (row, name, stage)
            assert not any(got["leaked"]), (row, name, stage)
    assert seconds < JOB_DEADLINE_S


@pytest.mark.heavy
def test_the_comparison_sees_a_clip_by_each_stages_own_norm(tmp_path: Path) -> None:
    """The control: the GPipe row's stages clipping by their own gradients' norm (not the whole
    model's) train the same first step's losses and gradients, but other weights."""
    _run_job("hybrid_gpipe_pp2", tmp_path, (CONTROL,))
    case, ranks = ROWS["hybrid_gpipe_pp2"]
    one = _one_rank(case, "none")
    results = [torch.load(tmp_path / f"{CONTROL}-rank{r}.pt") for r in range(ranks)]
    problems = _differences(one, results)
    assert problems and all("step 0" not in line for line in problems), problems
    assert any("final weight" in line for line in problems)
