"""The runner trains (moved from ``tests/unit/test_models.py``, whose tests train nothing):
learning, schedules, precision, determinism, the layer outputs' version counters through a
run (unsharded and ZeRO-3), and the small presets and the reference offloader on CUDA.

Expectations are written out here (schedule orders) or derived from first principles (bf16
rounding), not read back from the code under test. GPU tests are marked ``gpu`` and also skip
by themselves without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from model_states import TINY_PRESETS
from model_states import bitwise_equal as _bitwise_equal

from harness.models.runs import RunHooks
from harness.models.train import TrainResult, train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.reference import OffloadContext
from harness.vocab.spec import ModelSpec, RunSpec, group_template, preset

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
