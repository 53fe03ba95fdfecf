"""How each sharding of megatron-core's models trains (``TRAINERS``): megatron-core's DDP and
distributed optimizer, Megatron-FSDP (``mfsdp``) and Megatron-FSDP from its "v2 building
blocks" (``mfsdp2``), each a ``ShardingTrainer`` - the wrapper the schedule runs, and the
step's gradient zeroing, gradient reading, update, final state and tensors to free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.models.mcore.build import model_layers
from harness.vocab.spec import RunSpec


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


@dataclass
class ShardingTrainer:
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
) -> ShardingTrainer:
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

    return ShardingTrainer(
        wrapper=wrapper,
        zero_grad=zero_grad,
        grads=grads,
        step=optimizer.step,
        state=lambda: {n: _full(p) for n, p in model.named_parameters()},
        tensors=tensors,
    )


def _ddp_trainer(config: Any, model: Any, module: Any, run: RunSpec) -> ShardingTrainer:
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


def _mfsdp_trainer(config: Any, model: Any, module: Any, run: RunSpec) -> ShardingTrainer:
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


def _mfsdp2_trainer(config: Any, model: Any, module: Any, run: RunSpec) -> ShardingTrainer:
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

    return ShardingTrainer(
        wrapper=module,
        zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
        grads=lambda: _dtensor_grads(list(model.named_parameters())),
        step=step,
        state=lambda: {n: _full(p) for n, p in model.named_parameters()},
        tensors=tensors,
    )


TRAINERS: dict[str, Callable[[Any, Any, Any, RunSpec], ShardingTrainer]] = {
    "none": _ddp_trainer,
    "mfsdp": _mfsdp_trainer,
    "mfsdp2": _mfsdp2_trainer,
}
"""How each sharding of megatron-core's models trains (``harness.vocab.spec.SHARDINGS``)."""
