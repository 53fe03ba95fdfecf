"""Step time, copy rates and memory of the offload backends on realistic models, in one run.

For each model, every variant trains the same spec and seed with the harness runner
(``harness.train``):

    baseline     no offload machinery (backend ``none``)
    reference    the bundled reference offloader
    mcore        megatron-core's offloader (``not installed`` when the backend does not resolve)
    save_on_cpu  the simple peer: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around
                 each selected group (same selection; no side stream, no prefetch, no skip rules)

Each model's variants run ``--rounds`` times (default 3), interleaved: round 1 runs baseline,
reference, mcore, save_on_cpu, round 2 the same order again, and so on, every round a fresh run
(build, warmup, timed steps). Step-time ratios move by 1-2 % from run to run on an H200 (the
CPU-bound launches at the start of each step vary), too much for one median to judge a 3 %
target, so a ratio is taken per round (the variant's median step over the baseline's, both of
that round) and reported as its median and its min-max range over the rounds.

Per variant it reports the median over rounds of each round's median step time (CUDA events;
the device is synchronised at step boundaries only, never inside a timed step), the median ratio
to the baseline and its range, the D2H/H2D bytes one step moves (the backend's own log; every
round must agree), the effective rate (bytes both ways / step time), memory right after the last
forward (one extra untimed step, settled) and the timed steps' peak, both relative to what was
allocated before the run (memory figures: the first round's). In the same run it measures the
raw pinned ``copy_`` rate and each offloader's rate on a copy-only microbenchmark
(``harness/tools/bench_offload.py``) at the model's mean offloaded group size, once per model.

A model is *copy-bound* when its copies at the raw rate take longer than the baseline step. It is
*hideable* when its device compute can hide them: the D2H copies at the raw rate take no longer
than the forwards' compute and the H2D copies no longer than the backwards' (compute-stream busy
time of one traced steady baseline step, ``harness.timeline.phase_busy``: a profiler slows the
host, not the device). A model that is neither is *host-bound*: the copies only fit because the
host launches work slower than the device runs it, the step is host time, and what an
offloader adds to it is its own host time (``--host-time`` measures that); no step target
applies there, and the 1.03x line says why with the figures. Targets (printed with PASS/SHORT;
nothing is asserted; step ratios are per-round medians, their range over the rounds printed
with them):

    reference step <= 1.03 x baseline               hideable models (and where compute was not
                                                    measured: models not copy-bound)
    reference >= 90% of the raw copy rate           copy-only microbenchmark; copy-bound models
    reference faster than save_on_cpu
    reference step <= 1.05 x mcore's                when mcore is installed

Every variant runs with the harness's deterministic kernels (as the cases do) but without the
deterministic mode's fill of new memory (``torch.utils.deterministic.fill_uninitialized_memory``):
a debugging aid no training run enables, which fills each new pinned host buffer on the host (on
the H200: 78 ms per traced ``moe-small`` step for ``save_on_cpu``, 4 ms for megatron-core's
offloader), so it would slow the peers by what no user sees.

Writes ``bench.json`` into ``--out`` (default ``reports/<UTC>_<sha>[_dirty]/``) and prints the
tables. Needs CUDA; ``--device cpu --models hybrid-tiny`` is a smoke test (rates meaningless).

Diagnosis (where a step's extra time goes):

    --breakdown   per variant, the medians over the timed steps of: each microbatch's forward
                  (begin_microbatch to the end of its forward) and backward (the ``backward()``
                  call), the offloader's end_iteration, the optimizer, the drain (side-stream
                  work still running once the compute stream is done) and the rest; CUDA events
                  on the compute stream, recorded in the timed steps themselves (a few events
                  per step, no synchronisation). With several rounds, each phase's median over
                  the rounds of its per-round median. A table after the step table;
                  ``breakdown`` of each variant in bench.json (its ``steps``: every round's).
    --trace DIR   one torch.profiler chrome trace (CPU and CUDA activities) of one steady step
                  per variant: ``DIR/<model>_<variant>.pt.trace.json.gz``, the phases above as
                  ``bench.*`` ranges. Traced in separate short runs (warmup steps, then the
                  traced step) after all timed rounds, so the profiler never touches a timing.
                  Each trace is then read by ``harness.timeline``: compute-stream busy time in
                  the device window, its idle gaps (launch-bound or waiting) and how much of the
                  DtoH/HtoD copies overlaps compute; and the host self time of each
                  variant against the baseline's (in total, and the op or range names that
                  grew most: where an offloader's extra host time goes); one line per
                  variant, ``timeline`` in bench.json.
    --host-time N one more run per variant (warmup, then N steps) with the host time inside
                  each offloader entry point (group start, enter, pack, exit, commit, unpack,
                  the backward of its autograd nodes, begin_microbatch, end_iteration) on
                  ``harness.hostclock``'s clock: ``perf_counter`` per window, no profiler (a
                  profiler inflates exactly the host time a launch-bound step is made of). One
                  line per variant with its median per step by entry point, next to its timed
                  step's increase over the baseline; ``host_time`` in bench.json.

    scripts/bench [--models hybrid-small,moe-small,moe-bench,hybrid-bench] [--steps 10] [--warmup 2]
                  [--rounds 3] [--out DIR]
    scripts/bench --models moe-bench --breakdown --trace reports/moe-bench-trace
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from harness import hostclock, timeline
from harness.offload.backends import Factory, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.pool import no_deterministic_fill
from harness.offload.protocol import GroupRecord, IterationLog, Offloader, Output
from harness.report import HARNESS_VERSION, commit_info, machine_info, run_folder
from harness.spec import PRESETS, ModelSpec, RunSpec, preset
from harness.tools import bench_offload
from harness.train import RunHooks, schedule_order, train

MIB = 2**20
GB = 1e9
VARIANTS = ("baseline", "reference", "mcore", "save_on_cpu")
T = TypeVar("T")
DEFAULT_NAMES = ("core_attn", "attn_proj", "expert_fc1", "moe_act", "fused_group_mlp")
"""Offloaded by default where the model opens them (not the norms or qkv: their groups span
whole blocks or hold little)."""
COPY_BENCH_BUDGET = 4 * 2**30
"""Device bytes per copy-only measurement (groups x size)."""


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A model the bench runs: its spec and default offload selection."""

    spec: ModelSpec
    offload: tuple[str, ...] | None = None
    """Default selection (None: ``DEFAULT_NAMES`` the model opens)."""
    note: str = ""


def _bench_only() -> dict[str, BenchModel]:
    # Bench-only sizes (not presets: the case matrix does not need them). moe-bench is
    # "hideable": fc1 and fc2 do 3 x moe_ffn_hidden_size FLOP per offloaded byte of expert_fc1's
    # input (40 MiB per group), plus the dispatch matmuls and attention, none of it offloaded.
    moe_bench = ModelSpec(
        pattern="*E*E",
        hidden_size=2048,
        num_heads=16,
        ffn_hidden_size=8192,
        vocab_size=8192,
        seq_length=2048,
        micro_batch_size=2,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=4096,
        moe_capacity_factor=1.25,
    )
    # hybrid-bench: the headline pattern at a size where the device's compute, not the host,
    # sets the step and can hide its groups: attn_norm and qkv_linear hold 24 and 80.5 MiB per
    # MLA layer and microbatch against the layer pair's ~1 TFLOP of forward matmuls (on the
    # H200: 95 of a 99 ms step busy). Not core_attn (nor attn_proj, which needs it): unfused
    # attention's softmax output (B*H*T*T) outgrows any compute that could hide it at the
    # H200's PCIe rate.
    hybrid_bench = ModelSpec(
        pattern="+-+-+-",
        hidden_size=3072,
        num_heads=24,
        ffn_hidden_size=12288,
        vocab_size=8192,
        seq_length=2048,
        micro_batch_size=2,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    return {
        "moe-bench": BenchModel(
            spec=moe_bench, offload=("expert_fc1",), note="compute-heavy experts, 40 MiB groups"
        ),
        "hybrid-bench": BenchModel(
            spec=hybrid_bench,
            offload=("attn_norm", "qkv_linear"),
            note="compute-bound +-+-+-, tens of MiB per group",
        ),
    }


BENCH_MODELS = _bench_only()


def bench_model(name: str) -> BenchModel:
    """A bench-only model or a harness preset, by exact name."""
    if name in BENCH_MODELS:
        return BENCH_MODELS[name]
    try:
        return BenchModel(spec=preset(name))
    except ValueError:
        known = ", ".join([*PRESETS, *BENCH_MODELS])
        raise ValueError(f"unknown model {name!r}; known: {known}") from None


def selection(model: BenchModel, override: tuple[str, ...] | None) -> tuple[str, ...]:
    """The offloaded group names for ``model``: ``override`` or its default, narrowed to the
    groups the model opens."""
    wanted = override or model.offload or DEFAULT_NAMES
    names = tuple(n for n in wanted if n in model.spec.group_names)
    if not names:
        raise ValueError(
            f"pattern {model.spec.pattern!r} opens none of {', '.join(wanted)} "
            f"(it opens {', '.join(model.spec.group_names) or 'no group'})"
        )
    return names


# ---------------------------------------------------------------------------- save_on_cpu peer
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


# ------------------------------------------------------------------------------- measurement
def factories() -> dict[str, Factory | str]:
    """Each variant's backend factory, or why it cannot run (``not installed``)."""
    out: dict[str, Factory | str] = {"baseline": NoOffload, "save_on_cpu": SaveOnCpu}
    for name in ("reference", "mcore"):
        try:
            out[name] = resolve_backend(name)
        except ValueError:
            out[name] = "not installed"
    return {v: out[v] for v in VARIANTS}


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


class _Phases:
    """The phases of the steps it is active in: each microbatch's forward and backward, the
    offloader's end_iteration, the optimizer, the drain. Marks are CUDA events on the current
    (compute) stream, so a phase is what the device's compute timeline spent on it, stalls
    included; the host clock on CPU. With ``annotate`` each phase is also a ``bench.*``
    profiler range (for traces)."""

    def __init__(self, device: torch.device, order: list[tuple[str, int]], annotate: bool) -> None:
        self.cuda = device.type == "cuda"
        self.microbatches = 1 + max(mb for _, mb in order)
        self.backward_order = [mb for kind, mb in order if kind == "B"]
        self.annotate = annotate
        self.active = False
        self.steps: list[dict[str, Any]] = []
        self._marks: list[tuple[str, int, Any]] = []
        self._backwards = 0
        self._open: dict[str, Any] = {}

    # marks ---------------------------------------------------------------------------------
    def _mark(self, label: str, mb: int = -1) -> None:
        if self.cuda:
            stamp: Any = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        self._marks.append((label, mb, stamp))

    def _range(self, key: str, name: str | None) -> None:
        """Close the open range ``key``, then open ``name`` under that key (annotate only)."""
        if not self.annotate:
            return
        previous = self._open.pop(key, None)
        if previous is not None:
            previous.__exit__(None, None, None)
        if name is not None:
            self._open[key] = torch.profiler.record_function(name)
            self._open[key].__enter__()

    def forward_start(self, mb: int) -> None:
        if self.active:
            self._mark("forward_start", mb)
            self._range("forward", f"bench.forward|mb={mb}")

    def forward_end(self, mb: int) -> None:
        if self.active:
            self._range("forward", None)
            self._mark("forward_end", mb)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        mb = self.backward_order[self._backwards % len(self.backward_order)]
        self._backwards += 1
        self._mark("backward_start", mb)
        self._range("backward", f"bench.backward|mb={mb}")
        try:
            yield
        finally:
            self._range("backward", None)
            self._mark("backward_end", mb)

    @contextlib.contextmanager
    def end_iteration(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._mark("end_iteration_start")
        self._range("end_iteration", "bench.end_iteration")
        try:
            yield
        finally:
            self._range("end_iteration", None)
            self._mark("optimizer_start")
            self._range("optimizer", "bench.optimizer")

    # steps ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def around(
        self,
        outer: contextlib.AbstractContextManager[object],
        step_seconds: Callable[[], float] | None = None,
    ) -> Iterator[None]:
        """Mark the step ``outer`` wraps (a step timer or a profiler); with ``step_seconds``
        (the whole step's time, read once ``outer`` closed) keep its phases."""
        with outer:
            self._marks, self._backwards, self.active = [], 0, True
            self._mark("step_start")
            original = torch.Tensor.backward
            phases = self

            def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                with phases.backward():
                    original(tensor, *args, **kwargs)

            torch.Tensor.backward = backward  # type: ignore[method-assign]
            try:
                yield
                self._range("optimizer", None)
                self._mark("compute_end")
            finally:
                torch.Tensor.backward = original  # type: ignore[method-assign]
                self.active = False
                for key in list(self._open):
                    self._range(key, None)
        if step_seconds is not None:
            self.steps.append(self._phases(step_seconds()))

    def _phases(self, step_s: float) -> dict[str, Any]:
        """Seconds per phase of the step just marked (its events have completed)."""
        start = self._marks[0][2]

        def at(stamp: Any) -> float:
            return start.elapsed_time(stamp) / 1e3 if self.cuda else stamp - start

        times: dict[tuple[str, int], float] = {}
        for label, mb, stamp in self._marks:
            times[(label, mb)] = at(stamp)
        M = range(self.microbatches)
        out: dict[str, Any] = {
            "step_s": step_s,
            "forward_s": [times[("forward_end", m)] - times[("forward_start", m)] for m in M],
            "backward_s": [times[("backward_end", m)] - times[("backward_start", m)] for m in M],
        }
        last_backward = max(times[("backward_end", m)] for m in M)
        out["end_iteration_s"] = times[("optimizer_start", -1)] - last_backward
        out["optimizer_s"] = times[("compute_end", -1)] - times[("optimizer_start", -1)]
        out["drain_s"] = step_s - times[("compute_end", -1)]
        out["other_s"] = step_s - (
            sum(out["forward_s"])
            + sum(out["backward_s"])
            + out["end_iteration_s"]
            + out["optimizer_s"]
            + out["drain_s"]
        )
        return out

    def summary(self) -> dict[str, Any] | None:
        """Per phase, the median over the kept steps (microbatch phases: per microbatch)."""
        if not self.steps:
            return None
        out = _median_phases(self.steps)
        out["timed_steps"] = len(self.steps)
        out["clock"] = "cuda" if self.cuda else "host"
        out["steps"] = self.steps
        return out


_BREAKDOWN_INFO = ("timed_steps", "clock", "steps", "rounds")
"""Breakdown keys that are not phases."""


def _median_phases(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per phase key of ``items`` (steps, or rounds' summaries), the median over them;
    microbatch phases (lists) per microbatch."""
    out: dict[str, Any] = {}
    for key, first in items[0].items():
        if key in _BREAKDOWN_INFO:
            continue
        if isinstance(first, list):
            out[key] = [statistics.median(i[key][m] for i in items) for m in range(len(first))]
        else:
            out[key] = statistics.median(i[key] for i in items)
    return out


def merge_breakdowns(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' breakdowns as one: per phase, the median over the rounds of each round's
    median; ``steps``: every round's, in order; ``timed_steps``: per round."""
    if len(rounds) == 1:
        return rounds[0]
    out = _median_phases(rounds)
    out["timed_steps"] = rounds[0]["timed_steps"]
    out["clock"] = rounds[0]["clock"]
    out["rounds"] = len(rounds)
    out["steps"] = [step for b in rounds for step in b["steps"]]
    return out


class _Phased:
    """``offloader`` with the runner's brackets marked: begin_microbatch starts a forward,
    end_iteration ends the backward phase (the optimizer follows). Everything else is the
    offloader's own."""

    def __init__(self, offloader: Offloader, phases: _Phases) -> None:
        self._offloader = offloader
        self._phases = phases

    def __getattr__(self, name: str) -> Any:
        return getattr(self._offloader, name)

    def begin_microbatch(self, microbatch: int) -> None:
        self._phases.forward_start(microbatch)
        self._offloader.begin_microbatch(microbatch)

    def end_iteration(self) -> None:
        with self._phases.end_iteration():
            self._offloader.end_iteration()


@contextlib.contextmanager
def _profiled(device: torch.device, path: Path) -> Iterator[None]:
    """A torch.profiler trace (CPU, and CUDA on a GPU) of the enclosed code, written to
    ``path`` (a chrome trace, gzipped)."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()  # the step's device work inside the trace
    plain = path.with_suffix("")  # x.json.gz -> x.json
    prof.export_chrome_trace(str(plain))
    with plain.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


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
    """``--trace``: the trace's ``harness.timeline`` figures, or why there are none."""
    host_time: dict[str, Any] | str | None = None
    """``--host-time``: ``harness.hostclock.HostTime`` of one extra run, or why there is none."""

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
    last_forward_mb = [mb for kind, mb in order if kind == "F"][-1]
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


def trace_step(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    warmup: int,
    path: Path,
) -> None:
    """Train ``warmup`` steps, then profile one steady step into ``path`` (phases as ranges)."""
    order = schedule_order(run.schedule, run.microbatches)
    phases = _Phases(device, order, annotate=True)

    def step_context(step: int) -> contextlib.AbstractContextManager[object]:
        if step != warmup:
            return contextlib.nullcontext()
        return phases.around(_profiled(device, path))

    hooks = RunHooks(
        step_context=step_context, after_forward=lambda step, mb: phases.forward_end(mb)
    )
    run = run.replace(steps=warmup + 1)
    train(spec, run, _Phased(offloader, phases), device, hooks=hooks)  # type: ignore[arg-type]


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


def _ratio_text(ratios: Sequence[float]) -> str:
    """``1.012x``, and with several rounds ``1.012x (1.004-1.031 over 3 rounds)``."""
    text = f"{statistics.median(ratios):.3f}x"
    if len(ratios) > 1:
        text += f" ({min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds)"
    return text


def trace_variant(
    factory: Factory,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
    path: Path,
) -> str:
    """The trace of one variant: its path, or why there is none."""

    def work(offloader: Offloader) -> str:
        trace_step(spec, run, offloader, device, warmup, path)
        return str(path)

    return _with_offloader(factory, config, device, work)


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def copy_rates(
    group_bytes: int, factories_: dict[str, Factory | str], repeats: int
) -> dict[str, Any]:
    """Raw pinned copy_ and each installed offloader's copy-only rates (GB/s) at one size."""
    size = max(MIB, group_bytes // MIB * MIB)
    count = max(2, min(16, COPY_BENCH_BUDGET // size))
    raw_d2h, raw_h2d = bench_offload.raw_rates(size, count, repeats)
    moved = size * count / GB
    out: dict[str, Any] = {
        "size_bytes": size,
        "groups": count,
        "raw": {"d2h_gbs": moved / raw_d2h, "h2d_gbs": moved / raw_h2d},
    }
    for name, factory in factories_.items():
        if name == "baseline" or isinstance(factory, str):
            continue
        try:
            d2h, h2d = bench_offload.offload_rates(size, count, repeats, factory)
        except Exception as exc:
            out[name] = {"status": f"failed: {type(exc).__name__}: {_line(exc)}"}
            continue
        out[name] = {"d2h_gbs": moved / d2h, "h2d_gbs": moved / h2d}
    return out


# ------------------------------------------------------------------------------------ targets
@dataclass(frozen=True, kw_only=True)
class Target:
    """One issue-9 target on one model: measured value and verdict."""

    model: str
    target: str
    measured: str
    verdict: str
    """PASS, SHORT or n/a."""


def _baseline_spread(base: VariantResult, margin: float = 0.03) -> str:
    """``'; baseline rounds A-B ms'`` when the baseline's round medians differ by more than
    ``margin`` (the 1.03x target's): host noise that size moves a 3% verdict (on the H200 the
    launch-bound ``hybrid-small`` baseline's rounds spanned 49.4-66.9 ms in one run)."""
    rounds = base.round_step_s
    if len(rounds) < 2 or max(rounds) <= min(rounds) * (1 + margin):
        return ""
    return f"; baseline rounds {min(rounds) * 1e3:.1f}-{max(rounds) * 1e3:.1f} ms"


def _compute_short(entry: dict[str, Any]) -> str | None:
    """Why the baseline's device compute cannot hide the reference's copies at the raw rate
    (the D2H copies overlap the forwards, the H2D copies the backwards), or None when it can
    or was not measured."""
    compute = entry.get("baseline_compute")
    if not isinstance(compute, dict) or entry.get("raw_d2h_s") is None:
        return None
    short = [
        f"{kind} copies at the raw rate {copies * 1e3:.1f} ms > {phase} compute {busy * 1e3:.1f} ms"
        for kind, copies, phase, busy in (
            ("D2H", entry["raw_d2h_s"], "forward", compute["forward_s"]),
            ("H2D", entry["raw_h2d_s"], "backward", compute["backward_s"]),
        )
        if copies > busy
    ]
    return "; ".join(short) or None


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "SHORT"


def targets(name: str, entry: dict[str, Any]) -> list[Target]:
    """The targets this model's figures can judge."""
    v: dict[str, VariantResult] = entry["variants"]
    base, ref = v["baseline"].step_s, v["reference"].step_s
    out: list[Target] = []

    def add(target: str, measured: str, verdict: str) -> None:
        out.append(Target(model=name, target=target, measured=measured, verdict=verdict))

    if base is None or ref is None:
        add("reference vs baseline", "baseline or reference did not run", "n/a")
        return out
    raw_copy_s = entry.get("raw_copy_s")
    hidden_by = _compute_short(entry)
    if raw_copy_s is None:
        add("reference step <= 1.03x baseline (hideable)", "no raw rate (CPU)", "n/a")
    elif raw_copy_s < base and hidden_by is not None:
        ratios = round_ratios(v["reference"], v["baseline"])
        add(
            "reference step <= 1.03x baseline (hideable)",
            f"not hideable: {hidden_by}; not copy-bound either (copies at the raw rate "
            f"{raw_copy_s * 1e3:.1f} ms < baseline step {base * 1e3:.1f} ms): the step is "
            f"host-bound; reference {_ratio_text(ratios)}",
            "n/a",
        )
    elif raw_copy_s < base:
        ratios = round_ratios(v["reference"], v["baseline"])
        add(
            "reference step <= 1.03x baseline (hideable)",
            _ratio_text(ratios) + _baseline_spread(v["baseline"]),
            _verdict(statistics.median(ratios) <= 1.03),
        )
    else:
        add(
            "reference step <= 1.03x baseline (hideable)",
            f"copy-bound: copies at the raw rate {raw_copy_s * 1e3:.1f} ms > baseline step "
            f"{base * 1e3:.1f} ms",
            "n/a",
        )
        share = raw_copy_s / ref
        add(
            "reference >= 90% of raw copy rate (copy-bound step)",
            f"{share:.1%}",
            _verdict(share >= 0.9),
        )
    rates = entry.get("copy_rates") or {}
    if "d2h_gbs" in rates.get("reference", {}):
        for direction in ("d2h", "h2d"):
            share = rates["reference"][f"{direction}_gbs"] / rates["raw"][f"{direction}_gbs"]
            add(
                f"reference >= 90% of raw {direction.upper()} rate (copy-only, "
                f"{rates['size_bytes'] // MIB} MiB groups)",
                f"{share:.1%}",
                _verdict(share >= 0.9),
            )
    peer = round_ratios(v["reference"], v["save_on_cpu"])
    if not peer:
        add("reference faster than save_on_cpu", v["save_on_cpu"].status, "n/a")
    else:
        add(
            "reference faster than save_on_cpu",
            f"{_ratio_text(peer)} its step",
            _verdict(statistics.median(peer) < 1),
        )
    mcore = round_ratios(v["reference"], v["mcore"])
    if not mcore:
        add("reference step <= 1.05x mcore", v["mcore"].status, "n/a")
    else:
        add(
            "reference step <= 1.05x mcore",
            _ratio_text(mcore),
            _verdict(statistics.median(mcore) <= 1.05),
        )
    return out


# ------------------------------------------------------------------------------------- driver
def default_min_tensor_size(device: torch.device) -> int:
    """``--min-tensor-size`` when not given: Megatron's 1 Mi elements on CUDA, 1024 on CPU (where
    the smoke-test models are too small for Megatron's)."""
    return 1024 if device.type == "cpu" else 1024 * 1024


def _setup(
    name: str, args: argparse.Namespace, device: torch.device
) -> tuple[BenchModel, tuple[str, ...], OffloadConfig, RunSpec]:
    """The model, its selection, the offload config and the timed run of one bench model."""
    model = bench_model(name)
    offload = selection(model, args.offload)
    config = OffloadConfig(
        offload_modules=offload,
        min_offloaded_tensor_size=args.min_tensor_size,
        max_inflight_offloads=args.max_inflight,
    )
    config.check_applies_to(model.spec)
    memory_steps = 1 if device.type == "cuda" else 0
    run = RunSpec(
        steps=args.warmup + args.steps + memory_steps,
        microbatches=args.microbatches,
        schedule=args.schedule,
        precision=args.precision,
    )
    return model, offload, config, run


def bench_one(
    name: str, args: argparse.Namespace, device: torch.device, found: dict[str, Factory | str]
) -> dict[str, Any]:
    """Every variant on one model, its copy rates and derived figures."""
    model, offload, config, run = _setup(name, args, device)
    breakdown = bool(getattr(args, "breakdown", False))
    rounds: dict[str, list[VariantResult]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # interleaved: every variant once per round, in VARIANTS order
        for v, done in rounds.items():
            if done and done[-1].status != "ok":
                continue  # missing or failed: not retried in later rounds
            done.append(
                run_variant(
                    found[v], model.spec, run, config, device, args.warmup, breakdown=breakdown
                )
            )
    variants = {v: combine_rounds(done) for v, done in rounds.items()}
    for result in variants.values():
        result.round_ratio = round_ratios(result, variants["baseline"])
    sizes = variants["reference"].group_bytes
    entry: dict[str, Any] = {
        "model": name,
        "rounds": args.rounds,
        "pattern": model.spec.pattern,
        "note": model.note,
        "offload": list(offload),
        "spec": {f: getattr(model.spec, f) for f in model.spec.__dataclass_fields__},
        "run": {
            "microbatches": run.microbatches,
            "schedule": run.schedule,
            "precision": run.precision,
        },
        "variants": variants,
        "copy_rates": None,
        "raw_copy_s": None,
    }
    if device.type == "cuda" and variants["baseline"].status == "ok":
        entry["baseline_compute"] = baseline_compute(
            found["baseline"], model.spec, run, config, device, args.warmup
        )
    if device.type == "cuda" and sizes:
        rates = copy_rates(int(statistics.mean(sizes)), found, args.repeats)
        entry["copy_rates"] = rates
        ref = variants["reference"]
        entry["raw_d2h_s"] = (ref.d2h_bytes or 0) / (rates["raw"]["d2h_gbs"] * GB)
        entry["raw_h2d_s"] = (ref.h2d_bytes or 0) / (rates["raw"]["h2d_gbs"] * GB)
        entry["raw_copy_s"] = entry["raw_d2h_s"] + entry["raw_h2d_s"]
    return entry


def baseline_compute(
    factory: Factory | str,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
) -> dict[str, float] | str:
    """The device compute of one traced steady baseline step (``harness.timeline``): the
    compute stream's busy seconds in the whole step and in its forwards and backwards, or why
    there are none. A profiler slows the host, not the device, so busy time is what an
    untraced step computes; it is what the copies can hide behind."""
    if isinstance(factory, str):
        return factory
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "baseline.pt.trace.json.gz"
        traced = trace_variant(factory, spec, run, config, device, warmup, path)
        if traced != str(path):
            return traced
        try:
            found = timeline.analyse(path, phases=("bench.forward", "bench.backward"))
        except Exception as exc:
            return f"not analysed: {type(exc).__name__}: {_line(exc)}"
    if found is None:
        return "no device events in the baseline's trace"
    phases = found.phase_busy_s
    if not (phases["bench.forward"] and phases["bench.backward"]):
        return "no compute found inside the baseline trace's forward or backward ranges"
    return {
        "step_s": found.busy_s,
        "forward_s": phases["bench.forward"],
        "backward_s": phases["bench.backward"],
    }


def host_time_variant(
    factory: Factory,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
) -> dict[str, Any] | str:
    """One run of a variant with its entry points on ``harness.hostclock``'s clock after the
    warmup steps: the per-step medians, or why there are none."""
    clocked = set(range(warmup, run.steps))
    found = _with_offloader(
        factory,
        config,
        device,
        lambda offloader: hostclock.run_clocked(spec, run, offloader, device, clocked=clocked),
    )
    return found if isinstance(found, str) else {**found.__dict__, "summary": found.summary()}


def host_time_one(
    entry: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    found: dict[str, Factory | str],
) -> None:
    """``--host-time``: one clocked run (warmup, then ``--host-time`` steps) per variant that
    ran in ``entry``'s timed run."""
    model, _, config, run = _setup(entry["model"], args, device)
    run = run.replace(steps=args.warmup + args.host_time)
    for name, result in entry["variants"].items():
        factory = found[name]
        if isinstance(factory, str) or result.status != "ok":
            result.host_time = f"not clocked: {result.status}"
            continue
        result.host_time = host_time_variant(factory, model.spec, run, config, device, args.warmup)


def host_time_line(entry: dict[str, Any], name: str) -> str:
    """What ``--host-time`` found for one variant, with its step's increase over the
    baseline's for scale."""
    variants = entry["variants"]
    found = variants[name].host_time
    if not isinstance(found, dict):
        return str(found or "not clocked")
    line = found["summary"]
    base, own = variants["baseline"], variants[name]
    if name != "baseline" and base.step_s is not None and own.step_s is not None:
        line += f"; timed step {(own.step_s - base.step_s) * 1e3:+.2f} ms vs baseline"
    return line


def trace_one(
    entry: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    found: dict[str, Factory | str],
) -> None:
    """One trace per variant that ran in ``entry``'s timed run, into ``args.trace``."""
    model, _, config, run = _setup(entry["model"], args, device)
    args.trace.mkdir(parents=True, exist_ok=True)
    self_times: dict[str, dict[str, float]] = {}
    for name, result in entry["variants"].items():
        factory = found[name]
        if isinstance(factory, str) or result.status != "ok":
            result.trace = f"not traced: {result.status}"
            continue
        path = args.trace / f"{entry['model']}_{name}.pt.trace.json.gz"
        result.trace = trace_variant(factory, model.spec, run, config, device, args.warmup, path)
        if result.trace == str(path):
            result.timeline, host = trace_timeline(path)
            if host is not None:
                self_times[name] = host
    host_vs_baseline(entry["variants"], self_times)


def host_vs_baseline(
    variants: dict[str, VariantResult], self_times: dict[str, dict[str, float]], top: int = 5
) -> None:
    """Into each variant's ``timeline`` that has host self times (``trace_timeline``): its host
    self time minus the baseline's, in total and for the ``top`` names that grew most
    (``harness.timeline.host_increase``)."""
    base = self_times.get("baseline")
    if base is None:
        return
    for name, own in self_times.items():
        if name != "baseline":
            variants[name].timeline["host_vs_baseline"] = {  # type: ignore[index]
                "total_s": sum(own.values()) - sum(base.values()),
                "top": [[n, s] for n, s in timeline.host_increase(base, own, top)],
            }


def trace_timeline(path: Path) -> tuple[dict[str, Any] | str, dict[str, float] | None]:
    """From one read of the trace at ``path``: ``harness.timeline``'s figures, or why there
    are none, and its host self times (``harness.timeline.host_self_times``; None without
    figures)."""
    try:
        trace = timeline.load_trace(path)
        found = timeline.analyse(trace)
        if found is None:
            return "no device events (CPU-only trace)", None
        return found.to_json(), timeline.host_self_times(trace)
    except Exception as exc:  # a trace we cannot read must not cost the run's other results
        return f"not analysed: {type(exc).__name__}: {_line(exc)}", None


def trace_line(result: VariantResult) -> str:
    """What ``--trace`` found for one variant: its timeline summary, or why there is none."""
    if isinstance(result.timeline, dict):
        host = result.timeline.get("host_vs_baseline")
        if host is None:
            return result.timeline["summary"]
        grown = ", ".join(f"{name} +{s * 1e3:.2f}" for name, s in host["top"]) or "nothing grew"
        return (
            f"{result.timeline['summary']}; host self time vs baseline "
            f"{host['total_s'] * 1e3:+.2f} ms ({grown})"
        )
    return result.timeline or result.trace or "not traced"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def render(entry: dict[str, Any], found_targets: list[Target]) -> str:
    """The model's tables as text."""
    v: dict[str, VariantResult] = entry["variants"]
    sizes = v["reference"].group_bytes
    groups = (
        f"{len(sizes)} offloaded groups/step of {min(sizes) / MIB:.1f}-{max(sizes) / MIB:.1f} MiB "
        f"(mean {statistics.mean(sizes) / MIB:.1f})"
        if sizes
        else "no group offloaded by the reference"
    )
    run = entry["run"]
    rounds = entry.get("rounds", 1)
    # One round: no range column (the table as before --rounds).
    range_head = f" {'range':>11}" if rounds > 1 else ""
    lines = [
        f"== {entry['model']} ({entry['pattern']}, {run['precision']}, {run['microbatches']} mb "
        f"{run['schedule']}, offload {'+'.join(entry['offload'])}): {groups}"
        + (f"; medians of {rounds} rounds" if rounds > 1 else ""),
        f"{'variant':<12} {'step ms':>9} {'x base':>7}{range_head} {'D2H MiB':>9} {'H2D MiB':>9} "
        f"{'eff GB/s':>9} {'fwd MiB':>9} {'peak MiB':>9}  status",
    ]
    for name, r in v.items():
        step = "-" if r.step_s is None else f"{r.step_s * 1e3:.2f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        spread = "-" if r.ratio_range is None else "{:.3f}-{:.3f}".format(*r.ratio_range)
        spread = f" {spread:>11}" if rounds > 1 else ""
        eff = "-" if r.effective_gbs is None else f"{r.effective_gbs:.1f}"
        lines.append(
            f"{name:<12} {step:>9} {ratio:>7}{spread} {_mib(r.d2h_bytes):>9} "
            f"{_mib(r.h2d_bytes):>9} {eff:>9} {_mib(r.after_forward_bytes):>9} "
            f"{_mib(r.peak_bytes):>9}  {r.status}"
        )
    lines += render_breakdown(entry)
    rates = entry.get("copy_rates")
    if rates:
        raw = rates["raw"]
        lines.append(
            f"copy-only at {rates['size_bytes'] // MIB} MiB x {rates['groups']} groups (GB/s): "
            f"raw pinned copy_ D2H {raw['d2h_gbs']:.1f} H2D {raw['h2d_gbs']:.1f}"
        )
        for name, r in rates.items():
            if name in ("raw", "size_bytes", "groups"):
                continue
            if "status" in r:
                lines.append(f"  {name:<12} {r['status']}")
                continue
            lines.append(
                f"  {name:<12} D2H {r['d2h_gbs']:.1f} ({r['d2h_gbs'] / raw['d2h_gbs']:.0%})  "
                f"H2D {r['h2d_gbs']:.1f} ({r['h2d_gbs'] / raw['h2d_gbs']:.0%})"
            )
    lines += render_compute(entry)
    for t in found_targets:
        lines.append(f"[{t.verdict:<5}] {t.target}: {t.measured}")
    return "\n".join(lines)


def render_compute(entry: dict[str, Any]) -> list[str]:
    """The baseline's device compute next to the copies at the raw rate (CUDA only)."""
    lines: list[str] = []
    v: dict[str, VariantResult] = entry["variants"]
    compute = entry.get("baseline_compute")
    if isinstance(compute, dict):
        base = v["baseline"].step_s
        lines.append(
            f"device compute of a traced baseline step: busy {_ms(compute['step_s'])} of a "
            f"{_ms(base)} ms step, forwards {_ms(compute['forward_s'])}, backwards "
            f"{_ms(compute['backward_s'])}"
            + (
                f"; reference copies at the raw rate D2H {_ms(entry['raw_d2h_s'])}, H2D "
                f"{_ms(entry['raw_h2d_s'])}"
                if entry.get("raw_d2h_s") is not None
                else ""
            )
        )
    elif compute is not None:
        lines.append(f"device compute of the baseline: {compute}")
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def render_breakdown(entry: dict[str, Any]) -> list[str]:
    """The ``--breakdown`` table (none without it): median ms per phase, then each variant's
    difference to the baseline."""
    v: dict[str, VariantResult] = entry["variants"]
    measured = {name: r.breakdown for name, r in v.items() if r.breakdown}
    if not measured:
        return []
    M = entry["run"]["microbatches"]
    columns = [f"fwd{m}" for m in range(M)] + [f"bwd{m}" for m in range(M)]
    columns += ["end_it", "optim", "drain", "other"]

    def cells(b: dict[str, Any]) -> list[float]:
        return [
            *b["forward_s"],
            *b["backward_s"],
            b["end_iteration_s"],
            b["optimizer_s"],
            b["drain_s"],
            b["other_s"],
        ]

    first = next(iter(measured.values()))
    clock = "CUDA events on the compute stream" if first["clock"] == "cuda" else "host clock"
    medians = f"medians of {first['timed_steps']} timed steps"
    if first.get("rounds", 1) > 1:
        medians += f" per round, median of {first['rounds']} rounds"
    lines = [
        f"breakdown (ms, {medians}, {clock}): fwd/bwd per "
        "microbatch, end_it the offloader's end_iteration, optim the optimizer, drain side "
        "streams after compute, other the rest",
        f"{'variant':<12} {'step ms':>9} " + " ".join(f"{c:>7}" for c in columns),
    ]
    for name, r in v.items():
        b = measured.get(name)
        if b is None:
            lines.append(f"{name:<12} {'-':>9}  {r.status}")
            continue
        values = " ".join(f"{x * 1e3:>7.2f}" for x in cells(b))
        lines.append(f"{name:<12} {_ms(b['step_s']):>9} {values}")
    base = measured.get("baseline")
    others = [name for name in measured if name != "baseline"]
    if base is not None and others:
        lines.append("minus baseline (ms):")
        for name in others:
            b = measured[name]
            diffs = [x - y for x, y in zip(cells(b), cells(base), strict=True)]
            values = " ".join(f"{d * 1e3:>+7.2f}" for d in diffs)
            step = f"{(b['step_s'] - base['step_s']) * 1e3:+.2f}"
            lines.append(f"{name:<12} {step:>9} {values}")
    return lines


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return names


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _inflight(value: str) -> int | None:
    return None if value == "none" else int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-harness bench", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument(
        "--models",
        type=_names,
        default=None,
        help="comma-separated presets or bench models "
        f"({', '.join(BENCH_MODELS)}); default hybrid-small,moe-small,moe-bench,hybrid-bench "
        "(hybrid-tiny on cpu)",
    )
    p.add_argument("--steps", type=_positive, default=10, help="timed steps (default 10)")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=3,
        help="runs of every variant per model, interleaved (baseline, reference, mcore, "
        "save_on_cpu, then again); step ratios are per round, reported as median and range "
        "(default 3)",
    )
    p.add_argument(
        "--warmup",
        type=_positive,
        default=2,
        help="untimed steps first, >= 1: step 0 is the offloader's warmup (default 2)",
    )
    p.add_argument("--microbatches", type=_positive, default=2)
    p.add_argument("--schedule", default="sequential", choices=("sequential", "gpipe", "1f1b"))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--offload", type=_names, default=None, help="group names (default: per model)")
    p.add_argument(
        "--min-tensor-size",
        type=int,
        default=None,
        help="min_offloaded_tensor_size in elements (default Megatron's 1048576; 1024 on cpu)",
    )
    p.add_argument("--max-inflight", type=_inflight, default=None, help="int or none (default)")
    p.add_argument("--repeats", type=_positive, default=5, help="copy-only repeats (default 5)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench.json")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="per variant: median forward/backward time per microbatch, end_iteration, "
        "optimizer and drain over the timed steps (CUDA events; several rounds: median of the "
        "rounds' medians), in the table and bench.json",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write one torch.profiler chrome trace (CPU+CUDA) of one steady step per variant "
        "into DIR (<model>_<variant>.pt.trace.json.gz; extra runs after the timed ones) and "
        "print its device timeline (harness.timeline)",
    )
    p.add_argument(
        "--host-time",
        type=_positive,
        default=None,
        metavar="STEPS",
        help="after the timed rounds, one more run per variant with STEPS steps after the "
        "warmup in which the host time inside each offloader entry point is clocked "
        "(harness.hostclock; no profiler); per variant its median per step by entry point",
    )
    return p


def _device(value: str) -> torch.device:
    try:
        device = torch.device(value)
    except RuntimeError:
        device = torch.device("meta")  # any unsupported kind: the message below
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "needs a CUDA device and none is visible (smoke test: --device cpu --models "
                "hybrid-tiny)"
            )
        if device.index is not None:
            torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _json(value: Any) -> Any:
    if isinstance(value, VariantResult | Target):
        fields = dict(value.__dict__)
        if isinstance(value, VariantResult):
            fields["effective_gbs"] = value.effective_gbs
            fields["ratio"] = value.ratio
            fields["ratio_range"] = value.ratio_range
            for optional in ("breakdown", "trace", "timeline", "host_time"):  # only when asked
                if fields[optional] is None:
                    del fields[optional]
        return fields
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        device = _device(args.device)
        cpu = device.type == "cpu"
        args.models = args.models or (
            ("hybrid-tiny",) if cpu else ("hybrid-small", "moe-small", "moe-bench", "hybrid-bench")
        )
        if args.min_tensor_size is None:
            args.min_tensor_size = default_min_tensor_size(device)
        for name in args.models:
            _setup(name, args, device)  # the selection and the offload config's own rules
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    found = factories()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"bench on {where}, torch {torch.__version__}; variants: "
        + ", ".join(f"{v} ({f})" if isinstance(f, str) else v for v, f in found.items()),
        flush=True,
    )
    entries, all_targets = [], []
    with no_deterministic_fill():  # see the module docstring
        for name in args.models:
            entry = bench_one(name, args, device, found)
            found_targets = targets(name, entry)
            entries.append(entry)
            all_targets += found_targets
            print(render(entry, found_targets), flush=True)
        if args.trace is not None:
            for entry in entries:
                trace_one(entry, args, device, found)
                for name, result in entry["variants"].items():
                    print(f"trace {entry['model']}/{name}: {trace_line(result)}", flush=True)
            print(f"traces in {args.trace}/ (<model>_<variant>.pt.trace.json.gz)")
        if args.host_time:
            for entry in entries:
                host_time_one(entry, args, device, found)
                for name in entry["variants"]:
                    line = host_time_line(entry, name)
                    print(f"host time {entry['model']}/{name}: {line}", flush=True)
    out = args.out if args.out is not None else run_folder(Path("reports"))
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "harness_version": HARNESS_VERSION,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "commit": commit_info(),
        "device": str(device),
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "models": entries,
        "targets": all_targets,
    }
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2, default=_json) + "\n")
    print(f"wrote {path}")
    failed = [
        f"{e['model']}/{v}"
        for e in entries
        for v, r in e["variants"].items()
        if r.status.startswith("failed")
    ]
    if failed:
        print(f"bench: failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
