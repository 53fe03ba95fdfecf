"""Rows of when reloads happen and of the configurations that bound or disable the offload, on
our own models: partial offload (``activation_offload_fraction``) under 1F1B, sequential and
interleaved, a pinned pool capped below what a step needs, a ``min_offloaded_tensor_size`` that
makes the configuration inert."""

from __future__ import annotations

from harness.cases.case import ATTENTION_NAMES, SEED_CASE, Case

CADENCE_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=ATTENTION_NAMES,
        schedule="1f1b",
        microbatches=3,
        precision="bf16",
        fraction=0.5,
        description="activation_offload_fraction 0.5 under 1F1B with 3 microbatches: groups kept "
        "on the device still take a reload slot in Megatron's rule, so reloads run ahead of "
        "their backward (Megatron-LM #7575); the cadence check holds every step to the rule",
    ),
    SEED_CASE.replace(
        pool_cap=2,
        description="the pinned pool capped at 2 buffers, below what a step needs: exhausted, "
        "handled with buffers outside the pool, every loss bitwise (PaddleFleet #1877)",
    ),
    SEED_CASE.replace(
        min_tensor_size=1 << 30,
        description="min_offloaded_tensor_size above every saved activation: inert, nothing "
        "eligible, and nothing may move (PaddleFleet #1877)",
    ),
)
"""Rows of when reloads happen and of the configurations that bound or disable the offload:
partial offload under 1F1B, a pinned pool too small for the step, a threshold that makes the
configuration inert. The default matrix has these; the full one also ``FULL_CADENCE_ROWS``."""

FULL_CADENCE_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        precision="bf16",
        fraction=0.5,
        description="activation_offload_fraction 0.5, sequential schedule",
    ),
    Case(
        family="hybrid",
        offload=ATTENTION_NAMES,
        schedule="interleaved",
        microbatches=4,
        precision="bf16",
        fraction=0.5,
        description="activation_offload_fraction 0.5 under the interleaved schedule",
    ),
    Case(
        family="moe",
        offload=("qkv_linear", "core_attn", "attn_proj"),
        schedule="1f1b",
        microbatches=3,
        pool_cap=4,
        description="the pinned pool capped at 4 buffers under 1F1B with 3 microbatches",
    ),
)
"""The full matrix's further cadence, fraction and pool rows."""
