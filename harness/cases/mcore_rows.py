"""The rows on megatron-core's own models (``Case.impl`` ``mcore``: its ``HybridModel``,
``mcore-gpt``: its ``GPTModel``), selected by ``--models mcore`` (or ``all``): the seed and one
row per model family, the seed under Megatron-FSDP, every megatron-core knob that meets
offloading, and what upstream main adds; ``MCORE_FAMILY`` is all of them, in that order."""

from __future__ import annotations

from harness.cases.case import ATTENTION_NAMES, SEED_CASE, Case

_MCORE_SLACK = dict(
    memory_slack=64,
    memory_slack_reason=(
        "megatron-core's layers built with offloading on and off keep a few different scalar "
        "tensors (H200: a 1-byte block only in the seed's offload run, a 64-byte one only in "
        "the hybrid-moe baseline); every predicted storage must still be freed"
    ),
)
MCORE_ROWS: tuple[Case, ...] = (
    SEED_CASE.replace(
        impl="mcore", description="the seed on megatron-core's own HybridModel", **_MCORE_SLACK
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="hybrid",
        offload=ATTENTION_NAMES,
        precision="bf16",
        max_inflight=None,
        description="every attention group of the MLA layers",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="moe",
        offload=("expert_fc1", "moe_act"),
        precision="bf16",
        description="TransformerEngine's grouped MLP, selective expert names",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="moe-fused",
        offload=("fused_group_mlp",),
        precision="bf16",
        max_inflight=0,
        description="TransformerEngine's op-fuser grouped MLP as one group",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="hybrid-moe",
        offload=(*ATTENTION_NAMES, "mlp_norm", "expert_fc1", "moe_act"),
        precision="bf16",
        description="every name of MLA and MoE layers",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore-gpt",
        family="moe",
        offload=("core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"),
        precision="bf16",
        description="megatron-core's GPTModel with MoE layers, TransformerEngine's grouped MLP",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore-gpt",
        family="moe-fused",
        offload=("core_attn", "fused_group_mlp"),
        precision="bf16",
        description="megatron-core's GPTModel with MoE layers, the op-fuser grouped MLP",
    ),
)
"""Rows on megatron-core's own models (``Case.impl`` ``mcore``: ``HybridModel``, ``mcore-gpt``:
``GPTModel``): the seed, then one per model family, then the GPT-style MoE model on both expert
paths; bf16 as the seed runs it. Selected by ``--family mcore`` (or ``all``), with the
``MCORE_SHARDED_ROWS`` and ``MCORE_KNOB_ROWS``."""

_SEED_MCORE = MCORE_ROWS[0]
_MOE_MCORE = MCORE_ROWS[2]  # *E*E, expert_fc1 + moe_act, bf16
MCORE_SHARDED_ROWS: tuple[Case, ...] = (
    _SEED_MCORE.replace(
        sharding="mfsdp",
        description="the seed under Megatron-FSDP as megatron-core 0.19 ships it "
        "(optim_grads_params, distributed optimizer)",
    ),
    _SEED_MCORE.replace(
        sharding="mfsdp2",
        description='the seed under Megatron-FSDP built from its bundled "v2 building blocks" '
        "(flat fully_shard, fully_shard_optimizer; not the upstream v2 adapter)",
    ),
)
"""The seed's own scenario: megatron-core's ``HybridModel`` ``+-+-+-`` sharded flat ZeRO-3 by
Megatron-FSDP, core_attn + attn_proj offloaded, against the same model under the same sharding
without offloading. One rank is a one-rank mesh; under torchrun each rank has its shard."""

MCORE_KNOB_ROWS: tuple[Case, ...] = (
    _SEED_MCORE.replace(recompute="core_attn", description="selective recompute of core_attn"),
    _SEED_MCORE.replace(
        recompute="mla_up_proj", description="selective recompute of MLA's up-projections"
    ),
    _SEED_MCORE.replace(
        offload=ATTENTION_NAMES,
        recompute="layernorm",
        description="selective recompute of the norms, every attention group offloaded",
    ),
    _SEED_MCORE.replace(recompute="mlp", description="selective recompute of the dense MLPs"),
    _SEED_MCORE.replace(recompute="full", description="full recompute of every layer"),
    _MOE_MCORE.replace(
        recompute="moe_act",
        description="selective recompute of the expert activation, experts offloaded",
    ),
    _MOE_MCORE.replace(
        recompute="moe",
        description="the whole MoE layer recomputed while its experts offload",
    ),
    _SEED_MCORE.replace(cuda_graph="te", description="TransformerEngine CUDA graphs per layer"),
    _MOE_MCORE.replace(
        cuda_graph="local-moe",
        description="local CUDA graphs of the MoE router and preprocessing, experts offloaded",
    ),
    _SEED_MCORE.replace(fraction=0.5, description="activation_offload_fraction 0.5"),
    _SEED_MCORE.replace(
        delta_bytes=1 << 20,
        description="delta_offload_bytes_across_pp_ranks 1 MiB (one pipeline stage: rank 0)",
    ),
    _SEED_MCORE.replace(
        min_tensor_size=1 << 20,
        description="megatron-core's default min_offloaded_tensor_size (1 Mi elements)",
    ),
    _SEED_MCORE.replace(mtp="+-", description="one multi-token-prediction depth (+-)"),
)
"""Every megatron-core knob that meets offloading, one row each on the seed (or the MoE model
for the expert knobs): what megatron-core does - passes, moves less than configured, refuses -
is the row's verdict (a configuration 0.19 refuses skips with its message)."""

MCORE_MAIN_ROWS: tuple[Case, ...] = (
    _SEED_MCORE.replace(
        sharding="mfsdp-v2",
        description="the seed under the upstream Megatron-FSDP v2 adapter "
        "(megatron_fsdp_version=2, FullyShardedOptimizer), the seed's settings",
    ),
    _SEED_MCORE.replace(
        offload_buffer_kib=1 << 20,
        description="megatron-core's fixed pinned activation buffer at 1 GiB (fits the seed)",
    ),
    _SEED_MCORE.replace(
        offload_buffer_kib=1,
        description="megatron-core's fixed pinned activation buffer at 1 KiB, smaller than any "
        "offloaded tensor: megatron-core's own error is the verdict",
    ),
)
"""Rows for what upstream main adds (``harness.models.mcore.features``): each skips with the
feature's one line where the installed megatron-core lacks it (the sharding's or the buffer's
feature). No row selects ``gdp_qkv``: no model the harness builds opens it."""

MCORE_FAMILY: tuple[Case, ...] = MCORE_ROWS + MCORE_SHARDED_ROWS + MCORE_KNOB_ROWS + MCORE_MAIN_ROWS
"""Every row of ``--family mcore``."""
