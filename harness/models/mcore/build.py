"""megatron-core's model of a case: its ``HybridModel`` (``GPTModel`` for ``mcore-gpt``) built
from a ``TransformerConfig``, and its layers in the harness's numbering."""

from __future__ import annotations

from typing import Any

import torch

from harness.vocab.impls import IMPLS
from harness.vocab.spec import ModelSpec, RunSpec


def build_model(spec: ModelSpec, run: RunSpec, config: Any, device: torch.device) -> Any:
    """megatron-core's ``HybridModel`` (``GPTModel`` for ``mcore-gpt``) for ``spec`` on
    ``device``, weights drawn from the run's seed (the same seed gives the same weights, with or
    without offloading)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _reset_moe_metrics()
    torch.manual_seed(run.seed)
    # Seeds CUDA and a new RNG tracker of megatron-core's (TransformerEngine's, graph-safe,
    # under CUDA graphs), whatever the process's earlier models used.
    model_parallel_cuda_manual_seed(
        run.seed, te_rng_tracker=bool(spec.cuda_graph), force_reset_rng=True
    )
    if IMPLS[spec.impl].gpt_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=True),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            position_embedding_type="rope",  # MLA layers rotate inside their attention
        )
        return model.to(device)
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    model = HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        hybrid_layer_pattern=spec.pattern + (f"/{spec.mtp}" if spec.mtp else ""),
        position_embedding_type="rope" if "*" in spec.layers else "none",
    )
    return model.to(device)


def _reset_moe_metrics() -> None:
    """megatron-core's MoE metrics tracker is sized by the first model that records into it."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        return
    destroy_moe_metrics_tracker()


def model_layers(model: Any) -> list[Any]:
    """The model's layers in the harness's numbering: the decoder's, then each
    multi-token-prediction depth's inner layers (``ModelSpec.all_layers``)."""
    layers = list(model.decoder.layers)
    for depth in getattr(getattr(model, "mtp", None), "layers", ()):
        layers += list(getattr(getattr(depth, "mtp_model_layer", None), "layers", ()))
    return layers
