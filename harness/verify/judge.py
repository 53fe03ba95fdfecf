"""One judge of a case: every check, decided the same way for pytest's case files, ``offload-harness
run`` and mutation scoring.

A check reads the runs it needs from a ``CaseRuns`` (each run made at most once, on first use) and
returns a ``CheckOutcome``: ``pass``, ``fail`` with its problems, ``skip`` (the check applies but
cannot be decided here, e.g. no golden trace for this machine, the ZeRO-3 memory reading that
freed blocks older than the runs, sync on megatron-core's models), ``n-a`` (it does not apply to
this case or device, e.g. memory on CPU: decided before anything runs) or ``updated`` (golden with
``--update-golden``: the trace was written, nothing compared), each but pass and fail with the
reason. The checks, in the order they run:

=============  ===========================================================================
equivalence    the offload happened in the warmup step, then losses, gradients and final
               weights equal the plain baseline (``harness.verify.checks.equivalence_problems``)
leaks          every saved tensor packed in a step is unpacked by its backward, and the host
               memory the offloader holds stops growing after the warmup (the harness's own
               pack/unpack and D2H records, any backend; the offloader's log a cross-check)
transfers      per-group copies and bytes of the final step equal the prediction
disabled       the disabled run copies nothing
fidelity       in every step, by the harness's own windows: no unselected group's window
               copies, every name the prediction moves in that step moves
weights        no parameter storage (nor a cast of one, nor a marked tensor) is copied out in
               any step (n-a for a backend declaring that parameters move)
cadence        in every step, no reload is issued earlier than the declared or learned
               prefetch rule allows, nor more bytes reloaded ahead of their group's backward
               (``harness.execute.cadence``; the harness's own hooks mark each group's backward)
memory         CUDA: memory after the last forward drops by what the in-flight groups free
sync           CUDA: no host synchronisation inside the offloader's entry points
golden         the plain baseline equals this machine's golden trace (``harness.verify.golden``)
=============  ===========================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from harness.cases import Case
from harness.execute import steps as case_steps
from harness.execute.caserun import CaseRun
from harness.execute.consistency import HELD
from harness.execute.environment import Environment
from harness.execute.learn import LEARNED_ONLY, OBSERVED_LABEL
from harness.execute.memory import MemoryResult
from harness.execute.pipeline_case import run_pipeline_case
from harness.execute.steps import run_case
from harness.measure import fingerprint
from harness.measure.syncguard import GUARDED_STEP
from harness.models.runs import Refused
from harness.offload.protocol import Capabilities
from harness.reporting.report import case_record, memory_record
from harness.util import progress
from harness.util.globalstate import GlobalStateChanged
from harness.util.sanitizer import describe
from harness.verify import golden
from harness.verify.checks import (
    cadence_evidence,
    cadence_problems,
    checksum_coverage,
    checksum_gap,
    disabled_problems,
    equivalence_problems,
    fidelity_problems,
    leak_evidence,
    leak_problems,
    pool_record,
    transfer_problems,
    unordered_reason,
    weight_problems,
)
from harness.verify.hostchecks import footprint_problems
from harness.verify.memorycheck import memory_problems
from harness.verify.pipeline_checks import stage_outcome
from harness.vocab.impls import IMPLS

STATUSES = ("pass", "fail", "skip", "n-a", "updated")
"""``updated``: ``--update-golden`` wrote the golden trace the check would compare with, so it
compared nothing (neither a pass nor a failure)."""


@dataclass(frozen=True, kw_only=True)
class CheckOutcome:
    """What one check decided."""

    name: str
    status: str
    """One of ``STATUSES``."""
    problems: tuple[str, ...] = ()
    """What failed (``fail`` only), each naming the step, microbatch and group."""
    reason: str = ""
    """Why the check was skipped or does not apply."""
    record: dict[str, Any] = field(default_factory=dict)
    """Report fields the check contributes (losses, transfers, memory, golden...)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status must be one of {STATUSES}; got {self.status!r}")

    def status_record(self) -> dict[str, str]:
        """The report's entry for this check: its status, and the reason if there is one."""
        return {"status": self.status, **({"reason": self.reason} if self.reason else {})}


def raised(exc: Exception) -> str:
    """The problem of a check whose runs raised: the exception's type and message (a race the
    CUDA stream sanitizer found: its one-line description, ``harness.util.sanitizer``)."""
    race = describe(exc)
    if race is not None:
        return race
    if isinstance(exc, GlobalStateChanged):  # its message names the setting, before and after
        return str(exc)
    position = progress.where(exc)
    at = f" (raised in the offloader's calls at {position})" if position else ""
    # other notes (a pipeline's where), not the one ``progress.located`` added for ``at``
    own = f"raised in the offloader's calls at {position}"
    notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()) if n != own)
    return f"the case's runs raised {type(exc).__name__}: {exc}{at}{notes}"


_REPORTED = "offload_reported_by"


def reported_by(exc: Exception) -> str | None:
    """The check that already reported ``exc`` (a run's exception reaches every check that
    reads the run; the first carries it, ``mark_reported``), None if none did."""
    return getattr(exc, _REPORTED, None)


def mark_reported(exc: Exception, check_name: str) -> None:
    """Check ``check_name`` reports ``exc``; later readers of the run point to it."""
    with contextlib.suppress(AttributeError):
        setattr(exc, _REPORTED, check_name)


def raised_again(name: str, earlier: str) -> CheckOutcome:
    """The outcome of check ``name`` whose runs raised what check ``earlier`` reported: a skip
    pointing to it (the case's verdict is ``earlier``'s failure; the error is said once)."""
    return CheckOutcome(
        name=name, status="skip", reason=f"the case's runs raised: see the {earlier} check"
    )


def _from_problems(name: str, problems: Iterable[str], **record: Any) -> CheckOutcome:
    problems = tuple(problems)
    return CheckOutcome(
        name=name, status="fail" if problems else "pass", problems=problems, record=record
    )


def _not_applicable(name: str, reason: str) -> CheckOutcome:
    return CheckOutcome(name=name, status="n-a", reason=reason)


class CaseRuns:
    """The runs a case's checks read, each made once, on first use. A run that raised raises
    again for every check that reads it (without running again)."""

    def __init__(
        self,
        case: Case,
        env: Environment,
        *,
        update_golden: bool = False,
        golden_variant: str | None = None,
    ) -> None:
        self.case = case
        self.env = env
        self.update_golden = update_golden
        self.golden_variant = golden_variant or golden.variant(env.model_size)
        self._made: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}
        """Wall seconds of each made run (``case``, ``memory``, ``sync``)."""

    def _once(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self._made:
            began = time.perf_counter()
            try:
                self._made[name] = make()
            except Exception as exc:
                self._made[name] = _Raised(exc)
            self.seconds[name] = round(time.perf_counter() - began, 3)
        made = self._made[name]
        if isinstance(made, _Raised):
            raise made.error
        return made

    def case_run(self) -> CaseRun:
        """The plain, hooks, offload and disabled runs (``harness.execute.steps.run_case``)."""
        if getattr(self.case, "pipeline", 1) > 1:  # this rank's stage (pipeline_case)
            return self._once("case", lambda: run_pipeline_case(self.case, self.env))
        return self._once("case", lambda: run_case(self.case, self.env))

    def memory(self) -> MemoryResult:
        """The memory reading runs (``harness.execute.memory.run_memory``), CUDA only."""
        from harness.execute.memory import run_memory

        if self.env.declared is None:  # the rule it is held to is learned by the case run
            self.case_run()
        made = self._made.get("case")  # its hooks run recorded what the prediction needs
        observations = made.observations if isinstance(made, CaseRun) else None
        semantics = made.semantics if isinstance(made, CaseRun) else None
        return self._once(
            "memory", lambda: run_memory(self.case, self.env, observations, semantics)
        )

    def guarded(self) -> Any:
        """The guarded training of the host-sync check, a ``GuardedRun`` with the syncs it
        recorded. The case run's offload run guards its step ``GUARDED_STEP`` where it can
        (``harness.execute.steps.guards_in_offload_run``; if that run raised, so does this);
        otherwise, or before the case run is made, a run of its own."""
        made = self._made.get("case")
        if isinstance(made, CaseRun) and made.guarded is not None:
            return made.guarded
        if isinstance(made, _Raised) and case_steps.guards_in_offload_run(self.case, self.env):
            raise made.error  # the guarded step was in that run: said once, by its first reader
        return self._once("sync", self._guarded_run)

    def _guarded_run(self) -> Any:
        from harness.measure.syncguard import run_guarded

        run = self.case.run_spec().replace(steps=GUARDED_STEP + 1)
        offloader = self.env.offloader(self.case.offload_config())
        try:
            return run_guarded(
                self.env.spec(self.case), run, offloader, self.env.device, guarded={GUARDED_STEP}
            )
        finally:
            offloader.close()


@dataclass(frozen=True)
class _Raised:
    error: Exception


# ------------------------------------------------------------------------------ the checks


def _inert(name: str, runs: CaseRuns) -> CheckOutcome | None:
    """``n-a`` for a check that needs something moved, on an inert case (None otherwise)."""
    res = runs.case_run()
    if not res.inert:
        return None
    return _not_applicable(name, f"{res.inert}: nothing is offloaded to check")


def _equivalence(runs: CaseRuns) -> CheckOutcome:
    res = runs.case_run()
    record = case_record(res)
    if res.inert:
        record["inert"] = res.inert
    outcome = _from_problems(
        "equivalence", equivalence_problems(runs.case, res, runs.env), **record
    )
    if res.inert and outcome.status == "pass":
        return dataclasses.replace(
            outcome, reason=f"{res.inert}; nothing moved in any step, losses bitwise"
        )
    gap = checksum_gap(checksum_coverage(res))
    if gap and outcome.status == "pass":  # visible: never a silent pass of the checksum part
        return dataclasses.replace(outcome, reason=gap)
    return outcome


def _leaks(runs: CaseRuns) -> CheckOutcome:
    res = runs.case_run()
    record = {
        "leaks": {
            "packed": [sum(p.values()) for p in res.packed],
            "unpacked": [sum(u.values()) for u in res.unpacked],
            "host_held_bytes": [sum(n for _, _, n in held) for held in res.held],
            "log_cross_check": bool(res.offload.logs),
        }
    }
    if res.footprint and res.footprint.points:
        record["leaks"]["host_footprint"] = res.footprint.as_record()
        record["leaks"]["host_new_bytes"] = [sum(n for _, n in new) for new in res.new_host]
        if any(a is not None for a in res.host_allocs):
            record["leaks"]["host_allocs"] = list(res.host_allocs)
    pool = pool_record(runs.case, res)
    if pool is not None:
        record["pool"] = pool
    blind = leak_evidence(res)
    if blind is not None:
        return CheckOutcome(name="leaks", status="skip", reason=blind, record=record)
    capabilities = Capabilities() if runs.env.undeclared else runs.env.record.capabilities
    problems = leak_problems(runs.case, res) + footprint_problems(runs.case, res, capabilities)
    outcome = _from_problems("leaks", problems, **record)
    if pool is not None and outcome.status == "pass" and pool["exhausted"]:
        reason = (
            f"pinned pool capped at {pool['cap']} buffers: exhausted {pool['exhausted'][-1]} "
            f"times over the run, each handled with a buffer outside the pool"
        )
        return dataclasses.replace(outcome, reason=reason)
    return outcome


def _transfers(runs: CaseRuns) -> CheckOutcome:
    res = runs.case_run()
    att = res.attribution
    outside = (
        {"step 0": list(att.outside_copies[0]), "final step": list(att.outside_copies[1])}
        if att is not None
        else None
    )
    outcome = _from_problems(
        "transfers",
        transfer_problems(runs.case, res, runs.env.device),
        attribution=att.source if att is not None else None,
        outside_windows=outside,
    )
    if outcome.status == "pass" and res.rule is not None and _learned_only(runs.case, res):
        return CheckOutcome(name="transfers", status="skip", reason=LEARNED_ONLY)
    if outcome.status == "pass" and res.rule is not None:
        # What a learned rule cannot tell: a consistent rule of its own is no proof of Megatron's.
        held = (
            f"{HELD} (no rule of the family explains its copies)"
            if res.rule.own is not None
            else f"consistent with {OBSERVED_LABEL}"
        )
        reason = f"{held}; declare semantics to check it against Megatron's"
        return dataclasses.replace(outcome, reason=reason)
    return outcome


def _learned_only(case: Case, res: CaseRun) -> bool:
    """Whether every step of an undeclared backend's run was a learning step."""
    return res.rule is not None and case.steps <= len(res.rule.steps)


def _disabled(runs: CaseRuns) -> CheckOutcome:
    return _inert("disabled", runs) or _from_problems(
        "disabled", disabled_problems(runs.case_run())
    )


def _fidelity(runs: CaseRuns) -> CheckOutcome:
    spec = runs.env.spec(runs.case)
    return _from_problems("fidelity", fidelity_problems(runs.case, runs.case_run(), spec))


def _weights(runs: CaseRuns) -> CheckOutcome:
    res = runs.case_run()
    inert = _inert("weights", runs)
    if inert is not None:
        return inert
    seen = {
        "copies": len(res.weight_copies),
        "bytes": sum(c.nbytes for _, c in res.weight_copies),
        "parameter_storages": res.weights_known,
        "d2h_observed": res.d2h_watched,
    }
    record = {"weights": seen}
    if res.semantics.skip == "none" and not res.semantics.observed:
        return CheckOutcome(
            name="weights",
            status="n-a",
            reason=(
                f"the backend declares that every saved tensor moves, parameters included "
                f"(Semantics.skip = none): {seen['copies']} D2H copies of weights, "
                f"{seen['bytes']} B, in the offload run"
            ),
            record=record,
        )
    return _from_problems("weights", weight_problems(res), **record)


def _cadence(runs: CaseRuns) -> CheckOutcome:
    res = runs.case_run()
    inert = _inert("cadence", runs)
    if inert is not None:
        return inert
    cadence = res.cadence
    record = {"cadence": cadence.record()} if cadence is not None else {}
    blind = cadence_evidence(res, runs.env.device.type)
    if blind is not None:
        return CheckOutcome(name="cadence", status="skip", reason=blind, record=record)
    if cadence is not None and not any(s.reloads for s in cadence.steps):
        if not res.semantics.reloads_on(runs.env.device.type):
            return CheckOutcome(
                name="cadence",
                status="n-a",
                reason="on a CPU device the backend hands out the host copy at unpack: no "
                "reload copy to order",
                record=record,
            )
        reason = unordered_reason(res, cadence)
        return CheckOutcome(name="cadence", status="skip", reason=reason, record=record)
    outcome = _from_problems("cadence", cadence_problems(res), **record)
    if outcome.status == "pass" and res.semantics.observed and _learned_only(runs.case, res):
        return CheckOutcome(name="cadence", status="skip", reason=LEARNED_ONLY, record=record)
    if outcome.status == "pass" and cadence is not None:
        reason = cadence.summary()
        if res.semantics.observed:  # as transfers says: its own depth is no proof of Megatron's
            reason += (
                "; held to the prefetch depth its steps 0 and 1 showed; declare "
                "Semantics.prefetch_depth to check it against a rule"
            )
        note = cadence.cost_note()
        return dataclasses.replace(outcome, reason=f"{reason}; {note}" if note else reason)
    return outcome


def _memory(runs: CaseRuns) -> CheckOutcome:
    if runs.env.device.type != "cuda":
        return _not_applicable("memory", "needs a CUDA device (the caching allocator's figures)")
    inert = _inert("memory", runs)
    if inert is not None:
        return inert
    res = runs.memory()
    count, freed = res.floor_freed
    if runs.case.sharding == "zero3" and count:
        # Under FSDP2 a reading is exact (H200: every such row to the byte) unless the runs
        # freed blocks that were live before they started; same-sized blocks of their own may
        # then sit at those addresses unseen, so the drop is not the offloader's alone.
        reason = (
            f"not attributable under ZeRO-3: the runs freed {count} blocks ({freed} B) that "
            "were live before they started (an earlier run's, released meanwhile), so blocks "
            "of their own may hide at those addresses"
        )
        # applies, measured, and cannot be decided here: a skip (n-a is decided before running)
        return CheckOutcome(name="memory", status="skip", reason=reason, record=memory_record(res))
    problems = memory_problems(res)
    unmatched = res.backward.unmatched if res.backward is not None else ""
    if unmatched and not problems:
        # the boundaries are the harness's own marks: not matching them says nothing of the
        # offloader, and the backward part of the check is then undecided
        reason = (
            f"the backward reading is undecided: {unmatched}; after the last forward and at "
            "the peak the memory is as predicted"
        )
        return CheckOutcome(name="memory", status="skip", reason=reason, record=memory_record(res))
    return _from_problems("memory", problems, **memory_record(res))


def _sync(runs: CaseRuns) -> CheckOutcome:
    if runs.env.device.type != "cuda":
        return _not_applicable("sync", "needs a CUDA device (host-device synchronisation)")
    unguarded = IMPLS[runs.case.impl].sync_guard
    if unguarded is not None:  # the check applies to the case; the guard cannot run there
        return CheckOutcome(name="sync", status="skip", reason=unguarded)
    res = runs.guarded()
    record = {
        "host_sync": res.hits[0].describe() if res.hits else None,
        "sync_hits": len(res.hits),
        "guarded_windows": sum(res.windows.values()),
    }
    if not res.hits and res.evidence_problems():
        # Nothing moved in the guarded step: n-a where the configuration moves nothing by
        # design, as for the other checks that need something moved. A sync recorded there
        # still fails: the host waited all the same.
        inert = _inert("sync", runs)
        if inert is not None:
            return dataclasses.replace(inert, record=record)
    return _from_problems("sync", res.problems(), **record)


def _golden(runs: CaseRuns) -> CheckOutcome:
    here = fingerprint.of(runs.env.device)
    write = golden.update if runs.update_golden else golden.check
    outcome = write(runs.case.name, runs.case_run().plain.losses, here, runs.golden_variant)
    record = {"golden": outcome.record()}
    if outcome.status == "updated":  # compared with nothing: it just wrote the trace
        return CheckOutcome(name="golden", status="updated", reason=outcome.message, record=record)
    if outcome.status == "missing":
        return CheckOutcome(name="golden", status="skip", reason=outcome.message, record=record)
    problems = [] if outcome.ok else [outcome.message]
    return _from_problems("golden", problems, **record)


CHECKS: dict[str, Callable[[CaseRuns], CheckOutcome]] = {
    "equivalence": _equivalence,
    "leaks": _leaks,
    "transfers": _transfers,
    "disabled": _disabled,
    "fidelity": _fidelity,
    "weights": _weights,
    "cadence": _cadence,
    "memory": _memory,
    "sync": _sync,
    "golden": _golden,
}
"""Every check, by name, in the order they run."""

CASE_TESTS: dict[str, str] = {
    "equivalence": "cases/test_equivalence.py::test_loss_equivalence",
    "leaks": "cases/test_equivalence.py::test_no_leaks",
    "transfers": "cases/test_transfers.py::test_transfer_counts",
    "disabled": "cases/test_transfers.py::test_disabled_moves_nothing",
    "fidelity": "cases/test_transfers.py::test_name_fidelity",
    "weights": "cases/test_transfers.py::test_no_weight_offloaded",
    "cadence": "cases/test_transfers.py::test_reload_cadence",
    "memory": "cases/test_memory.py::test_memory_after_forward",
    "sync": "cases/test_sync.py::test_no_host_sync",
    "golden": "cases/test_golden.py::test_golden_baseline",
}
"""The pytest test of the repository's ``cases/`` that runs each check (relative to the root)."""


def check(name: str, runs: CaseRuns) -> CheckOutcome:
    """Run one check (its runs' exceptions propagate, except a configuration the model's
    library refuses, ``Refused``: a skip with the library's message)."""
    if getattr(getattr(runs, "case", None), "pipeline", 1) > 1:  # this rank's stage
        made = runs.case_run
        fields = stage_outcome(name, runs.case, made, runs.env.device.type)  # type: ignore[arg-type]
        return CheckOutcome(name=name, **fields)
    try:
        return CHECKS[name](runs)
    except Refused as exc:
        return CheckOutcome(name=name, status="skip", reason=str(exc))


# ------------------------------------------------------------------------------ the verdict


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """Every check of one case."""

    case: Case
    outcomes: tuple[CheckOutcome, ...]
    run_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds of the runs besides the case's own (``memory``, ``sync``)."""

    @property
    def verdict(self) -> str:
        """``fail`` if a check failed; ``inert`` if none failed and the configuration moves
        nothing by design (``harness.execute.predict.inert_reason``: nothing eligible, and nothing
        moved); ``skip`` if none failed and none passed but one skipped
        (a configuration the model's library refuses); else ``pass`` (a golden trace
        ``updated`` is no failure, and alone no pass either)."""
        statuses = {o.status for o in self.outcomes}
        if "fail" in statuses:
            return "fail"
        if any(o.record.get("inert") for o in self.outcomes):
            return "inert"
        if "skip" in statuses and "pass" not in statuses:
            return "skip"
        return "pass"

    @property
    def problems(self) -> list[str]:
        return [f"{o.name}: {p}" for o in self.outcomes for p in o.problems]

    def first_failure(self) -> CheckOutcome | None:
        return next((o for o in self.outcomes if o.status == "fail"), None)

    def record(self) -> dict[str, Any]:
        """The case's report fields: every check's, then name, verdict, problems and the
        per-check statuses."""
        fields: dict[str, Any] = {}
        for outcome in self.outcomes:
            fields.update(outcome.record)
        if self.run_seconds:  # with the case's own runs' (``report.case_record``)
            fields["run_seconds"] = {**fields.get("run_seconds", {}), **self.run_seconds}
        fields.update(
            name=self.case.name,
            verdict=self.verdict,
            problems=self.problems,
            checks={o.name: o.status_record() for o in self.outcomes},
        )
        return fields


def judge(
    case: Case,
    env: Environment,
    *,
    checks: Iterable[str] = tuple(CHECKS),
    stop_at_first_failure: bool = False,
    update_golden: bool = False,
) -> Judgement:
    """Run the checks on one case. The first check whose runs raise fails with the exception
    (as its pytest case would), where in the offloader's calls it was raised included; every
    later check that reads the same run is a skip pointing to it: the error is said once."""
    runs = CaseRuns(case, env, update_golden=update_golden)
    outcomes = []
    for name in checks:
        try:
            outcome = check(name, runs)
        except Exception as exc:
            earlier = reported_by(exc)
            if earlier is None:
                mark_reported(exc, name)
                outcome = CheckOutcome(name=name, status="fail", problems=(raised(exc),))
            else:
                outcome = raised_again(name, earlier)
        outcomes.append(outcome)
        if stop_at_first_failure and outcome.status == "fail":
            break
    others = {name: seconds for name, seconds in runs.seconds.items() if name != "case"}
    return Judgement(case=case, outcomes=tuple(outcomes), run_seconds=others)
