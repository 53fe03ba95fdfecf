"""The training runner across ranks: our models (``harness.models.hybrid``, every family) split
into pipeline stages, one per rank of a process group, activations and gradients crossing ranks
by point-to-point messages (``harness.models.p2p``), each rank driving its own offloader.

``train_pipeline`` is one rank's part of one run, called on every rank of the group with the
same arguments. What it does, and why the result is bitwise the one-rank run's
(``harness.models.train``, same spec, run and schedule):

* Placement (``p2p.PipelineLayout``): ``stages`` = the group's size (PP), ``chunks`` model chunks
  per rank (VPP: ``harness.vocab.spec.model_chunks`` of the schedule, 2 under ``interleaved``),
  ``stages * chunks`` virtual stages; virtual stage ``v`` runs the layers ``chunk_layers(count, v,
  stages * chunks)`` (contiguous, the first ones a layer longer), the first also the embedding,
  the last the final norm, the head and the loss. Megatron's interleaved assignment: rank ``r``'s
  chunk ``c`` is virtual stage ``c * stages + r``. Every rank builds the whole model from the
  run's seed (so every weight is the one-rank run's), then drops what it does not run.
* Order (``stage_order``): each rank runs its own slice of Megatron-Core's schedule - 1F1B with
  ``stages - rank - 1`` warmup forwards (Megatron's non-interleaved pipelining), interleaved 1F1B
  as ``harness.models.train.interleaved_order`` for this rank of ``stages``; GPipe (all forwards,
  then all backwards) and ``sequential`` run the one-rank order on every stage. Rank 0 of 2 runs
  exactly the one-rank runner's orders (``harness.models.train.schedule_order``).
* Passes and the offloader: a pass is one model chunk of one microbatch, with the one-rank
  runner's local id ``microbatch * chunks + chunk``; before each forward the rank calls
  ``model_chunk(chunk, chunks)`` (under VPP) and ``begin_microbatch(pass)`` on its own offloader,
  and ``end_iteration`` after its last backward of the step, as the one-rank runner does.
* Boundaries: a virtual stage's forward takes the previous one's output as received (what the
  one-rank interleaved runner does with the output detached), its backward starts from the
  gradient the next one sends back (the last one's from the loss over ``microbatches``), and it
  sends its input's gradient back. A parameter lives in exactly one virtual stage, whose
  backwards run in microbatch order under every schedule, so its gradient accumulates in the
  one-rank order: bitwise equal.
* Reductions across stages: the models tie no weights (embedding and head are separate
  parameters), so no gradient is summed across ranks. The gradient clip's norm spans every
  stage: each rank takes the norm of each of its gradients, the ranks gather them, and every rank
  takes the norm of all of them in the whole model's parameter order - the one-rank
  ``clip_grad_norm_``'s numbers, in its order - then scales its own gradients by it.
* Losses: the last stage computes them; each step it broadcasts the step's losses to every rank.

Limits: the harness's models only (``ModelSpec.impl`` ``harness``), no sharding, no no-grad
evaluation pass (``RunSpec.eval_first``), gloo only for now (``harness.models.p2p``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.models.hybrid import HybridModel, loss_fn, make_batches, seeded_model
from harness.models.p2p import AbortBoard, P2PError, PipelineLayout, StageLinks, program
from harness.models.runs import RunHooks, TrainResult
from harness.models.train import (
    DTYPES,
    _Optimizer,
    deterministic,
    interleaved_order,
    schedule_order,
)
from harness.offload.protocol import Offloader, model_chunk_of
from harness.util import distributed
from harness.vocab.impls import IMPLS
from harness.vocab.spec import SCHEDULES, ModelSpec, RunSpec, chunk_layers, model_chunks

Order = list[tuple[str, int]]


def stage_order(schedule: str, microbatches: int, stages: int, stage: int) -> Order:
    """The ("F"|"B", pass) sequence that pipeline rank ``stage`` of ``stages`` runs in one step
    of ``schedule``: its slice of Megatron-Core's 1F1B or interleaved 1F1B schedule, the one-rank
    order on every stage for ``gpipe`` and ``sequential`` (see the module docstring). Passes are
    local, as ``harness.models.train.schedule_order``'s: the microbatch under ``gpipe`` and
    ``1f1b``, ``microbatch * chunks + chunk`` under ``interleaved``. ``sequential`` is every
    microbatch's forward and backward in turn on every stage (no overlap)."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    M = microbatches
    if schedule in ("sequential", "gpipe"):
        return schedule_order(schedule, M)
    if schedule == "1f1b":
        warmup = min(stages - stage - 1, M)
        order: Order = [("F", mb) for mb in range(warmup)]
        for i in range(M - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", mb) for mb in range(M - warmup, M)]
    if schedule == "interleaved":
        return interleaved_order(M, chunks=model_chunks(schedule), ranks=stages, rank=stage)
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def stage_layers(count: int, layout: PipelineLayout, stage: int) -> list[range]:
    """The layer indices of each of ``stage``'s model chunks in a model of ``count`` layers."""
    V = layout.virtual_stages
    return [
        chunk_layers(count, layout.virtual_stage(stage, chunk), V) for chunk in range(layout.chunks)
    ]


class _Elsewhere(nn.Module):
    """Stands in for a part another stage runs (its weights dropped); never called."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError(f"{self.what} runs on another pipeline stage")


def stage_model(
    spec: ModelSpec, run: RunSpec, layout: PipelineLayout, stage: int
) -> tuple[HybridModel, list[str]]:
    """``stage``'s part of the model, on the CPU in fp32, and the whole model's parameter names
    in its order: the whole model built from the run's seed, then every layer the stage does not
    run replaced by a stand-in, the embedding dropped unless it runs virtual stage 0, the final
    norm and head unless it runs the last one. Its ``named_parameters`` are the stage's, named and
    ordered as in the whole model."""
    model = seeded_model(spec, run.seed)
    whole = [name for name, _ in model.named_parameters()]
    owned = {index for chunk in stage_layers(len(model.layers), layout, stage) for index in chunk}
    for index in range(len(model.layers)):
        if index not in owned:
            model.layers[index] = _Elsewhere(f"layer {index}")
    first, last = layout.owner(0)[0], layout.owner(layout.virtual_stages - 1)[0]
    if stage != first:
        model.embedding = None  # type: ignore[assignment]
    if stage != last:
        model.head = None  # type: ignore[assignment]
        model.final_norm = _Elsewhere("the final norm")  # type: ignore[assignment]
    return model, whole


class ClipAcrossStages:
    """A ``clip_grads`` for ``harness.models.train._Optimizer``: ``clip_grad_norm_(foreach=False)``
    of the whole model, computed across the stages. Each rank takes the norm of each of its fp32
    main gradients (named ``mine``) into its position in the whole model's parameter order
    (``whole``); the ranks gather them; every rank takes the total norm of all of them in that
    order - the numbers and the order of the one-rank clip - and scales its own gradients by it
    (``clip_grads_with_norm_``, as the one-rank clip does)."""

    def __init__(
        self, whole: list[str], mine: list[str], group: dist.ProcessGroup | None = None
    ) -> None:
        self.size, self.group = len(whole), group
        self.positions = [whole.index(name) for name in mine]
        self.wait: Callable[[dist.Work, str], None] = lambda work, what: work.wait()
        """How the gather is waited for (the run's ``StageLinks.collective``)."""

    def __call__(self, main: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        local = torch.zeros(2, self.size, dtype=torch.float32, device=main[0].device)
        for position, param in zip(self.positions, main, strict=True):
            if param.grad is not None:  # row 0: the gradient is there; row 1: its norm
                local[0, position] = 1.0
                local[1, position] = torch.linalg.vector_norm(param.grad, 2.0)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        self.wait(dist.all_gather(parts, local, group=self.group, async_op=True), "the clip")
        present = [part[0].tolist() for part in parts]
        norms = [
            part[1, position]
            for position in range(self.size)
            for part, flags in zip(parts, present, strict=True)
            if flags[position]
        ]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch.nn.utils.clip_grads_with_norm_(main, max_norm, total, foreach=False)
        return total


def check_pipeline(spec: ModelSpec, run: RunSpec, layout: PipelineLayout) -> None:
    """Refuse, before any training, what ``train_pipeline`` does not run (module docstring)."""
    if not IMPLS[spec.impl].ours:
        raise ValueError(
            f"a pipeline across ranks runs the harness's own models (impl 'harness'), not "
            f"{spec.impl!r}"
        )
    if run.eval_first:
        raise ValueError("a pipeline across ranks has no no-grad evaluation pass (eval_first)")
    if len(spec.layers) < layout.virtual_stages:
        raise ValueError(
            f"{layout.stages} stages x {layout.chunks} model chunks need at least "
            f"{layout.virtual_stages} layers; the pattern {spec.pattern!r} has {len(spec.layers)}"
        )
    stage_order(run.schedule, run.microbatches, layout.stages, 0)  # the schedule's own checks


def train_pipeline(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device | str,
    *,
    group: dist.ProcessGroup | None = None,
    hooks: RunHooks | None = None,
    keep_grads: bool = False,
    keep_final_state: bool = False,
) -> TrainResult:
    """This rank's part of training ``spec`` under ``run`` as a pipeline over ``group`` (the
    default group when None; one stage per rank, this rank's stage its rank there), with
    ``offloader`` driven for this rank's passes, under deterministic kernels. Call it on every
    rank of the group with the same arguments (each its own offloader).

    The result's losses are every microbatch's (broadcast from the last stage), so the same on
    every rank; its logs are this rank's offloader's; its gradients (per step, before the clip)
    and final weights are this stage's parameters, named as in the whole model."""
    if not dist.is_initialized():
        raise ValueError(
            "a pipeline across ranks needs a process group (torchrun's, or one of its own)"
        )
    device = torch.device(device)
    layout = PipelineLayout(dist.get_world_size(group), model_chunks(run.schedule))
    check_pipeline(spec, run, layout)
    own = group is None  # a group of its own per run: one given up on is left behind
    if own:
        group = _own_group()
    with deterministic(device):
        result = _train(
            spec,
            run,
            offloader,
            device,
            layout,
            group,
            hooks or RunHooks(),
            keep_grads,
            keep_final_state,
        )
    if own:
        dist.destroy_process_group(group)
    return result


def _own_group() -> dist.ProcessGroup:
    """A group of the whole world for one run, with the default group's timeout."""
    return dist.new_group(list(range(dist.get_world_size())), timeout=_group_timeout())


def _group_timeout() -> Any:
    """The default group's timeout, for the groups a run makes (where it can be read; else
    torch's default)."""
    default = dist.distributed_c10d._get_default_group()
    try:
        return default._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


@dataclass(kw_only=True)
class _StageRun:
    """What one rank's steps run with."""

    model: HybridModel
    offloader: Offloader
    links: StageLinks
    layout: PipelineLayout
    stage: int
    order: Order
    run: RunSpec
    hooks: RunHooks
    at: str = "before its first pass"
    """The pass this rank runs now, for a failure's line."""


def _train(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    layout: PipelineLayout,
    group: dist.ProcessGroup | None,
    hooks: RunHooks,
    keep_grads: bool,
    keep_final_state: bool,
) -> TrainResult:
    stage = dist.get_rank(group)
    dtype = DTYPES[run.precision]
    model, whole = stage_model(spec, run, layout, stage)
    model = model.to(device=device, dtype=dtype)
    names = [name for name, _ in model.named_parameters()]
    clip = ClipAcrossStages(whole, names, group)
    optimizer = _Optimizer(model, run, master_copies=run.precision == "bf16", clip_grads=clip)
    if hooks.model_ready is not None:
        hooks.model_ready(model)
    data = make_batches(spec, seed=run.seed, steps=run.steps, microbatches=run.microbatches)
    data = data.to(device)
    losses = torch.zeros(run.steps, run.microbatches, device=device)
    shape = (spec.micro_batch_size, spec.seq_length, spec.hidden_size)
    board = AbortBoard(distributed._store("pipeline"))
    links = StageLinks(layout, stage, shape, dtype, device, group, board, timeout=_group_timeout())
    clip.wait = links.collective
    this = _StageRun(
        model=model,
        offloader=offloader,
        links=links,
        layout=layout,
        stage=stage,
        order=stage_order(run.schedule, run.microbatches, layout.stages, stage),
        run=run,
        hooks=hooks,
    )
    last = layout.owner(layout.virtual_stages - 1)[0]
    grads: list[dict[str, torch.Tensor]] = []
    for step in range(run.steps):
        links.step = step
        context = hooks.step_context(step) if hooks.step_context else contextlib.nullcontext()
        with context, _giving_up(this, step):
            compute = hooks.compute_context(step) if hooks.compute_context else None
            with compute or contextlib.nullcontext():
                _run_step(this, data[step], losses[step], step)
            this.at = "the broadcast of the step's losses"
            sent = dist.broadcast(losses[step], group=group, group_src=last, async_op=True)
            links.collective(sent, this.at)
            this.at = "the optimizer step (the clip's gather of gradient norms)"
            if keep_grads:
                grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            optimizer.step()
    links.close()  # its channel groups; a run given up on leaves them behind, as its group
    state = {n: p.detach().cpu() for n, p in model.named_parameters()} if keep_final_state else {}
    return TrainResult(
        losses=losses.cpu(), logs=offloader.iteration_logs(), grads=grads, final_state=state
    )


@contextlib.contextmanager
def _giving_up(this: _StageRun, step: int) -> Iterator[None]:
    """A rank that fails in a step posts where (rank, stage, step, pass) on the run's abort
    board, so the ranks waiting on it give up at once naming it (``p2p.AbortBoard``); a rank
    that gave up because another posted adds nothing. The exception goes on, noted."""
    try:
        yield
    except BaseException as exc:
        if not (isinstance(exc, P2PError) and "given up" in str(exc)):
            first = str(exc).splitlines()[0] if str(exc) else ""
            line = (
                f"rank {dist.get_rank()} (pipeline stage {this.stage}) raised in step {step}, "
                f"in {this.at}: {type(exc).__name__}: {first}"
            )
            this.links.board.post(line)
            if not isinstance(exc, P2PError):
                exc.add_note(line)
        raise


def _run_step(this: _StageRun, batches: torch.Tensor, losses: torch.Tensor, step: int) -> None:
    """One step of this rank's passes in its order; sends are waited for at its end, then the
    offloader's iteration ends (as the one-rank runner ends it after its last backward)."""
    outputs: dict[int, torch.Tensor] = {}  # pass -> its output (the loss on the last stage)
    inputs: dict[int, torch.Tensor] = {}  # pass -> the activation it received
    chunks = this.layout.chunks
    this.links.posted.clear()
    for kind, p in this.order:
        mb, chunk = divmod(p, chunks)
        this.at = (
            f"the {'forward' if kind == 'F' else 'backward'} of microbatch {mb}"
            + (f", model chunk {chunk}" if chunks > 1 else "")
            + f" (virtual stage {this.layout.virtual_stage(this.stage, chunk)})"
        )
        if kind == "F":
            _forward(this, batches, losses, p, outputs, inputs)
            if this.hooks.after_forward is not None:
                this.hooks.after_forward(step, p)
        else:
            _backward(this, p, outputs, inputs)
    this.at = "the wait for the step's sends"
    this.links.finish()
    # what the NCCL play of tests/unit/test_pipeline_nccl.py reads is what ran
    expected = program(this.order, this.layout, this.stage)
    if this.links.posted != expected:
        raise P2PError(
            f"rank {this.stage}: step {step} posted {this.links.posted[:3]}... where "
            f"harness.models.p2p.program says {expected[:3]}..."
        )
    this.at = "the offloader's end_iteration"
    this.offloader.end_iteration()


def _forward(
    this: _StageRun,
    batches: torch.Tensor,
    losses: torch.Tensor,
    p: int,
    outputs: dict[int, torch.Tensor],
    inputs: dict[int, torch.Tensor],
) -> None:
    """Pass ``p``'s forward: its input received first (Megatron receives before the forward
    step), then the offloader told the pass, the virtual stage run, its output sent on (or the
    loss taken, on the last virtual stage)."""
    chunks, V = this.layout.chunks, this.layout.virtual_stages
    mb, chunk = divmod(p, chunks)
    v = this.layout.virtual_stage(this.stage, chunk)
    tokens = batches[mb]
    if v == 0:
        x = tokens[:, :-1]
    else:
        x = inputs[p] = this.links.recv_activation(v, mb).requires_grad_(True)
    if chunks > 1:
        model_chunk_of(this.offloader, chunk, chunks)
    this.offloader.begin_microbatch(p)
    out = this.model.forward_chunk(x, this.offloader, v, V)
    if v == V - 1:
        out = loss_fn(out, tokens[:, 1:])
        losses[mb].copy_(out.detach())
    else:
        this.links.send_activation(v, mb, out.detach())
    outputs[p] = out


def _backward(
    this: _StageRun, p: int, outputs: dict[int, torch.Tensor], inputs: dict[int, torch.Tensor]
) -> None:
    """Pass ``p``'s backward: from the loss over the microbatches on the last virtual stage,
    else from the gradient the next one sends back; then its input's gradient sent back."""
    V = this.layout.virtual_stages
    mb, chunk = divmod(p, this.layout.chunks)
    v = this.layout.virtual_stage(this.stage, chunk)
    out = outputs.pop(p)
    if v == V - 1:
        (out / this.run.microbatches).backward()
    else:
        out.backward(this.links.recv_gradient(v, mb))
    if v > 0:
        received = inputs.pop(p)
        assert received.grad is not None, "a virtual stage's input got no gradient"
        this.links.send_gradient(v, mb, received.grad)
