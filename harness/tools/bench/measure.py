"""Timing and memory of one variant's run: the step timer, ``measure`` (warmup, timed steps, on
CUDA one memory step), a variant run whose failure is a status, and the rounds combined into one
result with per-round ratios."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from harness.models.train import RunHooks, last_forward_index, schedule_order, train
from harness.offload.backends import Factory
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.tools.bench.common import GB, _line, _mib
from harness.tools.bench.phases import _Phased, _Phases, merge_breakdowns
from harness.vocab.spec import ModelSpec, RunSpec

T = TypeVar("T")


class _StepTimer:
    """Seconds of whole steps: CUDA events from an idle device to every stream drained (the
    synchronisations sit at the step boundaries), host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: list[float] = []
        self.peaks: list[int] = []

    @contextlib.contextmanager
    def step(self, floor: int) -> Iterator[None]:
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.seconds.append(time.perf_counter() - start)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        begin.record()
        yield
        torch.cuda.synchronize()  # side-stream copies included: the end event follows them
        end.record()
        end.synchronize()
        self.seconds.append(begin.elapsed_time(end) / 1e3)
        self.peaks.append(torch.cuda.max_memory_allocated() - floor)


def _settled_allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # also returns blocks whose record_stream uses have completed
    return torch.cuda.memory_allocated()


@dataclass(kw_only=True)
class VariantResult:
    """One variant's figures on one model (None where not measured)."""

    status: str = "ok"
    step_s: float | None = None
    """Median seconds per timed step (several rounds: the median of the rounds' medians)."""
    step_s_all: list[float] = field(default_factory=list)
    """Every timed step's seconds, round after round (``--steps`` per round)."""
    round_step_s: list[float] = field(default_factory=list)
    """Each round's median seconds per timed step."""
    round_ratio: list[float] = field(default_factory=list)
    """Each round's ``round_step_s`` over the baseline's of the same round."""
    d2h_bytes: int | None = None
    """Bytes one steady step moves device -> host (the backend's own log)."""
    h2d_bytes: int | None = None
    group_bytes: list[int] = field(default_factory=list)
    """D2H bytes of each offloaded group occurrence in a steady step."""
    after_forward_bytes: int | None = None
    """Allocated right after the last forward of a step, settled, relative to the run's start."""
    peak_bytes: int | None = None
    """Highest peak of the timed steps, relative to the run's start."""
    breakdown: dict[str, Any] | None = None
    """``--breakdown``: median seconds per phase (``_Phases.summary``)."""
    trace: str | None = None
    """``--trace``: the chrome trace of one steady step, or why there is none."""
    timeline: dict[str, Any] | str | None = None
    """``--trace``: the trace's ``harness.measure.timeline`` figures, or why there are none."""
    host_time: dict[str, Any] | str | None = None
    host_footprint: dict[str, Any] | str | None = None
    """``--host-time``: ``harness.measure.hostclock.HostTime`` of one extra run, or why there is
    none."""

    @property
    def effective_gbs(self) -> float | None:
        if self.step_s is None or not (self.d2h_bytes or self.h2d_bytes):
            return None
        return ((self.d2h_bytes or 0) + (self.h2d_bytes or 0)) / self.step_s / GB

    @property
    def ratio(self) -> float | None:
        """Median of ``round_ratio``: the step ratio to the baseline."""
        return statistics.median(self.round_ratio) if self.round_ratio else None

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        """Lowest and highest ``round_ratio``."""
        return (min(self.round_ratio), max(self.round_ratio)) if self.round_ratio else None


def measure(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    warmup: int,
    *,
    breakdown: bool = False,
) -> VariantResult:
    """Train ``run`` (warmup steps, timed steps, on CUDA one memory step) and read it out;
    with ``breakdown`` also the phases of the timed steps."""
    cuda = device.type == "cuda"
    timed = range(warmup, run.steps - 1 if cuda else run.steps)
    memory_step = run.steps - 1 if cuda else None
    order = schedule_order(run.schedule, run.microbatches)
    last_forward_mb = order[last_forward_index(order)][1]
    timer = _StepTimer(device)
    floor = _settled_allocated() if cuda else 0
    seen: dict[str, int] = {}
    phases = _Phases(device, order, annotate=False) if breakdown else None

    def step_context(step: int) -> contextlib.AbstractContextManager[object]:
        if step not in timed:
            return contextlib.nullcontext()
        if phases is None:
            return timer.step(floor)
        return phases.around(timer.step(floor), lambda: timer.seconds[-1])

    def after_forward(step: int, mb: int) -> None:
        if phases is not None:
            phases.forward_end(mb)
        if step == memory_step and mb == last_forward_mb:
            seen["after_forward"] = _settled_allocated() - floor

    hooks = RunHooks(step_context=step_context, after_forward=after_forward)
    driven = offloader if phases is None else _Phased(offloader, phases)
    logs = train(spec, run, driven, device, hooks=hooks).logs  # type: ignore[arg-type]
    steady = logs[warmup] if len(logs) > warmup else None
    return VariantResult(
        step_s=statistics.median(timer.seconds),
        step_s_all=timer.seconds,
        d2h_bytes=steady.d2h_bytes if steady else None,
        h2d_bytes=steady.h2d_bytes if steady else None,
        group_bytes=[g.d2h_bytes for g in steady.groups if g.d2h_bytes] if steady else [],
        after_forward_bytes=seen.get("after_forward"),
        peak_bytes=max(timer.peaks) if timer.peaks else None,
        breakdown=phases.summary() if phases is not None else None,
    )


def run_variant(
    factory: Factory | str,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
    *,
    breakdown: bool = False,
) -> VariantResult:
    """One variant; a backend that is missing or fails is a status, not an abort."""
    if isinstance(factory, str):
        return VariantResult(status=factory)
    found = _with_offloader(
        factory,
        config,
        device,
        lambda offloader: measure(spec, run, offloader, device, warmup, breakdown=breakdown),
    )
    return VariantResult(status=found) if isinstance(found, str) else found


def _with_offloader(
    factory: Factory, config: OffloadConfig, device: torch.device, work: Callable[[Offloader], T]
) -> T | str:
    """``work`` on a fresh offloader from ``factory``, closed and its memory released afterwards;
    a backend that cannot be built, or fails, is its status (``unavailable: ...``,
    ``failed: ...``), so the run goes on with the other variants."""
    try:
        offloader = factory(config, device)
    except (ValueError, ImportError, RuntimeError) as exc:
        return f"unavailable: {_line(exc)}"
    try:
        return work(offloader)
    except Exception as exc:  # report and go on with the other variants
        return f"failed: {type(exc).__name__}: {_line(exc)}"
    finally:
        offloader.close()
        del offloader
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def combine_rounds(rounds: Sequence[VariantResult]) -> VariantResult:
    """One variant's rounds (in order; a round that did not run ok is the last) as one result:
    median step time over the rounds' medians, every round's steps, the first round's bytes and
    memory; a round that did not run ok, or bytes per step that differ between rounds, is the
    status (``round N:`` in front when a later round failed)."""
    last = rounds[-1]
    if last.status != "ok":
        if len(rounds) == 1:
            return last
        return replace(last, status=f"round {len(rounds)}: {last.status}")
    first = rounds[0]
    status = first.status
    moved = {(r.d2h_bytes, r.h2d_bytes, tuple(r.group_bytes)) for r in rounds}
    if len(moved) > 1:
        per_round = ", ".join(f"{_mib(r.d2h_bytes)}/{_mib(r.h2d_bytes)}" for r in rounds)
        status = f"failed: bytes per step differ between rounds (D2H/H2D MiB {per_round})"
    medians = [r.step_s for r in rounds if r.step_s is not None]
    breakdowns = [r.breakdown for r in rounds if r.breakdown is not None]
    return replace(
        first,
        status=status,
        step_s=statistics.median(medians),
        step_s_all=[t for r in rounds for t in r.step_s_all],
        round_step_s=medians,
        breakdown=merge_breakdowns(breakdowns) if breakdowns else None,
    )


def round_ratios(variant: VariantResult, other: VariantResult) -> list[float]:
    """Per round, ``variant``'s median step over ``other``'s (empty unless both ran every
    round)."""
    if variant.step_s is None or other.step_s is None:
        return []
    return [a / b for a, b in zip(variant.round_step_s, other.round_step_s, strict=True)]
