"""The variants the bench compares and their backend factories, among them the simple peer
``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around each selected
group (same selection; no side stream, no prefetch, no skip rules), with a per-group byte log."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from harness.offload.backends import Factory, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import GroupRecord, IterationLog, Output

VARIANTS = ("baseline", "reference", "mcore", "save_on_cpu")


class _SaveOnCpuGroup:
    """A selected group whose saved tensors go through ``save_on_cpu(pin_memory=True)``."""

    def __init__(self, owner: SaveOnCpu, x: torch.Tensor, counts: dict[str, int]) -> None:
        self.input = x
        self._hooks = torch.autograd.graph.save_on_cpu(pin_memory=owner.cuda)
        pack, unpack = self._hooks.pack_hook, self._hooks.unpack_hook

        def counted_pack(tensor: torch.Tensor) -> Any:
            packed = pack(tensor)
            counts["d2h_copies"] += 1
            counts["d2h_bytes"] += packed[1].numel() * packed[1].element_size()
            return packed

        def counted_unpack(packed: Any) -> torch.Tensor:
            counts["h2d_copies"] += 1
            counts["h2d_bytes"] += packed[1].numel() * packed[1].element_size()
            return unpack(packed)

        self._hooks.pack_hook, self._hooks.unpack_hook = counted_pack, counted_unpack

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
        return output  # save_on_cpu frees nothing early: autograd holds only the host copies


class SaveOnCpu:
    """Backend-shaped peer: ``save_on_cpu`` around each selected group, per-group byte log."""

    name = "save_on_cpu"

    def __init__(self, config: OffloadConfig, device: torch.device) -> None:
        self.selected = frozenset(config.offload_modules)
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = True
        self._microbatch = 0
        self._counts: dict[tuple[int, int, str], dict[str, int]] = {}
        self._logs: list[IterationLog] = []

    def begin_microbatch(self, microbatch: int) -> None:
        self._microbatch = microbatch

    def group(
        self, name: str, x: torch.Tensor, *, layer: int
    ) -> _SaveOnCpuGroup | PassThroughGroup:
        if not self.enabled or name not in self.selected or not torch.is_grad_enabled():
            return PassThroughGroup(x)
        zero = dict.fromkeys(("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes"), 0)
        counts = self._counts.setdefault((self._microbatch, layer, name), zero)
        return _SaveOnCpuGroup(self, x, counts)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        return None  # save_on_cpu has no skip list: parameters saved in a group are copied too

    def end_iteration(self) -> None:
        records = tuple(
            GroupRecord(
                microbatch=mb,
                layer=layer,
                name=name,
                decision="offloaded",
                tracked=c["d2h_copies"],
                **c,
            )
            for (mb, layer, name), c in self._counts.items()
        )
        self._logs.append(IterationLog(iteration=len(self._logs), warmup=False, groups=records))
        self._counts = {}

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = bool(enabled)

    def iteration_logs(self) -> list[IterationLog]:
        return list(self._logs)

    def close(self) -> None:
        self._counts = {}


def factories() -> dict[str, Factory | str]:
    """Each variant's backend factory, or why it cannot run (``not installed``)."""
    out: dict[str, Factory | str] = {"baseline": NoOffload, "save_on_cpu": SaveOnCpu}
    for name in ("reference", "mcore"):
        try:
            out[name] = resolve_backend(name)
        except ValueError:
            out[name] = "not installed"
    return {v: out[v] for v in VARIANTS}
