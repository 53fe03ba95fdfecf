"""Offloaders nobody here wrote, as backends.

``save-on-cpu``: PyTorch's ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, entered when a
selected group's context is entered and left with it. It keeps no log, opens no profiler range
and knows nothing of Megatron's policies: the harness counts its copies through its own group
windows (``harness.observe``) and predicts them from the semantics declared here, which restate
what ``save_on_cpu`` does:

* every tensor autograd saves inside the group moves, parameters included (it has no skip rule);
* each is copied as itself: ``torch.empty(tensor.size())`` then ``copy_`` (a view is gathered);
* no size threshold, no warmup, margin or fraction: every selected group of every iteration;
* on CUDA the unpack copies back with ``.to(device)``; on a CPU device that ``.to`` is a no-op, so
  the reload hands out the host copy itself and a CPU run has no H2D.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.passthrough import PassThroughGroup
from harness.offload.protocol import Capabilities, IterationLog, Output
from harness.predict import Semantics

SAVE_ON_CPU = Semantics(
    view_copy="gather",
    skip="none",
    policies="every",
    size_threshold=False,
    host_reload=False,
    label="torch save_on_cpu's rules",
)


class _SaveOnCpuGroup:
    """One selected group occurrence: ``save_on_cpu`` lives exactly as long as the group."""

    def __init__(self, x: torch.Tensor) -> None:
        self.input = x
        self._hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)

    def __enter__(self) -> _SaveOnCpuGroup:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        return output


class SaveOnCpu:
    """Backend ``save-on-cpu``."""

    name = "save-on-cpu"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="torch.autograd.graph.save_on_cpu(pin_memory=True) around each selected group",
        semantics=SAVE_ON_CPU,
    )

    def __init__(self, config: OffloadConfig, device: Any = None) -> None:
        self.selected = frozenset(config.offload_modules)
        self.enabled = True

    def begin_microbatch(self, microbatch: int) -> None:
        return None

    def group(
        self, name: str, x: torch.Tensor, *, layer: int
    ) -> _SaveOnCpuGroup | PassThroughGroup:
        if self.enabled and name in self.selected:
            return _SaveOnCpuGroup(x)
        return PassThroughGroup(x)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        return None  # save_on_cpu has no such notion

    def end_iteration(self) -> None:
        return None

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def iteration_logs(self) -> list[IterationLog]:
        return []

    def close(self) -> None:
        return None
