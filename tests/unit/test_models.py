"""Models and runner: the layer-pattern parser, deterministic building, each layer's offload
group template (checked through the groups a real forward and backward open), the schedules'
orders and the batch generator. Nothing here trains: the runs (learning, schedules run,
precision, determinism, in-place checks, CUDA) are in ``tests/e2e/test_models_runs.py``.

Expectations are written out here (group sequences, schedule orders) or derived from first
principles, not read back from the code under test.
"""

from __future__ import annotations

import pytest
import torch
from model_states import TINY_PRESETS
from model_states import bitwise_equal as _bitwise_equal

from harness.models.hybrid import build_model, draw_batches, make_batches, seeded_model
from harness.models.runs import RunHooks
from harness.models.train import _run_step, deterministic, prepare_model, schedule_order
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.offload.recorder import RecordingOffloader
from harness.vocab.spec import ModelSpec, RunSpec, parse_pattern, preset

# ------------------------------------------------------------------------------------ parser


@pytest.mark.parametrize(
    ("pattern", "needles"),
    [
        pytest.param("", ("non-empty",), id="empty"),
        pytest.param("+x-", ("'x'", "position 1", "'+'", "'*'", "'-'", "'E'"), id="unknown"),
        pytest.param("+-e", ("'e'", "position 2", "'E'"), id="lowercase-e"),
        pytest.param("*E+", ("'*'", "'+'", "mixes"), id="star-and-plus"),
        pytest.param("+-|+-", ("'|'", "pipeline"), id="pipe"),
        pytest.param("+-/+", ("'/'", "multi-token"), id="slash"),
    ],
)
def test_parse_pattern_rejects(pattern: str, needles: tuple[str, ...]) -> None:
    """Every bad pattern is a one-line ValueError naming the problem (and the legal symbols)."""
    with pytest.raises(ValueError) as info:
        parse_pattern(pattern)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} missing from {message!r}"


def test_parse_pattern_rejects_non_string() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        parse_pattern(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "layers"),
    [
        ("+", ("+",)),
        ("E", ("E",)),
        ("+-+-+-", ("+", "-", "+", "-", "+", "-")),
        ("*E*E", ("*", "E", "*", "E")),
        ("+E+-+E", ("+", "E", "+", "-", "+", "E")),
        ("--E-", ("-", "-", "E", "-")),
    ],
)
def test_parse_pattern_accepts(pattern: str, layers: tuple[str, ...]) -> None:
    assert parse_pattern(pattern) == layers
    assert ModelSpec(pattern=pattern).layers == layers


def test_model_spec_rejects_bad_pattern_in_one_line() -> None:
    with pytest.raises(ValueError) as info:
        preset("hybrid-tiny").replace(pattern="+*")
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------- build determinism


def _state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    return build_model(spec, torch.Generator().manual_seed(seed)).state_dict()


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_build_is_a_pure_function_of_the_generator(name: str) -> None:
    spec = preset(name)
    rng_before = torch.random.get_rng_state()
    first = _state(spec, 7)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "build touched the global RNG"
    torch.manual_seed(999)  # a different global RNG state must not matter either
    second = _state(spec, 7)
    assert _bitwise_equal(first, second)
    other = _state(spec, 8)
    random_weights = [k for k in first if not k.endswith("norm.weight")]
    assert random_weights
    assert all(not torch.equal(first[k], other[k]) for k in random_weights)


# ----------------------------------------------------------------------------- group templates

EVERYTHING_UNFUSED = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
)
EVERYTHING_FUSED = (*EVERYTHING_UNFUSED[:5], "fused_group_mlp")
SELECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    # label: (moe_path, selected names); names a pattern cannot open must simply open nothing
    "attn_norm": ("unfused", ("attn_norm",)),
    "core_attn+attn_proj": ("unfused", ("core_attn", "attn_proj")),
    "moe_act": ("unfused", ("moe_act",)),
    "everything": ("unfused", EVERYTHING_UNFUSED),
    "fused-everything": ("fused", EVERYTHING_FUSED),
}
PATTERNS = ("+-+-+-", "*E*E", "+E+-+E", "E", "-+", "+E")

MLA = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")
ATTN = ("qkv_linear", "core_attn", "attn_proj")


def _at(layer: int, names: tuple[str, ...]) -> list[tuple[int, str]]:
    return [(layer, name) for name in names]


LITERAL: dict[tuple[str, str], list[tuple[int, str]]] = {
    ("+E", "everything"): [
        (0, "attn_norm"),
        (0, "qkv_linear"),
        (0, "core_attn"),
        (0, "attn_proj"),
        (1, "mlp_norm"),
        (1, "expert_fc1"),
        (1, "moe_act"),
    ],
    ("*E*E", "fused-everything"): [
        (0, "qkv_linear"),
        (0, "core_attn"),
        (0, "attn_proj"),
        (1, "mlp_norm"),
        (1, "fused_group_mlp"),
        (2, "qkv_linear"),
        (2, "core_attn"),
        (2, "attn_proj"),
        (3, "mlp_norm"),
        (3, "fused_group_mlp"),
    ],
    ("+-+-+-", "core_attn+attn_proj"): [
        (0, "core_attn"),
        (0, "attn_proj"),
        (2, "core_attn"),
        (2, "attn_proj"),
        (4, "core_attn"),
        (4, "attn_proj"),
    ],
    ("+E+-+E", "everything"): [
        *_at(0, MLA),
        *_at(1, ("mlp_norm", "expert_fc1", "moe_act")),
        *_at(2, MLA),
        *_at(4, MLA),
        *_at(5, ("mlp_norm", "expert_fc1", "moe_act")),
    ],
    ("*E*E", "everything"): [
        *_at(0, ATTN),
        *_at(1, ("mlp_norm", "expert_fc1", "moe_act")),
        *_at(2, ATTN),
        *_at(3, ("mlp_norm", "expert_fc1", "moe_act")),
    ],
    ("-+", "attn_norm"): [(1, "attn_norm")],
    ("*E*E", "attn_norm"): [],  # standard attention fuses its norm into qkv_linear
    ("E", "moe_act"): [(0, "moe_act")],
    ("E", "fused-everything"): [(0, "mlp_norm"), (0, "fused_group_mlp")],
    ("-+", "everything"): _at(1, MLA),  # the dense MLP layer opens no group
}


def _step_without_the_optimizer(spec: ModelSpec, run: RunSpec, offloader: Offloader) -> None:
    """Step 0 of ``train(spec, run, offloader, "cpu")`` up to its optimizer step: the same seeded
    model and batches, the same runner code for the schedule's passes (``_run_step``: each
    microbatch announced, its forward and its backward, then the offloader's iteration end),
    under the same deterministic kernels. Everything the offloader sees of a one-step run
    happens here: ``train``'s optimizer step comes after the iteration ended."""
    device = torch.device("cpu")
    model = prepare_model(spec, run, device)
    data = make_batches(spec, seed=run.seed, steps=1, microbatches=run.microbatches)
    losses = torch.zeros(1, run.microbatches)
    order = schedule_order(run.schedule, run.microbatches)
    with deterministic(device):
        _run_step(model, offloader, data[0], losses[0], order, run, 0, RunHooks())
    assert torch.isfinite(losses).all()


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_forward_opens_the_template_groups(pattern: str, selection: str) -> None:
    """One step x 2 microbatches with the hooks backend (its forwards and backwards, without
    the optimizer step): each microbatch opens, in start order, exactly the groups of the
    layers' templates that are selected."""
    moe_path, names = SELECTIONS[selection]
    spec = preset("hybrid-tiny").replace(pattern=pattern, moe_path=moe_path)
    recorder = RecordingOffloader(OffloadConfig(offload_modules=names), "cpu")
    _step_without_the_optimizer(spec, RunSpec(steps=1, microbatches=2), recorder)
    (observations,) = recorder.iterations
    assert [o.microbatch for o in observations] == sorted(o.microbatch for o in observations)
    expected = list(spec.group_sequence(frozenset(names)))
    for mb in range(2):
        opened = [(o.layer, o.name) for o in observations if o.microbatch == mb]
        assert opened == expected
        if (pattern, selection) in LITERAL:
            assert opened == LITERAL[(pattern, selection)]
    assert len(observations) == 2 * len(expected)


def test_literal_expectations_are_all_exercised() -> None:
    """Guard against a typo in LITERAL silently skipping its check."""
    assert {p for p, _ in LITERAL} <= set(PATTERNS)
    assert {s for _, s in LITERAL} <= set(SELECTIONS)
    assert len({p for p, _ in LITERAL}) >= 2


# ---------------------------------------------------------------------- schedules and batches


def test_schedule_orders_for_three_microbatches() -> None:
    assert schedule_order("sequential", 3) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
    ]
    assert schedule_order("gpipe", 3) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    ]
    assert schedule_order("1f1b", 3) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("B", 2),
    ]
    assert schedule_order("1f1b", 1) == [("F", 0), ("B", 0)]
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_order("zigzag", 3)


def test_a_seeded_model_built_again_is_a_fresh_bitwise_copy() -> None:
    """``seeded_model`` reuses the weights of its last (spec, seed): the reuse must be the same
    model ``build_model`` makes, in its own storage, untouched by training the earlier one."""
    spec = preset("hybrid-tiny")
    expected = _state(spec, 11)
    first = seeded_model(spec, 11)
    assert _bitwise_equal(first.state_dict(), expected)
    rng_before = torch.random.get_rng_state()
    with torch.no_grad():
        for param in first.parameters():
            param.add_(1.0)  # what training the first one does to its weights, in place
    second = seeded_model(spec, 11)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "reuse touched the global RNG"
    assert _bitwise_equal(second.state_dict(), expected)
    first_storage = {p.data_ptr() for p in first.parameters()}
    assert not first_storage & {p.data_ptr() for p in second.parameters()}, "storage shared"
    assert _bitwise_equal(seeded_model(spec, 12).state_dict(), _state(spec, 12))


def test_batches_drawn_again_are_fresh_bitwise_copies() -> None:
    spec = preset("hybrid-tiny")
    first = make_batches(spec, seed=5, steps=3, microbatches=2)
    first.zero_()  # a caller writing into its batches must not change the next caller's
    again = make_batches(spec, seed=5, steps=3, microbatches=2)
    assert torch.equal(again, draw_batches(spec, seed=5, steps=3, microbatches=2))
    assert int(again.max()) > 0


def test_batches_are_fixed_per_seed_step_and_microbatch() -> None:
    spec = preset("hybrid-tiny")
    three = make_batches(spec, seed=5, steps=3, microbatches=2)
    five = make_batches(spec, seed=5, steps=5, microbatches=4)
    B, T = spec.micro_batch_size, spec.seq_length
    assert three.shape == (3, 2, B, T + 1) and five.shape == (5, 4, B, T + 1)
    assert three.dtype == torch.long
    assert torch.equal(three[2], five[2, :2])
    assert torch.equal(three, five[:3, :2])
    assert not torch.equal(five[1], five[2])  # steps differ
    assert not torch.equal(five[2, 0], five[2, 1])  # microbatches differ
    other_seed = make_batches(spec, seed=6, steps=3, microbatches=2)
    assert not torch.equal(three, other_seed)
    assert int(three.min()) >= 0 and int(three.max()) < spec.vocab_size
