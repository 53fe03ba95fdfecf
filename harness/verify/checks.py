"""The checks a case makes, as functions returning problems (empty: pass).

``harness.verify.judge`` turns them into check outcomes for pytest's case files, ``offload-harness
run`` and mutation scoring alike, so no two entry points can disagree about a verdict.

Every problem names where it happened: the step, the microbatch and the group (a loss mismatch
lists the groups offloaded in the step where the first gradient or loss went wrong, per
microbatch, as suspects).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from harness.cases import Case
from harness.execute.attribution import total
from harness.execute.cadence import Cadence
from harness.execute.caserun import CaseRun, attribution_mismatches
from harness.execute.environment import Environment
from harness.execute.predict import predict
from harness.measure.observe import REUSED
from harness.measure.transfers import Counts
from harness.models.train import schedule_order
from harness.offload.semantics import GroupKey
from harness.util.compare import first_divergence, loss_table
from harness.verify.commands import case_command
from harness.vocab.spec import ModelSpec, pass_label

if TYPE_CHECKING:  # a type only: the memory reading runs before the checks read it
    pass


def repro_hint(case: Case, env: Environment) -> str:
    """``reproduce: <command>``: the fully explicit, shell-quoted ``offload-harness repro`` line
    that reruns ``case`` as it ran in ``env`` (row id, overridden fields, seed, backend, device,
    model size; ``harness.verify.commands.case_command``, the builder of ``command.txt`` too)."""
    return f"reproduce: {shlex.join(case_command(case, env, bisect=True))}"


def equivalence_problems(case: Case, res: CaseRun, env: Environment) -> list[str]:
    """Offload happened, then losses, gradients and final weights equal the plain baseline
    (``env``: where it ran, for the reproduce hint)."""
    if res.inert:
        moved = inert_copies(res)
        if moved:
            return [f"{res.inert}, yet the offload run copied: {moved}"]
    elif res.proof_problems or res.steady_proof:
        out = []
        if res.proof_problems:
            out += ["the offload did not happen in step 0 (the warmup step):", *res.proof_problems]
        if res.steady_proof:
            out += [
                "the offload did not happen in every steady step (each selected name moves in "
                "every step, whatever the offloader's own rule):",
                *res.steady_proof,
            ]
        return out + corrupted_lines(res)  # what did move may have come back wrong too
    problems = corrupted_lines(res)
    if not res.verdict.ok:
        problems.append(res.verdict.message)
    if res.grad_difference is not None:
        step, name, diff = res.grad_difference
        problems.append(
            f"first gradient that differs: step {step}, parameter {name} (max |diff| {diff:.3e})"
        )
    if res.weight_difference is not None:
        name, diff = res.weight_difference
        problems.append(f"final weights differ first at {name} (max |diff| {diff:.3e})")
    if problems:
        problems.append(suspect_groups(case, res))
        problems.append(loss_table(res.baseline.losses, res.offload.losses))
        problems.append(repro_hint(case, env))
    return problems


def corrupted_lines(res: CaseRun) -> list[str]:
    """The reloads that differ from what was saved: how many, the first, and - where reloads
    at a reused storage address are among them but not first - the first of those."""
    if not res.corrupted:
        return []
    step, where = res.corrupted[0]
    lines = [
        f"{len(res.corrupted)} reloads differ from what was saved (checksums at pack and "
        f"unpack, {res.checksummed} compared); the first: step {step}, {where}"
    ]
    reused = [(s, w) for s, w in res.corrupted if REUSED in w]
    if reused and reused[0] != res.corrupted[0]:
        lines.append(
            f"{len(reused)} of them were saved at a storage address another saved tensor had "
            f"held, freed since; the first: step {reused[0][0]}, {reused[0][1]}"
        )
    return lines


def inert_copies(res: CaseRun) -> str:
    """What an inert case's offload run copied anyway, by the harness's windows, per step
    (empty: nothing): the proof an inert case gives instead of the offload's."""
    moved = []
    for step, counts in enumerate(res.per_step):
        totals = counts.totals()
        if totals["d2h"].copies or totals["h2d"].copies:
            copied = [k for k, f in counts.by_group().items() if f["d2h_copies"] or f["h2d_copies"]]
            moved.append(
                f"step {step}: {totals['d2h']} out, {totals['h2d']} back, in {_occurrences(copied)}"
            )
    return "; ".join(moved[:3])


def checksum_coverage(res: CaseRun) -> dict[str, int]:
    """How many of the offload run's reloads were checksummed (``CaseRun.checksum_coverage``)."""
    return res.checksum_coverage()


def checksum_gap(coverage: dict[str, int]) -> str:
    """Why the checksum part of equivalence decided nothing (empty: it compared reloads): the
    run moved tensors but none could be checksummed - the backend's saved-tensor hooks run
    outside the harness's group windows, so no pack or unpack passed through its wrapper."""
    if coverage["compared"] or not coverage["offload_copies"]:
        return ""
    return (
        f"checksum part skipped: the offload run made {coverage['offload_copies']} offload "
        f"copies but no reload could be checksummed ({coverage['packed']} saved tensors packed "
        "through the harness's group windows: the backend's saved-tensor hooks run outside "
        "them); losses, gradients and weights were still compared"
    )


def suspect_groups(case: Case, res: CaseRun) -> str:
    """The groups offloaded in the first step whose gradients or losses differ, per microbatch:
    a corrupted reload shows in that step's gradients (its losses diverge one step later)."""
    loss = first_divergence(res.baseline.losses, res.offload.losses, case.tolerance)
    known = [loss.step] if loss is not None else []
    if res.grad_difference is not None:
        known.append(res.grad_difference[0])
    step = min(known) if known else case.steps - 1
    offloaded, source = _offloaded_in_step(case, res, step)
    parts = [
        f"{pass_label(mb, case.schedule)}: {_group_list(keys)}"
        for mb, keys in sorted(_by_microbatch(offloaded).items())
    ]
    line = f"suspect groups, offloaded in step {step} ({source}): " + ("; ".join(parts) or "none")
    if res.grad_difference is not None:
        layer = re.search(r"layers\.(\d+)\.", res.grad_difference[1])
        if layer is not None:
            line += f"; the first differing gradient is in layer {layer.group(1)}"
    return line


def _offloaded_in_step(case: Case, res: CaseRun, step: int) -> tuple[list[GroupKey], str]:
    """Group occurrences that moved bytes in ``step``: the offloader's log when it keeps one,
    else the prediction (warmup for step 0, steady state after)."""
    logs = res.offload.logs
    if step < len(logs):
        moved = [r.key for r in logs[step].groups if r.d2h_copies]
        if moved:
            return moved, "the offloader's log"
    order = schedule_order(case.schedule, case.microbatches)
    warmup, steady = predict(res.observations, case.offload_config(), order)
    expected = warmup if step == 0 else steady
    return [k for k, e in expected.items() if e.copies], "predicted"


def _by_microbatch(keys: Iterable[GroupKey]) -> dict[int, list[GroupKey]]:
    out: dict[int, list[GroupKey]] = {}
    for key in keys:
        out.setdefault(key[0], []).append(key)
    return out


def _group_list(keys: Iterable[GroupKey], limit: int = 8) -> str:
    """``core_attn (layer 0), attn_proj (layer 0), ...`` in layer order."""
    ordered = sorted(keys, key=lambda k: (k[1], k[2]))
    shown = [f"{name} (layer {layer})" for _, layer, name in ordered[:limit]]
    more = len(ordered) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _occurrences(keys: Iterable[GroupKey], limit: int = 6) -> str:
    """``expert_fc1 (microbatch 0, layer 1), ...``."""
    ordered = sorted(keys)
    shown = [f"{name} (microbatch {mb}, layer {layer})" for mb, layer, name in ordered[:limit]]
    more = len(ordered) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def leak_problems(case: Case, res: CaseRun) -> list[str]:
    """Per iteration, from the harness's own records (any backend, no log needed): every saved
    tensor a step's groups packed was unpacked by its backward, and the host memory the observed
    D2H copies wrote that is still held at a step's end stops growing after the warmup, the
    first steady step included. Where the offloader keeps a log, it is a cross-check: nothing
    left behind, pool buffers back, warmup first, pool stops growing."""
    problems = unpacked_problems(case, res) + held_problems(case, res)
    if res.offload.logs:
        problems += log_leak_problems(case, res)
    if not torch.isfinite(res.offload.losses).all():
        problems.append("non-finite losses in the offload run")
    return problems


def leak_evidence(res: CaseRun) -> str | None:
    """Why the harness's own leak records cannot decide (None: they can): no observed step, or
    no saved tensor packed through its windows and no host memory written by an observed D2H."""
    if not res.packed:
        return "the offload run observed no step"
    if not any(res.packed) and not any(res.held) and not res.offload.logs:
        return (
            "the harness saw no saved tensor packed in its group windows (the backend's hooks "
            "run outside them) and no host memory held, and the backend keeps no log"
        )
    return None


def unpacked_problems(case: Case, res: CaseRun) -> list[str]:
    """Saved tensors packed in a step's group windows that its backward never unpacked."""
    problems = []
    for step, (packed, unpacked) in enumerate(zip(res.packed, res.unpacked, strict=True)):
        left = {k: n - unpacked.get(k, 0) for k, n in packed.items() if n > unpacked.get(k, 0)}
        if left:
            problems.append(
                f"step {step}: {sum(left.values())} of {sum(packed.values())} saved tensors "
                f"packed in the step's groups were never unpacked by its backward (harness "
                f"pack/unpack records), in {_occurrences(left)}"
            )
    return problems


def held_problems(case: Case, res: CaseRun) -> list[str]:
    """Host memory held across iterations grows after the warmup (step 0): every step after
    it must hold at most what the step before it held."""
    totals = [sum(nbytes for _, _, nbytes in held) for held in res.held]
    problems = []
    for step in range(1, len(totals)):
        if totals[step] <= totals[step - 1]:
            continue
        newer = Counter()
        for written, key, nbytes in res.held[step]:
            if written >= 1:
                newer[(written, key)] += nbytes
        where = "; ".join(
            f"written in step {w}: {nbytes} B by {_occurrences([key])}"
            for (w, key), nbytes in sorted(newer.items())[:6]
        )
        problems.append(
            f"step {step}: host memory written by the offload copies and still held at the "
            f"step's end grew from {totals[step - 1]} B to {totals[step]} B after the warmup "
            f"(per step: {totals}); still alive: {where or 'none written after step 0'}"
        )
        break
    return problems


def log_leak_problems(case: Case, res: CaseRun) -> list[str]:
    """The offloader's own log: nothing left behind, pool buffers back, warmup first, the pool
    stops growing from the first steady step on."""
    logs = res.offload.logs
    evals = int(case.eval_first)  # the no-grad pass before step 0 ends an iteration too
    if len(logs) != case.steps + evals:
        return [f"{len(logs)} iteration logs for {evals} no-grad pass(es) and {case.steps} steps"]
    problems = []
    warmups = [log.warmup for log in logs]
    if warmups != [False] * evals + [True] + [False] * (case.steps - 1):
        what = "the first training step" if evals else "the first iteration"
        problems.append(f"warmup flags per iteration {warmups}: only {what} may be the warmup")
        first = logs[evals]
        if not first.warmup:
            offloaded = [r.key for r in first.groups if r.d2h_copies]
            problems.append(
                "step 0 (the first training step) ran as a steady-state iteration, planned from "
                "an earlier pass; groups it offloaded: "
                + (
                    "; ".join(
                        f"{pass_label(mb, case.schedule)}: {_group_list(keys)}"
                        for mb, keys in sorted(_by_microbatch(offloaded).items())
                    )
                    or "none"
                )
            )
    for log in logs:
        if log.leaked_tensors or log.pool_in_use:
            offloaded = [r.key for r in log.groups if r.d2h_copies]
            problems.append(
                f"step {log.iteration - evals}: {log.leaked_tensors} saved tensors never unpacked, "
                f"{log.pool_in_use} pool buffers not returned (the offloader's log); groups "
                "offloaded in that step: "
                + "; ".join(
                    f"{pass_label(mb, case.schedule)}: {_group_list(keys)}"
                    for mb, keys in sorted(_by_microbatch(offloaded).items())
                )
            )
    problems += pool_cap_problems(case, logs)
    # from the warmup's end on: a pool growing in the first steady step is growing too
    allocated = [log.pool_allocated for log in logs[evals:]]
    if len(set(allocated)) > 1:
        problems.append(
            f"pinned pool keeps allocating after the warmup (buffers allocated at the end of "
            f"steps 0..{case.steps - 1}): {allocated}"
        )
    return problems


def pool_cap_problems(case: Case, logs: list[Any]) -> list[str]:
    """A row capping the pinned pool below what a step needs must see the cap hit (the
    offloader's log counts each request the pool could not serve) and stay within it; a backend
    whose log shows no pool at all has nothing the cap applies to."""
    cap = case.pool_cap
    if cap is None or not any(log.pool_allocated for log in logs):
        return []
    problems = []
    if not logs[-1].pool_exhausted:
        problems.append(
            f"the pinned pool capped at {cap} buffers was never exhausted (allocated "
            f"{[log.pool_allocated for log in logs]}): the row proves nothing about exhaustion"
        )
    if max(log.pool_allocated for log in logs) > cap:
        problems.append(
            f"the pinned pool grew past its cap of {cap} buffers: "
            f"{[log.pool_allocated for log in logs]}"
        )
    return problems


def pool_record(case: Case, res: CaseRun) -> dict[str, Any] | None:
    """The report's ``pool`` field: the cap, and how often each step's pool was exhausted
    (cumulative per the offloader's log); None without a cap."""
    if case.pool_cap is None:
        return None
    return {
        "cap": case.pool_cap,
        "exhausted": [log.pool_exhausted for log in res.offload.logs],
        "allocated": [log.pool_allocated for log in res.offload.logs],
    }


def transfer_problems(case: Case, res: CaseRun, device: torch.device) -> list[str]:
    """Profiler counts equal the prediction and the offloader's log; no pageable or stray copy."""
    own = res.rule.own if res.rule is not None else None
    if not any(e.bytes for e in res.expected.values()) and not res.inert:
        what = "its first steady step moved" if own is not None else "the prediction moves"
        return [f"{what} nothing in the final step: the case would prove nothing"]
    problems = res.overdrawn_lines()  # an absolute: whatever was declared or learned
    if own is not None and res.rule is not None and res.rule.inconsistent:
        problems += [
            f"{res.rule.line}; inconsistent within its learning steps:",
            *_capped(list(res.rule.inconsistent)),
        ]
    relaid = res.relaid_inconsistencies()
    if relaid:
        problems += ["the reload layout changed after the learning steps:", *relaid]
    final = f"step {case.steps - 1} (the final step)"
    att = res.attribution
    source = att.source if att is not None else "offloader ranges"
    earlier = "the steps before the final one"
    held = "its own first steady step" if own is not None else "prediction"
    for title, lines in (
        (f"counted ({source}) vs {held} in {final}:", res.mismatches()),
        (f"offloader log vs counted ({source}) in {final}:", res.log_mismatches()),
        (f"counted (harness windows) vs {held} in {earlier}:", res.step_mismatches()),
        (f"offloader log vs counted (harness windows) in {earlier}:", res.step_log_mismatches()),
    ):
        if lines:
            problems += [title, *lines]
    crossed = attribution_mismatches(res, case.steps - 1)
    if crossed:
        problems += ["the offloader's own ranges vs the harness's group windows:", *crossed]
    copied = [k for k, f in res.measured.items() if f["d2h_copies"] or f["h2d_copies"]]
    if res.counts.pageable:
        where = (
            f"in {_occurrences(att.pageable_groups)}"
            if att is not None and att.pageable_groups
            else f"among the copies of {_occurrences(copied)}"
        )
        problems.append(
            f"{final}: {res.counts.pageable} offload copies used pageable host memory, {where}"
        )
    if att is not None and att.outside[1]:
        # The final step only, as for stray memcpys: the warmup step also holds an offloader's
        # one-off bookkeeping (megatron-core's post-warmup summary gathers objects across
        # ranks); its outside copies are in the check's record (outside_windows).
        problems.append(
            f"{final}: {att.outside[1]} copies outside every group window (a D2H issued after "
            f"its group's commit, or an H2D from host memory no observed D2H wrote): "
            f"{att.windows[1].unattributed}; {', '.join(att.outside_copies[1])}"
        )
    runner = res.runner_copies[1].unattributed if res.runner_copies else {}
    if source == "harness windows":
        # No range of its own: every memcpy the profiler saw is unattributed there. The ones
        # not the runner's must be the observer's (a copy bypassing the dispatcher is not).
        assert att is not None
        seen = res.counts.totals()
        stray = {}
        for d, c in att.profiled[1].unattributed.items():
            observed = seen[d].copies + att.windows[1].unattributed[d].copies
            if c.copies - runner.get(d, Counts()).copies != observed:
                theirs = runner.get(d, Counts()).copies
                stray[d] = f"profiler {c.copies}, runner's {theirs}, observed {observed}"
    else:
        stray = {
            d: c
            for d, c in res.counts.unattributed.items()
            if c.copies and c != runner.get(d, Counts())
        }
    if device.type == "cuda" and stray:
        problems.append(
            f"{final}: DtoH/HtoD memcpys outside any offload group ({source}): {stray} (the "
            f"plain run's own copies in that step: {_nonzero(runner)}); the groups that copied "
            f"in that step: {_occurrences(copied)}"
        )
    if problems and res.stale_marks:  # the why first
        problems[:0] = [
            "skipped by a stale mark (why copies went missing):",
            *res.stale_mark_lines(),
        ]
    return problems


def _capped(lines: list[str], limit: int = 12) -> list[str]:
    more = len(lines) - limit
    return lines[:limit] + ([f"... and {more} more"] if more > 0 else [])


def _nonzero(counts: dict[str, Counts]) -> dict[str, Counts]:
    return {d: c for d, c in counts.items() if c.copies}


def disabled_problems(res: CaseRun) -> list[str]:
    """The enabled run moved something; the disabled run moved nothing."""
    if not res.counts.totals()["d2h"].copies:
        return ["the enabled run moved nothing: the disabled comparison proves nothing"]
    runner = total(res.runner_copies[0]) if res.runner_copies else Counts()
    observed = total(res.disabled_observed)
    if observed.copies:
        inside = sorted({(k.microbatch, k.layer, k.name) for k in res.disabled_observed.by_range})
        outside = _nonzero(res.disabled_observed.unattributed)
        where = [f"in {_occurrences(inside)}"] if inside else []
        where += [f"outside every group window: {outside}"] if outside else []
        return [
            f"step 0 of the run with the offloader disabled still copied: {observed} seen by "
            f"the harness's copy observer, {'; '.join(where)}"
        ]
    if total(res.disabled) != runner:
        where = [
            f"{key.direction} {key.name} (microbatch {key.microbatch}, layer {key.layer}): "
            f"{c.copies} copies"
            for key, c in sorted(res.disabled.by_range.items(), key=str)
            if c.copies
        ]
        return [
            "step 0 of the run with the offloader disabled still copied: "
            + ("; ".join(where) or str(res.disabled))
            + f" (the plain run's own copies in step 0: {runner})"
        ]
    return []


def fidelity_problems(case: Case, res: CaseRun, spec: ModelSpec) -> list[str]:
    """Name fidelity in every step, from the copy observer's per-step record by the harness's
    own windows (not the final step's counts, which ``transfers`` reads, nor the offloader's
    ranges): no step copies inside an unselected group's window, and every selected name the
    prediction moves in a step (the warmup's in step 0, the steady state's after) moves in
    that step. The first three steps with a problem are named."""
    selected = set(case.offload)
    problems: list[str] = []
    for step, counts in enumerate(res.per_step):
        expected = res.warmup_expected if step == 0 else res.expected
        lines = _step_fidelity(step, counts.by_group(), expected, selected, spec)
        if lines:
            problems += lines
            if len({p.split(":")[0] for p in problems}) >= 3:
                break
    return problems


def _step_fidelity(
    step: int,
    measured: dict[GroupKey, dict[str, int]],
    expected: dict[GroupKey, Any],
    selected: set[str],
    spec: ModelSpec,
) -> list[str]:
    moved_keys = [k for k, f in measured.items() if f["d2h_copies"]]
    moved = {name for _, _, name in moved_keys}
    predicted = {name for (_, _, name), e in expected.items() if e.copies}
    problems = []
    if not moved <= selected:
        unselected = [k for k in moved_keys if k[2] not in selected]
        problems.append(
            f"step {step}: unselected groups moved: {sorted(moved - selected)}, in "
            f"{_occurrences(unselected)}"
        )
    if not predicted <= moved:
        missing = [k for k, e in expected.items() if e.copies and k[2] not in moved]
        problems.append(
            f"step {step}: selected groups the prediction moves did not move: "
            f"{sorted(predicted - moved)}, predicted in {_occurrences(missing)}"
        )
    fc1_alone = "moe_act" in selected and "expert_fc1" not in selected
    if spec.moe_path == "unfused" and fc1_alone and "expert_fc1" in moved:
        fc1 = [k for k in moved_keys if k[2] == "expert_fc1"]
        problems.append(
            f"step {step}: fc1's input moved although only moe_act is selected, in "
            f"{_occurrences(fc1)}"
        )
    return problems


def weight_problems(res: CaseRun) -> list[str]:
    """No weight left the device in any step of the offload run: no D2H copied from a
    parameter's storage (a view of it included), from a cast of a parameter a group saved, or
    from a tensor the model marked not-offloadable."""
    if not res.weights_known:
        return ["the copy observer knew no parameter storage: the check would prove nothing"]
    if not res.d2h_watched:
        return ["the offload run copied nothing to the host: the check would prove nothing"]
    if not res.weight_copies:
        return []
    copies = [c for _, c in res.weight_copies]
    steps = sorted({step for step, _ in res.weight_copies})
    first = []
    for step, copy in res.weight_copies:
        if copy.group is None:
            where = "outside every group window"
        else:
            mb, layer, name = copy.group
            where = f"group {name} (microbatch {mb}, layer {layer})"
        line = f"step {step}, {where}: {copy.weight}, {copy.nbytes} B"
        if line not in first:
            first.append(line)
    shown = first[:6] + ([f"... and {len(first) - 6} more"] if len(first) > 6 else [])
    problems = [
        f"{len(copies)} D2H copies of weights ({sum(c.nbytes for c in copies)} B) in steps "
        f"{steps} of the offload run (of {res.d2h_watched} D2H observed); the first:",
        *(f"  {line}" for line in shown),
    ]
    if res.semantics.observed:
        problems.append(
            "  (the backend declares no semantics, and a learned rule never excuses a weight "
            "copy; one that moves parameters by design declares Semantics(skip='none'), and this "
            "check then reports its weight copies as n-a)"
        )
    elif res.semantics.skip == "object":
        problems.append(
            f"  ({res.semantics.label}: only Parameter objects and marked tensors stay, so a "
            f"view of a parameter that autograd saves is offloaded)"
        )
    return problems


def cadence_problems(res: CaseRun) -> list[str]:
    """No reload is issued earlier than the declared or learned rule allows, and the bytes
    reloaded ahead of their group's backward never exceed the rule's, in any step
    (``harness.execute.cadence``): the first problem of each of the first three steps with one."""
    assert res.cadence is not None
    problems = res.cadence.problems()
    if problems and res.semantics.observed:
        problems.append(
            "(the backend declares no semantics: it is held to the prefetch depth its steps 0 "
            "and 1 showed; declare Semantics.prefetch_depth to hold it to a rule of its own)"
        )
    return problems


def unordered_reason(res: CaseRun, cadence: Cadence) -> str:
    """Why a run whose rule reloads ordered no reload: what the harness saw of the reloads."""
    unordered = sum(s.unordered for s in cadence.steps)
    if unordered:
        return (
            f"{unordered} reload copies were observed, but the backward of their group "
            "occurrences was never marked (no gradient reached the harness's hook on the "
            "window's output): none could be placed in the backward order"
        )
    h2d = sum(c.totals()["h2d"].copies for c in res.per_step)
    outside = sum(c.unattributed["h2d"].copies for c in res.per_step)
    if h2d or outside:
        return (
            f"no reload of a selected group was ordered: the run's H2D copies ({h2d} in group "
            f"windows, {outside} outside every window) read no host memory an observed "
            "offload of a selected group wrote"
        )
    return (
        "no reload copy was observed in any step, though the rule it is held to reloads "
        "(the transfers check says where)"
    )


def cadence_evidence(res: CaseRun, device_type: str) -> str | None:
    """Why the cadence check cannot decide (None: it can): no group backward was marked."""
    cadence = res.cadence
    if cadence is None or not cadence.marks:
        return (
            "no group occurrence's backward was marked (no gradient reached the harness's "
            "hooks on the windows' outputs and inputs): the reloads cannot be ordered"
        )
    return None
