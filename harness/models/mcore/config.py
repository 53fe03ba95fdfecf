"""megatron-core's configuration of a case: the environment its models run under, the process
state they need (``torch.distributed`` and ``parallel_state``, TP = PP = EP = 1), and the
``TransformerConfig`` of a ``ModelSpec`` - sizes, MoE, MLA, the fine-grained offloading knobs
of the case's ``OffloadConfig`` and megatron-core's own knobs (recompute, CUDA graphs,
multi-token prediction), a configuration megatron-core refuses being a ``Refused``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from harness.models.hybrid import INIT_STD
from harness.models.mcore.environment import apply_environment
from harness.models.runs import Refused
from harness.offload.config import OffloadConfig
from harness.util import distributed
from harness.vocab.groups import LAYERS
from harness.vocab.impls import IMPLS
from harness.vocab.spec import ModelSpec, RunSpec, gpt_layers


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why megatron-core's models cannot run here (None when they can)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "impl 'mcore' needs a CUDA device (megatron-core's models with TransformerEngine)"
    apply_environment()
    for module in ("transformer_engine.pytorch", "megatron.core.models.hybrid.hybrid_model"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a CUDA library TransformerEngine lacks
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return (
                f"impl 'mcore' needs TransformerEngine and megatron-core "
                f"(docs/megatron-core.md): import {module} failed: {first}"
            )
    from harness.models.mcore.features import required_missing

    return required_missing()  # a megatron-core without what the bridge needs: one line


def ensure_parallel_state(device: torch.device) -> None:
    """torch.distributed and megatron-core's model-parallel state (TP = PP = EP = 1)."""
    apply_environment()
    if device.index is not None:
        torch.cuda.set_device(device)  # NCCL and megatron-core's collectives use the current one
    distributed.ensure_process_group(device)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        # No gloo groups: they are only for distributed-optimizer checkpoints, and gloo on an
        # in-memory store needs a resolvable host name.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
            create_gloo_process_groups=False,
        )


def transformer_config(
    spec: ModelSpec, run: RunSpec, offload: OffloadConfig | None
) -> Any:  # megatron.core.transformer.TransformerConfig
    """megatron-core's config for ``spec`` (``MLATransformerConfig`` when the pattern has
    ``+``), with fine-grained offloading on for ``offload`` (off for None)."""
    fields = _base_fields(spec, run)
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    layers = spec.all_layers
    if any(LAYERS[symbol].experts for symbol in layers):
        fields.update(_moe_fields(spec))
    if offload is not None:
        fields.update(_offload_fields(offload))
    make: Callable[..., Any] = TransformerConfig
    if any(LAYERS[symbol].kind == "mla" for symbol in layers):
        fields.update(_mla_fields(spec))
        make = MLATransformerConfig
    return _with_knobs(make, fields, spec)


def _base_fields(spec: ModelSpec, run: RunSpec) -> dict[str, Any]:
    """Sizes, dtypes, the layers' shape and the unfused deterministic attention of ``spec``."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend

    bf16 = run.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    gpt = gpt_layers(spec.layers) if IMPLS[spec.impl].gpt_layers else None
    fields: dict[str, Any] = dict(
        num_layers=len(gpt) if gpt is not None else len(spec.layers),
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.hidden_size // spec.num_heads,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        attention_backend=AttnBackend.unfused,
        deterministic_mode=True,
    )
    return fields


def _moe_fields(spec: ModelSpec) -> dict[str, Any]:
    """The MoE fields of a pattern with experts (GPT models: which layers are MoE)."""
    gpt = gpt_layers(spec.layers) if IMPLS[spec.impl].gpt_layers else None
    fields: dict[str, Any] = dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=spec.moe_capacity_factor,
        # Every expert's input padded to its capacity, as the harness's MoE layers do: the
        # shapes of expert_fc1/moe_act/fused_group_mlp tensors do not follow the routing, so
        # the warmup's record predicts every later step's bytes.
        moe_pad_expert_input_to_capacity=True,
        use_transformer_engine_op_fuser=spec.moe_path == "fused",
    )
    if gpt is not None:  # which GPT layers are MoE (1) or dense (0)
        fields["moe_layer_freq"] = [int(mlp == "E") for _, mlp in gpt]
    return fields


def _offload_fields(offload: OffloadConfig) -> dict[str, Any]:
    """megatron-core's fine-grained offloading knobs of the case's ``OffloadConfig``."""
    return dict(
        fine_grained_activation_offloading=True,
        offload_modules=list(offload.offload_modules),
        min_offloaded_tensor_size=offload.min_offloaded_tensor_size,
        activation_offload_fraction=offload.activation_offload_fraction,
        fine_grained_offloading_max_inflight_offloads=offload.max_inflight_offloads,
        delta_offload_bytes_across_pp_ranks=offload.delta_offload_bytes_across_pp_ranks,
    )


def _mla_fields(spec: ModelSpec) -> dict[str, Any]:
    """The multi-latent attention fields of a pattern with ``+``."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_nope_head_dim,
        qk_pos_emb_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_type="rope",
    )


def _with_knobs(make: Callable[..., Any], fields: dict[str, Any], spec: ModelSpec) -> Any:
    """``make(**fields)`` with the spec's megatron-core knobs; a configuration megatron-core
    refuses with the knobs (and accepts without them) is a ``Refused``."""
    knobs = knob_fields(spec)
    if not knobs:
        return make(**fields)
    if spec.cuda_graph == "te" and not hasattr(torch.autograd.graph, STALE_CAPTURE_OVERRIDE):
        raise Refused(
            f"TransformerEngine's CUDA-graph capture of megatron-core's layers needs torch's "
            f"torch.autograd.graph.{STALE_CAPTURE_OVERRIDE} (pytorch#180090), which torch "
            f"{torch.__version__} lacks: on the H200 with torch 2.11 the capture failed in the "
            "plain baseline, before any offloading (autograd's gradient-accumulation nodes, "
            "made before the capture, held a stream outside it: 'capturing stream has unjoined "
            "work' on a side stream, 'legacy stream depend on a capturing blocking stream' on "
            "the default one)"
        )
    make(**fields)  # without the knobs first: an error there is the harness's, not a refusal
    try:
        return make(**fields, **knobs)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        if not raised_by_megatron(exc):
            raise  # ours (a knob mapped wrongly): an error of the case, never a skip
        raise Refused(
            f"megatron-core {_version()} refuses {_knob_text(spec)} with this case: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        ) from exc


def raised_by_megatron(exc: BaseException) -> bool:
    """Whether megatron-core's own code raised ``exc``: its innermost frame runs a module of
    ``megatron.core`` (a config's ``__post_init__`` refusing a combination). A ``TypeError``
    (a keyword the config does not take: a field we renamed) is never caught as a refusal, and
    an error raised anywhere else is the harness's wiring, an error of the case."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("megatron.core")


def knob_fields(spec: ModelSpec) -> dict[str, Any]:
    """``TransformerConfig`` fields of the spec's megatron-core knobs (recompute, CUDA graphs,
    multi-token prediction); empty without any."""
    fields: dict[str, Any] = {}
    if spec.recompute == "full":
        fields.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    elif spec.recompute:
        fields.update(
            recompute_granularity="selective", recompute_modules=spec.recompute.split("+")
        )
    if spec.cuda_graph:  # captured layers need TransformerEngine's graph-safe RNG tracker
        fields.update(use_te_rng_tracker=True, cuda_graph_warmup_steps=1)
    if spec.cuda_graph == "te":
        fields.update(cuda_graph_impl="transformer_engine")
    elif spec.cuda_graph == "local-moe":
        fields.update(cuda_graph_impl="local", cuda_graph_modules=["moe_router", "moe_preprocess"])
    if spec.mtp:
        fields["mtp_num_layers"] = spec.mtp_depths
    if spec.offload_buffer_kib:
        fields["fine_grained_offloading_buffer_size_gib"] = spec.offload_buffer_kib / (1 << 20)
    return fields


def _knob_text(spec: ModelSpec) -> str:
    parts = []
    if spec.recompute:
        parts.append(f"recompute {spec.recompute}")
    if spec.cuda_graph:
        parts.append(f"CUDA graphs {spec.cuda_graph}")
    if spec.mtp:
        parts.append(f"MTP layers {spec.mtp}")
    if spec.offload_buffer_kib:
        parts.append(f"a {spec.offload_buffer_kib} KiB pinned activation buffer")
    return " and ".join(parts)


def _version() -> str:
    from harness.util.installed import megatron_core_source

    return megatron_core_source()["version"]


STALE_CAPTURE_OVERRIDE = "set_override_stale_capture_stream"
"""torch's switch (pytorch#180090) that lets autograd nodes made before a CUDA-graph capture
(megatron-core's DDP makes its gradient-accumulation nodes when it wraps the model) run
inside it: the TransformerEngine CUDA-graph rows need it."""
