"""The training runner: N steps x M microbatches under a schedule, with an offloader.

One call of ``train`` is one run: build the model from (spec, seed), move it to the device and
precision, then per step run the schedule's forwards and backwards (gradient accumulation),
end the offloader's iteration (Megatron resets after every schedule call), clip and step.

Precision ``bf16`` is the seed test's mode: the model's parameters, activations and gradients are
bf16; an fp32 master copy of every parameter lives in the optimizer, takes the bf16 gradients
cast up, and is copied back (rounded) after each step.

Per-microbatch losses are written into a device tensor and fetched once at the end, so a
profiled step has no loss-copy traffic.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from harness.models.hybrid import HybridModel, build_model, loss_fn, make_batches
from harness.offload.protocol import IterationLog, Offloader
from harness.spec import ModelSpec, RunSpec

# cuBLAS reads this once, when its handle is created: set it before any CUDA matmul.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def schedule_order(schedule: str, microbatches: int) -> list[tuple[str, int]]:
    """The ("F"|"B", microbatch) sequence of one step."""
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
    raise ValueError(f"unknown schedule {schedule!r}; known: sequential, gpipe, 1f1b")


@dataclass(kw_only=True)
class RunHooks:
    """Optional callbacks into a run (for profiling and memory cases)."""

    step_context: Callable[[int], contextlib.AbstractContextManager[object]] | None = None
    """Context manager wrapped around each whole step (e.g. a profiler for the last one)."""
    after_forward: Callable[[int, int], None] | None = None
    """Called with (step, microbatch) right after each forward."""


@dataclass(kw_only=True)
class TrainResult:
    """What a run produced."""

    losses: torch.Tensor
    """[steps, microbatches] fp32 losses on the CPU."""
    logs: list[IterationLog]
    """The offloader's per-iteration accounting ([] for baselines)."""
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, every parameter's accumulated gradient before clipping (if kept), on the
    device (cloned there, so a profiled step has no copy traffic)."""
    final_state: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameters after the last step (CPU copies)."""


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for the duration of a run (restored afterwards)."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def prepare_model(spec: ModelSpec, run: RunSpec, device: torch.device) -> HybridModel:
    """Build from the run's seed and move to the device and compute dtype."""
    model = build_model(spec, torch.Generator().manual_seed(run.seed))
    return model.to(device=device, dtype=DTYPES[run.precision])


class _Optimizer:
    """The optimizer over fp32 weights: the model's own (fp32) or master copies (bf16)."""

    def __init__(self, model: HybridModel, run: RunSpec) -> None:
        self.model_params = [p for p in model.parameters()]
        if run.precision == "bf16":
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
            torch.nn.utils.clip_grad_norm_(self.main, self.clip, foreach=False)
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
) -> TrainResult:
    """Train ``run.steps`` steps of ``spec`` with ``offloader``; see the module docstring."""
    device = torch.device(device)
    hooks = hooks or RunHooks()
    with deterministic(device):
        model = prepare_model(spec, run, device)
        optimizer = _Optimizer(model, run)
        data = make_batches(spec, seed=run.seed, steps=run.steps, microbatches=run.microbatches)
        data = data.to(device)
        losses = torch.zeros(run.steps, run.microbatches, device=device)
        order = schedule_order(run.schedule, run.microbatches)
        grads: list[dict[str, torch.Tensor]] = []
        for step in range(run.steps):
            context = hooks.step_context(step) if hooks.step_context else contextlib.nullcontext()
            with context:
                _run_step(model, offloader, data[step], losses[step], order, run, step, hooks)
                if keep_grads:
                    grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
                optimizer.step()
        state = (
            {n: p.detach().cpu() for n, p in model.named_parameters()} if keep_final_state else {}
        )
        return TrainResult(
            losses=losses.cpu(), logs=offloader.iteration_logs(), grads=grads, final_state=state
        )


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
    pending: dict[int, torch.Tensor] = {}
    for kind, mb in order:
        if kind == "F":
            offloader.begin_microbatch(mb)
            tokens = batches[mb]
            loss = loss_fn(model(tokens[:, :-1], offloader), tokens[:, 1:])
            losses[mb].copy_(loss.detach())
            pending[mb] = loss
            if hooks.after_forward is not None:
                hooks.after_forward(step, mb)
        else:
            (pending.pop(mb) / run.microbatches).backward()
    offloader.end_iteration()
