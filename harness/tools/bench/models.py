"""The models the bench runs: bench-only sizes beside the harness presets, each model's default
offload selection, and one model's offload config and timed run from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from harness.offload.config import OffloadConfig
from harness.vocab.spec import PRESETS, ModelSpec, RunSpec, preset

DEFAULT_NAMES = ("core_attn", "attn_proj", "expert_fc1", "moe_act", "fused_group_mlp")
"""Offloaded by default where the model opens them (not the norms or qkv: their groups span
whole blocks or hold little)."""


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A model the bench runs: its spec and default offload selection."""

    spec: ModelSpec
    offload: tuple[str, ...] | None = None
    """Default selection (None: ``DEFAULT_NAMES`` the model opens)."""
    note: str = ""


def _bench_only() -> dict[str, BenchModel]:
    # Bench-only sizes (not presets: the case matrix does not need them). moe-bench is
    # "hideable": fc1 and fc2 do 3 x moe_ffn_hidden_size FLOP per offloaded byte of expert_fc1's
    # input (40 MiB per group), plus the dispatch matmuls and attention, none of it offloaded.
    moe_bench = ModelSpec(
        pattern="*E*E",
        hidden_size=2048,
        num_heads=16,
        ffn_hidden_size=8192,
        vocab_size=8192,
        seq_length=2048,
        micro_batch_size=2,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=4096,
        moe_capacity_factor=1.25,
    )
    # hybrid-bench: the headline pattern at a size where the device's compute, not the host,
    # sets the step and can hide its groups: attn_norm and qkv_linear hold 24 and 80.5 MiB per
    # MLA layer and microbatch against the layer pair's ~1 TFLOP of forward matmuls (on the
    # H200: 95 of a 99 ms step busy). Not core_attn (nor attn_proj, which needs it): unfused
    # attention's softmax output (B*H*T*T) outgrows any compute that could hide it at the
    # H200's PCIe rate.
    hybrid_bench = ModelSpec(
        pattern="+-+-+-",
        hidden_size=3072,
        num_heads=24,
        ffn_hidden_size=12288,
        vocab_size=8192,
        seq_length=2048,
        micro_batch_size=2,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    return {
        "moe-bench": BenchModel(
            spec=moe_bench, offload=("expert_fc1",), note="compute-heavy experts, 40 MiB groups"
        ),
        "hybrid-bench": BenchModel(
            spec=hybrid_bench,
            offload=("attn_norm", "qkv_linear"),
            note="compute-bound +-+-+-, tens of MiB per group",
        ),
    }


BENCH_MODELS = _bench_only()


def bench_model(name: str) -> BenchModel:
    """A bench-only model or a harness preset, by exact name."""
    if name in BENCH_MODELS:
        return BENCH_MODELS[name]
    try:
        return BenchModel(spec=preset(name))
    except ValueError:
        known = ", ".join([*PRESETS, *BENCH_MODELS])
        raise ValueError(f"unknown model {name!r}; known: {known}") from None


def selection(model: BenchModel, override: tuple[str, ...] | None) -> tuple[str, ...]:
    """The offloaded group names for ``model``: ``override`` or its default, narrowed to the
    groups the model opens."""
    wanted = override or model.offload or DEFAULT_NAMES
    names = tuple(n for n in wanted if n in model.spec.group_names)
    if not names:
        raise ValueError(
            f"pattern {model.spec.pattern!r} opens none of {', '.join(wanted)} "
            f"(it opens {', '.join(model.spec.group_names) or 'no group'})"
        )
    return names


def default_min_tensor_size(device: torch.device) -> int:
    """``--min-tensor-size`` when not given: Megatron's 1 Mi elements on CUDA, 1024 on CPU (where
    the smoke-test models are too small for Megatron's)."""
    return 1024 if device.type == "cpu" else 1024 * 1024


def _setup(
    name: str, args: argparse.Namespace, device: torch.device
) -> tuple[BenchModel, tuple[str, ...], OffloadConfig, RunSpec]:
    """The model, its selection, the offload config and the timed run of one bench model."""
    model = bench_model(name)
    offload = selection(model, args.offload)
    config = OffloadConfig(
        offload_modules=offload,
        min_offloaded_tensor_size=args.min_tensor_size,
        max_inflight_offloads=args.max_inflight,
    )
    config.check_applies_to(model.spec)
    memory_steps = 1 if device.type == "cuda" else 0
    run = RunSpec(
        steps=args.warmup + args.steps + memory_steps,
        microbatches=args.microbatches,
        schedule=args.schedule,
        precision=args.precision,
    )
    return model, offload, config, run
