"""The variants the bench compares and their backend factories, among them the simple peer
``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around each selected
group (same selection; no side stream, no prefetch, no skip rules), with a per-group byte log."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from harness.offload import adapters
from harness.offload.backends import Factory, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import Capabilities, GroupRecord, IterationLog

VARIANTS = ("baseline", "reference", "mcore", "save_on_cpu")


def _counted_save_on_cpu(pin_memory: bool, counts: dict[str, int]) -> Any:
    """``save_on_cpu(pin_memory=...)`` whose hooks add each copy's bytes to ``counts``."""
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def counted_pack(tensor: torch.Tensor) -> Any:
        packed = pack(tensor)
        counts["d2h_copies"] += 1
        counts["d2h_bytes"] += packed[1].numel() * packed[1].element_size()
        return packed

    def counted_unpack(packed: Any) -> torch.Tensor:
        counts["h2d_copies"] += 1
        counts["h2d_bytes"] += packed[1].numel() * packed[1].element_size()
        return unpack(packed)

    hooks.pack_hook, hooks.unpack_hook = counted_pack, counted_unpack
    return hooks


class SaveOnCpu(adapters.SaveOnCpu):
    """Backend-shaped peer: the ``save-on-cpu`` adapter (pinned only on CUDA) with a per-group
    byte log. ``save_on_cpu`` frees nothing early: autograd holds only the host copies."""

    name = "save_on_cpu"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="the bench's save_on_cpu peer, pinned on CUDA only (not a registered backend)"
    )

    def __init__(self, config: OffloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.cuda = torch.device(device).type == "cuda"
        self._microbatch = 0
        self._counts: dict[tuple[int, int, str], dict[str, int]] = {}
        self._logs: list[IterationLog] = []

    def begin_microbatch(self, microbatch: int) -> None:
        self._microbatch = microbatch

    def group(
        self, name: str, x: torch.Tensor, *, layer: int
    ) -> adapters.ContextGroup | PassThroughGroup:
        if not self.selects(name):
            return PassThroughGroup(x)
        zero = dict.fromkeys(("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes"), 0)
        counts = self._counts.setdefault((self._microbatch, layer, name), zero)
        return adapters.ContextGroup(x, _counted_save_on_cpu(self.cuda, counts))

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
