"""The interleaved pipeline schedule: its order, the model chunks, the runner, the offloaders."""

from __future__ import annotations

import pytest
import torch

from harness.cases import PIPELINE_ROWS, Case, default_matrix
from harness.models.hybrid import seeded_model
from harness.models.train import interleaved_order, pass_of, schedule_order, train
from harness.offload.broken import ChunkOrder
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Wrapper
from harness.offload.reference import OffloadContext
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


class _Spy(Wrapper):
    """Records the runner's calls: (model chunk, begin_microbatch) in order."""

    def __init__(self, inner: NoOffload) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, int | tuple[int, int]]] = []

    def model_chunk(self, chunk: int, chunks: int) -> None:
        self.calls.append(("chunk", (chunk, chunks)))

    def begin_microbatch(self, microbatch: int) -> None:
        self.calls.append(("begin", microbatch))
        super().begin_microbatch(microbatch)


def test_the_runner_announces_each_pass_with_its_chunk() -> None:
    case = SEED_INTERLEAVED.replace(steps=1)
    spy = _Spy(NoOffload())
    train(case.model_spec("tiny"), case.run_spec(), spy, "cpu")
    forwards = [p for kind, p in schedule_order("interleaved", case.microbatches) if kind == "F"]
    expected: list[tuple[str, int | tuple[int, int]]] = []
    for p in forwards:
        expected += [("chunk", (p % 2, 2)), ("begin", p)]
    assert spy.calls == expected


def test_interleaved_losses_equal_the_sequential_ones_bitwise() -> None:
    """The chunk boundary detaches, it does not compute, and each parameter lives in one chunk,
    whose backwards run in microbatch order: its gradient accumulates in the same order as
    under the sequential schedule, so every step's losses agree bitwise (fp32 and bf16)."""
    for precision in ("fp32", "bf16"):
        case = SEED_INTERLEAVED.replace(steps=3, precision=precision)
        spec = case.model_spec("tiny")
        chunked = train(spec, case.run_spec(), NoOffload(), "cpu")
        plain = train(spec, case.run_spec().replace(schedule="sequential"), NoOffload(), "cpu")
        assert torch.equal(chunked.losses, plain.losses), precision
        assert not torch.equal(chunked.losses[0], chunked.losses[1]), "the steps trained"


def test_reference_offloads_every_chunk_and_matches_the_baseline_bitwise() -> None:
    case = SEED_INTERLEAVED.replace(steps=3)
    spec, run = case.model_spec("tiny"), case.run_spec()
    plain = train(spec, run, NoOffload(), "cpu")
    off = OffloadContext(case.offload_config(), "cpu")
    result = train(spec, run, off, "cpu")
    logs = off.iteration_logs()
    moved = {(g.microbatch, g.layer) for g in logs[0].groups if g.d2h_copies and g.h2d_copies}
    assert {mb for mb, _ in moved} == set(range(case.microbatches * 2)), "every pass moved"
    # the MLA layers that open these groups: 0 and 2 in chunk 0, 4 in chunk 1
    assert {layer for _, layer in moved} == {0, 2, 4}, "layers of both chunks moved"
    assert all(log.leaked_tensors == 0 for log in logs)
    assert torch.equal(result.losses, plain.losses)


def test_chunk_order_breaks_only_the_interleaved_schedule() -> None:
    """``broken.chunk_order`` serves backward by forward order of chunks: exact under 1F1B
    (chunks run backward in forward order there), wrong under the interleaved schedule."""
    for schedule, exact in (("1f1b", True), ("interleaved", False)):
        case = SEED_INTERLEAVED.replace(schedule=schedule, steps=2)
        spec, run = case.model_spec("tiny"), case.run_spec()
        plain = train(spec, run, NoOffload(), "cpu")
        result = train(spec, run, ChunkOrder(case.offload_config(), "cpu"), "cpu")
        assert torch.equal(result.losses, plain.losses) is exact, schedule


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


def test_a_gated_activation_reloads_its_storage_twice() -> None:
    """moe_act saves both halves of fc1's output (two views of one storage); Megatron's rules
    copy each view's whole storage, so a reload of that group holds the storage twice: the
    memory case counts the second copy against the drop when the group is reloaded ahead of
    its backward, as the interleaved schedule does before its last forward (measured on the
    H200: 40 MiB blocks, 12 in the offload run where the drop without it predicted 11)."""
    from harness.execute.predict import redundant_reload_bytes, redundant_reload_sizes
    from harness.offload.recorder import RecordingOffloader

    case = PIPELINE_ROWS[1]
    recorder = RecordingOffloader(case.offload_config(), "cpu")
    train(case.model_spec("tiny"), case.run_spec().replace(steps=1), recorder, "cpu")
    observations = recorder.iterations[0]
    config = case.offload_config()
    # tiny: 64 tokens (2 x 32), top-2 of 4 experts at capacity factor 2.0 -> 64 tokens per
    # expert; fc1's gated output is 2 x moe_ffn_hidden_size = 128 wide, fp32:
    fc1_output = 4 * 64 * 128 * 4  # 131072 B, of which each SwiGLU half views one half
    for obs in observations:
        sizes = redundant_reload_sizes(obs, config)
        if obs.name == "moe_act":
            halves = [s for s in obs.saved if not s.contiguous]
            assert len(halves) == 2 and halves[0].storage_id == halves[1].storage_id
            assert halves[0].storage_nbytes == fc1_output
            assert sizes == [fc1_output]  # the second whole-storage copy of that storage
            assert redundant_reload_bytes(obs, config) == fc1_output
        else:
            assert sizes == [] and redundant_reload_bytes(obs, config) == 0


def test_a_tensor_saved_twice_reloads_as_two_allocations() -> None:
    """qkv_linear saves the normed input once per projection that reads it: one storage, two
    copies, so a reload of the group allocates it twice (what the memory case predicts for a
    group reloaded ahead of its backward)."""
    from harness.execute.predict import reload_sizes
    from harness.offload.recorder import RecordingOffloader
    from harness.offload.semantics import eligible

    case = PIPELINE_ROWS[2]
    config = case.offload_config()
    recorder = RecordingOffloader(config, "cpu")
    train(case.model_spec("tiny"), case.run_spec().replace(steps=1), recorder, "cpu")
    qkv = next(o for o in recorder.iterations[0] if o.name == "qkv_linear")
    normed = 64 * 64 * 2  # the normed input: 64 tokens (2 x 32) x hidden 64, bf16: 8192 B
    twice = [s for s in qkv.saved if s.shape == (64, 64) and eligible(s, config)]
    assert len(twice) == 2 and twice[0].storage_id == twice[1].storage_id, qkv.saved
    assert reload_sizes(qkv, config).count(normed) == 2, "one allocation per saved copy"


def test_an_offload_that_moves_nothing_is_named_by_pass_and_chunk() -> None:
    """The offload proof covers every pass of every model chunk, each named by its microbatch
    and chunk: ``broken.noop`` fails it for each of the 8 passes and both selected names."""
    from harness.execute.environment import Environment
    from harness.verify.judge import judge

    env = Environment(device=torch.device("cpu"), backend="broken.noop")
    outcome = judge(SEED_INTERLEAVED, env, checks=("equivalence",)).first_failure()
    assert outcome is not None
    text = "\n".join(outcome.problems)
    for p in range(8):
        label = f"pass {p} (microbatch {p // 2}, model chunk {p % 2})"
        for name in ("attn_proj", "core_attn"):
            assert f"{label}: no {name} group moved bytes" in text, (label, name, text)
