"""The pipeline across ranks without ranks (``harness.models.pipeline``, ``harness.models.p2p``):
each stage's order against the one-rank runner's and Megatron-Core's rules, the interleaved
placement of layers, that every stage order can run without a deadlock when sends never block,
the message tags, and what is refused before training. The runs themselves, on two gloo ranks,
are in ``tests/e2e/test_pipeline_ranks.py``."""

from __future__ import annotations

import pytest

from harness.cases import SEED_CASE
from harness.models.p2p import BACKWARD, FORWARD, PipelineLayout, message_tag
from harness.models.pipeline import check_pipeline, stage_layers, stage_order
from harness.models.train import schedule_order
from harness.vocab.spec import model_chunks

SCHEDULES = ("sequential", "gpipe", "1f1b", "interleaved")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("microbatches", [2, 4, 6])
def test_stage_0_of_2_runs_the_one_rank_order(schedule: str, microbatches: int) -> None:
    """The one-rank runner's orders are those of pipeline rank 0 of 2 (``schedule_order``):
    across ranks that rank runs exactly them, and the other rank its own slice."""
    assert stage_order(schedule, microbatches, 2, 0) == schedule_order(schedule, microbatches)


def test_1f1b_warms_up_by_the_stages_after_it() -> None:
    """Megatron's non-interleaved 1F1B: ``stages - stage - 1`` warmup forwards (at most all),
    then a forward and a backward at a time, then the remaining backwards; the last stage runs
    every microbatch's forward and backward in turn."""
    F, B = "F", "B"
    first = [(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (B, 1), (B, 2), (B, 3)]  # warmup 3
    second = [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)]  # warmup 2
    assert stage_order("1f1b", 4, 4, 0) == first
    assert stage_order("1f1b", 4, 4, 1) == second
    assert stage_order("1f1b", 4, 4, 3) == schedule_order("sequential", 4)
    assert stage_order("gpipe", 4, 4, 2) == schedule_order("gpipe", 4)


def _plays_through(orders: list[list[tuple[str, int]]], layout: PipelineLayout) -> bool:
    """Play each stage's order (``orders[stage]``) with sends that never block and receives that
    wait for their send (``harness.models.p2p``): whether every pass of every stage runs."""
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    at = [0] * layout.stages
    V = layout.virtual_stages
    progress = True
    while progress:
        progress = False
        for stage, order in enumerate(orders):
            if at[stage] == len(order):
                continue
            kind, p = order[at[stage]]
            mb, chunk = divmod(p, layout.chunks)
            v = layout.virtual_stage(stage, chunk)
            needs = ("F", mb, v - 1) if kind == "F" and v > 0 else None
            if kind == "B":
                needs = ("B", mb, v + 1) if v < V - 1 else ("F", mb, v)
            if needs is None or needs in done:
                done.add((kind, mb, v))
                at[stage] += 1
                progress = True
    return all(at[s] == len(orders[s]) for s in range(layout.stages))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_every_stage_order_runs_without_a_deadlock(
    schedule: str, stages: int, microbatches: int
) -> None:
    layout = PipelineLayout(stages, model_chunks(schedule))
    orders = [stage_order(schedule, microbatches, stages, s) for s in range(stages)]
    assert _plays_through(orders, layout)


def test_the_player_finds_a_deadlock() -> None:
    """The player above is not vacuous: stage 0 running its backwards before its forwards
    waits for a gradient that needs its own forward."""
    layout = PipelineLayout(2)
    backwards_first = [("B", mb) for mb in range(4)] + [("F", mb) for mb in range(4)]
    assert not _plays_through([backwards_first, stage_order("1f1b", 4, 2, 1)], layout)
    assert _plays_through([stage_order("1f1b", 4, 2, s) for s in (0, 1)], layout)


def test_interleaved_placement_is_megatrons() -> None:
    """Rank r's chunk c is virtual stage c * stages + r: at PP=2, VPP=2 on the seed's 6 layers
    (virtual stages of 2, 2, 1, 1 layers) rank 0 runs layers 0-1 and 4, rank 1 layers 2-3 and 5;
    at PP=4 without chunks each rank runs its contiguous quarter."""
    layout = PipelineLayout(2, 2)
    assert [layout.virtual_stage(s, c) for s in (0, 1) for c in (0, 1)] == [0, 2, 1, 3]
    assert all(layout.owner(layout.virtual_stage(s, c)) == (s, c) for s in (0, 1) for c in (0, 1))
    assert stage_layers(6, layout, 0) == [range(0, 2), range(4, 5)]
    assert stage_layers(6, layout, 1) == [range(2, 4), range(5, 6)]
    flat = PipelineLayout(4)
    assert [stage_layers(8, flat, s) for s in range(4)] == [
        [range(2 * s, 2 * s + 2)] for s in range(4)
    ]


def test_message_tags_are_unique_within_a_step() -> None:
    V, M = 8, 6
    tags = {
        message_tag(d, v, mb, V) for d in (FORWARD, BACKWARD) for v in range(V) for mb in range(M)
    }
    assert len(tags) == 2 * V * M


def test_what_the_pipeline_refuses_before_training() -> None:
    spec, run = SEED_CASE.model_spec("tiny"), SEED_CASE.run_spec()
    check_pipeline(spec, run, PipelineLayout(2, 2))
    with pytest.raises(
        ValueError, match="need at least 8 layers; the pattern '\\+-\\+-\\+-' has 6"
    ):
        check_pipeline(spec, run, PipelineLayout(4, 2))
    with pytest.raises(ValueError, match="no no-grad evaluation pass"):
        check_pipeline(spec, run.replace(eval_first=True), PipelineLayout(2))
    with pytest.raises(ValueError, match="multiple of 4"):
        check_pipeline(spec, run.replace(schedule="interleaved"), PipelineLayout(4, 1))
    with pytest.raises(ValueError, match="stages >= 2"):
        PipelineLayout(1)
