"""Running a case: the runs each check needs and the facts it asserts on.

Shared by the pytest cases and ``offload-harness run``, so both judge a case the same way.

* ``run_case`` - plain baseline, hooks baseline and offload run of the same spec and seed. The
  offload run's warmup step is profiled (proof that the offload happened) and so is its final
  step (counts per group against the independent prediction of ``harness.predict``, made from
  what the hooks run recorded); one more step runs with the offloader disabled.
* ``run_memory`` - CUDA only: memory right after the last forward and peak, baseline vs offload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harness import distributed, globalstate
from harness.cases import Case
from harness.compare import (
    Verdict,
    first_divergence,
    first_tensor_difference,
    layout_verdict,
    verdict,
)
from harness.impls import IMPLS
from harness.learn import LEARNING_STEPS, ObservedRule, expected_fields, learn
from harness.observe import Copy, Observed, Windowed, corrupted_reloads, observe
from harness.offload.backends import capabilities, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.layout import LayoutBaseline
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import GroupRecord, Offloader, plan_of
from harness.offload.recorder import GroupObservation, RecordingOffloader
from harness.offload.semantics import MEGATRON_MAIN, GroupKey, Semantics
from harness.predict import (
    Expected,
    freed_storages,
    in_flight_after_forward,
    predict,
    prefetched_before,
    redundant_reload_bytes,
    reload_sizes,
)
from harness.spec import ModelSpec, RunSpec, chunk_layers, group_template, model_chunks, pass_label
from harness.syncguard import (
    GUARDED_STEP,
    GuardedOffloader,
    GuardedRun,
    HostSyncError,
    SyncGuard,
    guarded_steps_hooks,
)
from harness.train import RunHooks, TrainResult, last_forward_index, schedule_order, train
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
    undeclared: bool = False
    """Judge the backend as if it declared no semantics: its rule is learned from its copies
    (``harness.learn``) even where its factory declares one (``mutation-score --undeclared``)."""

    def offloader(self, config: OffloadConfig) -> Offloader:
        """The backend, built under ``harness.globalstate``'s guard: a change it makes to
        process-global torch state is a ``GlobalStateChanged``, and undone."""
        with globalstate.guarded("when built"):
            return resolve_backend(self.backend)(config, self.device)

    @property
    def declared(self) -> Semantics | None:
        """The copy rules the backend's factory declares (the reference's and megatron-core's
        adapters declare theirs), or None: its rule is then learned from what it does."""
        return None if self.undeclared else capabilities(self.backend).semantics

    def spec(self, case: Case) -> ModelSpec:
        spec = case.model_spec(self.model_size)
        case.offload_config().check_applies_to(spec)
        return spec


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
    problems = [
        f"{pass_label(p, case.schedule)}: no {name} group moved bytes {way} in the profiled "
        "warmup step"
        for p in range(microbatches * chunks)
        for name in selected[p % chunks]
        if (p, name) not in seen
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


@dataclass(kw_only=True)
class CaseRun:
    """Everything one case's runs produced; the checks in ``harness.checks`` read it."""

    case: Case
    plain: TrainResult
    hooks: TrainResult
    offload: TrainResult
    verdict: Verdict
    """Offload vs the plain and hooks baselines."""
    grad_difference: tuple[int, str, float] | None
    """(step, parameter, max |diff|) of the first gradient not bitwise equal to plain's."""
    weight_difference: tuple[str, float] | None
    warmup_transfers: TransferCounts
    """Profiler counts of the warmup step (step 0)."""
    proof_problems: list[str]
    observations: list[GroupObservation]
    """What each group saved (one iteration of the hooks baseline)."""
    expected: dict[GroupKey, Expected]
    """Prediction per group occurrence for the final step: the steady state, or the warmup
    when the run has one step."""
    counts: TransferCounts
    """Profiler counts of the final step."""
    logged: dict[GroupKey, dict[str, int]] | None
    """The offloader's own log of the final step (None if it keeps none)."""
    disabled: TransferCounts
    """Profiler counts of a step with the offloader disabled."""
    disabled_observed: TransferCounts = field(default_factory=lambda: TransferCounts({}))
    """The copy observer's counts of that step."""
    attribution: Attribution | None = None
    """Where ``counts`` and ``warmup_transfers`` came from, with the other side's counts."""
    semantics: Semantics = MEGATRON_MAIN
    """The copy rules the prediction used: the backend's declaration, or the rule learned from
    its copies (``rule``)."""
    rule: ObservedRule | None = None
    """The rule learned from an undeclared backend's warmup and first steady step (None: it
    declares its semantics)."""
    runner_copies: tuple[TransferCounts, TransferCounts] | None = None
    """Profiler counts of the plain run's first and final steps: the copies the runner makes
    without any offloader (e.g. FSDP2's), which no offload group range can claim."""
    per_step: tuple[TransferCounts, ...] = ()
    """The copy observer's counts of every training step, by the harness's windows (the model's
    own copies removed): what the every-step checks read."""
    corrupted: tuple[tuple[int, str], ...] = ()
    """(step, where) of every saved tensor whose reload's checksum differed from its pack-time
    checksum in the offload run (``harness.observe.checksum``), in order."""
    checksummed: int = 0
    """Saved tensors whose pack and unpack checksums were compared in the offload run."""
    packed: tuple[dict[GroupKey, int], ...] = ()
    """Per step of the offload run: saved tensors each group occurrence packed through the
    harness's swapped pack hook (``harness.observe.Observed.packed``)."""
    unpacked: tuple[dict[GroupKey, int], ...] = ()
    """Per step: how many of those its backward unpacked, by group occurrence."""
    held: tuple[tuple[tuple[int, GroupKey, int], ...], ...] = ()
    """Per step: (step written, group, bytes) of the host storages observed D2H copies wrote
    that were still alive at the step's end (``harness.observe.Observed.held``)."""
    weight_copies: tuple[tuple[int, Copy], ...] = ()
    """(step, copy) of every D2H in the offload run whose source is a weight: a parameter's
    storage, a cast of a parameter a group saved, or a tensor the model marked
    not-offloadable (``harness.observe.Copy.weight``)."""
    weights_known: int = 0
    """Parameter storages the copy observer knew in the offload run (0: the check is blind)."""
    d2h_watched: int = 0
    """D2H copies the observer saw in the offload run (the model's own removed)."""
    warmup_expected: dict[GroupKey, Expected] = field(default_factory=dict)
    """The prediction for step 0 (the warmup); ``expected`` holds the steady one."""
    layout: TrainResult | None = None
    """The layout baseline, for a backend declaring contiguous reloads
    (``harness.offload.layout``): the offload run is compared with it instead of ``plain``."""
    plain_key: str = ""
    """``plain_key`` of the case: rows with the same one share one plain run."""
    plain_made_by: str = ""
    """The case whose run trained the plain baseline (this one's name, or an earlier row's)."""
    run_seconds: dict[str, float] = field(default_factory=dict)
    """Host seconds of each run (``plain``, ``hooks``, ``layout``, ``offload``, ``disabled``),
    where the case's time goes."""
    guarded: GuardedRun | HostSyncError | None = None
    """The host-sync check's guarded step ``GUARDED_STEP``, taken inside the offload run
    (``guards_in_offload_run``), or the sync that stopped it (the offload run was then made
    again without the guard); None where the check makes a run of its own."""
    seconds: float = 0.0

    @property
    def baseline(self) -> TrainResult:
        """The run the offload run must equal: the layout baseline where there is one, else
        the plain baseline."""
        return self.layout or self.plain

    def checksum_coverage(self) -> dict[str, int]:
        """How many of the offload run's reloads were checksummed (pack against unpack): saved
        tensors compared, saved tensors packed in the harness's windows, and D2H offload copies
        the observer attributed to a group over every step (what moved)."""
        return {
            "compared": self.checksummed,
            "packed": sum(sum(p.values()) for p in self.packed),
            "offload_copies": sum(c.totals()["d2h"].copies for c in self.per_step),
        }

    @property
    def measured(self) -> dict[GroupKey, dict[str, int]]:
        return self.counts.by_group()

    def mismatches(self) -> list[str]:
        """Group occurrences whose counted copies differ from the prediction, each with the
        rule behind the prediction."""
        return self._against(self.expected, self.counts, self.case.steps - 1)

    def step_mismatches(self) -> list[str]:
        """Every step but the final one (which ``mismatches`` judges by the offloader's own
        ranges where it opens any): the harness windows' counts per group occurrence against
        the warmup prediction in step 0 and the steady one afterwards, each with its rule."""
        return [
            line
            for step, counts in enumerate(self.per_step[:-1])
            for line in self._against(
                self.warmup_expected if step == 0 else self.expected, counts, step
            )
        ]

    def _against(
        self, expected: dict[GroupKey, Expected], counts: TransferCounts, step: int
    ) -> list[str]:
        whys = {k: e.why for k, e in expected.items() if e.why}
        device_type = "cuda" if counts.mode == "device" else "cpu"
        predicted = expected_fields(expected, self.semantics, device_type)
        return _diff(
            predicted,
            counts.by_group(),
            "predicted",
            "measured",
            whys,
            f"step {step}",
            self.case.schedule,
        )

    def step_log_mismatches(self) -> list[str]:
        """Every step but the final one: the offloader's log of that iteration against the
        windows' counts (offloaders that keep a log)."""
        logs = self.offload.logs[-len(self.per_step) :] if self.per_step else []
        if len(logs) != len(self.per_step):
            return []
        out = []
        for step, (log, counts) in enumerate(zip(logs[:-1], self.per_step[:-1], strict=True)):
            out += _diff(
                log_by_group(log.groups),
                counts.by_group(),
                "log",
                "counted",
                step=f"step {step}",
                schedule=self.case.schedule,
            )
        return out

    def log_mismatches(self) -> list[str]:
        """Group occurrences whose logged counts differ from the profiler's."""
        if self.logged is None:
            return []
        return _diff(
            self.logged,
            self.measured,
            "log",
            "counted",
            step=f"step {self.case.steps - 1}",
            schedule=self.case.schedule,
        )

    def moved_names(self) -> set[str]:
        return {name for (_, _, name), f in self.measured.items() if f["d2h_copies"]}


_ZERO = dict.fromkeys(COUNTER_FIELDS, 0)


def _diff(
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


def attribution_mismatches(res: CaseRun, final_step: int) -> list[str]:
    """Where the offloader's own ranges and the harness's windows disagree (cooperating
    backends only), per profiled step."""
    att = res.attribution
    if att is None or att.source != "offloader ranges":
        return []
    out = []
    for label, ranged, windows in (
        ("step 0", att.profiled[0], att.windows[0]),
        (f"step {final_step}", att.profiled[1], att.windows[1]),
    ):
        out += _diff(
            ranged.by_group(),
            windows.by_group(),
            "its ranges",
            "harness windows",
            step=label,
            schedule=res.case.schedule,
        )
    return out


def guards_in_offload_run(case: Case, env: Environment) -> bool:
    """Whether the case's offload run also arms the host-sync guard for its step
    ``GUARDED_STEP``, so the sync check trains nothing of its own (on the H200 that run was an
    eighth of the full matrix's test time): on CUDA, for an implementation the guard applies to,
    in a run whose profiled steps (the first and the last) are not that step. The guard changes
    no tensor; an offloader that synchronises fails that step, and the offload run is made
    again without it."""
    return (
        env.device.type == "cuda"
        and IMPLS[case.impl].sync_guard is None
        and case.run_spec().steps > GUARDED_STEP + 1
    )


@dataclass(frozen=True)
class _OffloadTraining:
    result: TrainResult
    sink: list[TransferCounts]
    seen: list[Observed]
    weights_known: int
    guard: SyncGuard | None


def _arming(
    inner: Callable[[int], contextlib.AbstractContextManager[object]] | None, guard: SyncGuard
) -> Callable[[int], contextlib.AbstractContextManager[object]]:
    """``inner``'s step context with ``guard`` armed inside it for step ``GUARDED_STEP``."""
    arm = guarded_steps_hooks(guard, {GUARDED_STEP})

    def context(step: int) -> contextlib.AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        if inner is not None:
            stack.enter_context(inner(step))
        stack.enter_context(arm(step))
        return stack

    return context


def run_case(case: Case, env: Environment) -> CaseRun:
    """The plain baseline, the hooks baseline's first training iteration (all of it when the
    offload run's losses differ from the plain baseline's, to classify the difference), the
    offload run (every step observed) and a disabled run; the prediction from the hooks run's
    records. The plain baseline is shared with the rows of the same ``plain_key``. A backend
    declaring contiguous reloads gets a layout baseline too, made after the prediction that
    decides its copies."""
    start = time.perf_counter()
    spec, run, config = env.spec(case), case.run_spec(), case.offload_config()
    kept = dict(keep_grads=True, keep_final_state=True, sharding=case.sharding)
    cuda = env.device.type == "cuda"
    seconds: dict[str, float] = {}
    with _timed(seconds, "plain"):  # ~0 when an earlier row's is reused
        shared = plain_baseline(case, env)
    plain, plain_sink = shared.result, shared.runner_copies
    recorder = RecordingOffloader(config, env.device)
    # Observed too, in step 0: the copies the model makes itself inside group windows (moving
    # nothing, the hooks baseline's copies are all the model's) are not the offloader's. They
    # are the same in every step (they do not depend on the offload), so step 0's stand for all.
    own: list[Observed] = []
    windowed = Windowed(recorder)
    last = run.steps - 1
    # Only its first training iteration is read (the records, the model's own copies), unless
    # the offload run differs from its baseline: then every step, for the diagnosis below.
    with _timed(seconds, "hooks"):
        hooks = train(
            spec,
            run.replace(steps=1),
            windowed,
            env.device,
            hooks=observe_steps(env.device, {0}, windowed, own),
            sharding=case.sharding,
        )
    observations = recorder.iterations[int(run.eval_first)]  # the first training iteration
    order = schedule_order(run.schedule, run.microbatches)
    declared = env.declared
    layout = None
    if declared is not None:  # an undeclared backend's rule is learned after its run
        warmup, steady = predict(observations, config, order, declared)
        if declared.reload_layout == "contiguous":
            with _timed(seconds, "layout"):
                layout = _layout_baseline(case, env, declared, warmup, steady)
    planned = [(o.layer, o.name) for o in observations if o.microbatch == order[0][1]]

    def offload_training(guarded: bool) -> _OffloadTraining:
        sink: list[TransferCounts] = []
        seen: list[Observed] = []
        guard = SyncGuard(env.device) if guarded else None
        with _closing(Windowed(env.offloader(config), checksums=True)) as offloader:
            plan_of(offloader, planned)
            hooks = profile_steps(
                env.device, {0, last}, sink, (offloader, seen), set(range(run.steps))
            )
            hooks.model_ready = offloader.note_model
            trained: Offloader = offloader
            if guard is not None:
                hooks.step_context = _arming(hooks.step_context, guard)
                trained = GuardedOffloader(offloader, guard)
            with globalstate.guarded("during the offload run", rng=False):
                result = train(spec, run, trained, env.device, hooks=hooks, **kept)
            return _OffloadTraining(result, sink, seen, len(offloader.state.weights), guard)

    guarded: GuardedRun | HostSyncError | None = None
    with _timed(seconds, "offload"):
        made: _OffloadTraining | None = None
        try:
            made = offload_training(guards_in_offload_run(case, env))
        except HostSyncError as exc:
            # The host-sync check's verdict, its message alone: the exception's traceback
            # would keep the aborted run's model and tensors alive.
            guarded = HostSyncError(str(exc))
        if made is None:  # made again without the guard (outside the handler, which holds it)
            made = offload_training(False)
    offload, sink, seen, weights_known = made.result, made.sink, made.seen, made.weights_known
    if made.guard is not None:
        guarded = GuardedRun.of(
            made.guard, {GUARDED_STEP}, offload, seen[GUARDED_STEP : GUARDED_STEP + 1]
        )
    mode = "device" if cuda else "cpu"
    mine = [s.without(own[0]) for s in seen]  # every step's
    per_step = [m.counts(mode) for m in mine]
    attribution = attribute(sink, mine, per_step)
    rule: ObservedRule | None = None
    semantics = declared
    if semantics is None:  # learned from the warmup and first steady step, held on every step
        learning = [per_step[s].by_group() for s in LEARNING_STEPS if s < len(per_step)]
        relaid = any(o.relaid for o in mine)
        rule = learn(observations, config, order, learning, env.device.type, relaid)
        semantics = rule.semantics
        warmup, steady = predict(observations, config, order, semantics)
        if semantics.reload_layout == "contiguous":
            with _timed(seconds, "layout"):
                layout = _layout_baseline(case, env, semantics, warmup, steady)
    final = warmup if last == 0 else steady  # a one-step run's final step is its warmup
    disabled: list[TransferCounts] = []
    disabled_seen: list[Observed] = []
    with (
        _closing(Windowed(env.offloader(config))) as offloader,
        _timed(seconds, "disabled"),
        globalstate.guarded("during the disabled run", rng=False),
    ):
        offloader.set_enabled(False)
        train(
            spec,
            run.replace(steps=1),
            offloader,
            env.device,
            # Its check reads the step's totals (the observer says which window copied).
            hooks=profile_steps(
                env.device, {0}, disabled, (offloader, disabled_seen), ranges=False
            ),
            sharding=case.sharding,
        )
    baseline = layout or plain  # what the offload run must equal
    diverged = first_divergence(plain.losses, offload.losses, case.tolerance) is not None
    if layout is None and diverged:
        full = Windowed(RecordingOffloader(config, env.device))
        with _timed(seconds, "hooks"):
            hooks = train(spec, run, full, env.device, sharding=case.sharding)
    result = CaseRun(
        case=case,
        plain=plain,
        hooks=hooks,
        offload=offload,
        verdict=(
            verdict(plain.losses, hooks.losses, offload.losses, case.tolerance)
            if layout is None
            else layout_verdict(plain.losses, layout.losses, offload.losses, case.tolerance)
        ),
        grad_difference=first_grad_difference(baseline, offload),
        weight_difference=first_tensor_difference(baseline.final_state, offload.final_state),
        layout=layout,
        per_step=tuple(per_step),
        corrupted=tuple(corrupted_reloads(seen)),
        weight_copies=tuple((step, c) for step, o in enumerate(mine) for c in o.weight_copies()),
        weights_known=weights_known,
        d2h_watched=sum(c.direction == "d2h" for o in mine for c in o.copies),
        checksummed=sum(o.checksummed for o in seen),
        packed=tuple(dict(o.packed) for o in seen),
        unpacked=tuple(dict(o.unpacked) for o in seen),
        held=tuple(tuple(o.held) for o in seen),
        warmup_expected=warmup,
        warmup_transfers=attribution.warmup,
        proof_problems=offload_proof(
            case, spec, attribution.warmup, run.microbatches, semantics, env.device, warmup
        ),
        observations=observations,
        expected=final,
        counts=attribution.final,
        attribution=attribution,
        semantics=semantics,
        rule=rule,
        logged=log_by_group(offload.logs[-1].groups) if offload.logs else None,
        disabled=disabled[0],
        disabled_observed=disabled_seen[0].without(own[0], any_window=True).counts(mode),
        runner_copies=plain_sink,
        plain_key=shared.key,
        plain_made_by=shared.made_by,
        run_seconds=seconds,
        guarded=guarded,
        seconds=time.perf_counter() - start,
    )
    # Compared: drop the copies (GBs on GPUs); the shared plain result keeps its own until the
    # next key replaces it.
    result.plain = dataclasses.replace(plain, grads=[], final_state={})
    for run_result in (offload, layout):
        if run_result is not None:
            run_result.grads, run_result.final_state = [], {}
    return result


def _layout_baseline(
    case: Case,
    env: Environment,
    semantics: Semantics,
    warmup: dict[GroupKey, Expected],
    steady: dict[GroupKey, Expected],
) -> TrainResult:
    """The layout baseline of a backend whose reloads come back contiguous: the same copies
    made on the device, following the prediction of which groups move in which step."""

    def moves(step: int, key: GroupKey) -> bool:
        expected = (warmup if step == 0 else steady).get(key)
        return expected is not None and expected.offloaded

    run = case.run_spec()
    copier = LayoutBaseline(
        case.offload_config(), env.device, semantics, moves, eval_first=run.eval_first
    )
    kept = dict(keep_grads=True, keep_final_state=True, sharding=case.sharding)
    return train(env.spec(case), run, copier, env.device, **kept)


@dataclass(frozen=True)
class SharedPlain:
    """A plain baseline and what identifies it: every row with the same ``key`` trains the same
    plain run, so the first one's serves them all (``plain_baseline``)."""

    key: str
    """A digest of what the plain run depends on (``plain_key``)."""
    made_by: str
    """The case whose run trained it."""
    result: TrainResult
    runner_copies: tuple[TransferCounts, TransferCounts] | None
    """Profiler counts of its first and final steps on CUDA (None on CPU)."""


_PLAIN: dict[str, SharedPlain] = {}
"""This process's latest plain baseline (one entry): rows sharing a key run one after another
(one pytest-xdist group per key, one worker call per key in ``offload-harness run``)."""


def forget_plain_baselines() -> None:
    """Drop this process's shared plain baseline and baseline memory reading (a test that
    changes how runs train)."""
    _PLAIN.clear()
    _MEMORY_BASELINE.clear()


def plain_key(case: Case, env: Environment) -> str:
    """What a case's plain baseline depends on - the model spec, the run spec (steps,
    microbatches, schedule, precision, seed, evaluation pass, optimizer), the sharding, the
    device and the world size - as a 12-digit digest; never the offload selection, the
    tolerance or the backend: the plain run has no offloader."""
    return _digest(env.spec(case), case.run_spec(), case.sharding, env.device)


def sharing_key(case: Case, env: Environment) -> str:
    """What schedules a case with the rows it shares a plain baseline with: ``plain_key``, or
    the case's own name for a row that does not apply to its model (it fails alone)."""
    try:
        return plain_key(case, env)
    except ValueError:
        return case.name


MAX_ROWS_SHARING = 4
"""The most case rows in one sharing group. The rows of a group run one after another on one
worker, which trains their plain baseline once; beyond this many, the further rows of a key
form further groups, each training the baseline again (about a second on the H200), so that
the full matrix's keys of 12 and 15 rows spread over the workers."""


def sharing_groups(cases: list[Case], env: Environment) -> list[str]:
    """Each case's group: ``plain-<sharing key>`` for its key's first ``MAX_ROWS_SHARING`` cases
    in table order, ``plain-<key>.2`` for the next ones, and so on (the pytest plugin's xdist
    groups, ``offload-harness run``'s bundles)."""
    seen: dict[str, int] = {}
    groups = []
    for case in cases:
        key = sharing_key(case, env)
        earlier = seen.get(key, 0)
        seen[key] = earlier + 1
        chunk = earlier // MAX_ROWS_SHARING
        groups.append(f"plain-{key}" + (f".{chunk + 1}" if chunk else ""))
    return groups


def _digest(spec: ModelSpec, run: RunSpec, sharding: str, device: torch.device) -> str:
    text = repr((spec, run, sharding, str(device), distributed.world_size()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plain_baseline(case: Case, env: Environment) -> SharedPlain:
    """The case's plain baseline: the one this process trained last if its key is the same,
    else trained now (and kept in its place)."""
    spec, run = env.spec(case), case.run_spec()
    key = _digest(spec, run, case.sharding, env.device)
    found = _PLAIN.get(key)
    if found is not None:
        return found
    _PLAIN.clear()
    sink: list[TransferCounts] = []
    result = train(
        spec,
        run,
        NoOffload(),
        env.device,
        # The runner's own copies only matter on CUDA (on CPU only copies inside offload
        # ranges are counted); profiling costs seconds per step on the CPU machine.
        hooks=profile_steps(env.device, {0, run.steps - 1}, sink, ranges=False)
        if env.device.type == "cuda"
        else None,
        keep_grads=True,
        keep_final_state=True,
        sharding=case.sharding,
    )
    shared = SharedPlain(key, case.name, result, (sink[0], sink[-1]) if sink else None)
    _PLAIN[key] = shared
    return shared


@contextlib.contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``seconds[name]``."""
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - began, 3)


@contextlib.contextmanager
def _closing(offloader: Offloader) -> Iterator[Offloader]:
    try:
        yield offloader
    finally:
        offloader.close()


def first_grad_difference(a: TrainResult, b: TrainResult) -> tuple[int, str, float] | None:
    """(step, parameter, max |diff|) of the first kept gradient that is not bitwise equal."""
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads, strict=True)):
        found = first_tensor_difference(ga, gb)
        if found is not None:
            return (step, *found)
    return None


def record_observations(case: Case, env: Environment) -> list[GroupObservation]:
    """What each group saves, from a one-step hooks run."""
    recorder = RecordingOffloader(case.offload_config(), env.device)
    one_step = case.run_spec().replace(steps=1)
    train(env.spec(case), one_step, recorder, env.device, sharding=case.sharding)
    return recorder.iterations[int(case.eval_first)]


def total(counts: TransferCounts) -> Counts:
    """All attributed and unattributed copies of both directions."""
    out = Counts()
    for c in [*counts.totals().values(), *counts.unattributed.values()]:
        out = out + c
    return out


@dataclass(kw_only=True)
class MemoryResult:
    """Memory right after the last forward of the final step, and that step's peak; every
    figure is relative to what was allocated before the run started."""

    case: Case
    predicted_drop: int
    """Bytes of the storages the in-flight offloaded groups free (``harness.predict``)."""
    baseline_requested: int
    """Bytes requested by the live allocations of the baseline after the last forward."""
    offload_requested: int
    baseline_allocated: int
    """``torch.cuda.memory_allocated`` of the baseline after the last forward."""
    offload_allocated: int
    rounding: int
    """Allocator rounding measured on the live blocks of both runs (block size - request)."""
    baseline_peak: int
    offload_peak: int
    peak_allowance: int
    """Duplicate whole-storage reloads of the two largest offloaded groups (see
    ``harness.predict.redundant_reload_bytes``): what Megatron's per-tensor copies may add."""
    predicted_sizes: Counter[int]
    """Bytes of each storage predicted to be freed."""
    predicted_extra: Counter[int] = dataclasses.field(default_factory=Counter)
    """Blocks predicted live only in the offload run: reloads of groups reloaded ahead of their
    backward beyond the storages they freed (``harness.predict.reload_sizes``)."""
    freed_sizes: Counter[int]
    """Requested bytes of live blocks the baseline holds and the offload run does not."""
    extra_sizes: Counter[int]
    """Requested bytes of live blocks only the offload run holds."""
    floor_freed: tuple[int, int] = (0, 0)
    """Blocks (count, bytes) live before a run started that it freed before its reading (both
    runs together): memory of earlier runs or process caches released meanwhile, counted in
    neither reading (reported with any memory problem)."""
    replaced_sizes: Counter[int] = dataclasses.field(default_factory=Counter)
    """Requested bytes of the blocks that replaced such freed blocks with the same sizes (a
    process cache re-created during a run; both runs), also counted in neither reading."""
    baseline_sites: dict[int, str] = dataclasses.field(default_factory=dict)
    """Requested size -> where the baseline allocated one of its counted blocks of that size
    (innermost Python frames outside torch; from the allocator's history, recorded during the
    memory runs), to name the owner of a block the prediction does not explain."""
    offload_sites: dict[int, str] = dataclasses.field(default_factory=dict)
    """The same for the offload run."""
    baseline_key: str = ""
    """The ``plain_key`` the baseline reading was read for (rows with one key share it)."""
    baseline_made_by: str = ""
    """The case whose memory check read it."""

    @property
    def requested_drop(self) -> int:
        return self.baseline_requested - self.offload_requested

    @property
    def allocated_drop(self) -> int:
        return self.baseline_allocated - self.offload_allocated


def run_memory(
    case: Case,
    env: Environment,
    observations: list[GroupObservation] | None = None,
    semantics: Semantics | None = None,
) -> MemoryResult:
    """Baseline vs offload memory after the last forward and at the final step's peak, in runs
    of the case's first ``MEMORY_STEPS`` steps (``memory_run_spec``).

    The drop is compared in requested bytes (the sum of the sizes the live allocations asked
    for), which the caching allocator's rounding does not touch, so it must equal the
    prediction exactly; ``memory_allocated`` counts rounded blocks, so its drop may differ by
    the rounding the snapshot shows on the live blocks of the two runs.

    ``observations`` are the hooks baseline's records of the case's first training iteration
    (``CaseRun.observations``; recorded here when not given); ``semantics`` the rule the case run
    predicted with (``CaseRun.semantics``: needed for a backend that declares none, whose rule
    is learned there). The baseline reading (no offload)
    depends only on the case's ``plain_key``: rows sharing it, which run one after another, read
    it once (``memory_baseline``).
    """
    if env.device.type != "cuda":
        raise ValueError("the memory case needs a CUDA device")
    spec, run, config = env.spec(case), memory_run_spec(case), case.offload_config()
    order = schedule_order(run.schedule, run.microbatches)
    last_forward = last_forward_index(order)
    if observations is None:
        observations = record_observations(case, env)
    semantics = semantics or env.declared
    if semantics is None:
        raise ValueError("an undeclared backend's memory reading needs its case run's rule")
    warmup, steady = predict(observations, config, order, semantics)
    if run.steps == 1:  # the final step is the warmup
        steady = warmup
    early = prefetched_before(observations, steady, order, last_forward)
    in_flight = in_flight_after_forward(order, last_forward)
    # A group reloaded ahead of its backward (``early``) freed its storages like any offloaded
    # one and holds its reloads instead: one allocation per copied tensor, so a tensor saved
    # twice or a storage copied whole for two views comes back as more blocks than it was.
    freed = freed_storages(observations, steady, in_flight)
    reloaded = Counter(
        size
        for o in observations
        if (o.microbatch, o.layer, o.name) in early and o.microbatch in in_flight
        for size in reload_sizes(o, config, semantics)
    )
    redundant = sorted(
        redundant_reload_bytes(o, config, semantics)
        for o in observations
        if steady[(o.microbatch, o.layer, o.name)].offloaded
    )
    last_mb = order[last_forward][1]
    with _allocation_sites(env.device):
        shared = memory_baseline(case, env)
        base = shared.reading
        with _closing(env.offloader(config)) as offloader:
            off = _memory_run(spec, run, offloader, env.device, last_mb, case.sharding)
    return MemoryResult(
        case=case,
        predicted_drop=sum(freed.values()) - sum(size * n for size, n in reloaded.items()),
        baseline_requested=base.requested,
        offload_requested=off.requested,
        baseline_allocated=base.allocated,
        offload_allocated=off.allocated,
        rounding=base.rounding + off.rounding,
        baseline_peak=base.peak,
        offload_peak=off.peak,
        peak_allowance=sum(redundant[-2:]),
        predicted_sizes=Counter(freed.values()) - reloaded,
        predicted_extra=reloaded - Counter(freed.values()),
        freed_sizes=base.blocks - off.blocks,
        extra_sizes=off.blocks - base.blocks,
        floor_freed=(
            base.floor_freed[0] + off.floor_freed[0],
            base.floor_freed[1] + off.floor_freed[1],
        ),
        replaced_sizes=base.replaced + off.replaced,
        baseline_sites=base.sites,
        offload_sites=off.sites,
        baseline_key=shared.key,
        baseline_made_by=shared.made_by,
    )


MEMORY_STEPS = 2
"""Steps a memory run trains: the warmup and one steady step, whose last forward is read.
Every later steady step opens, offloads and frees the same storages (the policies are decided
once, at the end of the warmup), so a longer run reads the same bytes, each further step adding
only cost; the case run's every-step transfer checks are what watch the steps in between."""


def memory_run_spec(case: Case) -> RunSpec:
    """The run spec of ``case``'s memory runs: its own, cut to ``MEMORY_STEPS`` steps."""
    run = case.run_spec()
    return run.replace(steps=min(run.steps, MEMORY_STEPS))


@dataclass(frozen=True)
class SharedMemoryBaseline:
    """A no-offload memory reading and what identifies it, like ``SharedPlain``."""

    key: str
    made_by: str
    reading: _MemoryReading


_MEMORY_BASELINE: dict[str, SharedMemoryBaseline] = {}
"""This process's latest baseline memory reading, by ``plain_key`` (one entry, like ``_PLAIN``)."""


def memory_baseline(case: Case, env: Environment) -> SharedMemoryBaseline:
    """The no-offload memory reading of ``case``: the one this process read last if its
    ``plain_key`` is the same (the reading depends on nothing else: the run has no
    offloader, and the microbatch read after is the schedule's), else read now."""
    key = plain_key(case, env)
    found = _MEMORY_BASELINE.get(key)
    if found is not None:
        return found
    _MEMORY_BASELINE.clear()
    run = memory_run_spec(case)
    order = schedule_order(run.schedule, run.microbatches)
    last_mb = order[last_forward_index(order)][1]
    reading = _memory_run(env.spec(case), run, NoOffload(), env.device, last_mb, case.sharding)
    shared = _MEMORY_BASELINE[key] = SharedMemoryBaseline(key, case.name, reading)
    return shared


@dataclass(frozen=True)
class _MemoryReading:
    allocated: int
    requested: int
    rounding: int
    peak: int
    blocks: Counter[int]
    floor_freed: tuple[int, int]
    replaced: Counter[int]
    sites: dict[int, str]


Block = tuple[int, int]
"""A live allocator block: (size, requested size) in bytes."""


def _live_blocks(device: torch.device, sites: dict[int, str] | None = None) -> dict[int, Block]:
    """The allocator's live blocks on ``device`` by address: (block size, requested size).

    With ``sites``, also fills it with each block's allocation site (``allocation_site``) where
    the allocator recorded one (``_allocation_sites``)."""
    live: dict[int, Block] = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", index) != index:
            continue
        address = int(segment["address"])  # blocks tile their segment in address order
        for block in segment.get("blocks", []):
            size = int(block["size"])
            address = int(block.get("address", address))
            if block.get("state") == "active_allocated":
                live[address] = (size, int(block.get("requested_size", size)))
                if sites is not None and block.get("frames"):
                    sites[address] = allocation_site(block["frames"])
            address += size
    return live


def allocation_site(frames: list[dict[str, Any]], depth: int = 2) -> str:
    """The innermost ``depth`` Python frames of an allocator stack (innermost first, as the
    snapshot lists them) outside torch's own package: ``file:line (function) < caller``."""
    own = [
        f
        for f in frames
        if f.get("filename", "").endswith(".py")
        and "/torch/" not in f["filename"].replace("\\", "/")
    ]
    shown = own[:depth] or frames[:depth]
    return " < ".join(
        f"{_short_path(f.get('filename', '?'))}:{f.get('line', '?')} ({f.get('name', '?')})"
        for f in shown
    )


def _short_path(filename: str) -> str:
    """A site's file from its package root (``megatron/core/...``, ``harness/...``)."""
    parts = filename.replace("\\", "/").split("/")
    for root in ("megatron", "transformer_engine", "harness", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root) :])
    return "/".join(parts[-2:])


@contextlib.contextmanager
def _allocation_sites(device: torch.device) -> Iterator[None]:
    """Record the Python stack of every CUDA allocation on ``device`` meanwhile (the
    allocator's history, state only: no event trace), so a reading can name where an
    unexplained block came from; off again afterwards."""
    record = torch.cuda.memory._record_memory_history
    record(enabled="state", context="alloc", stacks="python", device=device)
    try:
        yield
    finally:
        record(enabled=None, device=device)


@dataclass(frozen=True)
class _BlockChange:
    """How the live blocks changed since a run started (see ``_block_change``)."""

    new: Counter[Block]
    """What the run allocated and still holds."""
    replaced: Counter[Block]
    """Blocks gone since the start, each matched by a new one of the same sizes."""
    gone: Counter[Block]
    """Blocks live at the start and not now (``replaced`` among them)."""


def _block_change(now: dict[int, Block], before: dict[int, Block]) -> _BlockChange:
    """Blocks live ``now`` and not ``before`` (same address and sizes), less one block of the
    same sizes for each block of ``before`` that is gone: what the run allocated, whatever else
    was freed meanwhile.

    Memory a run frees without having allocated it: on the H200 megatron-core kept a finished
    run reachable until the next one replaced its globals (937 MB, before ``harness.models.mcore``
    emptied a run's storages at its end), and megatron-core and TransformerEngine replace
    process caches during a run (128 KiB and 512-B blocks, up to 1.4 MB, on every mcore row;
    the 128 KiB ones were earlier models' rotary tables in ``RotaryEmbedding.forward``'s
    ``lru_cache``, which ``harness.models.mcore`` now empties at a run's end), freeing the old block
    and allocating one of the same sizes at the same address or not. The readings count
    neither."""
    added = Counter(block for address, block in now.items() if before.get(address) != block)
    gone = Counter(block for address, block in before.items() if now.get(address) != block)
    return _BlockChange(new=added - gone, replaced=added & gone, gone=gone)


def _requested(blocks: Counter[Block]) -> Counter[int]:
    """The requested sizes of ``blocks``."""
    sizes: Counter[int] = Counter()
    for (_, requested), n in blocks.items():
        sizes[requested] += n
    return sizes


def _settled(device: torch.device) -> None:
    """Let everything pending be freed (collect cycles, finish the streams, let the process
    group drop finished collectives' tensors, free blocks whose record_stream events
    completed)."""
    gc.collect()
    torch.cuda.synchronize(device)
    distributed.collectives_released()  # finished collectives' tensors (NCCL keeps them)
    torch.cuda.empty_cache()


def _memory_run(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    last_mb: int,
    sharding: str,
) -> _MemoryReading:
    seen: dict[str, Any] = {}
    last = run.steps - 1
    _settled(device)
    floor = _live_blocks(device)

    def after_forward(step: int, mb: int) -> None:
        if step == last and mb == last_mb:
            _settled(device)
            sites: dict[int, str] = {}
            now = _live_blocks(device, sites)
            change = _block_change(now, floor)
            gone = change.gone.items()
            seen["floor_freed"] = (sum(n for _, n in gone), sum(b[0] * n for b, n in gone))
            seen["replaced"] = _requested(change.replaced)
            seen["blocks"] = _requested(change.new)
            seen["allocated"] = sum(size * n for (size, _), n in change.new.items())
            seen["requested"] = sum(size * n for size, n in seen["blocks"].items())
            seen["rounding"] = seen["allocated"] - seen["requested"]
            new = set(change.new)
            seen["sites"] = {}
            for address, block in now.items():
                if block in new and address in sites and floor.get(address) != block:
                    seen["sites"].setdefault(block[1], sites[address])

    @contextlib.contextmanager
    def step_context(step: int) -> Iterator[None]:
        if step == last:
            _settled(device)
            # the floor's blocks that are still live: the step's peak counts above them
            live = _live_blocks(device)
            kept = sum(block[0] for address, block in floor.items() if live.get(address) == block)
            torch.cuda.reset_peak_memory_stats(device)
        yield
        if step == last:
            torch.cuda.synchronize(device)
            seen["peak"] = torch.cuda.max_memory_allocated(device) - kept

    hooks = RunHooks(step_context=step_context, after_forward=after_forward)
    train(spec, run, offloader, device, hooks=hooks, sharding=sharding)
    return _MemoryReading(**seen)
