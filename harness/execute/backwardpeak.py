"""The memory case's backward reading - CUDA only: the bytes the live allocations requested at
every group occurrence's backward start and end of the final step, baseline against offload
run, and the drop the prediction expects at each of those points (``harness.execute.memory``
runs it).

Why at the group boundaries: an offloader that reloads every group at the start of backward
brings the peak back to the baseline's while the memory after the last forward still drops as
predicted; the drop *during* backward is what shows it. At each boundary the offload run holds,
per offloaded group occurrence of a pass whose forward is done and whose own backward has not
started, the storages its offload freed less (still on the host) or, once the cadence rule
(``harness.execute.cadence``, walked over the selected groups' marks as the cadence check walks
them) has reloaded it ahead of its backward, its reloads instead of them. The reading is the
allocator's requested bytes, not ``memory_allocated``: the block a request gets depends on the
cached blocks around (a block is not split when less than 1 MiB of it would remain), which
moved the two runs' ``memory_allocated`` apart by up to 3 MiB at a boundary on an H100, while
the requested bytes are the storages' sizes and the reading is exact to the byte. Groups that
nest (attn_norm and mlp_norm span other groups) are reloaded at moments the marks do not bound;
a row selecting them is read and reported but not predicted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.execute.cadence import END, START, Event, allowed_for
from harness.execute.predict import Expected, reload_sizes
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import apply_to_first
from harness.offload.protocol import Group, Offloader, Output, Wrapper
from harness.offload.recorder import GroupObservation, Identity
from harness.offload.semantics import GroupKey, Semantics

NESTING = frozenset({"attn_norm", "mlp_norm"})
"""Group names whose window spans other groups' windows."""

Sample = tuple[str, GroupKey, int]
"""(``start`` or ``end``, group occurrence, ``requested_bytes`` there)."""


def requested_bytes(device: torch.device) -> int:
    """The bytes the live allocations on ``device`` asked for (the caching allocator's
    ``requested_bytes`` stat), once the work queued so far has run.

    Requested bytes, not ``memory_allocated``: unaffected by the block a request gets (rounded
    up to 512 B, or a whole cached block left unsplit when less than 1 MiB of it would remain),
    which moved the two runs apart by up to 3 MiB at a boundary on an H100. After the queued
    work: a storage used on another stream than its own (``record_stream``: an offloaded
    activation until its D2H lands, a reload used on the compute stream) goes back to the
    allocator only when that stream has passed it, and the allocator looks at those events at
    its next allocation; read earlier, how much of it is back depends on how far the GPU lags
    the host (on the H100 an offload run read 243 MB higher at a boundary under load than
    alone). The host order of the offloader's calls is what the prediction follows, and
    synchronising at a mark changes none of it."""
    torch.cuda.synchronize(device)
    torch.empty(1, device=device)  # an allocation: the allocator frees what the events allow
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return int(stats["requested_bytes"]["all"]["current"])


def block(nbytes: int) -> int:
    """The caching allocator's block for a request of ``nbytes`` (multiples of 512 B)."""
    return max(512, -(-nbytes // 512) * 512) if nbytes else 0


class BackwardSampler(Wrapper):
    """``inner`` with the requested bytes (``requested_bytes``) read at each group occurrence's
    backward start and end while ``armed``; nothing else changes.

    The end is a hook on the group's input as the offloader hands it to the model: it runs when
    that input's gradient is complete, before the offloader's own node at the group's start (if
    it adds one) runs its backward. The start is the backward of an identity node of the
    sampler's own on the committed output, outside the offloader's commit node. The hook on a
    group's input and the start of the group before it would otherwise sit on one tensor where
    the offloader adds no node (the committed output is the next group's input: core_attn feeds
    attn_proj, expert_fc1 feeds moe_act) and fire in registration order - start first - but with
    the offloader's nodes between them in the other order. Through the node the order is the
    same in both runs: the later group's end, then the earlier group's start.

    The inner offloader gets the group's input through an identity node of the sampler's own as
    well, so the tensor the end hook waits on is used by the group alone in both runs. Where the
    model uses the input outside the group too (``*`` layers: ``x + attention(x)`` with
    qkv_linear's input ``x``), a hook on the input itself - the plain baseline's, which hands
    ``x`` through - fired only once the residual branch's gradient of ``x`` was summed with the
    group's, while a hook on the offloader's node output fired before that sum: the offload run
    held one [B, T, D] gradient more at every qkv_linear end (4 MiB in bf16, 8 MiB in fp32, on
    the H100 at afb5c10, all 27 rows selecting qkv_linear in ``*`` layers). Now both runs read
    there with the residual branch's gradient still apart."""

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
        if self._marks(x):
            x = Identity.apply(x)  # the group's input has no other consumer (class docstring)
        inner = self.inner.group(name, x, layer=layer)
        if self._marks(inner.input):
            inner.input.register_hook(lambda grad: self.read(END, key))
        return _Sampled(inner, self, key)

    def read(self, kind: str, key: GroupKey) -> None:
        """Append a sample: the requested bytes now, at ``kind`` of ``key``."""
        self.samples.append((kind, key, requested_bytes(self.device)))

    def _marks(self, tensor: Any) -> bool:
        return self.armed and isinstance(tensor, torch.Tensor) and tensor.requires_grad


class _StartMark(torch.autograd.Function):
    """Identity; its backward reads the sampler at the group's backward start."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: BackwardSampler, key: GroupKey) -> torch.Tensor:
        ctx.owner, ctx.key = owner, key
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.owner.read(START, ctx.key)
        return grad, None, None


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
        if not self.owner._marks(first):
            return out
        return apply_to_first(out, _StartMark.apply, self.owner, self.key)


@dataclass(kw_only=True)
class BackwardReading:
    """The final step's backward, baseline against offload run, at the group boundaries; the
    two runs' samples are matched by boundary (kind and group occurrence), not by position."""

    baseline: list[Sample]
    offload: list[Sample]
    predicted: list[int] | None
    """The drop (bytes) predicted at each boundary of ``offload``, in its order; None: not
    predicted (``why_not``) or not matched (``unmatched``)."""
    why_not: str = ""
    """Why the drops are not predicted (nesting groups, no marks): reported, not decided."""
    unmatched: str = ""
    """Why the two runs' boundaries cannot be matched: the reading is undecided (a skip)."""
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
        base = _by_boundary(self.baseline)
        return max(
            (base[s[:2]] - d for s, d in zip(self.offload, self.predicted, strict=True)),
            default=0,
        )

    def record(self) -> dict[str, Any]:
        return {
            "boundaries": len(self.offload),
            "baseline_peak": self.baseline_peak,
            "offload_peak": self.offload_peak,
            "predicted_peak": self.predicted_peak,
            "not_predicted": self.why_not or None,
            "unmatched": self.unmatched or None,
            "samples": {
                "baseline": [_compact(s) for s in self.baseline],
                "offload": [_compact(s) for s in self.offload],
                "predicted": self.predicted,
            },
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> BackwardReading:
        """The reading a report's ``memory.backward`` record holds (its problems decided anew):
        how data recorded on a GPU is replayed on CPU."""
        samples = record["samples"]
        reading = cls(
            baseline=[_expand(s) for s in samples["baseline"]],
            offload=[_expand(s) for s in samples["offload"]],
            predicted=samples["predicted"],
            why_not=record.get("not_predicted") or "",
        )
        if not reading.why_not:
            reading.unmatched = boundary_mismatch(reading.baseline, reading.offload)
        reading.problems = backward_problems(reading)
        return reading


def _compact(sample: Sample) -> list[Any]:
    """A sample as a report keeps it: ``[kind, microbatch, layer, group, bytes]``."""
    kind, (microbatch, layer, name), nbytes = sample
    return [kind, microbatch, layer, name, nbytes]


def _expand(row: Sequence[Any]) -> Sample:
    kind, microbatch, layer, name, nbytes = row
    return (kind, (int(microbatch), int(layer), str(name)), int(nbytes))


def _by_boundary(samples: Sequence[Sample]) -> dict[tuple[str, GroupKey], int]:
    return {(kind, key): nbytes for kind, key, nbytes in samples}


def _boundary(kind: str, key: GroupKey) -> str:
    microbatch, layer, name = key
    return f"backward {kind} of {name} (microbatch {microbatch}, layer {layer})"


def boundary_mismatch(baseline: Sequence[Sample], offload: Sequence[Sample]) -> str:
    """Why the two runs' boundaries cannot be matched one to one ("" when they can): a
    boundary marked twice in one run, or marked in one run only. The order may differ."""
    for run, samples in (("baseline", baseline), ("offload run", offload)):
        seen: set[tuple[str, GroupKey]] = set()
        for kind, key, _ in samples:
            if (kind, key) in seen:
                return f"the {run} marked the {_boundary(kind, key)} twice"
            seen.add((kind, key))
    base, off = _by_boundary(baseline), _by_boundary(offload)
    only = [("offload run", b) for b in off if b not in base]
    only += [("baseline", b) for b in base if b not in off]
    if not only:
        return ""
    run, (kind, key) = only[0]
    return (
        f"{len(only)} group boundaries are marked in one run only (the first: the "
        f"{_boundary(kind, key)}, in the {run} alone)"
    )


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
    # The rule's reload slots are the selected groups' backward ends, as the cadence check walks
    # them (``step_events`` keeps the selected names): an unselected group's end reloads nothing.
    chosen = [i for i, e in enumerate(events) if e.key[2] in names]
    allowed = {
        key: None if at is None else chosen[at]
        for key, at in allowed_for([events[i] for i in chosen], passes, order, semantics).items()
    }
    by_key = {(o.microbatch, o.layer, o.name): o for o in observations}
    freed = {k: _freed_storages(by_key[k], steady[k]) for k in offloaded}
    back = {k: sum(reload_sizes(by_key[k], config, semantics)) for k in offloaded}
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
        drops.append(drop + sum(storages.values()))
    return drops


def _freed_storages(obs: GroupObservation, expected: Expected) -> dict[tuple[int, int], int]:
    """(pass, storage id) -> bytes of each storage the group's offload frees."""
    return {
        (obs.microbatch, info.storage_id): info.storage_nbytes
        for info in (*obs.saved, *obs.released)
        if info.storage_id in expected.freed_storages
    }


def backward_problems(reading: BackwardReading) -> list[str]:
    """Each boundary where the offload run's drop against the baseline's reading at the same
    boundary is not the predicted one (the first six), naming the group occurrence and both
    figures. Nothing where the drops were not predicted or the boundaries not matched."""
    if reading.predicted is None or reading.unmatched:
        return []
    base = _by_boundary(reading.baseline)
    problems = []
    for (kind, key, o), drop in zip(reading.offload, reading.predicted, strict=True):
        b = base[(kind, key)]
        if b - o != drop:
            problems.append(
                f"{_boundary(kind, key)}: {o} requested bytes against the baseline's {b} B, "
                f"a drop of {b - o} B, predicted {drop} B"
            )
    if problems:
        head = (
            f"during backward (final step) the offload run peaked at {reading.offload_peak} B at "
            f"the group boundaries, predicted {reading.predicted_peak} B (baseline "
            f"{reading.baseline_peak} B); {len(problems)} boundaries differ:"
        )
        return [head, *problems[:6]]
    return []
