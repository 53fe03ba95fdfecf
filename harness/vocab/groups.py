"""The model vocabulary in two tables: offload group names and layer pattern symbols.

``GROUPS`` holds every offload group name a model may open, with the rules Megatron-Core puts
on selecting it (``requires``, ``excludes``) and whether its saved shapes follow the routing.
``LAYERS`` holds every layer pattern symbol: the layer kind it builds, its role in a GPT layer
(attention or MLP), the groups it opens in start order, and the class of our model that builds
it. ``harness.vocab.spec`` (pattern parsing, group templates), ``harness.offload.config``
(selection rules), ``harness.models`` and ``harness.models.mcore`` all read these tables; adding
a symbol or a group name is one entry here (plus, for a symbol, its layer module).

Data only: importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class GroupName:
    """One offload group name (Megatron-Core's ``offload_modules`` entries)."""

    name: str
    description: str
    routing_dependent: bool = False
    """Its saved tensors' shapes follow the MoE routing: never served from the pinned pool."""
    requires: tuple[str, ...] = ()
    """Names that must be selected with it."""
    excludes: tuple[str, ...] = ()
    """Names that cannot be selected with it."""
    reason: str = ""
    """Why ``requires`` / ``excludes`` hold (the error message's explanation)."""


_GROUPS = (
    GroupName(
        name="attn_norm", description="the input norm of an MLA layer (wraps the attention block)"
    ),
    GroupName(name="qkv_linear", description="the query/key/value projections"),
    GroupName(name="core_attn", description="scores, softmax and the value product"),
    GroupName(
        name="attn_proj",
        description="the attention output projection",
        requires=("core_attn",),
        reason="attn_proj's input is core_attn's output, which core_attn's backward needs",
    ),
    GroupName(name="mlp_norm", description="the pre-MLP norm of a MoE layer"),
    GroupName(
        name="expert_fc1",
        description="the experts' first projection (unfused expert path)",
        routing_dependent=True,
        excludes=("fused_group_mlp",),
        reason="the fused expert path has no separate fc1/activation groups",
    ),
    GroupName(
        name="moe_act",
        description="the experts' activation (unfused expert path)",
        routing_dependent=True,
        excludes=("fused_group_mlp",),
        reason="the fused expert path has no separate fc1/activation groups",
    ),
    GroupName(
        name="fused_group_mlp",
        description="the experts as one fused unit (fused expert path)",
        routing_dependent=True,
        excludes=("expert_fc1", "moe_act"),
        reason="the fused expert path has no separate fc1/activation groups",
    ),
)
GROUPS: dict[str, GroupName] = {group.name: group for group in _GROUPS}
"""Every group name by name, in the order a layer opens them (Megatron's ``gdp_qkv`` has no
layer here)."""


MoEPath = Literal["unfused", "fused"]


@dataclass(frozen=True, kw_only=True)
class LayerSymbol:
    """One layer pattern symbol (Megatron-Core's hybrid patterns)."""

    symbol: str
    kind: str
    """``mla``, ``attention``, ``mlp`` or ``moe``."""
    role: Literal["attention", "mlp"]
    """Its half of a GPT layer (attention first, then MLP)."""
    groups: tuple[str, ...]
    """The groups it opens, in start order (unfused expert path)."""
    fused_groups: tuple[str, ...] | None = None
    """The groups on the fused expert path, where it differs."""
    experts: bool = False
    """Has routed experts (the MoE settings of a model apply)."""
    layer_class: str
    """``module:class`` of our model's layer (``harness.models``), imported when built."""
    note: str = ""
    """Why it opens the groups it opens."""

    def template(self, moe_path: MoEPath = "unfused") -> tuple[str, ...]:
        if moe_path == "fused" and self.fused_groups is not None:
            return self.fused_groups
        return self.groups


_LAYERS = (
    LayerSymbol(
        symbol="+",
        kind="mla",
        role="attention",
        groups=("attn_norm", "qkv_linear", "core_attn", "attn_proj"),
        layer_class="harness.models.layers:MLALayer",
        note="a real input norm, so attn_norm wraps the whole attention block",
    ),
    LayerSymbol(
        symbol="*",
        kind="attention",
        role="attention",
        groups=("qkv_linear", "core_attn", "attn_proj"),
        layer_class="harness.models.layers:AttentionLayer",
        note="the norm is fused into the QKV projection, so there is no attn_norm",
    ),
    LayerSymbol(
        symbol="-",
        kind="mlp",
        role="mlp",
        groups=(),
        layer_class="harness.models.layers:MLPLayer",
        note="the norm is fused into fc1 and dense MLPs are not wired: no groups",
    ),
    LayerSymbol(
        symbol="E",
        kind="moe",
        role="mlp",
        groups=("mlp_norm", "expert_fc1", "moe_act"),
        fused_groups=("mlp_norm", "fused_group_mlp"),
        experts=True,
        layer_class="harness.models.moe:MoELayer",
        note="a real pre-MLP norm; experts are fc1/act (unfused) or one fused unit",
    ),
)
LAYERS: dict[str, LayerSymbol] = {layer.symbol: layer for layer in _LAYERS}
"""Every legal pattern symbol."""

ATTENTION_KINDS_EXCLUSIVE = ("mla", "attention")
"""Layer kinds one model cannot mix (standard attention and MLA)."""


def _check() -> None:
    for layer in _LAYERS:
        for name in (*layer.groups, *(layer.fused_groups or ())):
            if name not in GROUPS:
                raise AssertionError(f"layer {layer.symbol!r} opens unknown group {name!r}")
    for group in _GROUPS:
        for name in (*group.requires, *group.excludes):
            if name not in GROUPS:
                raise AssertionError(f"group {group.name!r} refers to unknown {name!r}")


_check()
