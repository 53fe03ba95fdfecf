"""The pipeline across ranks without ranks (``harness.models.pipeline``, ``harness.models.p2p``):
each stage's order against the one-rank runner's and Megatron-Core's rules, the interleaved
placement of layers, that every stage order can run without a deadlock when sends never block,
the message tags, and what is refused before training; the pipeline rows of the case table
(``harness.cases.pp_rows``: ids, skip reasons, refusals) and the cadence rule's next chunk on a
stage with an empty model chunk. The runs themselves, on two gloo ranks,
are in ``tests/e2e/test_pipeline_ranks.py``."""

from __future__ import annotations

import pytest
import torch

from harness.cases import PP_ROWS, SEED_CASE
from harness.execute.cadence import END, START, Event, megatron_allowed
from harness.execute.environment import Environment
from harness.models.p2p import BACKWARD, FORWARD, PipelineLayout, message_tag
from harness.models.pipeline import check_pipeline, stage_layers, stage_order
from harness.models.train import schedule_order
from harness.plugin.cases import skip_reason
from harness.verify.judge import CaseRuns, check
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


def test_pipeline_rows_are_named_by_their_stages_and_need_exactly_them() -> None:
    """The rows' ids end ``_pp<PP>`` (``x<VPP>`` under interleaved), so ``-k pp`` and ``-k pp4``
    select them; ``min_ranks`` follows the stages; at any other world size they skip with one
    line naming the torchrun command."""
    names = [row.name for row in PP_ROWS]
    assert [n.rsplit("_", 1)[1] for n in names] == ["pp2", "pp2x2", "pp4", "pp2", "pp2", "pp2"]
    assert all(row.min_ranks == row.pipeline for row in PP_ROWS)
    assert "ranks-" not in " ".join(names)
    cpu = torch.device("cpu")
    for row in PP_ROWS:
        assert skip_reason(row, row.pipeline, cpu, 0) == ""
        for world in (1, 2, 4):
            if world != row.pipeline:
                reason = skip_reason(row, world, cpu, 0)
                assert f"WORLD_SIZE is {world}" in reason and "\n" not in reason
                assert f"--nproc-per-node={row.pipeline}" in reason
    assert skip_reason(SEED_CASE, 2, cpu, 0) == ""  # the other rows are unaffected


def test_what_a_pipeline_row_refuses() -> None:
    with pytest.raises(ValueError, match="pipeline must be an int >= 1"):
        SEED_CASE.replace(pipeline=0)
    with pytest.raises(ValueError, match="gpipe, 1f1b or interleaved"):
        SEED_CASE.replace(pipeline=2)  # sequential
    with pytest.raises(ValueError, match="unsharded"):
        SEED_CASE.replace(schedule="1f1b", sharding="zero3", pipeline=2)
    assert SEED_CASE.replace(schedule="gpipe", pipeline=2).name.endswith("_gpipe_bf16_pp2")


def test_the_cadence_rule_passes_over_a_chunk_without_a_selected_group() -> None:
    """Megatron-Core's next backward chunk is the next non-empty one (``front_backward_chunk``
    skips empty chunks): on a pipeline stage whose second model chunk has no selected layer
    (the seed at PP=2 x VPP=2, rank 1, layer 5), the end of pass 0's last group backward may
    reload pass 2's, over the empty pass 1 between them; without ``holding`` it may not."""
    first, third = (0, 2, "core_attn"), (2, 2, "core_attn")
    events = [Event(kind=kind, key=key) for key in (first, third) for kind in (START, END)]
    order = [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert megatron_allowed(events, {2: [third]}, order) == {third: 2}
    assert megatron_allowed(events, {2: [third]}, order, holding={0, 2}) == {third: 1}


def test_a_pipeline_row_outside_its_world_is_a_skip_with_the_reason() -> None:
    """``offload-harness run`` or a one-process judge of a pipeline row trains nothing: every
    check is a skip naming the ranks it needs."""
    env = Environment(device=torch.device("cpu"), model_size="tiny")
    runs = CaseRuns(PP_ROWS[0], env)
    for name in ("equivalence", "transfers", "golden"):
        outcome = check(name, runs)
        assert outcome.status == "skip", outcome
        assert "runs on exactly 2 ranks (torchrun --nproc-per-node=2), not 1" in outcome.reason
    assert not runs.seconds  # nothing ran
