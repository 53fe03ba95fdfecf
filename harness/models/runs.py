"""What a training run takes besides its specs and what it produces, and the call signature of
a model implementation's training function (``Trainer``): shared by the runner for our models
(``harness.models.train``) and the one for megatron-core's (``harness.models.mcore``), so neither
imports the other for them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from harness.offload.protocol import IterationLog, Offloader
from harness.vocab.spec import ModelSpec, RunSpec


@dataclass(kw_only=True)
class RunHooks:
    """Optional callbacks into a run (for profiling and memory cases)."""

    step_context: Callable[[int], contextlib.AbstractContextManager[object]] | None = None
    """Context manager wrapped around each whole step (e.g. a profiler for the last one)."""
    compute_context: Callable[[int], contextlib.AbstractContextManager[object]] | None = None
    """Context manager wrapped around a step's microbatches only - their forwards, backwards
    and the iteration's end, every call into the offloader - inside ``step_context``; the
    runner's own bookkeeping after them (gradient copies, the optimizer step) is outside it."""
    after_forward: Callable[[int, int], None] | None = None
    """Called with (step, microbatch) right after each forward."""
    model_ready: Callable[[Any], None] | None = None
    """Called with the model once it is built, before any forward (the copy observer learns
    its parameters' storages)."""


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


class Refused(ValueError):
    """The model's own library refuses the case's configuration before any training (e.g.
    megatron-core's ``TransformerConfig`` rejecting a knob with offloading), or the installed
    torch lacks what the configuration needs (TransformerEngine's CUDA graphs of megatron-core's
    layers). Every check of the case is then a skip whose reason says which: a finding about the
    library or the environment, not a failure of the offloader under test."""


class Trainer(Protocol):
    """A model implementation's training function (``harness.vocab.impls.ModelImpl.trainer`` names
    it): ``harness.models.train.train_harness`` for ours, ``harness.models.mcore.train`` for
    megatron-core's. ``harness.models.train.train`` checks the sharding, resolves the device and the
    hooks and calls it under deterministic kernels; it trains ``run.steps`` steps of ``spec``
    with ``offloader`` on ``device``, calling ``hooks``, keeping each step's gradients and the
    final parameters when asked, under ``sharding`` (one of the implementation's)."""

    def __call__(
        self,
        spec: ModelSpec,
        run: RunSpec,
        offloader: Offloader,
        device: torch.device,
        *,
        hooks: RunHooks,
        keep_grads: bool,
        keep_final_state: bool,
        sharding: str,
    ) -> TrainResult: ...
