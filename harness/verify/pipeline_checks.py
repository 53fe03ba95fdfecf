"""The checks of a pipeline row (``Case.pipeline`` > 1) on one rank: its stage's runs
(``harness.execute.pipeline_case.StageRun``) judged on that stage's groups and its part of the
schedule. ``harness.verify.judge.check`` sends a pipeline row's checks here.

Every problem line starts with the stage (``stage 1 of 2 (layers 3-5; 1f1b, 0 forwards before
its first backward): ...``); under torchrun the plugin's collective verdict prefixes the rank
(``rank 1: stage 1 of 2 ...``), so a failure on any rank fails the case on every rank, naming
it. Each outcome's record carries the stage's own verdict (``stage``: rank, stage, status,
first problems, copies per step), gathered from every rank into ``<check>_per_stage``.

=============  ===========================================================================
equivalence    the losses (on every rank), this stage's gradients of every step and its
               final weights equal the one-rank run's of the same schedule bitwise; the
               warmup moved what the prediction moves on the stage; no corrupted reload
leaks          every saved tensor packed in a step is unpacked by its backward (the harness's
               windows), the offloader's log leaks nothing, a capped pool is hit and held
transfers      every step's copies per group occurrence of this stage equal the prediction for
               its groups and its order (warmup in step 0, steady state afterwards)
disabled       the stage's offloader disabled copies nothing
fidelity       no unselected group copies; every name the prediction moves moves, each step
weights        no parameter storage of the stage is copied out
cadence        reloads held to the rule in the stage's order (n-a where no reload copies)
memory, sync   CUDA only: n-a on CPU; not run per stage on CUDA yet (skip)
golden         n-a: the baseline is the one-rank run, held bitwise by ``equivalence``
=============  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from harness.cases import Case
from harness.execute.attribution import group_differences
from harness.execute.learn import LEARNED_ONLY, expected_fields
from harness.execute.pipeline_case import StageRun, check_world
from harness.measure.footprint import footprint
from harness.measure.observe import corrupted_reloads
from harness.verify.checks import _step_fidelity, pool_cap_problems

NO_RELOAD = "on a CPU device the backend hands out the host copy at unpack: no reload copy to order"
GOLDEN = (
    "a pipeline row's baseline is the one-rank run of the same schedule, held bitwise by its "
    "equivalence check; no golden trace of its own"
)


def stage_record(res: StageRun, status: str, problems: Iterable[str] = ()) -> dict[str, Any]:
    """The stage's own verdict of one check, for the case's record."""
    counts = [c.totals()["d2h"] for c in res.per_step]
    return {
        "rank": res.rank,
        "stage": res.stage,
        "label": res.label,
        "status": status,
        "problems": list(problems)[:5],
        "copies_per_step": [c.copies for c in counts],
        "bytes_per_step": [c.bytes for c in counts],
    }


def labelled(res: StageRun, problems: Iterable[str]) -> list[str]:
    return [f"{res.label}: {p}" for p in problems]


def equivalence(res: StageRun) -> list[str]:
    """Losses, this stage's gradients and final weights against the one-rank run; the warmup
    moved what the prediction moves on the stage; no reload came back changed."""
    problems = []
    plain, got = res.plain, res.offload
    if not torch.equal(got.losses, plain.losses):
        differs = (got.losses != plain.losses).nonzero().tolist()
        step, mb = differs[0] if differs else (0, 0)
        problems.append(
            f"losses differ from the one-rank run first at step {step}, microbatch {mb}: "
            f"{got.losses[step, mb].item()!r} vs {plain.losses[step, mb].item()!r}"
        )
    for step, grads in enumerate(got.grads):
        bad = [n for n, g in grads.items() if not torch.equal(g, plain.grads[step][n])]
        if bad:
            problems.append(f"step {step}: gradients differ from the one-rank run: {bad[:4]}")
            break
    bad = [n for n, w in got.final_state.items() if not torch.equal(w, plain.final_state[n])]
    if bad:
        problems.append(f"final weights differ from the one-rank run: {bad[:4]}")
    predicted = sum(e.copies for e in res.warmup.values())
    moved = res.per_step[0].totals()["d2h"].copies if res.per_step else 0
    if predicted and not moved:
        problems.append(
            f"the warmup step moved nothing on this stage; the prediction moves {predicted} "
            "copies: the bitwise equality proves nothing"
        )
    corrupted = corrupted_reloads(res.seen)
    if corrupted:
        step, where = corrupted[0]
        problems.append(
            f"{len(corrupted)} reloads differ from what was saved (checksums at pack and "
            f"unpack); the first: step {step}, {where}"
        )
    return problems


def leaks(res: StageRun) -> list[str]:
    problems = []
    for step, observed in enumerate(res.seen):
        left = {k: n - observed.unpacked.get(k, 0) for k, n in observed.packed.items()}
        left = {k: n for k, n in left.items() if n}
        if left:
            where = ", ".join(f"{res.where(step, k)} ({n})" for k, n in list(left.items())[:3])
            problems.append(f"saved tensors packed and never unpacked: {where}")
    logs = res.offload.logs
    leaked = [log.leaked_tensors for log in logs]
    if any(leaked):
        problems.append(f"the offloader's log leaked tensors per step: {leaked}")
    return problems + pool_cap_problems(res.case, logs)


def transfers(res: StageRun) -> list[str]:
    assert res.semantics is not None
    device = "cuda" if res.per_step and res.per_step[0].mode == "device" else "cpu"
    problems = []
    if not any(res.steady_copies) and not res.inert:
        problems.append("the prediction moves nothing on any stage: the case proves nothing")
    own = res.rule.own if res.rule is not None else None
    if own is not None and res.rule is not None and res.rule.inconsistent:
        problems += [f"{res.rule.line}; inconsistent within its learning steps:"]
        problems += list(res.rule.inconsistent[:4])
    for step, counts in enumerate(res.per_step):
        expected = res.warmup if step == 0 else res.steady
        whys = {k: e.why for k, e in expected.items() if e.why}
        held = (  # an undeclared stage no rule fits: its own learning step's copies
            own.table(step) if own is not None else expected_fields(expected, res.semantics, device)
        )
        lines = group_differences(
            held,
            counts.by_group(),
            "predicted" if own is None else "held to",
            "measured",
            whys,
            f"step {step}",
            res.case.schedule,
        )
        problems += lines[:4] + ([f"... and {len(lines) - 4} more"] if len(lines) > 4 else [])
    return problems


def disabled(res: StageRun) -> list[str]:
    if not any(c.totals()["d2h"].copies for c in res.per_step):
        return ["the enabled run moved nothing on this stage: the disabled run proves nothing"]
    assert res.disabled is not None
    moved = [c for c in res.disabled.copies]
    if moved:
        keys = sorted({str(c.group) for c in moved})[:4]
        return [f"step 0 with the offloader disabled still copied {len(moved)} times: {keys}"]
    return []


def fidelity(res: StageRun) -> list[str]:
    problems: list[str] = []
    spec = res.case.model_spec("tiny")
    for step, counts in enumerate(res.per_step):
        expected = res.warmup if step == 0 else res.steady
        problems += _step_fidelity(step, counts.by_group(), expected, set(res.case.offload), spec)
    return problems[:6]


def weights(res: StageRun) -> list[str]:
    return [
        f"step {step}: a weight was copied out: {copy}"
        for step, observed in enumerate(res.seen)
        for copy in observed.weight_copies()
    ][:4]


def cadence(res: StageRun) -> list[str]:
    assert res.cadence is not None
    return res.cadence.problems()


PROBLEMS = {
    "equivalence": equivalence,
    "leaks": leaks,
    "transfers": transfers,
    "disabled": disabled,
    "fidelity": fidelity,
    "weights": weights,
    "cadence": cadence,
}
"""The checks a stage's runs decide, by name (the others are decided before any run)."""


def stage_outcome(
    name: str, case: Case, made: Callable[[], StageRun], device_type: str
) -> dict[str, Any]:
    """Check ``name`` of a pipeline row on this rank: the fields of its
    ``harness.verify.judge.CheckOutcome`` (status, problems, reason, record). ``made`` makes
    (once) or returns the stage's runs; checks that do not apply, and every check outside a
    process group of the row's stages (a skip), are decided without them."""
    try:  # outside torchrun (offload-harness run, a one-process pytest): a skip, not a failure
        check_world(case)
    except ValueError as exc:
        return {"status": "skip", "reason": str(exc)}
    if name == "golden":
        return {"status": "n-a", "reason": GOLDEN}
    if name in ("memory", "sync"):
        if device_type != "cuda":
            return {"status": "n-a", "reason": f"{name} needs a CUDA device"}
        return {"status": "skip", "reason": f"{name} is not run per pipeline stage yet"}
    res = made()
    if name in ("transfers", "cadence") and res.rule is not None and res.case.steps <= 2:
        reason = f"{res.label}: {LEARNED_ONLY}"
        return {"status": "skip", "reason": reason, "record": {"stage": stage_record(res, "skip")}}
    if name == "cadence" and res.cadence is None:
        return {"status": "n-a", "reason": NO_RELOAD, "record": {"stage": stage_record(res, "n-a")}}
    if not res.observations and name not in ("equivalence", "leaks"):
        reason = f"{res.label}: none of its layers opens a selected group; nothing to move here"
        return {"status": "n-a", "reason": reason, "record": {"stage": stage_record(res, "n-a")}}
    if res.inert and name not in ("equivalence", "leaks"):
        reason = f"{res.inert}: nothing is offloaded to check"
        return {"status": "n-a", "reason": reason, "record": {"stage": stage_record(res, "n-a")}}
    problems = labelled(res, PROBLEMS[name](res))
    status = "fail" if problems else "pass"
    record: dict[str, Any] = {"stage": stage_record(res, status, problems)}
    if name == "leaks" and res.seen:  # this stage's host footprint (reported, not judged yet)
        record["stage"]["host_footprint"] = footprint(res.seen[-1]).as_record()
    if name == "leaks" and res.case.pool_cap is not None:  # this stage's pinned pool
        logs = res.offload.logs
        record["stage"]["pool"] = {
            "cap": res.case.pool_cap,
            "exhausted": [log.pool_exhausted for log in logs],
            "allocated": [log.pool_allocated for log in logs],
        }
    if name == "equivalence":  # gathered from every rank into transfers_per_rank
        record["transfers"] = record["stage"]
        record["losses"] = {
            "plain": res.plain.losses.tolist(),
            "offload": res.offload.losses.tolist(),
        }
        record["run_seconds"] = res.seconds
    return {"status": status, "problems": tuple(problems), "record": record}
