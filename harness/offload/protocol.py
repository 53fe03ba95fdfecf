"""What an offloader backend implements, and the accounting records it may report.

Model code drives an offloader at group boundaries, the way Megatron-Core's layers drive its
fine-grained offloading interface:

    group = off.group("core_attn", query, layer=i)   # start: query passes an identity op
    with group:                                       # saved-tensor hooks live only here
        out = core_attention(group.input, key, value)
    out = group.commit(out, release=(query, key, value))   # commit: identity op on out

The training runner brackets microbatches and iterations:

    off.begin_microbatch(m)   # before the forward of microbatch m (one "chunk")
    ...forward/backward of every microbatch, in the schedule's order...
    off.end_iteration()       # after the optimizer step (Megatron's reset); the first one that
                              # saw groups ends the warmup iteration

Under the ``interleaved`` schedule the model runs in model chunks (virtual pipeline stages):
each chunk's forward of a microbatch is a pass of its own, and ``begin_microbatch`` gets the
pass id ``microbatch * chunks + chunk`` (``harness.models.train.pass_of``), so an offloader keyed by
microbatch sees one forward and one backward per id as always.

Two members are optional: ``plan(occurrences)``, told the selected group occurrences of a
microbatch's forward before training where the runner knows them (``plan_of``); and
``model_chunk(chunk, chunks)``, called just before ``begin_microbatch`` of every pass of a
schedule with model chunks, for an offloader that keys its state by virtual stage as
Megatron-Core's does (``model_chunk_of``).

A backend is a factory ``(config, device) -> Offloader``; see ``harness.offload.backends``. What
the harness needs to know about a factory besides that (its copy rules, whether it takes race
delays, where it cannot run, its description) it declares in one ``Capabilities`` record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

Output = TypeVar("Output")
F = TypeVar("F", bound=Callable[..., Any])


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a possibly sharded tensor: a DTensor's local shard (the object it
    holds, so a weak reference to it lives as long as the DTensor), else ``tensor`` itself.

    A DTensor has no storage of its own (``untyped_storage().data_ptr()`` raises), yet models
    mark sharded parameters not-offloadable (Megatron-FSDP's ``fully_shard``): an offloader
    keeps such a mark by its shard's storage."""
    return getattr(tensor, "_local_tensor", tensor)


@runtime_checkable
class Group(Protocol):
    """One group occurrence (one name, one layer, one microbatch)."""

    input: torch.Tensor
    """The start tensor after the start identity op; the group's module must consume this."""

    def __enter__(self) -> Group: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        """Pass ``output`` (a tensor, or element 0 of a tuple/list) through the commit identity
        op, start the group's D2H if policy says so, and free ``release`` tensors' storage if the
        group was offloaded."""
        ...


@runtime_checkable
class Offloader(Protocol):
    """An activation offloader as the harness drives it."""

    name: str
    """Backend name for reports (``reference``, ``none``, ``mcore``, ``broken.stale_pool`` ...)."""

    def begin_microbatch(self, microbatch: int) -> None:
        """The forward of ``microbatch`` is about to start (Megatron: init_chunk_handler)."""
        ...

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        """Open group ``name`` of ``layer`` on input ``x``. Unselected names and a disabled
        offloader return a pass-through group."""
        ...

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        """Never offload these tensors (or any tensor sharing their storage)."""
        ...

    def end_iteration(self) -> None:
        """End of an optimizer step: reset per-iteration state (Megatron's reset)."""
        ...

    def set_enabled(self, enabled: bool) -> None:
        """Turn the offloader off (no hooks, groups or copies) or back on."""
        ...

    def iteration_logs(self) -> list[IterationLog]:
        """Accounting of every finished iteration, oldest first ([] if the backend keeps none)."""
        ...

    def close(self) -> None:
        """Release streams, pinned memory and hooks; the object is unusable afterwards."""
        ...


class Wrapper:
    """An ``Offloader`` around another one: every call goes to ``inner`` unchanged; a wrapper
    (``harness.diagnose.bisect.RoutedOffloader``, ``harness.measure.syncguard.GuardedOffloader``)
    overrides the calls it changes."""

    def __init__(self, inner: Offloader, name: str | None = None) -> None:
        self.inner = inner
        self.name = inner.name if name is None else name

    def begin_microbatch(self, microbatch: int) -> None:
        self.inner.begin_microbatch(microbatch)

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        return self.inner.group(name, x, layer=layer)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        self.inner.mark_not_offloadable(*tensors)

    def end_iteration(self) -> None:
        self.inner.end_iteration()

    def set_enabled(self, enabled: bool) -> None:
        self.inner.set_enabled(enabled)

    def iteration_logs(self) -> list[IterationLog]:
        return self.inner.iteration_logs()

    def close(self) -> None:
        self.inner.close()

    def plan(self, occurrences: Sequence[tuple[int, str]]) -> None:
        plan_of(self.inner, occurrences)

    def model_chunk(self, chunk: int, chunks: int) -> None:
        model_chunk_of(self.inner, chunk, chunks)


def model_chunk_of(offloader: object, chunk: int, chunks: int) -> None:
    """Tell ``offloader`` that the next pass (``begin_microbatch``) runs model chunk ``chunk``
    of ``chunks``, if it takes that (the optional member ``model_chunk``). The runner calls it
    under schedules with model chunks only; an offloader keyed by pass needs nothing more."""
    model_chunk = getattr(offloader, "model_chunk", None)
    if callable(model_chunk):
        model_chunk(chunk, chunks)


def plan_of(offloader: object, occurrences: Sequence[tuple[int, str]]) -> None:
    """Tell ``offloader`` the selected group occurrences of one microbatch's forward, as
    ``(layer, name)`` in forward order, if it takes them (the optional member ``plan``: an
    offloader that must know its layer count before the first forward, as TransformerEngine's
    does, implements it). The case runner calls it before training with what the ``hooks``
    baseline recorded; an offloader must still work when nobody calls it."""
    plan = getattr(offloader, "plan", None)
    if callable(plan):
        plan(occurrences)


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What a backend factory declares about itself, as its ``capabilities`` attribute (a class
    attribute, or ``@declare(...)`` on a function); ``harness.offload.backends.capabilities``
    reads it. A factory without one gets ``Capabilities()``; a subclass inherits its base's."""

    description: str = ""
    """One line for ``offload-harness backends``."""
    semantics: Any = None
    """Its version-dependent copy rules for the prediction, a
    ``harness.offload.semantics.Semantics`` (typed Any: that module depends on this one), or a
    function returning one that ``harness.offload.backends.capabilities`` calls when asked (the
    ``mcore`` backend reads the installed megatron-core's); None: Megatron-Core main's."""
    race_delays: bool = False
    host_pool: bool = False
    """It keeps its host buffers in a pool filled in the warmup: host memory new to its copies in
    a later step is a ``leaks`` failure (``harness.verify.checks.footprint_problems``). A backend
    whose iteration log reports pool buffers (``IterationLog.pool_allocated``) is held to it
    too."""
    host_bound: float | None = None
    """The most host memory it holds per byte it has in flight, at its final step's peak
    (``harness.measure.footprint``), from step 2 on (the first steady step may still hold the
    warmup's buffers): above it is a ``leaks`` failure; None: reported only."""
    """It takes a ``delays=`` keyword (``harness.offload.reference.RaceDelays``), so
    ``<backend>+delays`` applies to it."""
    unavailable: Callable[[torch.device], str | None] | None = None
    """Why it cannot run on a device (the call returns None where it can); None: runs anywhere."""


def declare(base: Capabilities | None = None, /, **fields: Any) -> Callable[[F], F]:
    """Decorator setting a factory's ``capabilities``: ``base`` (default ``Capabilities()``) with
    ``fields`` replaced, e.g. ``@declare(description="...", race_delays=True)``."""
    record = dataclasses.replace(base or Capabilities(), **fields)

    def mark(factory: F) -> F:
        factory.capabilities = record  # type: ignore[attr-defined]
        return factory

    return mark


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupRecord:
    """What happened to one group occurrence in one iteration."""

    microbatch: int
    layer: int
    name: str
    decision: str
    """``offloaded`` or ``kept:<policy>`` (margin, last_of_name, delta, fraction)."""
    tracked: int
    """Tensors the saved-tensor hook took into the group."""
    d2h_copies: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    released: int = 0
    """Tensors whose storage was freed by the commit's forced release."""
    pool_hits: int = 0
    pool_misses: int = 0

    @property
    def key(self) -> tuple[int, int, str]:
        """(microbatch, layer, name): the identity of a group occurrence within an iteration."""
        return (self.microbatch, self.layer, self.name)


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationLog:
    """Accounting of one iteration (forward + backward of every microbatch)."""

    iteration: int
    warmup: bool
    groups: tuple[GroupRecord, ...]
    leaked_tensors: int = 0
    """Tracked tensors never unpacked by backward (non-zero is a leak)."""
    pool_in_use: int = 0
    """Pinned pool buffers still handed out at the end of the iteration (non-zero is a leak)."""
    pool_allocated: int = 0
    """Pinned pool buffers allocated so far (stops growing after the warmup)."""
    pool_exhausted: int = 0
    """Requests a capped pinned pool could not serve so far (``pinned_pool_buffers``), each
    handled with a buffer outside the pool."""
    summary_bytes: dict[str, int] = field(default_factory=dict)
    """Post-warmup summary, per name (only on the warmup iteration's log)."""

    @property
    def d2h_bytes(self) -> int:
        return sum(g.d2h_bytes for g in self.groups)

    @property
    def h2d_bytes(self) -> int:
        return sum(g.h2d_bytes for g in self.groups)
