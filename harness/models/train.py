"""The training runner: N steps x M microbatches under a schedule, with an offloader.

One call of ``train`` is one run: build the model from (spec, seed), move it to the device and
precision, then per step run the schedule's forwards and backwards (gradient accumulation),
end the offloader's iteration (Megatron resets after every schedule call), clip and step.

Precision ``bf16`` is the seed test's mode: the model's parameters, activations and gradients are
bf16; an fp32 master copy of every parameter lives in the optimizer, takes the bf16 gradients
cast up, and is copied back (rounded) after each step.

Sharding ``zero3`` is flat ZeRO-3 through PyTorch's FSDP2 (``fully_shard`` on every layer, then
on the root) over the default process group (a single-rank one on a ``HashStore`` when the
process is not under torchrun). The parameters stay fp32 and sharded - they are the main
weights of one optimizer; in ``bf16`` FSDP2 all-gathers them cast to bf16 for compute and
reduce-scatters the gradients in fp32 (``MixedPrecisionPolicy``); buffers are cast to the
compute dtype as in the unsharded mode. Each rank trains on its own data shard
(``make_batches(..., shard=rank)``), so losses, gradients and weights are per rank; gradients
kept and final weights are the rank's local shards.

Per-microbatch losses are written into a device tensor and fetched once at the end, so a
profiled step has no loss-copy traffic.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator

import torch

from harness.models.hybrid import HybridModel, loss_fn, make_batches, seeded_model
from harness.models.runs import RunHooks, Trainer, TrainResult
from harness.offload.protocol import Offloader, model_chunk_of
from harness.util import distributed
from harness.vocab.impls import IMPLS
from harness.vocab.spec import (
    INTERLEAVED_CHUNKS,
    INTERLEAVED_RANK,
    INTERLEAVED_RANKS,
    SCHEDULES,
    SHARDINGS,
    ModelSpec,
    RunSpec,
    model_chunks,
)

# cuBLAS reads this once, when its handle is created: set it before any CUDA matmul.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def schedule_order(schedule: str, microbatches: int) -> list[tuple[str, int]]:
    """The ("F"|"B", pass) sequence of one step. A pass is one forward (and later its backward)
    of one model chunk for one microbatch: the microbatch itself for the schedules without
    model chunks, ``microbatch * chunks + chunk`` for ``interleaved`` (``pass_of``)."""
    M = microbatches
    if schedule == "sequential":
        return [op for mb in range(M) for op in (("F", mb), ("B", mb))]
    if schedule == "gpipe":
        return [("F", mb) for mb in range(M)] + [("B", mb) for mb in range(M)]
    if schedule == "1f1b":
        order = [("F", 0)]
        for mb in range(1, M):
            order += [("F", mb), ("B", mb - 1)]
        return [*order, ("B", M - 1)]
    if schedule == "interleaved":
        return interleaved_order(M)
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def pass_of(microbatch: int, chunk: int, chunks: int) -> int:
    """The pass id of ``chunk``'s forward of ``microbatch`` (``schedule_order``'s second field)."""
    return microbatch * chunks + chunk


def interleaved_order(
    microbatches: int,
    *,
    chunks: int = INTERLEAVED_CHUNKS,
    ranks: int = INTERLEAVED_RANKS,
    rank: int = INTERLEAVED_RANK,
) -> list[tuple[str, int]]:
    """Megatron-Core's interleaved 1F1B order of passes as pipeline rank ``rank`` of ``ranks``
    runs it with ``chunks`` model chunks (virtual stages) and microbatch groups of ``ranks``:
    the k-th forward runs chunk ``(k mod (ranks * chunks)) // ranks`` of microbatch
    ``(k // (ranks * chunks)) * ranks + k mod ranks``, the k-th backward the same microbatch's
    chunk ``chunks - 1 -`` that; ``(ranks - rank - 1) * 2 + (chunks - 1) * ranks`` forwards of
    warmup, then one forward and one backward at a time, then the remaining backwards.

    Every chunk's forward of a microbatch comes after the previous chunk's, and its backward
    after the next chunk's, so the whole model can run on one process in this order: the other
    ranks' stages, which sit between this rank's chunks in a real pipeline, are folded into
    them and never touch this rank's offloader."""
    if microbatches % ranks:
        raise ValueError(
            f"the interleaved schedule takes microbatches in groups of {ranks} (its pipeline "
            f"ranks): --microbatches must be a multiple of {ranks}, got {microbatches}"
        )
    total = microbatches * chunks

    def position(k: int, backward: bool) -> int:
        chunk = (k % (ranks * chunks)) // ranks
        microbatch = (k // (ranks * chunks)) * ranks + k % ranks
        return pass_of(microbatch, chunks - 1 - chunk if backward else chunk, chunks)

    warmup = min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, total)
    order = [("F", position(k, False)) for k in range(warmup)]
    for i in range(total - warmup):
        order += [("F", position(warmup + i, False)), ("B", position(i, True))]
    return order + [("B", position(i, True)) for i in range(total - warmup, total)]


def last_forward_index(order: list[tuple[str, int]]) -> int:
    """The position in ``order`` (a ``schedule_order``) of its last forward."""
    return max(i for i, (kind, _) in enumerate(order) if kind == "F")


def _set_deterministic(mode: bool, *, warn_only: bool = False) -> None:
    """``torch.use_deterministic_algorithms`` without its side trip into TorchInductor's config:
    that first call imports ``torch._inductor`` (2-5 s per process on the CPU machine, paid by
    every xdist and CLI worker) only to mirror the flag for compiled code, which the harness
    never uses."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        setter(mode, warn_only=warn_only)


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for the duration of a run (restored afterwards)."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    _set_deterministic(True)
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        _set_deterministic(previous, warn_only=previous_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def prepare_model(spec: ModelSpec, run: RunSpec, device: torch.device) -> HybridModel:
    """Build from the run's seed and move to the device and compute dtype."""
    model = seeded_model(spec, run.seed)
    return model.to(device=device, dtype=DTYPES[run.precision])


def shard_model(spec: ModelSpec, run: RunSpec, device: torch.device) -> HybridModel:
    """Build from the run's seed (fp32, identical on every rank), then shard it with FSDP2:
    each layer, then the root (embedding, final norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    distributed.ensure_process_group(device)
    # The mesh names the run's device type: FSDP2's default mesh takes the machine's
    # accelerator, which puts a CPU run's parameters on the GPU when one is visible.
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    model = seeded_model(spec, run.seed).to(device)
    compute = DTYPES[run.precision]
    for module in model.modules():  # buffers (RoPE tables, masks) in the compute dtype
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(compute))
    policy = MixedPrecisionPolicy(
        param_dtype=compute if compute != torch.float32 else None, reduce_dtype=torch.float32
    )
    _quiet_about_returned_views({type(m).__name__ for m in (model, *model.layers)})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _quiet_about_returned_views(classes: set[str]) -> None:
    """Silence FSDP2's warning that one of these modules returned a view, which it prints for
    every offloaded layer (an offloader's identity autograd function returns a view of its
    input): the warning is about an in-place op on that view dropping FSDP's pre-backward hook,
    and our models never modify a layer's output in place (``tests/e2e/test_models_runs.py``
    proves it with the outputs' version counters). Only these classes: another model's is still
    said."""
    names = "|".join(sorted(f"FSDP{name}" for name in classes))
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \(({names})\) returned a view",
        category=UserWarning,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


ClipGrads = Callable[[list[torch.nn.Parameter], float], object]
"""Clips the fp32 main weights' gradients to a maximum norm (``_Optimizer``'s ``clip_grads``)."""


def clip_locally(main: list[torch.nn.Parameter], max_norm: float) -> object:
    """Torch's ``clip_grad_norm_`` on one process, per tensor (``foreach=False``)."""
    return torch.nn.utils.clip_grad_norm_(main, max_norm, foreach=False)


class _Optimizer:
    """The optimizer over fp32 weights: the model's own (fp32, or sharded fp32 under ZeRO-3) or
    master copies (bf16 unsharded). ``clip_grads`` clips them (``clip_locally``; a pipeline stage,
    ``harness.models.pipeline``, passes one that takes the norm over every stage's gradients)."""

    def __init__(
        self,
        model: torch.nn.Module,
        run: RunSpec,
        *,
        master_copies: bool,
        clip_grads: ClipGrads = clip_locally,
    ) -> None:
        self.model_params = [p for p in model.parameters()]
        self.clip_grads = clip_grads
        if master_copies:
            self.main = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        else:
            self.main = self.model_params
        self.clip = run.grad_clip
        kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
        self.optimizer = kinds[run.optimizer](self.main, lr=run.lr, foreach=False)

    def step(self) -> None:
        if self.main is not self.model_params:
            for main, param in zip(self.main, self.model_params, strict=True):
                main.grad = param.grad.float()
        if self.clip is not None:
            self.clip_grads(self.main, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.main is not self.model_params:
            with torch.no_grad():
                for main, param in zip(self.main, self.model_params, strict=True):
                    param.copy_(main)
        for param in self.model_params:
            param.grad = None


def train(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device | str,
    *,
    hooks: RunHooks | None = None,
    keep_grads: bool = False,
    keep_final_state: bool = False,
    sharding: str = "none",
) -> TrainResult:
    """Train ``run.steps`` steps of ``spec`` with ``offloader`` under deterministic kernels, on
    the model implementation ``spec.impl`` names (``harness.vocab.impls``: ours is
    ``train_harness``, see the module docstring)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDINGS)}")
    device = torch.device(device)
    trainer: Trainer = IMPLS[spec.impl].train_function()
    with deterministic(device):
        return trainer(
            spec,
            run,
            offloader,
            device,
            hooks=hooks or RunHooks(),
            keep_grads=keep_grads,
            keep_final_state=keep_final_state,
            sharding=sharding,
        )


def train_harness(
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
    """One run of our model (``harness.models``): see the module docstring."""
    if sharding == "zero3" and model_chunks(run.schedule) > 1:
        raise ValueError(
            f"schedule {run.schedule!r} runs model chunks, which FSDP2's root does not gather "
            "around: sharding 'zero3' takes the other schedules"
        )
    if sharding == "zero3":
        model = shard_model(spec, run, device)
        optimizer = _Optimizer(model, run, master_copies=False)
    else:
        model = prepare_model(spec, run, device)
        optimizer = _Optimizer(model, run, master_copies=run.precision == "bf16")
    if hooks.model_ready is not None:
        hooks.model_ready(model)
    shard = distributed.rank() if sharding == "zero3" else 0
    data = make_batches(
        spec, seed=run.seed, steps=run.steps, microbatches=run.microbatches, shard=shard
    )
    data = data.to(device)
    losses = torch.zeros(run.steps, run.microbatches, device=device)
    order = schedule_order(run.schedule, run.microbatches)
    grads: list[dict[str, torch.Tensor]] = []
    if run.eval_first:
        _eval_pass(model, offloader, data[0], run.microbatches)
    for step in range(run.steps):
        context = hooks.step_context(step) if hooks.step_context else contextlib.nullcontext()
        with context:
            compute = hooks.compute_context(step) if hooks.compute_context else None
            with compute or contextlib.nullcontext():
                _run_step(model, offloader, data[step], losses[step], order, run, step, hooks)
            if keep_grads:
                grads.append(
                    {n: _local(p.grad).detach().clone() for n, p in model.named_parameters()}
                )
            optimizer.step()
    state = (
        {n: _local(p).detach().cpu() for n, p in model.named_parameters()}
        if keep_final_state
        else {}
    )
    return TrainResult(
        losses=losses.cpu(), logs=offloader.iteration_logs(), grads=grads, final_state=state
    )


def _eval_pass(
    model: HybridModel, offloader: Offloader, batches: torch.Tensor, microbatches: int
) -> None:
    """A forward-only pass of every microbatch under ``torch.no_grad`` (outputs discarded)."""
    with torch.no_grad():
        for mb in range(microbatches):
            offloader.begin_microbatch(mb)
            model(batches[mb][:, :-1], offloader)
    offloader.end_iteration()


def _run_step(
    model: HybridModel,
    offloader: Offloader,
    batches: torch.Tensor,
    losses: torch.Tensor,
    order: list[tuple[str, int]],
    run: RunSpec,
    step: int,
    hooks: RunHooks,
) -> None:
    """One step in the schedule's passes. Without model chunks a pass is a microbatch's whole
    forward and backward; with them (``interleaved``) each pass is one chunk of a microbatch,
    as pipeline stages run them: a chunk's forward takes the previous chunk's output detached
    (what a stage receives), its backward starts from the next chunk's input gradient (what a
    stage is sent back), the last chunk's from the loss."""
    chunks = model_chunks(run.schedule)
    outputs: dict[int, torch.Tensor] = {}  # pass -> its output (the loss for the last chunk)
    inputs: dict[int, torch.Tensor] = {}  # pass -> the detached input it received
    sent_back: dict[int, torch.Tensor] = {}  # pass -> the gradient of its output
    for kind, p in order:
        mb, chunk = divmod(p, chunks)
        if kind == "F":
            if chunks > 1:
                model_chunk_of(offloader, chunk, chunks)
            offloader.begin_microbatch(p)
            tokens = batches[mb]
            if chunk == 0:
                x = tokens[:, :-1]
            else:
                x = inputs[p] = outputs[p - 1].detach().requires_grad_(True)
            # One chunk is the whole model: through its __call__, where FSDP2's root gathers.
            out = (
                model.forward_chunk(x, offloader, chunk, chunks)
                if chunks > 1
                else model(x, offloader)
            )
            if chunk == chunks - 1:
                out = loss_fn(out, tokens[:, 1:])
                losses[mb].copy_(out.detach())
            outputs[p] = out
            if hooks.after_forward is not None:
                hooks.after_forward(step, p)
        else:
            out = outputs.pop(p)
            if chunk == chunks - 1:
                (out / run.microbatches).backward()
            else:
                out.backward(sent_back.pop(p))
            if chunk > 0:
                received = inputs.pop(p)
                assert received.grad is not None, "a chunk's input got no gradient"
                sent_back[p - 1] = received.grad
    offloader.end_iteration()
