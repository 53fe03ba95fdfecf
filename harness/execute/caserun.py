"""What one case's runs produced (``CaseRun``, made by ``harness.execute.steps.run_case``) and the
per-group comparisons the checks read from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.cases import Case
from harness.execute.attribution import _ZERO, Attribution, group_differences, log_by_group
from harness.execute.cadence import Cadence
from harness.execute.consistency import OwnRule, Sizes, size_difference
from harness.execute.learn import ObservedRule, expected_fields
from harness.execute.predict import Expected, copy_sizes_of
from harness.measure.footprint import Footprint
from harness.measure.observe import Copy, Observed
from harness.measure.syncguard import GuardedRun
from harness.measure.transfers import TransferCounts
from harness.models.runs import TrainResult
from harness.offload.recorder import GroupObservation
from harness.offload.semantics import MEGATRON_MAIN, GroupKey, Semantics
from harness.util.compare import Verdict
from harness.vocab.spec import pass_label


@dataclass(kw_only=True)
class CaseRun:
    """Everything one case's runs produced; the checks in ``harness.verify.checks`` read it."""

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
    steady_proof: list[str] = field(default_factory=list)
    """For an undeclared offloader held to its own tables: steps after the warmup in which a
    selected name moved nothing (``harness.execute.consistency.steady_proof``)."""
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
    checksum in the offload run (``harness.measure.observe.checksum``), in order."""
    checksummed: int = 0
    """Saved tensors whose pack and unpack checksums were compared in the offload run."""
    packed: tuple[dict[GroupKey, int], ...] = ()
    """Per step of the offload run: saved tensors each group occurrence packed through the
    harness's swapped pack hook (``harness.measure.observe.Observed.packed``)."""
    unpacked: tuple[dict[GroupKey, int], ...] = ()
    """Per step: how many of those its backward unpacked, by group occurrence."""
    held: tuple[tuple[tuple[int, GroupKey, int], ...], ...] = ()
    """Per step: (step written, group, bytes) of the host storages observed D2H copies wrote
    that were still alive at the step's end (``harness.measure.observe.Observed.held``)."""
    footprint: Footprint | None = None
    """The final step's host memory held beside bytes in flight at each group boundary
    (``harness.measure.footprint``); None without an observed step."""
    new_host: tuple[tuple[tuple[GroupKey, int], ...], ...] = ()
    """Per step: (group, bytes) of the host storages its D2H copies wrote at an address no
    earlier step's did (``Observed.new_host``)."""
    host_allocs: tuple[int | None, ...] = ()
    final_observed: Observed | None = None
    """The final step as the copy observer saw it (a replay fixture records it)."""
    """Per step, on CUDA: pinned blocks the caching host allocator newly allocated."""
    weight_copies: tuple[tuple[int, Copy], ...] = ()
    """(step, copy) of every D2H in the offload run whose source is a weight: a parameter's
    storage, a cast of a parameter a group saved, or a tensor the model marked
    not-offloadable (``harness.measure.observe.Copy.weight``)."""
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
    guarded: GuardedRun | None = None
    """The host-sync check's guarded step ``GUARDED_STEP``, taken inside the offload run
    (``guards_in_offload_run``), with the syncs recorded there; None where the check makes a
    run of its own."""
    inert: str = ""
    """Why the configuration moves nothing by design (``harness.execute.predict.inert_reason``;
    empty: it moves something): the case then proves that nothing moved instead of the offload."""
    copy_sizes: tuple[Sizes, ...] = ()
    """Per step of the offload run: the bytes of each copy the observer attributed, per group
    occurrence and direction (``harness.execute.consistency.copy_sizes``), which names the
    tensor behind a difference."""
    relaid: tuple[int, ...] = ()
    """Per step: reloads whose strides differed from the saved tensor's."""
    overdrawn: tuple[tuple[int, GroupKey | None, int, int], ...] = ()
    """(step, group, bytes read, bytes saved) of every saved storage the offload run's D2H
    copies read more of than its saves hold: the same data copied out twice."""
    stale_marks: tuple[tuple[GroupKey, int, int, int], ...] = ()
    """(group, bytes, step marked, step) of every saved tensor the offloader kept on the device
    at an address whose marked storage was gone (``Observed.stale_marks``)."""
    cadence: Cadence | None = None
    """Every step's reloads ordered against the group backwards around them
    (``harness.execute.cadence``)."""
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
        own = self.rule.own if self.rule is not None else None
        if own is not None:  # held to its own learning steps, not to a rule's prediction
            return self._against_own(own, counts, step)
        whys = {k: e.why for k, e in expected.items() if e.why}
        device_type = "cuda" if counts.mode == "device" else "cpu"
        predicted = expected_fields(expected, self.semantics, device_type)
        lines = group_differences(
            predicted,
            counts.by_group(),
            "predicted",
            "measured",
            whys,
            f"step {step}",
            self.case.schedule,
        )
        if self.rule is None or not lines:
            return lines
        # an undeclared offloader: name the tensors behind each difference by their sizes
        measured = counts.by_group()
        sizes = self.copy_sizes[step] if step < len(self.copy_sizes) else {}
        back = self.semantics.reloads_on(device_type)
        named = []
        for key in sorted({*predicted, *measured}):
            if predicted.get(key, _ZERO) == measured.get(key, _ZERO):
                continue
            obs = next(
                (o for o in self.observations if (o.microbatch, o.layer, o.name) == key), None
            )
            moved = expected.get(key)
            one = (
                copy_sizes_of(obs, self.case.offload_config(), self.semantics)
                if obs is not None and moved is not None and moved.copies
                else ()
            )
            want = {"d2h": one, "h2d": one if back else ()}
            named.append(size_difference(key, sizes.get(key, {}), want, self.observations))
        return [line + extra for line, extra in zip(lines, named, strict=True)]

    def _against_own(self, own: OwnRule, counts: TransferCounts, step: int) -> list[str]:
        """``step``'s counts per group occurrence against the learning step it is held to, each
        difference with the copies, by size, that one has and the other has not."""
        table, measured = own.table(step), counts.by_group()
        sizes = self.copy_sizes[step] if step < len(self.copy_sizes) else {}
        reference = own.sizes[min(step, 1)]
        lines = []
        for key in sorted({*table, *measured}):
            held, seen = table.get(key, _ZERO), measured.get(key, _ZERO)
            if held == seen:
                continue
            mb, layer, name = key
            lines.append(
                f"step {step}, {pass_label(mb, self.case.schedule)}, layer {layer}, group {name}: "
                f"held to {held} measured {seen} - {own.why(step)}"
                + size_difference(
                    key, sizes.get(key, {}), reference.get(key, {}), self.observations
                )
            )
        return lines

    def overdrawn_lines(self, limit: int = 3) -> list[str]:
        """Each saved storage copied out more than once per save, first ``limit``."""
        lines = []
        for step, group, drawn, allowed in self.overdrawn[:limit]:
            where = (
                f"{pass_label(group[0], self.case.schedule)}, layer {group[1]}, group {group[2]}"
                if group is not None
                else "outside every group window"
            )
            lines.append(
                f"step {step}, {where}: D2H copies read {drawn} B from a saved storage whose saves "
                f"hold {allowed} B: copied out more than the saved storages hold (the same data "
                "moved twice)"
            )
        more = len(self.overdrawn) - limit
        return lines + ([f"... and {more} more such storages"] if more > 0 else [])

    def stale_mark_lines(self, limit: int = 3) -> list[str]:
        """Why copies went missing where the offloader skipped tensors by stale marks."""
        lines = []
        for key, nbytes, marked, step in self.stale_marks[:limit]:
            mb, layer, name = key
            lines.append(
                f"step {step}, {pass_label(mb, self.case.schedule)}, layer {layer}, group "
                f"{name}: a saved tensor of {nbytes} B was kept on the device at an address "
                f"that held a storage marked not-offloadable in step {marked}, freed since; "
                "marks kept by address go stale when storage is reused"
            )
        more = len(self.stale_marks) - limit
        return lines + ([f"... and {more} more such skips"] if more > 0 else [])

    def relaid_inconsistencies(self) -> list[str]:
        """An undeclared offloader's reload layout is learned from its learning steps: a later
        step whose reloads come back with other strides when those kept the saved ones (or the
        other way round) is inconsistent."""
        if self.rule is None or len(self.relaid) <= len(self.rule.steps):
            return []
        learned = any(self.relaid[s] for s in self.rule.steps)
        return [
            f"step {step}: {n} reloads came back with other strides than the saved tensor's; "
            f"steps {' and '.join(map(str, self.rule.steps))} kept the saved strides"
            if not learned
            else f"step {step}: every reload kept the saved strides; its learning steps' came "
            "back contiguous"
            for step, n in enumerate(self.relaid)
            if step >= len(self.rule.steps) and bool(n) != learned
        ][:3]

    def step_log_mismatches(self) -> list[str]:
        """Every step but the final one: the offloader's log of that iteration against the
        windows' counts (offloaders that keep a log)."""
        logs = self.offload.logs[-len(self.per_step) :] if self.per_step else []
        if len(logs) != len(self.per_step):
            return []
        out = []
        for step, (log, counts) in enumerate(zip(logs[:-1], self.per_step[:-1], strict=True)):
            out += group_differences(
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
        return group_differences(
            self.logged,
            self.measured,
            "log",
            "counted",
            step=f"step {self.case.steps - 1}",
            schedule=self.case.schedule,
        )

    def moved_names(self) -> set[str]:
        return {name for (_, _, name), f in self.measured.items() if f["d2h_copies"]}


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
        out += group_differences(
            ranged.by_group(),
            windows.by_group(),
            "its ranges",
            "harness windows",
            step=label,
            schedule=res.case.schedule,
        )
    return out
