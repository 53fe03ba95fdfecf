"""How a harness offloader meets megatron-core's modules: the layer tracker naming each group
occurrence's layer, the ``Bridge`` standing in for megatron-core's offloading interface (any
harness offloader but megatron-core's own), and the wiring of a run by mode (``plain``,
``native``: megatron-core's own manager watched by ``McoreOffloader``, ``bridge``)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch

from harness.measure.observe import Windowed
from harness.models.mcore.build import model_layers
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import Offloader, Wrapper

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


class LayerTracker:
    """Which layer is running its forward (multi-token-prediction layers numbered after the
    decoder's): a forward pre-hook on every layer, or with ``hooks=False`` a wrapper of each
    layer's ``forward`` (megatron-core refuses to capture a CUDA graph of a module with
    pre-forward hooks)."""

    def __init__(self, model: Any, *, hooks: bool = True) -> None:
        self.layer = -1
        self._handles: list[Any] = []
        self._wrapped: list[Any] = []
        for index, layer in enumerate(model_layers(model)):
            if hooks:
                self._handles.append(layer.register_forward_pre_hook(self._hook(index)))
            else:
                layer.forward = self._wrap(index, layer.forward)
                self._wrapped.append(layer)

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self.layer = index

        return hook

    def _wrap(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.layer = index
            return forward(*args, **kwargs)

        return tracked

    def __call__(self) -> int:
        return self.layer

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for layer in self._wrapped:
            del layer.forward  # the class's forward again


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
