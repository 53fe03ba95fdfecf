"""The process environment megatron-core's models run under, exported before anything imports
TransformerEngine (the feature probe and the models both need it first)."""

from __future__ import annotations

import os

ENVIRONMENT = {
    # Unfused attention (megatron-core's offloading test pins it the same way).
    "NVTE_FLASH_ATTN": "0",
    "NVTE_FUSED_ATTN": "0",
    "NVTE_UNFUSED_ATTN": "1",
    # deterministic_mode=True refuses to build TransformerEngine attention without it.
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    # megatron-core's gate for the op-fuser expert path with SwiGLU (moe_path "fused"); on
    # Hopper in bf16 TransformerEngine runs the path's ops one by one (its fused kernel is
    # SM100 with MXFP8/NVFP4 only).
    "NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1",
}
"""Environment megatron-core's models run under. TransformerEngine reads it once, at its first
import, so it is set before anything imports TransformerEngine (``unavailable_reason`` runs at
collection, first); the attention variables must agree with what megatron-core's language
model asserts and writes for the unfused backend."""


def apply_environment() -> None:
    """Export ``ENVIRONMENT`` (and TransformerEngine's CPU-offload default) to this process."""
    os.environ.update(ENVIRONMENT)
    # TransformerEngine's CPU-offload implementation is a setting (``--nvte-cpu-offload-v1``,
    # exported by ``harness.run.settings.apply``); unset, its older one: the code path
    # megatron-core's fine-grained offloading toggles (megatron's training arguments require
    # it, TE >= 2.10).
    os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")
