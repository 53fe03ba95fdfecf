"""The interleaved pipeline schedule: its order, the model chunks, the refusals. Its runs (the
runner, the offloaders, what the groups save) are in ``tests/e2e/test_interleaved_runs.py``."""

from __future__ import annotations

import pytest
import torch

from harness.cases import PIPELINE_ROWS, Case, default_matrix
from harness.models.hybrid import seeded_model
from harness.models.train import interleaved_order, pass_of, schedule_order
from harness.offload.passthrough import NoOffload
from harness.vocab.spec import RunSpec, chunk_layers

SEED_INTERLEAVED = PIPELINE_ROWS[0]


def _positions(order: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    return {op: i for i, op in enumerate(order)}


def test_four_microbatches_follow_megatrons_interleaved_rule_for_rank_0_of_2() -> None:
    """Derived by hand from the rule in ``interleaved_order``'s docstring (P = 2 ranks, V = 2
    chunks, rank 0): 4 warmup forwards (2 * (P - 1) + (V - 1) * P), then F/B pairs, then the
    remaining backwards; pass = microbatch * 2 + chunk."""
    F, B = "F", "B"
    expected = [(F, 0), (F, 2), (F, 1), (F, 3)]  # chunk 0 of mb 0, 1; chunk 1 of mb 0, 1
    expected += [(F, 4), (B, 1), (F, 6), (B, 3), (F, 5), (B, 0), (F, 7), (B, 2)]
    expected += [(B, 5), (B, 7), (B, 4), (B, 6)]
    assert schedule_order("interleaved", 4) == expected


@pytest.mark.parametrize("microbatches", [2, 4, 6, 8])
@pytest.mark.parametrize(("ranks", "rank", "chunks"), [(2, 0, 2), (2, 1, 2), (4, 0, 3), (4, 3, 2)])
def test_every_order_runs_on_one_process(
    microbatches: int, ranks: int, rank: int, chunks: int
) -> None:
    """Each pass once forward and once backward; a chunk's forward after the previous chunk's
    of the same microbatch, its backward after its own forward and after the next chunk's
    backward: what running the whole model in that order on one process needs."""
    if microbatches % ranks:
        with pytest.raises(ValueError, match=f"multiple of {ranks}"):
            interleaved_order(microbatches, chunks=chunks, ranks=ranks, rank=rank)
        return
    order = interleaved_order(microbatches, chunks=chunks, ranks=ranks, rank=rank)
    passes = [pass_of(mb, c, chunks) for mb in range(microbatches) for c in range(chunks)]
    assert sorted(p for kind, p in order if kind == "F") == sorted(passes)
    assert sorted(p for kind, p in order if kind == "B") == sorted(passes)
    at = _positions(order)
    for mb in range(microbatches):
        for c in range(chunks):
            p = pass_of(mb, c, chunks)
            assert at[("F", p)] < at[("B", p)]
            if c > 0:
                assert at[("F", p - 1)] < at[("F", p)]
            if c < chunks - 1:
                assert at[("B", p + 1)] < at[("B", p)]
    total = microbatches * chunks
    warmup = min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, total)
    first_backward = next(i for i, (kind, _) in enumerate(order) if kind == "B")
    assert first_backward == warmup + (warmup < total), "warmup forwards, then F B pairs"


def test_chunks_cover_the_layers_and_compose_to_the_whole_forward() -> None:
    case = SEED_INTERLEAVED
    spec = case.model_spec("tiny")
    model = seeded_model(spec, 1234)
    assert [list(chunk_layers(6, c, 2)) for c in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [list(chunk_layers(6, c, 4)) for c in range(4)] == [[0, 1], [2, 3], [4], [5]]
    with pytest.raises(ValueError, match="needs at least one"):
        chunk_layers(6, 0, 7)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
    off = NoOffload()
    whole = model(tokens, off)
    hidden = model.forward_chunk(tokens, off, 0, 2)
    assert hidden.shape == (2, spec.seq_length, spec.hidden_size)
    assert torch.equal(model.forward_chunk(hidden, off, 1, 2), whole)


def test_bad_interleaved_input_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match="multiple of 2 under the interleaved schedule"):
        RunSpec(schedule="interleaved", microbatches=3)
    with pytest.raises(ValueError, match="has 1"):
        Case(family="hybrid", offload=("core_attn",), schedule="interleaved", custom_pattern="+")
    with pytest.raises(ValueError, match="unsharded models only"):
        SEED_INTERLEAVED.replace(sharding="zero3")
    with pytest.raises(ValueError, match="impl 'mcore' runs schedule sequential"):
        SEED_INTERLEAVED.replace(impl="mcore")


def test_the_default_matrix_carries_the_seed_under_the_interleaved_schedule() -> None:
    assert SEED_INTERLEAVED in default_matrix()
    assert SEED_INTERLEAVED.name == "hybrid-+-+-+-_core_attn+attn_proj_interleaved_bf16_6x4"
