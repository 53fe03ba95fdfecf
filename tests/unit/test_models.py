"""Models and runner: the layer-pattern parser, deterministic building, each layer's offload
group template (checked through the groups a real forward opens), learning, schedules,
precision, determinism and the batch generator.

Expectations are written out here (group sequences, schedule orders) or derived from first
principles (bf16 rounding), not read back from the code under test. GPU tests are marked
``gpu`` and also skip by themselves without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from harness.models.hybrid import build_model, draw_batches, make_batches, seeded_model
from harness.models.runs import RunHooks
from harness.models.train import TrainResult, schedule_order, train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.recorder import RecordingOffloader
from harness.offload.reference import OffloadContext
from harness.vocab.spec import ModelSpec, RunSpec, group_template, parse_pattern, preset

TINY_PRESETS = ("hybrid-tiny", "moe-tiny", "moe-tiny-fused", "hybrid-moe")

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


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_forward_opens_the_template_groups(pattern: str, selection: str) -> None:
    """One step x 2 microbatches with the hooks backend: each microbatch opens, in start order,
    exactly the groups of the layers' templates that are selected."""
    moe_path, names = SELECTIONS[selection]
    spec = preset("hybrid-tiny").replace(pattern=pattern, moe_path=moe_path)
    recorder = RecordingOffloader(OffloadConfig(offload_modules=names), "cpu")
    train(spec, RunSpec(steps=1, microbatches=2), recorder, "cpu")
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


# ------------------------------------------------------------------------------------ training


def _run(name: str | ModelSpec, **run: object) -> TrainResult:
    spec = preset(name) if isinstance(name, str) else name
    run_spec = RunSpec(**run)  # type: ignore[arg-type]
    return train(spec, run_spec, NoOffload(), "cpu", keep_final_state=True)


@pytest.mark.parametrize("name", ["hybrid-tiny", "moe-tiny"])
def test_loss_goes_down(name: str) -> None:
    # Measured (seed 1234, 20 steps x 2 microbatches, AdamW lr 1e-3): mean of the first 3 steps
    # 4.770 (hybrid-tiny) / 4.785 (moe-tiny), of the last 3 steps 3.760 / 3.872, a drop of
    # about 1.0 / 0.91; ln(128) = 4.85 is chance level. Require a drop of at least 0.5.
    losses = _run(name, steps=20, microbatches=2).losses
    first, last = losses[:3].mean().item(), losses[-3:].mean().item()
    assert last < first - 0.5, f"first 3 steps {first:.3f}, last 3 steps {last:.3f}"


@pytest.mark.parametrize("sharding", ["none", "zero3"])
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_no_layer_output_is_modified_in_place(name: str, sharding: str) -> None:
    """Each layer's output keeps its version counter from its forward through the backward: no
    in-place op touches it or a view of it. Under the reference offloader every offloaded
    layer's output is a view (its identity autograd function returns its input), the case in
    which FSDP2 warns that an in-place op would drop its pre-backward hook; this is why
    ``harness.models.train.shard_model`` silences that warning for our models."""
    spec = preset(name)
    # every group the model opens: the norm groups commit a layer's output itself
    names = tuple(sorted({n for s in spec.layers for n in group_template(s, spec.moe_path)}))
    outputs: list[tuple[str, torch.Tensor, int]] = []

    def keep(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        outputs.append((type(module).__name__, out, out._version))

    def ready(model: torch.nn.Module) -> None:
        for layer in model.layers:  # type: ignore[union-attr]
            layer.register_forward_hook(keep)

    offloader = OffloadContext(OffloadConfig(offload_modules=names), "cpu")
    run = RunSpec(steps=2, microbatches=2, precision="bf16")
    train(spec, run, offloader, "cpu", hooks=RunHooks(model_ready=ready), sharding=sharding)
    assert outputs and any(out._is_view() for _, out, _ in outputs), "no layer returned a view"
    changed = [
        (kind, before, out._version) for kind, out, before in outputs if out._version != before
    ]
    assert not changed, changed


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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_schedule_runs(precision: str) -> None:
    """Every schedule gives finite [steps, microbatches] losses. Each runs every microbatch's
    backward in microbatch order, so gradients accumulate in the same order and the schedules
    must agree bitwise: the interleaving changes nothing in the math."""
    spec = preset("hybrid-moe")
    results = {
        schedule: _run(spec, steps=2, microbatches=3, schedule=schedule, precision=precision)
        for schedule in ("sequential", "gpipe", "1f1b")
    }
    for schedule, result in results.items():
        assert result.losses.shape == (2, 3), schedule
        assert result.losses.dtype == torch.float32
        assert torch.isfinite(result.losses).all(), schedule
        assert torch.equal(result.losses, results["sequential"].losses), schedule
    # The second step trained on the first: its losses are not the first step's.
    assert not torch.equal(results["sequential"].losses[0], results["sequential"].losses[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_runner_is_bitwise_deterministic(precision: str) -> None:
    # Measured noise floor between two identical CPU runs: 0 (every kernel is deterministic).
    spec = preset("hybrid-moe")
    a = _run(spec, steps=3, microbatches=2, precision=precision)
    b = _run(spec, steps=3, microbatches=2, precision=precision)
    assert torch.equal(a.losses, b.losses)
    assert _bitwise_equal(a.final_state, b.final_state)


def test_bf16_computes_in_bf16_with_fp32_main_weights() -> None:
    """bf16 parameters come out of the run and the losses differ from fp32's (yet stay close)."""
    spec = preset("hybrid-tiny")
    run = dict(steps=2, microbatches=2)
    fp32, bf16 = _run(spec, **run), _run(spec, precision="bf16", **run)
    assert {t.dtype for t in bf16.final_state.values()} == {torch.bfloat16}
    assert {t.dtype for t in fp32.final_state.values()} == {torch.float32}
    assert not torch.equal(fp32.losses, bf16.losses)
    assert (fp32.losses - bf16.losses).abs().max() < 0.05  # same model, coarser arithmetic


def test_bf16_updates_below_one_ulp_accumulate() -> None:
    """Updates too small to change a bf16 weight still add up: they live in fp32 main weights.

    Norm weights start at exactly 1.0, whose bf16 neighbours are 1 - 2**-8 and 1 + 2**-7, so a
    bf16 weight of 1.0 changes only if one update exceeds 2**-9 = 1.95e-3. Adam's step is
    lr * m_hat / sqrt(v_hat), and by Cauchy-Schwarz |m_hat| / sqrt(v_hat) <=
    (1 - b1) / sqrt((1 - b2) * (1 - b1**2 / b2)) = 7.27 for b1 = 0.9, b2 = 0.999; at lr 2e-4
    every update is below 1.46e-3, so weights updated in bf16 stay exactly 1.0 forever
    (checked: 0 of 256 norm weights move over 30 steps when the optimizer steps the bf16
    parameters directly). In fp32 they drift ~2e-4 per step and cross the rounding midpoint
    after ~10 steps of one sign (measured: 51 of 256 moved after 30 steps).
    """
    spec = preset("hybrid-tiny").replace(pattern="+-", seq_length=16)
    slow = _run(spec, steps=30, microbatches=1, precision="bf16", optimizer="adam", lr=2e-4)
    norms = [v for k, v in slow.final_state.items() if k.endswith("norm.weight")]
    moved = sum(int((v != 1.0).sum()) for v in norms)
    assert moved > 0, "no norm weight left 1.0: sub-ULP updates were lost (no fp32 main copy?)"


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


# ----------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["hybrid-small", "moe-small"])
def test_small_presets_run_deterministically_on_cuda(name: str, precision: str) -> None:
    spec = preset(name)
    run = RunSpec(steps=2, microbatches=2, precision=precision)  # type: ignore[arg-type]
    a = train(spec, run, NoOffload(), "cuda")
    b = train(spec, run, NoOffload(), "cuda")
    assert a.losses.shape == (2, 2)
    assert torch.isfinite(a.losses).all()
    assert torch.equal(a.losses, b.losses)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reference_offload_is_bitwise_equal_on_cuda(precision: str) -> None:
    spec = preset("hybrid-small")
    run = RunSpec(steps=2, microbatches=2, precision=precision)  # type: ignore[arg-type]
    config = OffloadConfig(
        offload_modules=("core_attn", "attn_proj"),
        min_offloaded_tensor_size=1024,
        max_inflight_offloads=1,
    )
    plain = train(spec, run, NoOffload(), "cuda")
    offloader = OffloadContext(config, "cuda")
    try:
        offloaded = train(spec, run, offloader, "cuda")
    finally:
        offloader.close()
    assert sum(log.d2h_bytes for log in offloaded.logs) > 0, "nothing was offloaded"
    assert torch.isfinite(plain.losses).all()
    assert torch.equal(plain.losses, offloaded.losses)
