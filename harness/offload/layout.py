"""The layout baseline: an offloader's layout change without its move.

An offloader whose reload hands back a fresh contiguous tensor (``Semantics(reload_layout=
"contiguous")``, e.g. ``torch.autograd.graph.save_on_cpu``) changes the strides backward sees for
every saved view. A bf16 kernel given a contiguous operand where it had a transposed one may take
another path and round differently, so such an offloader cannot equal the plain baseline bitwise
even when every byte it moves comes back intact. The layout baseline separates the two: it makes
the same copies the offloader makes - each saved tensor it would move becomes
``torch.empty(tensor.size())`` filled by ``copy_``, on the device, in the same group occurrences
- and moves nothing. The offload run must equal it bitwise; how far it lies from the plain
baseline is the layout change's effect, reported beside the verdict.

Which tensors and occurrences it copies comes from the declared rules
(``harness.offload.semantics``, the prediction's rules too): a tensor the declared skip rules
leave on the device is left alone, and so is every tensor of an occurrence the declared policies
keep (the caller's ``moves``, from the prediction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.protocol import Capabilities
from harness.offload.recorder import RecordingOffloader, _Holder, _RecordingGroup
from harness.offload.semantics import GroupKey, Semantics, skip_reason

Moves = Callable[[int, GroupKey], bool]
"""Whether the offloader moves group occurrence ``key`` in training step ``step``."""


class _LayoutGroup(_RecordingGroup):
    def __init__(
        self, owner: LayoutBaseline, key: GroupKey, x: torch.Tensor, *, copies: bool
    ) -> None:
        super().__init__(owner, key, x)
        self._copies = copies

    def _pack(self, tensor: torch.Tensor) -> _Holder:
        holder = super()._pack(tensor)
        owner: LayoutBaseline = self._owner  # type: ignore[assignment]
        if self._copies and skip_reason(self._saved[-1], owner.config, owner.semantics) is None:
            copy = torch.empty(tensor.size(), dtype=tensor.dtype, device=tensor.device)
            holder.tensor = copy.copy_(tensor)
        return holder


class LayoutBaseline(RecordingOffloader):
    """Backend-like baseline for ``reload_layout="contiguous"``: groups and saved-tensor hooks as
    the ``hooks`` baseline, and each tensor the offloader would move replaced by a contiguous copy
    on the device (see the module docstring)."""

    name = "layout"
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="layout baseline: an offloader's contiguous copies made on the device"
    )

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        semantics: Semantics,
        moves: Moves,
        *,
        eval_first: bool = False,
    ) -> None:
        super().__init__(config, device)
        self.semantics = semantics
        self.moves = moves
        self._first_step = int(eval_first)  # an eval pass is iteration 0 of the recorder

    def _recording_group(self, key: GroupKey, x: torch.Tensor) -> Any:
        step = len(self.iterations) - self._first_step
        return _LayoutGroup(self, key, x, copies=self.moves(step, key))
