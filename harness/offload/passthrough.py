"""The ``none`` backend (the plain baseline) and the pass-through group every backend returns for
unselected names: no autograd ops, no hooks, no copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.protocol import Capabilities, IterationLog, Output


class PassThroughGroup:
    """A group that does nothing: ``input`` is the start tensor itself, commit returns output."""

    __slots__ = ("input",)

    def __init__(self, x: torch.Tensor) -> None:
        self.input = x

    def __enter__(self) -> PassThroughGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        return output


class NoOffload:
    """Backend ``none``: the model runs exactly as without any offload machinery."""

    name = "none"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="plain baseline: no offload machinery"
    )

    def __init__(self, config: OffloadConfig | None = None, device: Any = None) -> None:
        self.config = config

    def begin_microbatch(self, microbatch: int) -> None:
        return None

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> PassThroughGroup:
        return PassThroughGroup(x)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        return None

    def end_iteration(self) -> None:
        return None

    def set_enabled(self, enabled: bool) -> None:
        return None

    def iteration_logs(self) -> list[IterationLog]:
        return []

    def close(self) -> None:
        return None


def apply_to_first(output: Output, fn: Callable[..., torch.Tensor], *args: Any) -> Output:
    """Apply ``fn`` (with ``args`` after the tensor) to ``output`` or to element 0 of a
    tuple/list output, keeping its structure (Megatron's commit only passes element 0 through
    the identity op)."""
    if isinstance(output, torch.Tensor):
        return fn(output, *args)  # type: ignore[return-value]
    if isinstance(output, tuple | list):
        if not output:
            return output
        first = fn(output[0], *args)
        return type(output)([first, *output[1:]])  # type: ignore[return-value]
    raise TypeError(f"group commit expects a tensor or a tuple/list of tensors, got {type(output)}")
