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

How an offloader meets the model (``train``)
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
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from harness import distributed
from harness.groups import LAYERS
from harness.impls import IMPLS
from harness.models.hybrid import INIT_STD, make_batches
from harness.observe import Windowed
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import Offloader, Wrapper
from harness.runs import Refused, RunHooks, TrainResult
from harness.spec import ModelSpec, RunSpec, gpt_layers

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

BRIDGED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.hybrid.hybrid_model",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.moe.experts",
)
"""megatron-core modules that call the offloading interface through a module-level
``off_interface`` name (transformer layers hold it as an attribute instead)."""


def _apply_environment() -> None:
    os.environ.update(ENVIRONMENT)
    # TransformerEngine's CPU-offload implementation is a setting (``--nvte-cpu-offload-v1``,
    # exported by ``harness.settings.apply``); unset, its older one: the code path megatron-core's
    # fine-grained offloading toggles (megatron's training arguments require it, TE >= 2.10).
    os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why megatron-core's models cannot run here (None when they can)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "impl 'mcore' needs a CUDA device (megatron-core's models with TransformerEngine)"
    _apply_environment()
    for module in ("transformer_engine.pytorch", "megatron.core.models.hybrid.hybrid_model"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a CUDA library TransformerEngine lacks
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return (
                f"impl 'mcore' needs TransformerEngine and megatron-core "
                f"(docs/megatron-core.md): import {module} failed: {first}"
            )
    return None


def ensure_parallel_state(device: torch.device) -> None:
    """torch.distributed and megatron-core's model-parallel state (TP = PP = EP = 1)."""
    _apply_environment()
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


# ----------------------------------------------------------------------------------- the model
def transformer_config(
    spec: ModelSpec, run: RunSpec, offload: OffloadConfig | None
) -> Any:  # megatron.core.transformer.TransformerConfig
    """megatron-core's config for ``spec`` (``MLATransformerConfig`` when the pattern has
    ``+``), with fine-grained offloading on for ``offload`` (off for None)."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    bf16 = run.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    layers = spec.all_layers
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
    if any(LAYERS[symbol].experts for symbol in layers):
        fields.update(
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
    if offload is not None:
        fields.update(
            fine_grained_activation_offloading=True,
            offload_modules=list(offload.offload_modules),
            min_offloaded_tensor_size=offload.min_offloaded_tensor_size,
            activation_offload_fraction=offload.activation_offload_fraction,
            fine_grained_offloading_max_inflight_offloads=offload.max_inflight_offloads,
            delta_offload_bytes_across_pp_ranks=offload.delta_offload_bytes_across_pp_ranks,
        )
    make: Callable[..., Any] = TransformerConfig
    if any(LAYERS[symbol].kind == "mla" for symbol in layers):
        fields.update(
            multi_latent_attention=True,
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_head_dim=spec.qk_nope_head_dim,
            qk_pos_emb_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            rope_type="rope",
        )
        make = MLATransformerConfig
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
    return fields


def _knob_text(spec: ModelSpec) -> str:
    parts = []
    if spec.recompute:
        parts.append(f"recompute {spec.recompute}")
    if spec.cuda_graph:
        parts.append(f"CUDA graphs {spec.cuda_graph}")
    if spec.mtp:
        parts.append(f"MTP layers {spec.mtp}")
    return " and ".join(parts)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # not installed as a distribution (a source checkout)
        return "(version unknown)"


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


# ---------------------------------------------------------------------------------- the bridge
def model_layers(model: Any) -> list[Any]:
    """The model's layers in the harness's numbering: the decoder's, then each
    multi-token-prediction depth's inner layers (``ModelSpec.all_layers``)."""
    layers = list(model.decoder.layers)
    for depth in getattr(getattr(model, "mtp", None), "layers", ()):
        layers += list(getattr(getattr(depth, "mtp_model_layer", None), "layers", ()))
    return layers


class LayerTracker:
    """Which layer is running its forward (multi-token-prediction layers numbered after the
    decoder's): a forward pre-hook on every layer, or with ``hooks=False`` a wrapper of each
    layer's ``forward`` (megatron-core refuses to capture a CUDA graph of a module with
    pre-forward hooks)."""

    def __init__(self, model: Any, *, hooks: bool = True) -> None:
        self.layer = -1
        self._handles: list[Any] = []
        self._wrapped: list[Any] = []
        for index, layer in enumerate(model_layers(model)):
            if hooks:
                self._handles.append(layer.register_forward_pre_hook(self._hook(index)))
            else:
                layer.forward = self._wrap(index, layer.forward)
                self._wrapped.append(layer)

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self.layer = index

        return hook

    def _wrap(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.layer = index
            return forward(*args, **kwargs)

        return tracked

    def __call__(self) -> int:
        return self.layer

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for layer in self._wrapped:
            del layer.forward  # the class's forward again


def _te_cpu_offload_flag() -> Any:
    """The object megatron-core toggles around a group (TransformerEngine's CPU-offload module)."""
    extension = importlib.import_module("megatron.core.extensions.transformer_engine")
    return getattr(extension, "cpu_offload", None)


class BridgeGroup:
    """One ``off_interface(flag, tensor, name)`` of a megatron-core layer, as a harness group."""

    def __init__(self, bridge: Bridge, offload: bool, tensor: torch.Tensor, name: str) -> None:
        self._bridge = bridge
        self._offload = offload
        self._tensor = tensor
        self._name = name
        self._group: Any = None

    def __enter__(self) -> torch.Tensor:
        if not self._offload:
            return self._tensor
        off = self._bridge.offloader
        self._group = off.group(self._name, self._tensor, layer=self._bridge.layer())
        self._group.__enter__()
        self._flag(True)
        return self._group.input

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._group is not None:
            self._flag(False)
            self._group.__exit__(exc_type, exc, tb)

    def _flag(self, value: bool) -> None:
        """TransformerEngine's CPU-offload flag, as megatron-core's manager sets it (inside
        groups that offload), so TransformerEngine saves what it saves under megatron-core."""
        flag = self._bridge.te_flag
        if flag is not None and not isinstance(self._group, PassThroughGroup):
            flag.CPUOffloadEnabled = value

    def group_offload(
        self,
        tensor: Any,
        forced_released_tensors: list[torch.Tensor] | None = None,
        delay_offload: bool = False,
    ) -> Any:
        if self._group is None:
            return tensor
        released = tuple(t for t in (forced_released_tensors or ()) if t is not None)
        return self._group.commit(tensor, release=released)


class Bridge:
    """Stands in for megatron-core's ``FineGrainedActivationOffloadingInterface`` and routes
    megatron-core's calls to a harness offloader. Chunk starts and resets are the runner's
    (``begin_microbatch`` before each forward, ``end_iteration`` after each step), so megatron-
    core's own ``init_chunk_handler`` and ``reset`` calls do nothing here; its parameter marks
    (``mark_not_offload``) reach the offloader."""

    def __init__(self, offloader: Offloader, layer: Callable[[], int], te_flag: Any) -> None:
        self.offloader = offloader
        self.layer = layer
        self.te_flag = te_flag
        """TransformerEngine's CPU-offload module (None: nothing to toggle)."""

    def __call__(self, offload: bool, tensor: torch.Tensor, name: str) -> BridgeGroup:
        return BridgeGroup(self, offload, tensor, name)

    def init_chunk_handler(self, *args: Any, **kwargs: Any) -> None:
        return None

    def mark_not_offload(self, tensor: torch.Tensor) -> None:
        if tensor is not None:
            self.offloader.mark_not_offloadable(tensor)

    def reset(self) -> None:
        return None

    def get_context(self, flag: bool) -> contextlib.AbstractContextManager[None]:
        if flag:
            raise NotImplementedError("the bridge does not offer megatron-core's get_context")
        return contextlib.nullcontext()

    def flush_delayed_groups(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(
            f"megatron-core called off_interface.{name}, which the harness bridge does not "
            "provide (CUDA graphs and delayed offloading are out of its scope)"
        )


@contextlib.contextmanager
def bridged(model: Any, bridge: Bridge) -> Iterator[None]:
    """megatron-core's offloading calls go to ``bridge`` while inside."""
    saved: list[tuple[Any, str, Any]] = []
    for name in BRIDGED_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "off_interface"):
            saved.append((module, "off_interface", module.off_interface))
            module.off_interface = bridge
    for sub in model.modules():
        if "off_interface" in vars(sub):
            saved.append((sub, "off_interface", sub.off_interface))
            sub.off_interface = bridge
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


# ------------------------------------------------------------------------------------ training
def innermost(offloader: Offloader) -> Offloader:
    """The backend under any ``Wrapper``s (the harness windows, the sync guard)."""
    while isinstance(offloader, Wrapper):
        offloader = offloader.inner
    return offloader


def _mode(offloader: Offloader) -> str:
    """``plain`` (flag off), ``native`` (megatron-core's own manager) or ``bridge``."""
    from harness.offload.mcore import McoreOffloader

    if isinstance(offloader, NoOffload):
        return "plain"
    if isinstance(offloader, McoreOffloader):
        return "native" if offloader.enabled else "plain"
    return "bridge"


def train(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    *,
    hooks: RunHooks,
    keep_grads: bool,
    keep_final_state: bool,
    sharding: str,
) -> TrainResult:
    """``harness.train.train`` for megatron-core's models (see the module docstring)."""
    # The registry's refusal (the one ``Case`` gives); the evaluation pass is left to the case
    # table, which refuses it for these rows.
    refused = IMPLS[spec.impl].refuse(schedule=run.schedule, sharding=sharding, eval_first=False)
    if refused is not None:
        raise ValueError(refused)
    reason = unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason)
    ensure_parallel_state(device)
    _warm_process(spec, run, device, sharding)
    with _graph_scope(spec, device):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        inner = innermost(offloader)  # a wrapper (harness windows, the sync guard) drives it
        mode = _mode(inner)
        offload = getattr(inner, "config", None) if mode != "plain" else None
        if mode != "plain" and not isinstance(offload, OffloadConfig):
            raise ValueError(f"backend {offloader.name!r} has no OffloadConfig for megatron-core")
        config = transformer_config(spec, run, offload)
        model = build_model(spec, run, config, device)
        tracker = LayerTracker(model, hooks=not spec.cuda_graph)
        module = Float16Module(config, model) if run.precision == "bf16" else model
        trainer = TRAINERS[sharding](config, model, module, run)
        ddp = trainer.wrapper
        if hooks.model_ready is not None:  # after bf16 casting and the wrapper moved the weights
            hooks.model_ready(model)
        graphs = _graph_helper(config, ddp, spec, run.microbatches)
        shard = distributed.rank() if sharding != "none" else 0
        data = make_batches(
            spec, seed=run.seed, steps=run.steps, microbatches=run.microbatches, shard=shard
        )
        data = data.to(device)
        B, T = spec.micro_batch_size, spec.seq_length
        positions = torch.arange(T, device=device).unsqueeze(0).expand(B, T)
        losses = torch.zeros(run.steps, run.microbatches, device=device)
        grads: list[dict[str, torch.Tensor]] = []
        forward_backward = get_forward_backward_func()

        def one_pass(step: int, batches: torch.Tensor, forward_only: bool) -> None:
            def forward_step(data_iterator: Iterator[int], net: Any) -> Any:
                mb = next(data_iterator)
                offloader.begin_microbatch(mb)
                tokens = batches[mb]
                inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
                # attention_mask None: TransformerEngine builds the causal mask itself (a given mask
                # is OR-ed with it).
                output = net(inputs, positions, None, labels=labels)

                def loss_func(per_token: torch.Tensor) -> Any:
                    loss = per_token.float().mean()
                    if not forward_only:
                        losses[step, mb].copy_(loss.detach())
                        if hooks.after_forward is not None:
                            hooks.after_forward(step, mb)
                    return loss, {"loss": loss.detach()}

                return output, loss_func

            forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(range(run.microbatches)),
                model=[ddp],
                num_microbatches=run.microbatches,
                seq_length=T,
                micro_batch_size=B,
                forward_only=forward_only,
            )
            offloader.end_iteration()

        with _wired(mode, offloader, model, tracker):
            if run.eval_first:
                ddp.eval()
                with torch.no_grad():
                    one_pass(0, data[0], forward_only=True)
                ddp.train()
            for step in range(run.steps):
                context = hooks.step_context(step) if hooks.step_context else None
                with context or contextlib.nullcontext():
                    if graphs is not None and step == config.cuda_graph_warmup_steps:
                        # as megatron's training loop: after the warmup; the replayed layers
                        # take the parameter-gather pre-hooks by hand only where those overlap
                        # (megatron-core asserts otherwise)
                        graphs.create_cudagraphs()
                        if getattr(ddp.ddp_config, "overlap_param_gather", False):
                            graphs.cuda_graph_set_manual_hooks()
                    trainer.zero_grad()
                    compute = hooks.compute_context(step) if hooks.compute_context else None
                    with compute or contextlib.nullcontext():
                        one_pass(step, data[step], forward_only=False)
                    if keep_grads:
                        grads.append(trainer.grads())
                    trainer.step()
        tracker.remove()
        state = trainer.state() if keep_final_state else {}
        result = TrainResult(
            losses=losses.cpu(), logs=offloader.iteration_logs(), grads=grads, final_state=state
        )
        if graphs is not None and graphs.graphs_created():  # a 1-step run captures none
            graphs.delete_cuda_graphs()
        _release(trainer.tensors())
        _clear_forward_caches(model)
        return result


STALE_CAPTURE_OVERRIDE = "set_override_stale_capture_stream"
"""torch's switch (pytorch#180090) that lets autograd nodes made before a CUDA-graph capture
(megatron-core's DDP makes its gradient-accumulation nodes when it wraps the model) run
inside it: the TransformerEngine CUDA-graph rows need it."""


@contextlib.contextmanager
def _graph_scope(spec: ModelSpec, device: torch.device) -> Iterator[None]:
    """A CUDA-graph row's run (nothing for the others): on a side stream, with megatron-core's
    process-wide graph state reset afterwards, however the run ended.

    The stream: a stream capture must not depend on the legacy default stream, yet autograd
    runs a parameter's gradient accumulation on the stream its node was made on, and
    megatron-core's DDP makes those nodes when it wraps the model. On the default stream, the
    H200's first capture failed in TransformerEngine's backward ("operation would make the
    legacy stream depend on a capturing blocking stream"); megatron-core's own local graph
    manager moves to a side stream for the same reason. The state: a capture that raised
    leaves megatron-core "capturing", and the local capture's record says "created" until
    ``delete_cuda_graphs``, so the next model of the process (the next baseline) found no graph
    runners of its own ("`cudagraph_created` is set to True but no matching cudagraph
    runners")."""
    if not spec.cuda_graph:
        yield
        return
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.transformer import cuda_graphs

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    override = getattr(torch.autograd.graph, STALE_CAPTURE_OVERRIDE, None)
    if override is not None:  # as megatron-core's own full-iteration capture does
        override(True)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        if override is not None:
            override(False)
        torch.cuda.current_stream(device).wait_stream(stream)
        cuda_graphs._set_capture_end()
        with contextlib.suppress(ImportError):  # TransformerEngine keeps its own flag
            from transformer_engine.pytorch.graph import set_capture_end

            set_capture_end()
        cuda_graphs.delete_cuda_graphs()
        destroy_num_microbatches_calculator()


def _clear_forward_caches(model: torch.nn.Module) -> None:
    """Empty the ``functools.lru_cache`` of every module class whose ``forward`` has one.

    megatron-core's ``RotaryEmbedding.forward`` is cached per instance (at most 32 entries
    process-wide), so each finished model's rotary table (128 KiB at the ``-small`` sizes)
    stayed live until 31 later calls evicted it: on the H200 a memory pair's reading then
    depended on which run an eviction fell in (a 131072-B block "only in the baseline", or
    only in the offload run, allocated at ``rotary_pos_embedding.py`` ``get_emb``)."""
    for cls in {type(m) for m in model.modules()}:
        clear = getattr(cls.forward, "cache_clear", None)
        if callable(clear):
            clear()


def _release(tensors: list[Any]) -> None:
    """Free the run's device memory before returning.

    On the H200 a finished run's parameter and gradient buffers, fp32 main weights and Adam
    states were still reachable after ``gc.collect()`` (through megatron-core's DDP: its
    bucket groups, hook closures and the config's ``no_sync_func``) and went away only during
    a later run, so the next run's memory case counted a whole model it did not hold (937 MB).
    Emptying the storages makes every run start from the same allocator state (a sharded
    tensor by its local shard)."""
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        if isinstance(local, torch.Tensor) and local.is_cuda:
            local.untyped_storage().resize_(0)


def _optimizer_tensors(optimizer: Any) -> list[Any]:
    """Every tensor a megatron-core (or torch) optimizer holds: its fp32 main weights, their
    gradients (kept after the last step) and the Adam moments."""
    tensors: list[Any] = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", inner)
        for group in getattr(torch_optimizer, "param_groups", ()):
            for param in group["params"]:
                tensors += [param, param.grad]
                tensors += list(torch_optimizer.state.get(param, {}).values())
    return tensors


_WARMED: set[tuple[ModelSpec, str, str]] = set()


def _warm_process(spec: ModelSpec, run: RunSpec, device: torch.device, sharding: str) -> None:
    """One unmeasured plain step of ``spec`` before the process's first run of it.

    megatron-core and TransformerEngine set things up lazily in the first step a process takes
    with a model shape (measured on the H200: the first plain step of the seed's model made 392
    DtoH/HtoD copies, a later model's first step 2), so without this the first run of a
    process would not be comparable with the next ones (the disabled run is compared with the
    plain run's step 0 copy for copy)."""
    key = (spec, run.precision, sharding)
    if key in _WARMED:
        return
    _WARMED.add(key)
    train(
        spec,
        run.replace(steps=1),
        NoOffload(),
        device,
        hooks=RunHooks(),
        keep_grads=False,
        keep_final_state=False,
        sharding=sharding,
    )


def _main_grads(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient: megatron-core's DDP keeps it in ``main_grad``
    (a view into its gradient buffer, reduced by ``finalize_model_grads``)."""
    out = {}
    for name, param in named:
        grad = getattr(param, "main_grad", None)
        if grad is None:
            raise RuntimeError(f"parameter {name} has no main_grad after the step's backward")
        out[name] = grad.detach().clone()
    return out


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor, detached, on the CPU (no copy on the
    device first: the host copy is the copy)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().cpu()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor of a (possibly sharded) DTensor, on its device."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _dtensor_grads(named: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Every sharded parameter's gradient (``.grad``), whole, after the step's backward.
    Copied on the device: a copy to the host inside the step would be counted with the step's
    transfers (``_main_grads`` clones on the device too)."""
    out = {}
    for name, param in named:
        if param.grad is None:
            raise RuntimeError(f"parameter {name} has no gradient after the step's backward")
        out[name] = _whole(param.grad)
    return out


# ------------------------------------------------------------------------ wrappers (sharding)
@dataclass
class Trainer:
    """How one sharding trains: the wrapper the schedule runs, and the step's
    gradient zeroing, gradient reading, update, final state and tensors to free."""

    wrapper: Any
    zero_grad: Callable[[], None]
    grads: Callable[[], dict[str, torch.Tensor]]
    step: Callable[[], None]
    state: Callable[[], dict[str, torch.Tensor]]
    tensors: Callable[[], list[Any]]


def _optimizer_config(config: Any, run: RunSpec) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=run.lr,
        weight_decay=0.01,
        bf16=run.precision == "bf16",
        params_dtype=config.params_dtype,
        use_distributed_optimizer=True,
        clip_grad=run.grad_clip if run.grad_clip is not None else 0.0,
    )


def _megatron_trainer(
    config: Any, model: Any, wrapper: Any, run: RunSpec, grads: Callable[[], dict[str, Any]]
) -> Trainer:
    """A megatron-core wrapper (DDP, Megatron-FSDP) with megatron-core's distributed optimizer,
    its ``finalize_model_grads`` and no-sync, as megatron-core's training loop wires them."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        _optimizer_config(config, run), [wrapper], use_gloo_process_groups=False
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = wrapper.no_sync
    config.grad_scale_func = optimizer.scale_loss

    def zero_grad() -> None:
        wrapper.zero_grad_buffer()
        optimizer.zero_grad()

    def tensors() -> list[Any]:
        out: list[Any] = []
        for _, param in model.named_parameters():
            out += [param, param.grad, getattr(param, "main_grad", None)]
        buffer = getattr(wrapper, "param_and_grad_buffer", None)
        for group in getattr(buffer, "parameter_groups", ()):  # Megatron-FSDP's buffers
            for name in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer"):
                out.append(getattr(getattr(group, name, None), "data", None))
        return out + _optimizer_tensors(optimizer)

    return Trainer(
        wrapper=wrapper,
        zero_grad=zero_grad,
        grads=grads,
        step=optimizer.step,
        state=lambda: {n: _full(p) for n, p in model.named_parameters()},
        tensors=tensors,
    )


def _ddp_trainer(config: Any, model: Any, module: Any, run: RunSpec) -> Trainer:
    """megatron-core's DDP (no overlap) and distributed optimizer: BF16 compute and main
    gradients, FP32 main weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=True
        ),
        module=module,
    )
    named = list(model.named_parameters())
    return _megatron_trainer(config, model, ddp, run, lambda: _main_grads(named))


def _mfsdp_trainer(config: Any, model: Any, module: Any, run: RunSpec) -> Trainer:
    """Megatron-FSDP as megatron-core 0.19 ships it: ``use_megatron_fsdp`` with the
    ``optim_grads_params`` strategy (flat ZeRO-3 over the data-parallel group, every
    TransformerLayer a unit), FP32 main weights, main gradients in the compute dtype, one
    distributed optimizer. Gradients are read from the optimizer's sharded parameters (the
    model's own lose ``main_grad`` once reduced)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    wrapper = FullyShardedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads_params",
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            megatron_fsdp_main_params_dtype=torch.float32,
            megatron_fsdp_main_grads_dtype=config.params_dtype,
        ),
        module=module,
    )
    buffer = wrapper.param_and_grad_buffer
    return _megatron_trainer(
        config, model, wrapper, run, lambda: _dtensor_grads(buffer.optimizer_named_parameters)
    )


def _mfsdp2_trainer(config: Any, model: Any, module: Any, run: RunSpec) -> Trainer:
    """Megatron-FSDP from the "v2 building blocks" megatron-core 0.19 bundles (not the upstream
    v2 adapter, which no release has): the experimental ``fully_shard`` with flat placements
    on every layer then the root (ZeRO-3: parameters, gradients and optimizer state flat-
    sharded over the data-parallel group), FP32 main weights, main gradients in the compute
    dtype, and one torch AdamW made FSDP-aware by ``fully_shard_optimizer``. The model is cast
    to the compute dtype first (the policy has no compute dtype). Gradient clipping is torch's
    over the sharded gradients."""
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MixedPrecisionPolicy
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import (
        Flat,
        Placements,
        fully_shard,
        fully_shard_optimizer,
    )
    from torch.distributed.device_mesh import DeviceMesh

    group = parallel_state.get_data_parallel_group()
    mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("dp",))
    placements = Placements(
        dp_axes=["dp"], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()]
    )
    policy = MixedPrecisionPolicy(
        main_params_dtype=torch.float32, main_grads_dtype=config.params_dtype
    )
    for layer in model_layers(model):
        fully_shard(layer, mesh, placements, policy)
    fully_shard(model, mesh, placements, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.01)
    fully_shard_optimizer(optimizer)
    config.finalize_model_grads_func = None
    config.no_sync_func = None
    config.grad_scale_func = None

    def step() -> None:
        if run.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), run.grad_clip)
        optimizer.step()

    def tensors() -> list[Any]:
        return [t for _, p in model.named_parameters() for t in (p, p.grad)] + (
            _optimizer_tensors(optimizer)
        )

    return Trainer(
        wrapper=module,
        zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
        grads=lambda: _dtensor_grads(list(model.named_parameters())),
        step=step,
        state=lambda: {n: _full(p) for n, p in model.named_parameters()},
        tensors=tensors,
    )


TRAINERS: dict[str, Callable[[Any, Any, Any, RunSpec], Trainer]] = {
    "none": _ddp_trainer,
    "mfsdp": _mfsdp_trainer,
    "mfsdp2": _mfsdp2_trainer,
}
"""How each sharding of megatron-core's models trains (``harness.spec.SHARDINGS``)."""


def _graph_helper(config: Any, wrapper: Any, spec: ModelSpec, microbatches: int) -> Any:
    """megatron-core's TransformerEngine CUDA-graph helper for ``cuda_graph="te"`` (None
    otherwise): it captures every layer after ``cuda_graph_warmup_steps`` steps, as megatron's
    training loop drives it. The local capture needs no helper: its layers capture
    themselves."""
    if spec.cuda_graph != "te":  # megatron-core cuda_graph_impl "transformer_engine"
        return None
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    # The capture sizes its warmup by megatron's global microbatch calculator, which megatron's
    # training loop sets up: one microbatch count of this run, data parallel over the world.
    world = distributed.world_size()
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(
        rank=distributed.rank(),
        global_batch_size=spec.micro_batch_size * microbatches * world,
        micro_batch_size=spec.micro_batch_size,
        data_parallel_size=world,
    )
    return TECudaGraphHelper(
        model=[wrapper],
        config=config,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
    )


@contextlib.contextmanager
def _wired(mode: str, offloader: Offloader, model: Any, tracker: LayerTracker) -> Iterator[None]:
    if mode == "native":
        windows = offloader if isinstance(offloader, Windowed) else None
        with innermost(offloader).native(tracker, windows):  # type: ignore[attr-defined]
            yield
    elif mode == "bridge":
        with bridged(model, Bridge(offloader, tracker, _te_cpu_offload_flag())):
            yield
    else:
        yield
