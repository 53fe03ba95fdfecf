"""Running a case: the runs each check needs and the facts it asserts on.

Shared by the pytest cases and ``offload-harness run``, so both judge a case the same way.

* ``run_equivalence`` - plain baseline, hooks baseline and offload run of the same spec and seed;
  the offload run's warmup step is profiled to prove the offload happened.
* ``run_transfers`` - the independent prediction (``harness.predict``, from a hooks run), the
  offload run with its final step profiled, and a disabled run that must copy nothing.
* ``run_memory`` - CUDA only: memory right after the last forward and peak, baseline vs offload.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from harness.cases import Case
from harness.compare import Verdict, first_tensor_difference, verdict
from harness.offload.backends import resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import GroupRecord, Offloader
from harness.offload.recorder import GroupObservation, RecordingOffloader
from harness.predict import Expected, GroupKey, freed_bytes, in_flight_after_forward, predict
from harness.spec import ModelSpec, RunSpec
from harness.train import RunHooks, TrainResult, schedule_order, train
from harness.transfers import Counts, TransferCounts, count_transfers, transfer_profiler

COUNTER_FIELDS = ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes")


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where and with what a case runs."""

    device: torch.device
    backend: str = "reference"
    """Backend under test: a name or ``module:factory``."""
    model_size: str = "tiny"
    """``tiny`` (CPU sized) or ``small`` (GPU sized) presets."""

    def offloader(self, config: OffloadConfig) -> Offloader:
        return resolve_backend(self.backend)(config, self.device)

    def spec(self, case: Case) -> ModelSpec:
        spec = case.model_spec(self.model_size)
        case.offload_config().check_applies_to(spec)
        return spec


@contextlib.contextmanager
def _profiled(device: torch.device, sink: list[TransferCounts]) -> Iterator[None]:
    with transfer_profiler(device) as prof:
        yield
    sink.append(count_transfers(prof, mode="device" if device.type == "cuda" else "cpu"))


def profile_steps(device: torch.device, steps: set[int], sink: list[TransferCounts]) -> RunHooks:
    """Run hooks that profile the listed steps, appending their counts to ``sink``."""

    def context(step: int) -> contextlib.AbstractContextManager[object]:
        return _profiled(device, sink) if step in steps else contextlib.nullcontext()

    return RunHooks(step_context=context)


def log_by_group(records: tuple[GroupRecord, ...]) -> dict[GroupKey, dict[str, int]]:
    """An offloader log's counters per group occurrence (groups that moved something)."""
    return {
        r.key: {f: getattr(r, f) for f in COUNTER_FIELDS}
        for r in records
        if any(getattr(r, f) for f in COUNTER_FIELDS)
    }


def offload_proof(
    case: Case, spec: ModelSpec, counts: TransferCounts, microbatches: int
) -> list[str]:
    """Problems with the claim "every selected name moved bytes in every microbatch"."""
    selected = set(case.offload) & set(spec.group_names)
    moved = {
        (mb, name)
        for (mb, _, name), fields in counts.by_group().items()
        if fields["d2h_bytes"] > 0 and fields["h2d_bytes"] > 0
    }
    return [
        f"microbatch {mb}: no {name} group moved bytes both ways in the profiled warmup step"
        for mb in range(microbatches)
        for name in sorted(selected)
        if (mb, name) not in moved
    ]


@dataclass(kw_only=True)
class EquivalenceResult:
    case: Case
    plain: TrainResult
    hooks: TrainResult
    offload: TrainResult
    verdict: Verdict
    warmup_transfers: TransferCounts
    proof_problems: list[str]
    grad_difference: tuple[int, str, float] | None
    """(step, parameter, max |diff|) of the first gradient that is not bitwise equal."""
    weight_difference: tuple[str, float] | None
    seconds: float


def run_equivalence(case: Case, env: Environment) -> EquivalenceResult:
    """Offload vs the plain and hooks baselines, every step and microbatch."""
    start = time.perf_counter()
    spec, run, config = env.spec(case), case.run_spec(), case.offload_config()
    kept = dict(keep_grads=True, keep_final_state=True)
    plain = train(spec, run, NoOffload(), env.device, **kept)
    hooks = train(spec, run, RecordingOffloader(config, env.device), env.device)
    sink: list[TransferCounts] = []
    offloader = env.offloader(config)
    try:
        offload = train(
            spec, run, offloader, env.device, hooks=profile_steps(env.device, {0}, sink), **kept
        )
    finally:
        offloader.close()
    result = EquivalenceResult(
        case=case,
        plain=plain,
        hooks=hooks,
        offload=offload,
        verdict=verdict(plain.losses, hooks.losses, offload.losses, case.tolerance),
        warmup_transfers=sink[0],
        proof_problems=offload_proof(case, spec, sink[0], run.microbatches),
        grad_difference=_first_grad_difference(plain, offload),
        weight_difference=first_tensor_difference(plain.final_state, offload.final_state),
        seconds=time.perf_counter() - start,
    )
    for run_result in (plain, offload):  # compared; drop the copies (GBs on GPU-sized models)
        run_result.grads, run_result.final_state = [], {}
    return result


def _first_grad_difference(a: TrainResult, b: TrainResult) -> tuple[int, str, float] | None:
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads, strict=True)):
        found = first_tensor_difference(ga, gb)
        if found is not None:
            return (step, *found)
    return None


@dataclass(kw_only=True)
class TransferResult:
    case: Case
    expected: dict[GroupKey, Expected]
    """Steady-state prediction per group occurrence."""
    measured: dict[GroupKey, dict[str, int]]
    """Profiler counts of the final step per group occurrence."""
    logged: dict[GroupKey, dict[str, int]] | None
    """The offloader's own log of the final step (None if it keeps none)."""
    counts: TransferCounts
    disabled: TransferCounts
    """Profiler counts of a final step with the offloader disabled."""
    observations: list[GroupObservation] = field(default_factory=list)
    seconds: float = 0.0

    def expected_fields(self) -> dict[GroupKey, dict[str, int]]:
        return {
            k: {
                "d2h_copies": e.copies,
                "d2h_bytes": e.bytes,
                "h2d_copies": e.copies,
                "h2d_bytes": e.bytes,
            }
            for k, e in self.expected.items()
            if e.copies
        }

    def mismatches(self) -> list[str]:
        """Group occurrences whose profiled counts differ from the prediction."""
        want, got = self.expected_fields(), self.measured
        return [
            f"{_label(k)}: predicted {want.get(k, _ZERO)} measured {got.get(k, _ZERO)}"
            for k in sorted({*want, *got})
            if want.get(k, _ZERO) != got.get(k, _ZERO)
        ]

    def log_mismatches(self) -> list[str]:
        """Group occurrences whose logged counts differ from the profiler's."""
        if self.logged is None:
            return []
        return [
            f"{_label(k)}: log {self.logged.get(k, _ZERO)} profiler {self.measured.get(k, _ZERO)}"
            for k in sorted({*self.logged, *self.measured})
            if self.logged.get(k, _ZERO) != self.measured.get(k, _ZERO)
        ]

    def moved_names(self) -> set[str]:
        return {name for (_, _, name), f in self.measured.items() if f["d2h_copies"]}


_ZERO = dict.fromkeys(COUNTER_FIELDS, 0)


def _label(key: GroupKey) -> str:
    mb, layer, name = key
    return f"step final, microbatch {mb}, layer {layer}, group {name}"


def record_observations(case: Case, env: Environment) -> list[GroupObservation]:
    """What each group saves, from a one-step hooks run."""
    recorder = RecordingOffloader(case.offload_config(), env.device)
    train(env.spec(case), case.run_spec().replace(steps=1), recorder, env.device)
    return recorder.iterations[0]


def run_transfers(case: Case, env: Environment) -> TransferResult:
    """Final-step transfers: prediction, profiler, the offloader's log, and a disabled run."""
    start = time.perf_counter()
    spec, run, config = env.spec(case), case.run_spec(), case.offload_config()
    observations = record_observations(case, env)
    _, steady = predict(observations, config, schedule_order(run.schedule, run.microbatches))
    last = run.steps - 1
    sink: list[TransferCounts] = []
    offloader = env.offloader(config)
    try:
        result = train(
            spec, run, offloader, env.device, hooks=profile_steps(env.device, {last}, sink)
        )
    finally:
        offloader.close()
    disabled_sink: list[TransferCounts] = []
    disabled = env.offloader(config)
    disabled.set_enabled(False)
    try:
        train(
            spec,
            run.replace(steps=2),
            disabled,
            env.device,
            hooks=profile_steps(env.device, {1}, disabled_sink),
        )
    finally:
        disabled.close()
    return TransferResult(
        case=case,
        expected=steady,
        measured=sink[0].by_group(),
        logged=log_by_group(result.logs[-1].groups) if result.logs else None,
        counts=sink[0],
        disabled=disabled_sink[0],
        observations=observations,
        seconds=time.perf_counter() - start,
    )


def total(counts: TransferCounts) -> Counts:
    """All attributed and unattributed copies of both directions."""
    out = Counts()
    for c in [*counts.totals().values(), *counts.unattributed.values()]:
        out = out + c
    return out


@dataclass(kw_only=True)
class MemoryResult:
    case: Case
    baseline_after_forward: int
    offload_after_forward: int
    predicted_drop: int
    tolerance: int
    """Allocator rounding bound (see ``run_memory``)."""
    baseline_peak: int
    offload_peak: int

    @property
    def measured_drop(self) -> int:
        return self.baseline_after_forward - self.offload_after_forward


def run_memory(case: Case, env: Environment) -> MemoryResult:
    """Memory right after the last forward of the final step, and that step's peak.

    Tolerance: the caching allocator hands out blocks rounded to 512 B, and a large block whose
    remainder would be at most 1 MiB is handed out whole, so each freed storage may differ from
    its byte size by up to 512 B (small) or 1 MiB (large, > 1 MiB).
    """
    if env.device.type != "cuda":
        raise ValueError("the memory case needs a CUDA device")
    spec, run, config = env.spec(case), case.run_spec(), case.offload_config()
    order = schedule_order(run.schedule, run.microbatches)
    last_forward = max(i for i, (kind, _) in enumerate(order) if kind == "F")
    observations = record_observations(case, env)
    _, steady = predict(observations, config, order)
    in_flight = in_flight_after_forward(order, last_forward)
    predicted = freed_bytes(observations, steady, in_flight)
    storages = {
        (o.microbatch, s.storage_id): s.storage_nbytes
        for o in observations
        for s in (*o.saved, *o.released)
        if o.microbatch in in_flight
        and s.storage_id in steady[(o.microbatch, o.layer, o.name)].freed_storages
    }
    tolerance = sum(2**20 if n > 2**20 else 512 for n in storages.values())
    base = _memory_run(spec, run, NoOffload(), env.device, order[last_forward][1])
    offloader = env.offloader(config)
    try:
        off = _memory_run(spec, run, offloader, env.device, order[last_forward][1])
    finally:
        offloader.close()
    return MemoryResult(
        case=case,
        baseline_after_forward=base[0],
        offload_after_forward=off[0],
        predicted_drop=predicted,
        tolerance=tolerance,
        baseline_peak=base[1],
        offload_peak=off[1],
    )


def _memory_run(
    spec: ModelSpec, run: RunSpec, offloader: Offloader, device: torch.device, last_mb: int
) -> tuple[int, int]:
    seen: dict[str, int] = {}
    last = run.steps - 1

    def after_forward(step: int, mb: int) -> None:
        if step == last and mb == last_mb:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # frees blocks whose record_stream events completed
            seen["after_forward"] = torch.cuda.memory_allocated(device)

    @contextlib.contextmanager
    def step_context(step: int) -> Iterator[None]:
        if step == last:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        yield
        if step == last:
            torch.cuda.synchronize(device)
            seen["peak"] = torch.cuda.max_memory_allocated(device)

    train(
        spec,
        run,
        offloader,
        device,
        hooks=RunHooks(step_context=step_context, after_forward=after_forward),
    )
    return seen["after_forward"], seen["peak"]
