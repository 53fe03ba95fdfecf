"""Running a case: the runs each check needs and the facts it asserts on.

Shared by the pytest cases and ``offload-harness run``, so both judge a case the same way.

* ``run_case`` - plain baseline, hooks baseline and offload run of the same spec and seed. The
  offload run's warmup step is profiled (proof that the offload happened) and so is its final
  step (counts per group against the independent prediction of ``harness.execute.predict``, made
  from what the hooks run recorded); one more step runs with the offloader disabled. Its steps are
  the methods of ``_CaseSteps``; what it produced is a ``harness.execute.caserun.CaseRun``.

Beside it: where a case runs (``harness.execute.environment``), which group each copy belongs to
(``harness.execute.attribution``), the plain baselines rows share (``harness.execute.baselines``)
and the
memory reading (``harness.execute.memory``: ``run_memory``, CUDA only). The names this module had
before they moved are re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from harness.cases import Case
from harness.execute.attribution import (
    COUNTER_FIELDS,
    Attribution,
    attribute,
    log_by_group,
    observe_steps,
    offload_proof,
    profile_steps,
    total,
)
from harness.execute.baselines import (
    BASELINES,
    MAX_ROWS_SHARING,
    Baselines,
    SharedPlain,
    forget_plain_baselines,
    plain_baseline,
    plain_key,
    sharing_groups,
    sharing_key,
)
from harness.execute.cadence import Cadence, run_cadence
from harness.execute.caserun import CaseRun, attribution_mismatches
from harness.execute.consistency import copy_sizes, own_expected, steady_proof
from harness.execute.environment import Environment, closing
from harness.execute.learn import ObservedRule, learn_from_steps
from harness.execute.predict import Expected, inert_reason, predict
from harness.measure.footprint import host_fields
from harness.measure.observe import Observed, Windowed, corrupted_reloads
from harness.measure.syncguard import (
    GUARDED_STEP,
    GuardedOffloader,
    GuardedRun,
    SyncGuard,
    guarded_steps_hooks,
)
from harness.measure.threads import unwatched
from harness.measure.transfers import TransferCounts
from harness.models.train import TrainResult, schedule_order, train
from harness.offload.layout import LayoutBaseline
from harness.offload.protocol import Offloader, plan_of
from harness.offload.recorder import GroupObservation, RecordingOffloader
from harness.offload.semantics import GroupKey, Semantics
from harness.util import globalstate
from harness.util.compare import (
    first_divergence,
    first_tensor_difference,
    layout_verdict,
    verdict,
)
from harness.vocab.impls import IMPLS
from harness.vocab.spec import pass_label

__all__ = [
    "BASELINES",
    "COUNTER_FIELDS",
    "MAX_ROWS_SHARING",
    "Attribution",
    "Baselines",
    "CaseRun",
    "Environment",
    "SharedPlain",
    "attribute",
    "attribution_mismatches",
    "first_grad_difference",
    "forget_plain_baselines",
    "guards_in_offload_run",
    "log_by_group",
    "observe_steps",
    "offload_proof",
    "plain_baseline",
    "plain_key",
    "profile_steps",
    "record_observations",
    "run_case",
    "sharing_groups",
    "sharing_key",
    "total",
]


def guards_in_offload_run(case: Case, env: Environment) -> bool:
    """Whether the case's offload run also arms the host-sync guard for its step
    ``GUARDED_STEP``, so the sync check trains nothing of its own (on the H200 that run was an
    eighth of the full matrix's test time): on CUDA, for an implementation the guard applies to,
    in a run whose profiled steps (the first and the last) are not that step. The guard changes
    no tensor and raises nothing: the syncs an offloader makes there are recorded, and every
    other check reads the same run."""
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


def run_case(case: Case, env: Environment, baselines: Baselines | None = None) -> CaseRun:
    """The plain baseline, the hooks baseline's first training iteration (all of it when the
    offload run's losses differ from the plain baseline's, to classify the difference), the
    offload run (every step observed) and a disabled run; the prediction from the hooks run's
    records. The plain baseline is shared with the rows of the same ``plain_key`` (kept in
    ``baselines``, default ``BASELINES``). A backend declaring contiguous reloads gets a layout
    baseline too, made after the prediction that decides its copies."""
    start = time.perf_counter()
    steps = _CaseSteps(case, env)
    with _timed(steps.seconds, "plain"):  # ~0 when an earlier row's is reused
        shared = plain_baseline(case, env, baselines)
    hooks = steps.hooks_run()
    if steps.semantics is not None:  # an undeclared backend's rule is learned after its run
        steps.predict_with(steps.semantics)
    made, guarded = steps.offload_run()
    mine = [s.without(steps.own[0]) for s in made.seen]  # every step's
    per_step = [m.counts(steps.mode) for m in mine]
    attribution = attribute(made.sink, mine, per_step)
    if steps.semantics is None:  # learned from the warmup and first steady step
        steps.learn_rule(mine)
    disabled = steps.disabled_run()
    hooks = steps.diagnosis(shared.result, made.result, hooks)
    result = steps.assemble(
        _Runs(shared, hooks, made, guarded, disabled), attribution, mine, per_step, start
    )
    return _dropped_copies(result, made.result, steps.layout)


@dataclass(frozen=True)
class _Runs:
    """The runs of a case, for ``_CaseSteps.assemble``."""

    shared: SharedPlain
    hooks: TrainResult
    made: _OffloadTraining
    guarded: GuardedRun | None
    disabled: tuple[TransferCounts, Observed]
    """The disabled run's profiler counts and observed copies."""


class _CaseSteps:
    """The steps of ``run_case`` and what they hand each other: the prediction (from the
    declared or the learned rule), the layout baseline, the model's own copies of step 0."""

    def __init__(self, case: Case, env: Environment) -> None:
        self.case, self.env = case, env
        self.spec, self.run, self.config = env.spec(case), case.run_spec(), case.offload_config()
        self.kept: dict[str, Any] = dict(
            keep_grads=True, keep_final_state=True, sharding=case.sharding
        )
        self.mode = "device" if env.device.type == "cuda" else "cpu"
        self.seconds: dict[str, float] = {}
        self.last = self.run.steps - 1
        self.semantics: Semantics | None = env.declared
        self.rule: ObservedRule | None = None
        self.layout: TrainResult | None = None
        self.own: list[Observed] = []
        self.observations: list[GroupObservation] = []
        self.order: list[tuple[str, int]] = []
        self.warmup: dict[GroupKey, Expected] = {}
        self.steady: dict[GroupKey, Expected] = {}

    def hooks_run(self) -> TrainResult:
        """The hooks baseline's first training iteration: what each group saves (the records
        the prediction reads) and, observed in step 0, the copies the model makes itself inside
        group windows (moving nothing, the hooks baseline's copies are all the model's), which
        are not the offloader's. They are the same in every step (they do not depend on the
        offload), so step 0's stand for all. Only its first training iteration is read, unless
        the offload run differs from its baseline: then every step (``diagnosis``)."""
        recorder = RecordingOffloader(self.config, self.env.device)
        windowed = Windowed(recorder)
        with _timed(self.seconds, "hooks"):
            hooks = train(
                self.spec,
                self.run.replace(steps=1),
                windowed,
                self.env.device,
                hooks=observe_steps(self.env.device, {0}, windowed, self.own),
                sharding=self.case.sharding,
            )
        # the first training iteration
        self.observations = recorder.iterations[int(self.run.eval_first)]
        self.order = schedule_order(self.run.schedule, self.run.microbatches)
        return hooks

    def predict_with(self, semantics: Semantics) -> None:
        """The prediction by ``semantics``, and the layout baseline if its reloads come back
        contiguous."""
        self.warmup, self.steady = predict(self.observations, self.config, self.order, semantics)
        if semantics.reload_layout == "contiguous":
            with _timed(self.seconds, "layout"):
                self.layout = _layout_baseline(
                    self.case, self.env, semantics, self.warmup, self.steady
                )

    def offload_training(self, guarded: bool) -> _OffloadTraining:
        """The offload run, every step observed, the first and the last profiled; ``guarded``:
        with the host-sync guard armed for step ``GUARDED_STEP``."""
        env, run = self.env, self.run
        planned = [(o.layer, o.name) for o in self.observations if o.microbatch == self.order[0][1]]
        sink: list[TransferCounts] = []
        seen: list[Observed] = []
        guard = SyncGuard(env.device) if guarded else None
        with closing(Windowed(env.offloader(self.config), checksums=True)) as offloader:
            plan_of(offloader, planned)
            hooks = profile_steps(
                env.device, {0, self.last}, sink, (offloader, seen), set(range(run.steps))
            )
            hooks.model_ready = offloader.note_model
            trained: Offloader = offloader
            if guard is not None:
                hooks.step_context = _arming(hooks.step_context, guard)
                trained = GuardedOffloader(offloader, guard)
            with globalstate.guarded("during the offload run", rng=False):
                result = train(self.spec, run, trained, env.device, hooks=hooks, **self.kept)
            return _OffloadTraining(result, sink, seen, len(offloader.state.weights), guard)

    def offload_run(self) -> tuple[_OffloadTraining, GuardedRun | None]:
        """The offload run, with the guarded step where ``guards_in_offload_run``; also what
        the guard recorded there (None: no guarded step)."""
        with _timed(self.seconds, "offload"):
            made = self.offload_training(guards_in_offload_run(self.case, self.env))
        if made.guard is None:
            return made, None
        seen = made.seen[GUARDED_STEP : GUARDED_STEP + 1]
        return made, GuardedRun.of(made.guard, {GUARDED_STEP}, made.result, seen)

    def learn_rule(self, mine: list[Observed]) -> None:
        """An undeclared backend's rule, learned from the warmup and first steady step (and
        held on every step), and the prediction by it."""
        self.rule = learn_from_steps(
            self.observations,
            self.config,
            self.order,
            mine,
            self.env.device.type,
            self.case.schedule,
        )
        self.semantics = self.rule.semantics
        self.predict_with(self.semantics)
        if self.rule.own is not None:  # held to its own tables; the closest rule only guesses
            closest = self.steady  # which storages a move frees
            self.warmup, self.steady = own_expected(self.rule.own, self.observations, closest)

    def disabled_run(self) -> tuple[TransferCounts, Observed]:
        """One step with the offloader disabled: its totals (the observer says which window
        copied)."""
        env = self.env
        disabled: list[TransferCounts] = []
        disabled_seen: list[Observed] = []
        with (
            closing(Windowed(env.offloader(self.config))) as offloader,
            _timed(self.seconds, "disabled"),
            globalstate.guarded("during the disabled run", rng=False),
        ):
            offloader.set_enabled(False)
            train(
                self.spec,
                self.run.replace(steps=1),
                offloader,
                env.device,
                # Its check reads the step's totals (the observer says which window copied).
                hooks=profile_steps(
                    env.device, {0}, disabled, (offloader, disabled_seen), ranges=False
                ),
                sharding=self.case.sharding,
            )
        return disabled[0], disabled_seen[0]

    def diagnosis(
        self, plain: TrainResult, offload: TrainResult, hooks: TrainResult
    ) -> TrainResult:
        """The hooks baseline to judge by: every step of it when the offload run's losses
        diverge from the plain baseline's (no layout baseline), to classify the difference."""
        diverged = first_divergence(plain.losses, offload.losses, self.case.tolerance) is not None
        if self.layout is None and diverged:
            full = Windowed(RecordingOffloader(self.config, self.env.device))
            with _timed(self.seconds, "hooks"):
                hooks = train(
                    self.spec, self.run, full, self.env.device, sharding=self.case.sharding
                )
        return hooks

    def assemble(
        self,
        runs: _Runs,
        attribution: Attribution,
        mine: list[Observed],
        per_step: list[TransferCounts],
        start: float,
    ) -> CaseRun:
        """The ``CaseRun`` of the steps."""
        case, layout, semantics = self.case, self.layout, self.semantics
        plain, offload, seen = runs.shared.result, runs.made.result, runs.made.seen
        assert semantics is not None  # declared, or learned
        baseline = layout or plain  # what the offload run must equal
        tolerance = case.tolerance
        return CaseRun(
            case=case,
            plain=plain,
            hooks=runs.hooks,
            offload=offload,
            verdict=(
                verdict(plain.losses, runs.hooks.losses, offload.losses, tolerance)
                if layout is None
                else layout_verdict(plain.losses, layout.losses, offload.losses, tolerance)
            ),
            grad_difference=first_grad_difference(baseline, offload),
            weight_difference=first_tensor_difference(baseline.final_state, offload.final_state),
            layout=layout,
            per_step=tuple(per_step),
            corrupted=tuple(corrupted_reloads(seen)),
            weight_copies=tuple(
                (step, c) for step, o in enumerate(mine) for c in o.weight_copies()
            ),
            weights_known=runs.made.weights_known,
            d2h_watched=sum(c.direction == "d2h" for o in mine for c in o.copies),
            checksummed=sum(o.checksummed for o in seen),
            packed=tuple(dict(o.packed) for o in seen),
            unpacked=tuple(dict(o.unpacked) for o in seen),
            held=tuple(tuple(o.held) for o in seen),
            **host_fields(mine),
            copy_sizes=tuple(copy_sizes(o) for o in mine),
            relaid=tuple(o.relaid for o in seen),
            stale_marks=tuple(m for o in seen for m in o.stale_marks),
            overdrawn=self.overdrawn(seen),
            warmup_expected=self.warmup,
            warmup_transfers=attribution.warmup,
            proof_problems=with_unwatched(
                attribution.warmup,
                offload_proof(
                    case,
                    self.spec,
                    attribution.warmup,
                    self.run.microbatches,
                    semantics,
                    self.env.device,
                    self.warmup,
                ),
            ),
            steady_proof=self.steady_proof(per_step),
            observations=self.observations,
            # a one-step run's final step is its warmup
            expected=self.warmup if self.last == 0 else self.steady,
            counts=attribution.final,
            attribution=attribution,
            semantics=semantics,
            rule=self.rule,
            logged=log_by_group(offload.logs[-1].groups) if offload.logs else None,
            disabled=runs.disabled[0],
            disabled_observed=runs.disabled[1]
            .without(self.own[0], any_window=True)
            .counts(self.mode),
            runner_copies=runs.shared.runner_copies,
            plain_key=runs.shared.key,
            plain_made_by=runs.shared.made_by,
            run_seconds=self.seconds,
            guarded=runs.guarded,
            cadence=self.cadence(mine),
            inert=inert_reason(self.observations, self.config, [self.warmup, self.steady]),
            seconds=time.perf_counter() - start,
        )

    def overdrawn(self, seen: list[Observed]) -> tuple[tuple[int, GroupKey | None, int, int], ...]:
        """(step, group, bytes read, bytes saved) of every saved storage the offload run's D2H
        copies read more of than its saves hold (``Observed.overdrawn``), except in groups where
        the model copies saved data to the host itself (its own copies, seen in the hooks run)."""
        own = {c.group for o in self.own for c in o.copies if c.direction == "d2h"}
        return tuple(
            (step, group, drawn, allowed)
            for step, observed in enumerate(seen)
            for group, drawn, allowed in observed.overdrawn
            if group not in own
        )

    def steady_proof(self, per_step: list[TransferCounts]) -> list[str]:
        """For an offloader held to its own tables: each selected name the model opens moved
        bytes in every step after the warmup (``harness.execute.consistency.steady_proof``)."""
        own = self.rule.own if self.rule is not None else None
        if own is None:
            return []
        hands_back = self.env.device.type != "cuda" and not any(
            f["h2d_copies"] for f in own.steady.values()
        )
        names = set(self.case.offload) & set(self.spec.group_names)
        return steady_proof(per_step, names, hands_back)

    def cadence(self, mine: list[Observed]) -> Cadence:
        """Every step's reloads ordered against the group backwards around them, held to the
        declared or learned rule (``harness.execute.cadence``)."""
        assert self.semantics is not None
        schedule = self.case.schedule
        return run_cadence(
            self.observations,
            self.order,
            mine,
            [self.warmup, self.steady],
            self.semantics,
            self.case.offload,
            lambda p: pass_label(p, schedule),
        )


def with_unwatched(warmup: TransferCounts, problems: list[str]) -> list[str]:
    """``problems`` of the offload proof, and - where the warmup step showed no copy at all -
    the threads of the process that carry no relay to the copy observer
    (``harness.measure.threads.unwatched``: started before the harness could watch them), whose
    copies would go unseen."""
    seen = any(c.copies for c in warmup.totals().values())
    threads = unwatched() if problems and not seen else []
    if not threads:
        return problems
    return [
        *problems,
        f"(threads started before the harness watched them, whose copies it cannot see: "
        f"{', '.join(sorted(threads)[:5])})",
    ]


def _dropped_copies(result: CaseRun, offload: TrainResult, layout: TrainResult | None) -> CaseRun:
    """Compared: drop the copies (GBs on GPUs); the shared plain result keeps its own until the
    next key replaces it."""
    result.plain = dataclasses.replace(result.plain, grads=[], final_state={})
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


@contextlib.contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``seconds[name]``."""
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - began, 3)


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
