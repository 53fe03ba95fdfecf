"""The ``mcore`` model family's plumbing that runs without megatron-core: the case table's
``impl`` column, ``--models`` selection and collection skips, and the bridge that lets a harness
offloader stand in for megatron-core's offloading interface (driven here the way megatron-core's
layers drive it). The Megatron-FSDP rows and the knobs are in ``test_mcore_knobs.py``. The models
themselves need CUDA, TransformerEngine and megatron-core: the GPU runs of
``pytest cases/ --models mcore`` exercise them."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import warm
from child_pytest import pytest_command
from fake_megatron import fake_megatron as _fake_megatron

from harness.cases import (
    MCORE_FAMILY,
    MCORE_ROWS,
    SEED_CASE,
    Case,
    matrix,
)
from harness.models.mcore import (
    Bridge,
    transformer_config,
    unavailable_reason,
)
from harness.offload.config import OffloadConfig
from harness.offload.recorder import RecordingOffloader
from harness.vocab.spec import ModelSpec, gpt_layers

ROOT = Path(__file__).resolve().parents[2]
PYTEST = tuple(pytest_command("-q", "--report-dir", ""))


def test_mcore_rows_are_named_apart_and_build_megatron_specs() -> None:
    names = [row.name for row in MCORE_ROWS]
    assert names[0] == "mcore-" + SEED_CASE.name
    assert all(name.startswith("mcore-") for name in names)
    assert len(set(names)) == len(names)
    assert {row.model_spec("small").impl for row in MCORE_ROWS} == {"mcore", "mcore-gpt"}
    fused = [row for row in MCORE_ROWS if row.family == "moe-fused"]
    assert {row.impl for row in fused} == {"mcore", "mcore-gpt"}
    assert all(row.model_spec("small").moe_path == "fused" for row in fused)
    gpt = [row for row in MCORE_ROWS if row.impl == "mcore-gpt"]
    assert [row.name.split("_")[0] for row in gpt] == [
        "mcore-gpt-moe-*E*E",
        "mcore-gpt-moe-fused-*E*E",
    ]


@pytest.mark.parametrize(
    ("pattern", "pairs"),
    [("*E*E", (("*", "E"), ("*", "E"))), ("*-*E", (("*", "-"), ("*", "E"))), ("+E", (("+", "E"),))],
)
def test_gpt_layers_pair_attention_with_mlp(pattern: str, pairs: tuple) -> None:
    assert gpt_layers(tuple(pattern)) == pairs
    assert ModelSpec(pattern=pattern, impl="mcore-gpt").layers == tuple(pattern)


@pytest.mark.parametrize("pattern", ["*E*", "E*E*", "**", "*E-E", "-"])
def test_gpt_model_refuses_patterns_that_are_not_layer_pairs(pattern: str) -> None:
    with pytest.raises(ValueError, match="a GPT model's layer is attention"):
        ModelSpec(pattern=pattern, impl="mcore-gpt")
    ModelSpec(pattern=pattern)  # fine for the hybrid models


@pytest.mark.parametrize(
    ("impl", "pattern", "layers", "moe_freq"),
    [
        ("mcore-gpt", "*E*E", 2, [1, 1]),
        ("mcore-gpt", "*-*E", 2, [0, 1]),
        ("mcore", "*E*E", 4, None),
    ],
)
def test_transformer_config_counts_gpt_layers_as_pairs(
    monkeypatch: pytest.MonkeyPatch, impl: str, pattern: str, layers: int, moe_freq: list | None
) -> None:
    built = _fake_megatron(monkeypatch)
    spec = ModelSpec(pattern=pattern, impl=impl)
    transformer_config(spec, SEED_CASE.run_spec(), OffloadConfig(offload_modules=("core_attn",)))
    ((cls, fields),) = built
    assert cls == "TransformerConfig"
    assert fields["num_layers"] == layers
    assert fields.get("moe_layer_freq") == moe_freq
    assert fields["offload_modules"] == ["core_attn"]


def test_models_selects_rows() -> None:
    ours = matrix("default")
    assert all(row.impl == "harness" for row in ours)
    assert matrix("default", "mcore") == list(MCORE_FAMILY)
    assert matrix("default", "all") == ours + list(MCORE_FAMILY)
    assert MCORE_FAMILY[: len(MCORE_ROWS)] == MCORE_ROWS
    with pytest.raises(ValueError, match="unknown models 'gpt'"):
        matrix("default", "gpt")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(schedule="1f1b"), "impl 'mcore' runs schedule sequential, not '1f1b'"),
        (
            dict(sharding="zero3"),
            "impl 'mcore' runs sharding none or mfsdp or mfsdp2 or mfsdp-v2, not 'zero3'",
        ),
        (dict(eval_first=True), "impl 'mcore' runs no evaluation pass before the first step"),
    ],
    ids=["1f1b", "zero3", "evalfirst"],
)
def test_mcore_rows_refuse_what_one_megatron_stage_cannot_run(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SEED_CASE.replace(impl="mcore", **changes)


def test_unknown_impl_is_one_line() -> None:
    with pytest.raises(ValueError, match="unknown impl 'te'; known: harness, mcore, mcore-gpt"):
        SEED_CASE.replace(impl="te")
    with pytest.raises(
        ValueError, match=r"ModelSpec\.impl must be one of harness, mcore, mcore-gpt"
    ):
        ModelSpec(pattern="+-", impl="te")


def test_cpu_has_no_megatron_models() -> None:
    assert "needs a CUDA device" in str(unavailable_reason("cpu"))


def test_models_mcore_skips_at_collection_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU skip reason")
    out = warm.run(
        [*PYTEST, "cases/test_equivalence.py", "--models", "mcore", "-rs"], cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SKIPPED [{2 * len(MCORE_FAMILY)}]" in out.stdout
    assert "impl 'mcore' needs a CUDA device" in out.stdout
    assert "passed" not in out.stdout.splitlines()[-1]


def test_bad_models_is_a_usage_error() -> None:
    out = warm.run([*PYTEST, "cases/", "--models", "gpt"], cwd=ROOT, timeout=300)
    assert out.returncode == 4
    assert "--models must be one of harness, mcore, all; got 'gpt'" in out.stderr


def _layer_norm_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight)


def test_bridge_drives_a_harness_offloader_at_megatron_boundaries() -> None:
    """Open, hook and commit as megatron-core's layers do; the recorder sees each selected group
    with the tracked layer, the flag is set only inside selected groups."""
    recorder = RecordingOffloader(OffloadConfig(offload_modules=("core_attn",)), "cpu")
    flag = types.SimpleNamespace(CPUOffloadEnabled=False)
    seen: list[bool] = []
    layer = [3]
    bridge = Bridge(recorder, lambda: layer[0], flag)
    weight = torch.nn.Parameter(torch.ones(8))
    bridge.init_chunk_handler(0, None, None, 1024, 0, 1.0, max_inflight_offloads=None)
    bridge.mark_not_offload(weight)
    recorder.begin_microbatch(0)
    x = torch.randn(2, 8, requires_grad=True)

    unselected = bridge(False, x, "attn_norm")
    with unselected as y:
        seen.append(flag.CPUOffloadEnabled)
        z = _layer_norm_like(y, weight)
    assert y is x
    assert unselected.group_offload(z, forced_released_tensors=[y]) is z

    selected = bridge(True, z, "core_attn")
    with selected as q:
        seen.append(flag.CPUOffloadEnabled)
        out = (q * q).sum(-1)
    seen.append(flag.CPUOffloadEnabled)
    out = selected.group_offload(out, forced_released_tensors=[q])
    bridge.reset()  # megatron-core's schedule calls it; the runner ends the iteration
    recorder.end_iteration()
    out.sum().backward()

    assert seen == [False, True, False]
    (observation,) = recorder.iterations[0]
    assert (observation.microbatch, observation.layer, observation.name) == (0, 3, "core_attn")
    assert [s.shape for s in observation.saved] == [(2, 8), (2, 8)]
    assert [s.shape for s in observation.released] == [(2, 8)]
    assert x.grad is not None


def test_bridge_refuses_interface_parts_it_does_not_offer() -> None:
    bridge = Bridge(
        RecordingOffloader(OffloadConfig(offload_modules=("core_attn",)), "cpu"), lambda: 0, None
    )
    with pytest.raises(NotImplementedError, match=r"off_interface\.forward_record"):
        bridge.forward_record()


def test_case_family_column_is_validated_with_the_rest() -> None:
    row = Case(impl="mcore", family="moe", offload=("expert_fc1", "moe_act"), precision="bf16")
    assert row.name == "mcore-moe-*E*E_expert_fc1+moe_act_sequential_bf16"


def test_memory_slack_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="memory slack needs a memory_slack_reason"):
        SEED_CASE.replace(memory_slack=8)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--models", "mcore", "--device", "cpu"],
        ["run", "--models", "mcore", "--backend", "reference", "--device", "cpu"],
        ["repro", "--case", MCORE_ROWS[0].name, "--device", "cpu"],
    ],
    ids=["run", "run-bridge", "repro"],
)
def test_cli_refuses_mcore_rows_without_cuda_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    from harness.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0]


def test_cli_lists_the_mcore_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main

    assert main(["cases", "--models", "mcore"]) == 0
    assert capsys.readouterr().out.split() == [row.name for row in MCORE_FAMILY]


def test_a_finished_runs_cached_forwards_are_emptied() -> None:
    """megatron-core's ``RotaryEmbedding.forward`` is an ``lru_cache`` keyed by the module, so a
    finished model's rotary table stayed live until later calls evicted it (the H200 memory
    case then saw a 131072-B block in one run of a pair only); a run's end empties such caches
    for every module class of its model and leaves other classes alone."""
    import functools

    from harness.models.mcore.loop import _clear_forward_caches

    class Rotary(torch.nn.Module):
        @functools.lru_cache(maxsize=32)  # noqa: B019 - the pattern under test
        def forward(self, n: int) -> torch.Tensor:
            return torch.arange(n)

    class Elsewhere(torch.nn.Module):  # not in the model: its cache stays
        @functools.lru_cache(maxsize=32)  # noqa: B019
        def forward(self, n: int) -> torch.Tensor:
            return torch.arange(n)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Rotary())
    other = Elsewhere()
    model[1](4), other(4)
    assert Rotary.forward.cache_info().currsize == 1
    _clear_forward_caches(model)
    assert Rotary.forward.cache_info().currsize == 0
    assert Elsewhere.forward.cache_info().currsize == 1
