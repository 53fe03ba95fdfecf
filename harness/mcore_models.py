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
from harness.runs import RunHooks, TrainResult
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
    if any(LAYERS[symbol].experts for symbol in spec.layers):
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
    if any(LAYERS[symbol].kind == "mla" for symbol in spec.layers):
        return MLATransformerConfig(
            **fields,
            multi_latent_attention=True,
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_head_dim=spec.qk_nope_head_dim,
            qk_pos_emb_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            rope_type="rope",
        )
    return TransformerConfig(**fields)


def build_model(spec: ModelSpec, run: RunSpec, config: Any, device: torch.device) -> Any:
    """megatron-core's ``HybridModel`` (``GPTModel`` for ``mcore-gpt``) for ``spec`` on
    ``device``, weights drawn from the run's seed (the same seed gives the same weights, with or
    without offloading)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _reset_moe_metrics()
    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)  # seeds CUDA and megatron-core's RNG tracker
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
        hybrid_layer_pattern=spec.pattern,
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
class LayerTracker:
    """Which decoder layer is running its forward (a forward pre-hook on every layer)."""

    def __init__(self, model: Any) -> None:
        self.layer = -1
        self._handles = [
            layer.register_forward_pre_hook(self._hook(index))
            for index, layer in enumerate(model.decoder.layers)
        ]

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self.layer = index

        return hook

    def __call__(self) -> int:
        return self.layer

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


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
    if sharding != "none":
        raise ValueError("impl 'mcore' runs unsharded (megatron-core's DDP over the world)")
    if run.schedule != "sequential":
        raise ValueError(
            f"impl 'mcore' runs megatron-core's one-stage schedule (sequential), not "
            f"{run.schedule!r}"
        )
    reason = unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason)
    ensure_parallel_state(device)
    _warm_process(spec, run, device)
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    inner = innermost(offloader)  # a wrapper (harness windows, the sync guard) drives it
    mode = _mode(inner)
    offload = getattr(inner, "config", None) if mode != "plain" else None
    if mode != "plain" and not isinstance(offload, OffloadConfig):
        raise ValueError(f"backend {offloader.name!r} has no OffloadConfig for megatron-core")
    config = transformer_config(spec, run, offload)
    model = build_model(spec, run, config, device)
    tracker = LayerTracker(model)
    module = Float16Module(config, model) if run.precision == "bf16" else model
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=True
        ),
        module=module,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=run.lr,
            weight_decay=0.01,
            bf16=run.precision == "bf16",
            params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
            clip_grad=run.grad_clip if run.grad_clip is not None else 0.0,
        ),
        [ddp],
        use_gloo_process_groups=False,
    )
    if hooks.model_ready is not None:  # after bf16 casting and DDP's buffers moved the weights
        hooks.model_ready(model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    data = make_batches(spec, seed=run.seed, steps=run.steps, microbatches=run.microbatches)
    data = data.to(device)
    B, T = spec.micro_batch_size, spec.seq_length
    positions = torch.arange(T, device=device).unsqueeze(0).expand(B, T)
    losses = torch.zeros(run.steps, run.microbatches, device=device)
    grads: list[dict[str, torch.Tensor]] = []
    forward_backward = get_forward_backward_func()
    named = [(n, p) for n, p in model.named_parameters()]

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
            context = hooks.step_context(step) if hooks.step_context else contextlib.nullcontext()
            with context:
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                compute = hooks.compute_context(step) if hooks.compute_context else None
                with compute or contextlib.nullcontext():
                    one_pass(step, data[step], forward_only=False)
                if keep_grads:
                    grads.append(_main_grads(named))
                optimizer.step()
    tracker.remove()
    state = {n: p.detach().cpu() for n, p in named} if keep_final_state else {}
    result = TrainResult(
        losses=losses.cpu(), logs=offloader.iteration_logs(), grads=grads, final_state=state
    )
    _release(named, optimizer)
    _clear_forward_caches(model)
    return result


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


def _release(named: list[tuple[str, torch.nn.Parameter]], optimizer: Any) -> None:
    """Free the run's device memory before returning.

    On the H200 a finished run's parameter and gradient buffers, fp32 main weights and Adam
    states were still reachable after ``gc.collect()`` (through megatron-core's DDP: its
    bucket groups, hook closures and the config's ``no_sync_func``) and went away only during
    a later run, so the next run's memory case counted a whole model it did not hold (937 MB).
    Emptying the storages makes every run start from the same allocator state. The first
    version of this left the fp32 gradients of the main weights (one fp32 block per weight,
    46 MB, seen on the H200); they are emptied too now, not yet checked on a GPU."""
    tensors: list[torch.Tensor | None] = []
    for _, param in named:
        tensors += [param, param.grad, getattr(param, "main_grad", None)]
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                # the fp32 main weight, its fp32 gradient (kept after the last step) and the
                # Adam moments
                tensors += [param, param.grad]
                tensors += list(torch_optimizer.state.get(param, {}).values())
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            tensor.untyped_storage().resize_(0)


_WARMED: set[tuple[ModelSpec, str]] = set()


def _warm_process(spec: ModelSpec, run: RunSpec, device: torch.device) -> None:
    """One unmeasured plain step of ``spec`` before the process's first run of it.

    megatron-core and TransformerEngine set things up lazily in the first step a process takes
    with a model shape (measured on the H200: the first plain step of the seed's model made 392
    DtoH/HtoD copies, a later model's first step 2), so without this the first run of a
    process would not be comparable with the next ones (the disabled run is compared with the
    plain run's step 0 copy for copy)."""
    key = (spec, run.precision)
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
        sharding="none",
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
