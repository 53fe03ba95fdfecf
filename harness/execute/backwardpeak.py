"""The memory case's backward reading - CUDA only: ``torch.cuda.memory_allocated`` at every group
occurrence's backward start and end of the final step, baseline against offload run, and the
drop the prediction expects at each of those points (``harness.execute.memory`` runs it).

Why at the group boundaries: an offloader that reloads every group at the start of backward
brings the peak back to the baseline's while the memory after the last forward still drops as
predicted; the drop *during* backward is what shows it. At each boundary the offload run holds,
per offloaded group occurrence of a pass whose forward is done and whose own backward has not
started, the storages its offload freed less (still on the host) or, once the cadence rule
(``harness.execute.cadence``) has reloaded it ahead of its backward, its reloads instead of them.
The allocator's blocks are the requests rounded up to 512 B, so the prediction rounds each storage
and each reload the same way and the reading is exact to the byte. Groups that nest (attn_norm
and mlp_norm span other groups) are reloaded at moments the marks do not bound; a row
selecting them is read and reported but not predicted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.execute.cadence import END, START, Event, allowed_for
from harness.execute.predict import Expected, reload_sizes
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Group, Offloader, Output, Wrapper
from harness.offload.recorder import GroupObservation
from harness.offload.semantics import GroupKey, Semantics

NESTING = frozenset({"attn_norm", "mlp_norm"})
"""Group names whose window spans other groups' windows."""

Sample = tuple[str, GroupKey, int]
"""(``start`` or ``end``, group occurrence, ``memory_allocated`` there)."""


def block(nbytes: int) -> int:
    """The caching allocator's block for a request of ``nbytes`` (multiples of 512 B)."""
    return max(512, -(-nbytes // 512) * 512) if nbytes else 0


class BackwardSampler(Wrapper):
    """``inner`` with ``memory_allocated`` read at each group occurrence's backward start (a hook
    on its output) and end (on its input) while ``armed``; nothing else changes."""

    def __init__(self, inner: Offloader, device: torch.device) -> None:
        super().__init__(inner)
        self.device = device
        self.armed = False
        self.samples: list[Sample] = []
        self._microbatch = 0

    def begin_microbatch(self, microbatch: int) -> None:
        self._microbatch = microbatch
        self.inner.begin_microbatch(microbatch)

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        key = (self._microbatch, layer, name)
        inner = self.inner.group(name, x, layer=layer)
        self._hook(inner.input, END, key)
        return _Sampled(inner, self, key)

    def _hook(self, tensor: Any, kind: str, key: GroupKey) -> None:
        if not (self.armed and isinstance(tensor, torch.Tensor) and tensor.requires_grad):
            return

        def read(grad: torch.Tensor) -> None:
            self.samples.append((kind, key, torch.cuda.memory_allocated(self.device)))

        tensor.register_hook(read)


class _Sampled:
    def __init__(self, inner: Group, owner: BackwardSampler, key: GroupKey) -> None:
        self.inner, self.owner, self.key = inner, owner, key

    @property
    def input(self) -> torch.Tensor:
        return self.inner.input

    def __enter__(self) -> _Sampled:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        out = self.inner.commit(output, release)
        first = out[0] if isinstance(out, tuple | list) and out else out
        self.owner._hook(first, START, self.key)
        return out


@dataclass(kw_only=True)
class BackwardReading:
    """The final step's backward, baseline against offload run, at the group boundaries."""

    baseline: list[Sample]
    offload: list[Sample]
    predicted: list[int] | None
    """The drop (bytes) predicted at each boundary; None: not predicted (nesting groups)."""
    why_not: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def baseline_peak(self) -> int:
        return max((s[2] for s in self.baseline), default=0)

    @property
    def offload_peak(self) -> int:
        return max((s[2] for s in self.offload), default=0)

    @property
    def predicted_peak(self) -> int | None:
        if self.predicted is None:
            return None
        return max(
            (s[2] - d for s, d in zip(self.baseline, self.predicted, strict=True)), default=0
        )

    def record(self) -> dict[str, Any]:
        return {
            "boundaries": len(self.offload),
            "baseline_peak": self.baseline_peak,
            "offload_peak": self.offload_peak,
            "predicted_peak": self.predicted_peak,
            "not_predicted": self.why_not or None,
        }


def predicted_drops(
    samples: Sequence[Sample],
    observations: Sequence[GroupObservation],
    steady: Mapping[GroupKey, Expected],
    order: Sequence[tuple[str, int]],
    config: OffloadConfig,
    semantics: Semantics,
) -> list[int]:
    """The drop at each boundary of ``samples`` (see the module docstring)."""
    events = [Event(kind=kind, key=key) for kind, key, _ in samples]
    names = set(config.selected)
    offloaded = [
        (o.microbatch, o.layer, o.name)
        for o in observations
        if o.name in names and steady[(o.microbatch, o.layer, o.name)].offloaded
    ]
    passes: dict[int, list[GroupKey]] = {}
    for key in offloaded:
        passes.setdefault(key[0], []).append(key)
    allowed = allowed_for(events, passes, order, semantics)
    by_key = {(o.microbatch, o.layer, o.name): o for o in observations}
    freed = {k: _freed_storages(by_key[k], steady[k]) for k in offloaded}
    back = {k: sum(block(n) for n in reload_sizes(by_key[k], config, semantics)) for k in offloaded}
    starts = {e.key: i for i, e in reversed(list(enumerate(events))) if e.kind == START}
    drops = []
    for index, (_, current, _) in enumerate(samples):
        at = order.index(("B", current[0]))
        storages: dict[tuple[int, int], int] = {}  # a storage two groups free counts once
        drop = 0
        for key in offloaded:
            if order.index(("F", key[0])) > at or starts.get(key, len(events)) < index:
                continue  # not yet forwarded, or its backward already ran
            storages.update(freed[key])
            limit = allowed.get(key)
            if limit is not None and limit < index and starts.get(key, -1) > limit:
                drop -= back[key]  # reloaded ahead: its reloads hold device memory again
        drops.append(drop + sum(block(n) for n in storages.values()))
    return drops


def _freed_storages(obs: GroupObservation, expected: Expected) -> dict[tuple[int, int], int]:
    """(pass, storage id) -> bytes of each storage the group's offload frees."""
    return {
        (obs.microbatch, info.storage_id): info.storage_nbytes
        for info in (*obs.saved, *obs.released)
        if info.storage_id in expected.freed_storages
    }


def backward_problems(reading: BackwardReading) -> list[str]:
    """Each boundary where the offload run's drop against the baseline is not the predicted
    one (the first six), naming the group occurrence and both figures."""
    if reading.predicted is None:
        return []
    base, off = reading.baseline, reading.offload
    if [s[:2] for s in base] != [s[:2] for s in off]:
        return ["the baseline's and the offload run's backward group boundaries differ"]
    problems = []
    for (kind, key, b), (_, _, o), drop in zip(base, off, reading.predicted, strict=True):
        if b - o != drop:
            mb, layer, name = key
            problems.append(
                f"backward {kind} of {name} (microbatch {mb}, layer {layer}): memory_allocated "
                f"{o} B against the baseline's {b} B, a drop of {b - o} B, predicted {drop} B"
            )
    if problems:
        head = (
            f"during backward (final step) the offload run peaked at {reading.offload_peak} B at "
            f"the group boundaries, predicted {reading.predicted_peak} B (baseline "
            f"{reading.baseline_peak} B); {len(problems)} boundaries differ:"
        )
        return [head, *problems[:6]]
    return []
