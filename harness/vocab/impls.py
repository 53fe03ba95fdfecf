"""Who builds and trains a case's model: one registry of model implementations.

A ``Case`` (and its ``ModelSpec``) names an implementation by ``impl``; everything that differs
between implementations - which schedules and shardings they run, whether the host-sync guard
applies, their default backend, why they cannot run on this machine, the function that trains
them - is declared here, so no other module tests for a particular implementation by name.

Adding an implementation is one entry here plus its module, whose ``train`` function is a
``harness.models.runs.Trainer`` (the call signature it shares with
``harness.models.train.train_harness``).
Data only: importing this module imports no torch; the ``module:function`` paths are imported
when used (so the field holds a path, and ``harness.models.train.train`` annotates what it imports).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelImpl:
    """One model implementation and what it can run."""

    name: str
    models: str
    """``--models`` value that selects its rows: ``harness`` (ours) or ``mcore``."""
    description: str
    trainer: str
    """``module:function`` of its ``harness.models.runs.Trainer``, the function training one run
    (``harness.models.train.train`` dispatches to it). A path, not the function: this table imports
    no torch, and it is below ``harness.models.runs`` in the layers
    (``tests/unit/test_layers.py``)."""
    schedules: tuple[str, ...]
    shardings: tuple[str, ...]
    eval_first: bool
    """Can run an evaluation pass before the first step (``Case.eval_first``)."""
    gpt_layers: bool = False
    """Its layers are (attention, MLP) pairs of the pattern (``harness.vocab.spec.gpt_layers``)."""
    sync_guard: str | None = None
    """None when the host-sync check guards it; else why it does not apply."""
    knobs: bool = False
    """Takes megatron-core's recompute and CUDA-graph settings (``ModelSpec.recompute``,
    ``ModelSpec.cuda_graph``)."""
    mtp: bool = False
    """Builds multi-token-prediction layers (``ModelSpec.mtp``)."""
    default_backend: str = "reference"
    """The backend its rows run when none is named."""
    availability: str | None = None
    """``module:function`` ``(device) -> str | None``: why it cannot run here (None: it can);
    None when it runs wherever torch does."""

    @property
    def ours(self) -> bool:
        """Whether it is the harness's own models (``harness.models``), not a framework's."""
        return self is _IMPLS[0]

    @property
    def case_prefix(self) -> str:
        """What its rows' case ids start with: nothing for ours, ``<name>-`` for the others."""
        return "" if self.ours else f"{self.name}-"

    def train_function(self) -> Callable[..., Any]:
        """Its ``harness.models.runs.Trainer`` (imported now)."""
        module, _, name = self.trainer.partition(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]

    def unavailable_reason(self, device: Any) -> str | None:
        """Why this implementation cannot run on ``device`` here, or None."""
        if self.availability is None:
            return None
        module, _, name = self.availability.partition(":")
        return getattr(importlib.import_module(module), name)(device)  # type: ignore[no-any-return]

    def refuse(self, *, schedule: str, sharding: str, eval_first: bool) -> str | None:
        """Why a case of these settings cannot run on this implementation, or None."""
        if schedule not in self.schedules:
            return (
                f"impl {self.name!r} runs schedule {' or '.join(self.schedules)}, not {schedule!r}"
            )
        if sharding not in self.shardings:
            return (
                f"impl {self.name!r} runs sharding {' or '.join(self.shardings)}, not {sharding!r}"
            )
        if eval_first and not self.eval_first:
            return f"impl {self.name!r} runs no evaluation pass before the first step"
        return None


_MCORE_SYNC = (
    "not guarded on megatron-core's models: their own modules drive megatron-core's offloader, "
    "not the harness protocol the guard wraps (it is guarded on ours)"
)
_IMPLS = (
    ModelImpl(
        name="harness",
        models="harness",
        description="ours: harness.models in plain PyTorch, trained by harness.models.train",
        trainer="harness.models.train:train_harness",
        schedules=("sequential", "gpipe", "1f1b", "interleaved"),
        shardings=("none", "zero3"),
        eval_first=True,
    ),
    ModelImpl(
        name="mcore",
        models="mcore",
        description="megatron-core's HybridModel with TransformerEngine layers, its one-stage "
        "schedule, DDP and distributed optimizer or Megatron-FSDP",
        trainer="harness.models.mcore:train",
        schedules=("sequential",),
        shardings=("none", "mfsdp", "mfsdp2", "mfsdp-v2"),
        eval_first=False,
        knobs=True,
        mtp=True,
        sync_guard=_MCORE_SYNC,
        default_backend="mcore",
        availability="harness.models.mcore:unavailable_reason",
    ),
    ModelImpl(
        name="mcore-gpt",
        models="mcore",
        description="megatron-core's GPTModel with TransformerEngine layers (each layer one "
        "attention and one MLP/MoE symbol of the pattern), trained as mcore",
        trainer="harness.models.mcore:train",
        schedules=("sequential",),
        shardings=("none", "mfsdp", "mfsdp2", "mfsdp-v2"),
        eval_first=False,
        gpt_layers=True,
        knobs=True,
        sync_guard=_MCORE_SYNC,
        default_backend="mcore",
        availability="harness.models.mcore:unavailable_reason",
    ),
)
IMPLS: dict[str, ModelImpl] = {impl.name: impl for impl in _IMPLS}
"""Every model implementation by name."""


def models_impl(models: str) -> ModelImpl:
    """The first implementation of a ``--models`` value (custom cases of it build it)."""
    for impl in _IMPLS:
        if impl.models == models:
            return impl
    raise ValueError(f"no model implementation of models {models!r}")


def default_backend(models: str) -> str:
    """The backend when none is named: the first implementation's of ``models`` (``reference``
    for ours and for ``all``)."""
    if models not in {impl.models for impl in _IMPLS}:
        return "reference"
    return models_impl(models).default_backend


def impl_unavailable(impls: set[str] | list[str], device: Any) -> str | None:
    """The first reason one of these implementations cannot run on ``device``, or None."""
    for name in dict.fromkeys(impls):
        reason = IMPLS[name].unavailable_reason(device)
        if reason is not None:
            return reason
    return None
