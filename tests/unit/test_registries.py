"""The extension axes are registries: a layer symbol, an offload group name and a model
implementation are each one table entry (``harness.vocab.groups``, ``harness.vocab.impls``) plus
their own module; nothing else names them. Each test adds an entry and shows the rest of the harness
picks it up. The checks from outside this interpreter (``git grep``, imports without torch) are in
``tests/e2e/test_registries_processes.py``."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import pytest
import torch

from harness.cases import Case
from harness.models.hybrid import build_model
from harness.models.runs import Trainer, TrainResult
from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.vocab import groups, impls
from harness.vocab.groups import GroupName, LayerSymbol
from harness.vocab.spec import ModelSpec, RunSpec, group_template, parse_pattern


@pytest.fixture
def extra_symbol(monkeypatch: pytest.MonkeyPatch) -> str:
    """A new symbol ``M``: a dense MLP layer that opens a new group ``mlp_extra``."""
    group = GroupName(
        name="mlp_extra", description="test group", requires=("core_attn",), reason="a test rule"
    )
    layer = LayerSymbol(
        symbol="M",
        kind="mlp2",
        role="mlp",
        groups=("mlp_extra",),
        layer_class="harness.models.layers:MLPLayer",
    )
    monkeypatch.setitem(groups.GROUPS, group.name, group)
    monkeypatch.setitem(groups.LAYERS, layer.symbol, layer)
    monkeypatch.setattr("harness.vocab.spec.ALL_GROUP_NAMES", tuple(groups.GROUPS))
    monkeypatch.setattr("harness.offload.config.ALL_GROUP_NAMES", tuple(groups.GROUPS))
    monkeypatch.setitem(
        __import__("harness.vocab.spec", fromlist=["LAYER_SYMBOLS"]).LAYER_SYMBOLS, "M", "mlp2"
    )
    return "M"


def test_a_layer_symbol_is_one_table_entry(extra_symbol: str) -> None:
    assert parse_pattern(f"+{extra_symbol}") == ("+", extra_symbol)
    assert group_template(extra_symbol) == ("mlp_extra",)
    spec = ModelSpec(pattern=f"+{extra_symbol}")
    assert spec.group_names == ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_extra")
    model = build_model(spec, torch.Generator().manual_seed(0))
    assert type(model.layers[1]).__name__ == "MLPLayer"


def test_a_group_name_is_one_table_entry(extra_symbol: str) -> None:
    config = OffloadConfig(offload_modules=("core_attn", "mlp_extra"))
    config.check_applies_to(ModelSpec(pattern=f"*{extra_symbol}"))
    with pytest.raises(ValueError, match=r"'mlp_extra' requires 'core_attn' \(a test rule\)"):
        OffloadConfig(offload_modules=("mlp_extra",))


def test_group_rules_come_from_the_table() -> None:
    for name, group in groups.GROUPS.items():
        for other in group.excludes:
            with pytest.raises(ValueError, match="cannot be combined"):
                OffloadConfig(offload_modules=(name, other))
        if group.requires:
            with pytest.raises(ValueError, match="requires"):
                OffloadConfig(offload_modules=(name,))


_CALLS: list[tuple[Any, ...]] = []


def fake_trainer(spec: ModelSpec, run: RunSpec, offloader: Any, device: Any, **kw: Any) -> Any:
    """The trainer of the test implementation: records its call."""
    _CALLS.append((spec.impl, run.schedule, kw["sharding"]))
    return TrainResult(losses=torch.zeros(run.steps, run.microbatches), logs=[], grads=[])


def test_a_model_implementation_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    new = impls.ModelImpl(
        name="theirs",
        models="harness",
        description="a test implementation",
        trainer=f"{__name__}:fake_trainer",
        schedules=("gpipe",),
        shardings=("none",),
        eval_first=False,
        sync_guard="not guarded: a test",
        availability=f"{__name__}:never_here",
    )
    monkeypatch.setitem(impls.IMPLS, new.name, new)
    case = Case(family="hybrid", offload=("core_attn",), schedule="gpipe", impl="theirs")
    with pytest.raises(ValueError, match="impl 'theirs' runs schedule gpipe, not 'sequential'"):
        case.replace(schedule="sequential")
    spec = ModelSpec(pattern="+-", impl="theirs")
    _CALLS.clear()
    train(spec, case.run_spec(), NoOffload(case.offload_config(), torch.device("cpu")), "cpu")
    assert _CALLS == [("theirs", "gpipe", "none")]
    assert impls.impl_unavailable(["harness", "theirs"], torch.device("cpu")) == "not here: test"


def never_here(device: Any) -> str:
    return "not here: test"


def test_every_symbol_and_group_is_consistent() -> None:
    for symbol, layer in groups.LAYERS.items():
        assert layer.symbol == symbol
        for moe_path in ("unfused", "fused"):
            assert set(layer.template(moe_path)) <= set(groups.GROUPS)
    assert replace(groups.LAYERS["E"]).template("fused") == ("mlp_norm", "fused_group_mlp")


@pytest.mark.parametrize("name", sorted(impls.IMPLS))
def test_every_trainer_has_the_trainer_signature(name: str) -> None:
    """Each implementation's training function takes the ``harness.models.runs.Trainer`` call: the
    same parameters, kinds and annotations, the same result (megatron-core's module imports
    without megatron-core: its imports are inside the functions)."""
    expected = inspect.signature(Trainer.__call__)
    expected = expected.replace(parameters=list(expected.parameters.values())[1:])
    assert inspect.signature(impls.IMPLS[name].train_function()) == expected
