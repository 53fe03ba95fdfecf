"""Backend ``hooks``: the offload machinery without the offload, recording what each group saves.

It opens the same groups as an offloader (identity start/commit autograd ops, saved-tensor hooks
inside each ``with`` block) but hands every saved tensor straight back, so it is the baseline that
separates "the hooks changed the graph" from "the transport corrupted data". What it records -
shape, strides, storage size, dtype of every saved tensor per group occurrence - is the input of
the independent transfer prediction (``harness.execute.predict``); it never looks at an offloader's
log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.passthrough import PassThroughGroup, apply_to_first
from harness.offload.protocol import Capabilities, IterationLog, Output, local_tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedInfo:
    """One tensor autograd saved inside a group, as seen by the pack hook."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    itemsize: int
    storage_nbytes: int
    storage_id: int
    """Identity of the storage within its microbatch's forward (all saved storages are alive
    then, so addresses cannot be reused between them)."""
    contiguous: bool
    on_device: bool
    """On the device the model runs on (an offloader only tracks those)."""
    parameter: bool
    """A ``Parameter`` object, or a tensor sharing a storage marked not-offloadable."""
    marked_itself: bool = False
    """The saved object itself is a ``Parameter`` or was itself marked not-offloadable (a view
    of a parameter, e.g. the ``W.t()`` a matmul saves, is not)."""

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupObservation:
    """One group occurrence: what its ``with`` block saved and what its commit released."""

    microbatch: int
    layer: int
    name: str
    saved: tuple[SavedInfo, ...]
    released: tuple[SavedInfo, ...]


class _Holder:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Identity(torch.autograd.Function):
    """An autograd node that passes its input on: a tensor of the node's own, so a hook or a
    module hangs on it alone, not on what else reads the input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _RecordingGroup:
    def __init__(self, owner: RecordingOffloader, key: tuple[int, int, str], x: torch.Tensor):
        self._owner = owner
        self._key = key
        self._saved: list[SavedInfo] = []
        self._hooks: Any = None
        self._index = len(owner.observations)
        owner.observations.append(None)  # filled at commit: observations stay in start order
        self.input = Identity.apply(x)

    def __enter__(self) -> _RecordingGroup:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)

    def _pack(self, tensor: torch.Tensor) -> _Holder:
        self._saved.append(self._owner.describe(tensor))
        return _Holder(tensor)

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        released = tuple(self._owner.describe(t) for t in release if t is not None)
        microbatch, layer, name = self._key
        self._owner.observations[self._index] = GroupObservation(
            microbatch=microbatch,
            layer=layer,
            name=name,
            saved=tuple(self._saved),
            released=released,
        )
        return apply_to_first(output, Identity.apply)


def _opted_out(tensor: torch.Tensor) -> bool:
    """The tensor object carries an offload opt-out attribute: megatron-core's
    ``_do_not_offload`` (its ``mark_not_offload``) or TransformerEngine's
    ``_TE_do_not_offload``, which megatron-core's checker honours too."""
    return bool(
        getattr(tensor, "_do_not_offload", False) or getattr(tensor, "_TE_do_not_offload", False)
    )


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor


class RecordingOffloader:
    """Backend ``hooks``: groups and hooks for the selected names, no copies, full records."""

    name = "hooks"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="machinery baseline: groups and saved-tensor hooks, moving nothing; records"
    )

    def __init__(self, config: OffloadConfig, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        self.enabled = True
        self.observations: list[GroupObservation | None] = []
        """Every group occurrence of the current iteration, in start order (None: not yet
        committed)."""
        self.iterations: list[list[GroupObservation]] = []
        """Observations of finished iterations."""
        self._microbatch: int | None = None
        self._storages: dict[int, int] = {}
        self._marked: dict[int, torch.Tensor] = {}

    def begin_microbatch(self, microbatch: int) -> None:
        self._microbatch = microbatch
        self._storages = {}

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Any:
        if (
            not self.enabled
            or self._microbatch is None
            or name not in self.config.selected
            or not torch.is_grad_enabled()
        ):
            return PassThroughGroup(x)
        return self._recording_group((self._microbatch, layer, name), x)

    def _recording_group(self, key: tuple[int, int, str], x: torch.Tensor) -> Any:
        """The group that records occurrence ``key`` (a subclass may return its own kind)."""
        return _RecordingGroup(self, key, x)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        for tensor in map(local_tensor, tensors):
            self._marked[tensor.untyped_storage().data_ptr()] = tensor

    def describe(self, tensor: torch.Tensor) -> SavedInfo:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        return SavedInfo(
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            itemsize=tensor.element_size(),
            storage_nbytes=storage.nbytes(),
            storage_id=self._storages.setdefault(ptr, len(self._storages)),
            contiguous=tensor.is_contiguous(),
            on_device=_same_device(tensor.device, self.device),
            parameter=isinstance(tensor, torch.nn.Parameter) or self._is_marked(ptr),
            marked_itself=isinstance(tensor, torch.nn.Parameter)
            or any(tensor is t for t in self._marked.values())
            or _opted_out(tensor),
        )

    def _is_marked(self, ptr: int) -> bool:
        """A mark counts while the marked storage still lives at ``ptr`` (FSDP2 frees unsharded
        parameters after each layer's forward; an activation may reuse the address)."""
        marked = self._marked.get(ptr)
        if marked is None:
            return False
        storage = marked.untyped_storage()
        if storage.data_ptr() == ptr and storage.nbytes():
            return True
        del self._marked[ptr]
        return False

    def end_iteration(self) -> None:
        if any(o is None for o in self.observations):
            raise RuntimeError("a group was opened but never committed in this iteration")
        self.iterations.append(self.observations)  # type: ignore[arg-type]
        self.observations = []
        self._microbatch = None

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = bool(enabled)

    def iteration_logs(self) -> list[IterationLog]:
        return []

    def close(self) -> None:
        self.observations = []
        self._marked.clear()


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
