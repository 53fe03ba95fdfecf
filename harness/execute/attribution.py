"""Which group each copy belongs to: the run hooks that profile and observe steps, the
attribution of the profiled steps' copies (the offloader's own ranges or the harness's windows),
the proof that the offload happened and the per-group comparisons the checks read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness.cases import Case
from harness.execute.predict import Expected
from harness.measure.observe import Observed, Windowed, observe
from harness.measure.transfers import Counts, TransferCounts, count_transfers, transfer_profiler
from harness.models.runs import RunHooks
from harness.offload.protocol import GroupRecord
from harness.offload.semantics import MEGATRON_MAIN, GroupKey, Semantics
from harness.vocab.spec import ModelSpec, chunk_layers, group_template, model_chunks, pass_label

COUNTER_FIELDS = ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes")
_ZERO = dict.fromkeys(COUNTER_FIELDS, 0)


@contextlib.contextmanager
def _profiled(
    device: torch.device, sink: list[TransferCounts], ranges: bool = True
) -> Iterator[None]:
    with transfer_profiler(device, ranges=ranges) as prof:
        yield
    sink.append(count_transfers(prof, mode="device" if device.type == "cuda" else "cpu"))


@contextlib.contextmanager
def _ranged(sink: list[TransferCounts], seen: list[Observed]) -> Iterator[None]:
    """Append the observed step's copies inside the offloader's own ranges (a step that raised
    appends nothing: its exception goes on)."""
    yield
    sink.append(seen[-1].ranged_counts())


def profile_steps(
    device: torch.device,
    steps: set[int],
    sink: list[TransferCounts],
    observer: tuple[Windowed, list[Observed]] | None = None,
    observed: set[int] | None = None,
    *,
    ranges: bool = True,
) -> RunHooks:
    """Run hooks that profile the listed steps, appending their counts to ``sink`` (with
    ``ranges=False`` only the totals on CUDA: ``transfer_profiler``); with
    ``observer`` (the run's ``Windowed`` offloader and a list) the harness's copy observer
    watches the ``observed`` steps (default: the same; they must include them). On a CPU
    device with an observer no profiler runs: the observer reads the offloader's own ranges
    itself (``Observed.ranged_counts``, the profiler counter's CPU-mode record; a profiler
    costs about a third of a case there).

    A profiler covers the whole step; the observer covers the microbatches (``compute_context``),
    where every call into the offloader is made: the runner's gradient copies and optimizer step
    after them run no offloader code (on CUDA a memcpy issued there is still in the profile,
    unattributed, so it is reported), and skipping them saves a quarter of the observed ops."""
    watched = steps if observed is None else observed

    def context(step: int) -> contextlib.AbstractContextManager[object]:
        if step not in steps:
            return contextlib.nullcontext()
        if observer is None or device.type == "cuda":
            return _profiled(device, sink, ranges)
        return _ranged(sink, observer[1])  # exits after the observer appended its record

    def compute(step: int) -> contextlib.AbstractContextManager[object]:
        if observer is None or step not in watched:
            return contextlib.nullcontext()
        return observe(observer[0], device, observer[1])

    return RunHooks(step_context=context, compute_context=compute)


def observe_steps(
    device: torch.device, steps: set[int], offloader: Windowed, seen: list[Observed]
) -> RunHooks:
    """Run hooks in which the harness's copy observer alone watches the listed steps'
    microbatches."""

    def compute(step: int) -> contextlib.AbstractContextManager[object]:
        return observe(offloader, device, seen) if step in steps else contextlib.nullcontext()

    return RunHooks(compute_context=compute)


@dataclass(frozen=True, kw_only=True)
class Attribution:
    """Which group each copy of the profiled steps belongs to, and who said so."""

    source: str
    """``harness windows`` (the offloader opened no range of its own: every count comes from
    the harness's copy observer) or ``offloader ranges`` (its own profiler ranges, cross-checked
    against the harness's windows)."""
    warmup: TransferCounts
    final: TransferCounts
    windows: tuple[TransferCounts, TransferCounts]
    """The observer's counts of the warmup and the final step."""
    profiled: tuple[TransferCounts, TransferCounts]
    """The profiler's counts of the same steps (by the offloader's ranges, if it opened any)."""
    outside: tuple[int, int]
    """Copies the observer saw outside every group window, in the warmup and the final step."""
    outside_copies: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    """Those copies, ``"d2h copy_ 4096 B"`` each (the first 12 of each step), for the report."""
    pageable_groups: tuple[GroupKey, ...] = ()
    """Group occurrences with a copy from/to pageable host memory in the final step (observer)."""


def _described(copies: list[Any], limit: int = 12) -> tuple[str, ...]:
    return tuple(f"{c.direction} {c.op} {c.nbytes} B" for c in copies[:limit])


def attribute(
    sink: list[TransferCounts], seen: list[Observed], windows: list[TransferCounts]
) -> Attribution:
    """Pick the counts the checks read: the offloader's own ranges when it opened any (as the
    reference and megatron-core's adapter do), else the harness's windows. ``seen`` and
    ``windows`` are every observed step's copies and their counts by window."""
    profiled = (sink[0], sink[-1])
    outside = (seen[0].outside(), seen[-1].outside())
    pageable = tuple(sorted({c.group for c in seen[-1].copies if c.pageable and c.group}))
    ranged = any(c.by_range for c in profiled)
    return Attribution(
        source="offloader ranges" if ranged else "harness windows",
        warmup=profiled[0] if ranged else windows[0],
        final=profiled[1] if ranged else windows[-1],
        windows=(windows[0], windows[-1]),
        profiled=profiled,
        outside=(len(outside[0]), len(outside[1])),
        outside_copies=(_described(outside[0]), _described(outside[1])),
        pageable_groups=pageable,
    )


def log_by_group(records: tuple[GroupRecord, ...]) -> dict[GroupKey, dict[str, int]]:
    """An offloader log's counters per group occurrence (groups that moved something)."""
    return {
        r.key: {f: getattr(r, f) for f in COUNTER_FIELDS}
        for r in records
        if any(getattr(r, f) for f in COUNTER_FIELDS)
    }


def offload_proof(
    case: Case,
    spec: ModelSpec,
    counts: TransferCounts,
    microbatches: int,
    semantics: Semantics = MEGATRON_MAIN,
    device: torch.device | None = None,
    warmup: dict[GroupKey, Expected] | None = None,
) -> list[str]:
    """Problems with the claim "the offload happened in the warmup step": every selected name
    moved bytes in every pass, whatever rule was declared or learned (an absolute: a rule learned
    from an offloader that moves nothing predicts nothing), and every group occurrence the
    ``warmup`` prediction moves moved bytes - both ways, or out only where the rule says a reload
    on this device hands out the host copy."""
    back = semantics.reloads_on(device.type if device is not None else "cpu")
    by_group = counts.by_group()

    def moved(fields: dict[str, int]) -> bool:
        return fields["d2h_bytes"] > 0 and (fields["h2d_bytes"] > 0 or not back)

    seen = {(mb, name) for (mb, _, name), fields in by_group.items() if moved(fields)}
    way = "both ways" if back else f"out (a reload hands out the host copy here: {semantics.label})"
    # The selected names each model chunk opens (one chunk: the whole model, MTP included).
    chunks = model_chunks(case.schedule)
    selected = [
        sorted(set(case.offload) & set(spec.group_names))
        if chunks == 1
        else sorted(
            set(case.offload)
            & {
                name
                for i in chunk_layers(len(spec.layers), chunk, chunks)
                for name in group_template(spec.layers[i], spec.moe_path)
            }
        )
        for chunk in range(chunks)
    ]
    # A rule offloading some layers only (``Semantics.layers``) owes nothing in a pass none of
    # whose occurrences of the name lies in them (a later model chunk's, say).
    subset = semantics.layers

    def owed(p: int, name: str) -> bool:
        if subset is None or warmup is None:
            return True
        return any(layer in subset for mb, layer, n in warmup if mb == p and n == name)

    problems = [
        f"{pass_label(p, case.schedule)}: no {name} group moved bytes {way} in the profiled "
        "warmup step"
        for p in range(microbatches * chunks)
        for name in selected[p % chunks]
        if (p, name) not in seen and owed(p, name)
    ]
    missing = [
        key
        for key, expected in sorted((warmup or {}).items())
        if expected.copies and (key[0], key[2]) in seen and not moved(by_group.get(key, _ZERO))
    ]
    problems += [
        f"{pass_label(mb, case.schedule)}, layer {layer}: its {name} group moved no bytes {way} "
        f"in the profiled warmup step, predicted {warmup[(mb, layer, name)].bytes} B"  # type: ignore[index]
        for mb, layer, name in missing
    ]
    return problems


def group_differences(
    left: dict[GroupKey, dict[str, int]],
    right: dict[GroupKey, dict[str, int]],
    a: str,
    b: str,
    whys: dict[GroupKey, str] | None = None,
    step: str = "final step",
    schedule: str = "sequential",
) -> list[str]:
    whys = whys or {}
    return [
        f"{step}, {pass_label(k[0], schedule)}, layer {k[1]}, group {k[2]}: "
        f"{a} {left.get(k, _ZERO)} {b} {right.get(k, _ZERO)}"
        + (f" - {whys[k]}" if k in whys else "")
        for k in sorted({*left, *right})
        if left.get(k, _ZERO) != right.get(k, _ZERO)
    ]


def total(counts: TransferCounts) -> Counts:
    """All attributed and unattributed copies of both directions."""
    out = Counts()
    for c in [*counts.totals().values(), *counts.unattributed.values()]:
        out = out + c
    return out
