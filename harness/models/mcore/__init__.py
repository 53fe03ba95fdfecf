"""Models of ``impl="mcore"`` and ``impl="mcore-gpt"``: megatron-core's own ``HybridModel`` and
``GPTModel`` with TransformerEngine layers, trained the way megatron-core's users train them,
with any harness offloader.

What is megatron-core's here and what is ours
    ``mcore``: megatron-core's ``HybridModel`` built from the case's pattern with its
    TransformerEngine layer spec ``hybrid_stack_spec`` (``+`` MLA, ``*`` attention, ``-`` MLP,
    ``E`` MoE on TransformerEngine's grouped MLP; ``moe_path="fused"`` selects the op-fuser path,
    ``use_transformer_engine_op_fuser``); layer indices and group templates are those of the
    harness's own models. ``mcore-gpt``: megatron-core's ``GPTModel`` with the TransformerEngine
    decoder block spec (``get_gpt_decoder_block_spec``); each GPT layer is one attention and one
    MLP/MoE symbol of the pattern (``*E*E`` is two layers, each attention then MoE; ``+`` is MLA,
    ``moe_layer_freq`` says which layers are MoE), so its group occurrences are keyed by GPT
    layer index. Sizes come from the ``ModelSpec``; the offload knobs from
    the case's ``OffloadConfig`` through ``TransformerConfig`` (fine_grained_activation_offloading,
    offload_modules, min_offloaded_tensor_size, activation_offload_fraction,
    fine_grained_offloading_max_inflight_offloads, delta_offload_bytes_across_pp_ranks).
    Unfused attention backend and deterministic kernels, as megatron-core's offloading test runs.

    Training is megatron-core's: ``Float16Module`` for bf16, its ``DistributedDataParallel`` and
    distributed optimizer (BF16 compute and main gradients, FP32 main weights, grad clip from the
    run), and ``forward_backward_no_pipelining`` for the microbatches of a step (the one schedule
    a single pipeline stage has: the harness's ``sequential``). The data, the seed and the loss
    (mean next-token cross entropy) are the harness's.

How an offloader meets the model (``train``, ``bridge.py``)
    * ``NoOffload`` (the plain baseline): the config flag is off; megatron-core's layers open no
      group at all.
    * ``McoreOffloader`` (backend ``mcore`` and its variants): the flag is on and megatron-core's
      own modules drive its own manager - its model forward opens the chunk, its layers open
      and commit the groups, its schedule resets. The adapter only watches (``native``): it
      names each group occurrence by (microbatch, layer, name), wraps the chunks' copy paths
      with profiler ranges and counters, adds race delays where asked, and logs each iteration
      just before megatron-core's own reset. Disabled, the model is built with the flag off.
    * Any other harness offloader (``hooks``, ``reference``, ``broken.*``): the flag is on and
      megatron-core's layers call a ``Bridge`` in place of megatron-core's offloading interface
      (the module-level ``off_interface`` names and each layer's ``off_interface``), which
      drives the harness protocol: group start / saved-tensor hooks / commit at megatron-core's
      own boundaries, with TransformerEngine's CPU-offload flag set inside selected groups as
      megatron-core's manager sets it. This is how the ``hooks`` baseline records what each
      group saves for the independent prediction.

Process state: megatron-core needs ``torch.distributed`` and its ``parallel_state`` (TP = PP =
EP = 1; data parallel over the world). Both are started once per process and kept.

Modules, by concern: ``config`` (environment, process state, ``transformer_config`` and the
knobs), ``build`` (the model), ``bridge`` (the layer tracker, the ``Bridge`` and the wiring of a
run to its offloader), ``sharding`` (a trainer per sharding), ``loop`` (``train``) and
``features`` (what the installed megatron-core offers, found by feature; ``python -m
harness.models.mcore.features``).
"""

from __future__ import annotations

from harness.models.mcore.bridge import (
    BRIDGED_MODULES,
    Bridge,
    BridgeGroup,
    LayerTracker,
    bridged,
    innermost,
)
from harness.models.mcore.build import build_model, model_layers
from harness.models.mcore.config import (
    STALE_CAPTURE_OVERRIDE,
    ensure_parallel_state,
    knob_fields,
    raised_by_megatron,
    transformer_config,
    unavailable_reason,
)
from harness.models.mcore.environment import ENVIRONMENT
from harness.models.mcore.loop import train
from harness.models.mcore.sharding import TRAINERS, ShardingTrainer

__all__ = [
    "BRIDGED_MODULES",
    "ENVIRONMENT",
    "STALE_CAPTURE_OVERRIDE",
    "TRAINERS",
    "Bridge",
    "BridgeGroup",
    "LayerTracker",
    "ShardingTrainer",
    "bridged",
    "build_model",
    "ensure_parallel_state",
    "innermost",
    "knob_fields",
    "model_layers",
    "raised_by_megatron",
    "train",
    "transformer_config",
    "unavailable_reason",
]
