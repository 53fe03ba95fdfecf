"""The training loop of megatron-core's models (``train``, a ``harness.models.runs.Trainer``):
megatron-core's ``forward_backward_no_pipelining`` for the microbatches of a step, under the
sharding's trainer, with the process warmed once per model shape, CUDA-graph rows on a side
stream, and the run's device memory freed when it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from harness.models.hybrid import make_batches
from harness.models.mcore.bridge import LayerTracker, _mode, _wired, innermost
from harness.models.mcore.build import build_model
from harness.models.mcore.config import (
    STALE_CAPTURE_OVERRIDE,
    ensure_parallel_state,
    transformer_config,
    unavailable_reason,
)
from harness.models.mcore.sharding import TRAINERS, ShardingTrainer
from harness.models.runs import RunHooks, TrainResult
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Offloader
from harness.util import distributed
from harness.vocab.impls import IMPLS
from harness.vocab.spec import ModelSpec, RunSpec


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
    """``harness.models.train.train`` for megatron-core's models (see ``harness.models.mcore``)."""
    _refuse(spec, run, device, sharding)
    ensure_parallel_state(device)
    _warm_process(spec, run, device, sharding)
    with _graph_scope(spec, device):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        inner = innermost(offloader)  # a wrapper (harness windows, the sync guard) drives it
        mode = _mode(inner)
        config = transformer_config(spec, run, _offload_config(offloader, inner, mode))
        model = build_model(spec, run, config, device)
        tracker = LayerTracker(model, hooks=not spec.cuda_graph)
        module = Float16Module(config, model) if run.precision == "bf16" else model
        trainer = TRAINERS[sharding](config, model, module, run)
        if hooks.model_ready is not None:  # after bf16 casting and the wrapper moved the weights
            hooks.model_ready(model)
        graphs = _graph_helper(config, trainer.wrapper, spec, run.microbatches)
        shard = distributed.rank() if sharding != "none" else 0
        data = make_batches(
            spec, seed=run.seed, steps=run.steps, microbatches=run.microbatches, shard=shard
        )
        data = data.to(device)
        B, T = spec.micro_batch_size, spec.seq_length
        positions = torch.arange(T, device=device).unsqueeze(0).expand(B, T)
        losses = torch.zeros(run.steps, run.microbatches, device=device)
        grads: list[dict[str, torch.Tensor]] = []
        one_pass = _pass_function(
            spec,
            run,
            offloader,
            trainer.wrapper,
            hooks,
            losses,
            positions,
            get_forward_backward_func(),
        )
        with _wired(mode, offloader, model, tracker):
            _steps(
                run, config, trainer, graphs, hooks, one_pass, data, grads if keep_grads else None
            )
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


def _refuse(spec: ModelSpec, run: RunSpec, device: torch.device, sharding: str) -> None:
    """Raise ``ValueError`` for a case these models cannot run here."""
    # The registry's refusal (the one ``Case`` gives); the evaluation pass is left to the case
    # table, which refuses it for these rows.
    refused = IMPLS[spec.impl].refuse(schedule=run.schedule, sharding=sharding, eval_first=False)
    if refused is not None:
        raise ValueError(refused)
    reason = unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason)


def _offload_config(offloader: Offloader, inner: Offloader, mode: str) -> OffloadConfig | None:
    """The offload knobs megatron-core's config takes (None for the plain run)."""
    offload = getattr(inner, "config", None) if mode != "plain" else None
    if mode != "plain" and not isinstance(offload, OffloadConfig):
        raise ValueError(f"backend {offloader.name!r} has no OffloadConfig for megatron-core")
    return offload


class PassFunction(Protocol):
    """One pass over a step's microbatches."""

    def __call__(self, step: int, batches: torch.Tensor, forward_only: bool) -> None: ...


def _pass_function(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    ddp: Any,
    hooks: RunHooks,
    losses: torch.Tensor,
    positions: torch.Tensor,
    forward_backward: Callable[..., Any],
) -> PassFunction:
    """megatron-core's schedule over a step's microbatches, each forward told to the offloader
    first, the losses recorded into ``losses`` (not in a forward-only pass), the iteration
    ended after the last backward."""
    B, T = spec.micro_batch_size, spec.seq_length

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

    return one_pass


def _steps(
    run: RunSpec,
    config: Any,
    trainer: ShardingTrainer,
    graphs: Any,
    hooks: RunHooks,
    one_pass: PassFunction,
    data: torch.Tensor,
    grads: list[dict[str, torch.Tensor]] | None,
) -> None:
    """The run's steps (after its evaluation pass, if any); each step's gradients appended to
    ``grads`` (None: not kept)."""
    ddp = trainer.wrapper
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
            if grads is not None:
                grads.append(trainer.grads())
            trainer.step()


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
