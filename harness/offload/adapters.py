"""Offloaders nobody here wrote, as backends.

``save-on-cpu``: PyTorch's ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, entered when a
selected group's context is entered and left with it. It keeps no log, opens no profiler range
and knows nothing of Megatron's policies: the harness counts its copies through its own group
windows (``harness.measure.observe``) and predicts them from the semantics declared here, which
restate what ``save_on_cpu`` does:

* every tensor autograd saves inside the group moves, parameters included (it has no skip rule);
* each is copied as itself: ``torch.empty(tensor.size())`` then ``copy_`` (a view is gathered),
  and comes back as that contiguous copy, not with the saved view's strides;
* no size threshold, no warmup, margin or fraction: every selected group of every iteration;
* on CUDA the unpack copies back with ``.to(device)``; on a CPU device that ``.to`` is a no-op, so
  the reload hands out the host copy itself and a CPU run has no H2D.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.passthrough import PassThroughGroup, apply_to_first
from harness.offload.protocol import Capabilities, IterationLog, Output
from harness.offload.semantics import Semantics

SAVE_ON_CPU = Semantics(
    view_copy="gather",
    skip="none",
    policies="every",
    size_threshold=False,
    host_reload=False,
    reload_layout="contiguous",
    prefetch_depth=0,  # its unpack hook is the reload: never ahead of the group's backward
    label="torch save_on_cpu's rules",
)


class ContextGroup:
    """A selected group occurrence whose saved tensors ``context`` handles: the context (a
    ``saved_tensors_hooks`` or any context manager) is entered and left with the group, and
    ``commit`` passes the output through."""

    def __init__(self, x: torch.Tensor, context: Any) -> None:
        self.input, self.context = x, context

    def __enter__(self) -> ContextGroup:
        self.context.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.context.__exit__(exc_type, exc, tb)

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        return output


class _Adapter:
    """What the adapters share: the selection, enable/disable, no log, nothing to release."""

    def __init__(self, config: OffloadConfig, device: Any = None) -> None:
        self.config = config  # (megatron-core's models read the knobs from it)
        self.selected = frozenset(config.offload_modules)
        self.enabled = True

    def selects(self, name: str) -> bool:
        """Whether group ``name`` is offloaded now (a no-grad pass saves nothing)."""
        return self.enabled and name in self.selected and torch.is_grad_enabled()

    def begin_microbatch(self, microbatch: int) -> None:
        return None

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        return None

    def end_iteration(self) -> None:
        return None

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def iteration_logs(self) -> list[IterationLog]:
        return []

    def close(self) -> None:
        return None


class SaveOnCpu(_Adapter):
    """Backend ``save-on-cpu`` (it has no skip list: ``mark_not_offloadable`` does nothing)."""

    name = "save-on-cpu"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="torch.autograd.graph.save_on_cpu(pin_memory=True) around each selected group",
        semantics=SAVE_ON_CPU,
    )

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> ContextGroup | PassThroughGroup:
        if self.selects(name):  # save_on_cpu lives exactly as long as the group
            return ContextGroup(x, torch.autograd.graph.save_on_cpu(pin_memory=True))
        return PassThroughGroup(x)


# ------------------------------------------------------------------ TransformerEngine's offload
def _te_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "TransformerEngine's CPU offloading needs a CUDA device"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # not installed, or its extension does not load
        return f"transformer_engine.pytorch does not import ({type(exc).__name__}: {exc})"
    return None


class _TeGroup(ContextGroup):
    """One selected group occurrence as one of TransformerEngine's offload "layers": its
    context entered with the group, its synchronisation function on the group's output."""

    def __init__(self, x: torch.Tensor, context: Any, synchronize: Any) -> None:
        super().__init__(x, context)
        self.synchronize = synchronize

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        return apply_to_first(output, self.synchronize)


class TeCpuOffload(_Adapter):
    """Backend ``te``: TransformerEngine's ``get_cpu_offload_context``, each selected group
    occurrence of a microbatch's forward one of its "layers" (its context entered with the
    group, its synchronisation function applied to the group's output). It needs the number of
    layers up front and never offloads the last one: ``plan`` (called by the case runner with
    the occurrences the hooks baseline recorded) gives the count, ``num_layers = count - 1``;
    where nobody calls it, the first microbatch of the first iteration only counts them.
    ``NVTE_CPU_OFFLOAD_V1=1`` in the environment selects its older implementation.
    It declares no semantics: its policies (the last layer kept, the newer implementation's own
    size threshold of 2**20 elements) are learned from its copies like any undeclared
    offloader's (``harness.execute.learn``), and it is held to them in every step."""

    name = "te"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="TransformerEngine's get_cpu_offload_context, one selected group per layer",
        unavailable=_te_unavailable,
    )

    def __init__(self, config: OffloadConfig, device: Any = None) -> None:
        super().__init__(config, device)
        self.counted = 0
        self.layers: int | None = None
        self.context: Any = None
        self.synchronize: Any = None

    def plan(self, occurrences: Sequence[tuple[int, str]]) -> None:
        """The selected occurrences of a microbatch's forward, known before training: every
        one of them is a layer from the first microbatch on (no counting pass)."""
        if self.layers is None:
            self._build(sum(1 for _, name in occurrences if name in self.selected))

    def begin_microbatch(self, microbatch: int) -> None:
        if self.layers is None and self.counted:
            self._build(self.counted)

    def _build(self, layers: int) -> None:
        self.layers = layers
        if layers < 2:  # TransformerEngine keeps the last layer: nothing would move
            return
        from transformer_engine.pytorch import get_cpu_offload_context

        wanted = dict(
            enabled=True,
            num_layers=layers - 1,
            model_layers=layers,
            offload_activations=True,
            offload_weights=False,
        )
        accepted = inspect.signature(get_cpu_offload_context).parameters
        self.context, self.synchronize = get_cpu_offload_context(
            **{k: v for k, v in wanted.items() if k in accepted}
        )

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _TeGroup | PassThroughGroup:
        if not self.selects(name):  # (TE's synchronisation function also needs grad)
            return PassThroughGroup(x)
        if self.layers is None:
            self.counted += 1
            return PassThroughGroup(x)
        if self.context is None:
            return PassThroughGroup(x)
        return _TeGroup(x, self.context, self.synchronize)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        if self.context is None:
            return
        try:
            from transformer_engine.pytorch.cpu_offload import mark_is_weight
        except ImportError:  # an implementation without it skips Parameter objects only
            return
        mark_is_weight(*tensors)
