"""The checks a case makes, as functions returning problems (empty: pass).

pytest cases assert that the list is empty; ``offload-harness run`` prints it. One definition
serves both, so the CLI and the test suite cannot disagree about a verdict.
"""

from __future__ import annotations

from collections import Counter

import torch

from harness.cases import Case
from harness.compare import loss_table
from harness.execute import CaseRun, MemoryResult, total
from harness.spec import ModelSpec
from harness.transfers import Counts


def repro_hint(case: Case) -> str:
    return f"reproduce: offload-harness run --case '{case.name}'"


def equivalence_problems(case: Case, res: CaseRun) -> list[str]:
    """Offload happened, then losses, gradients and final weights equal the plain baseline."""
    if res.proof_problems:
        return ["the offload did not happen:", *res.proof_problems]
    problems = []
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
        problems.append(loss_table(res.plain.losses, res.offload.losses))
        problems.append(repro_hint(case))
    return problems


def leak_problems(case: Case, res: CaseRun) -> list[str]:
    """Per iteration: nothing left behind, pool buffers back, warmup first, pool stops growing."""
    logs = res.offload.logs
    if len(logs) != case.steps:
        return [f"{len(logs)} iteration logs for {case.steps} steps"]
    problems = []
    warmups = [log.warmup for log in logs]
    if warmups != [True] + [False] * (case.steps - 1):
        problems.append(f"warmup flags per iteration {warmups}: only the first may be the warmup")
    for log in logs:
        if log.leaked_tensors or log.pool_in_use:
            problems.append(
                f"iteration {log.iteration}: {log.leaked_tensors} saved tensors never unpacked, "
                f"{log.pool_in_use} pool buffers not returned"
            )
    allocated = [log.pool_allocated for log in logs[1:]]
    if len(set(allocated)) > 1:
        problems.append(f"pinned pool keeps allocating after the warmup: {allocated}")
    if not torch.isfinite(res.offload.losses).all():
        problems.append("non-finite losses in the offload run")
    return problems


def transfer_problems(case: Case, res: CaseRun, device: torch.device) -> list[str]:
    """Profiler counts equal the prediction and the offloader's log; no pageable or stray copy."""
    if not any(e.bytes for e in res.expected.values()):
        return ["the prediction moves nothing in the final step: the case would prove nothing"]
    problems = []
    if res.mismatches():
        problems += ["profiler vs prediction:", *res.mismatches()]
    if res.log_mismatches():
        problems += ["offloader log vs profiler:", *res.log_mismatches()]
    if res.counts.pageable:
        problems.append(f"{res.counts.pageable} offload copies used pageable host memory")
    stray = {d: c for d, c in res.counts.unattributed.items() if c.copies}
    if device.type == "cuda" and stray:
        problems.append(f"DtoH/HtoD memcpys outside any offload group range: {stray}")
    return problems


def disabled_problems(res: CaseRun) -> list[str]:
    """The enabled run moved something; the disabled run moved nothing."""
    if not res.counts.totals()["d2h"].copies:
        return ["the enabled run moved nothing: the disabled comparison proves nothing"]
    if total(res.disabled) != Counts():
        return [f"disabled offloader still copied: {res.disabled}"]
    return []


def fidelity_problems(case: Case, res: CaseRun, spec: ModelSpec) -> list[str]:
    """Only selected groups move, and exactly the selected groups the prediction moves."""
    selected = set(case.offload)
    predicted = {name for (_, _, name), e in res.expected.items() if e.copies}
    moved = res.moved_names()
    problems = []
    if not moved <= selected:
        problems.append(f"unselected groups moved: {sorted(moved - selected)}")
    if moved != predicted:
        problems.append(f"groups moved {sorted(moved)}, predicted {sorted(predicted)}")
    fc1_alone = "moe_act" in selected and "expert_fc1" not in selected
    if spec.moe_path == "unfused" and fc1_alone and "expert_fc1" in moved:
        problems.append("fc1's input moved although only moe_act is selected")
    return problems


def memory_problems(res: MemoryResult) -> list[str]:
    """After the last forward the offload run holds exactly the predicted bytes less than the
    baseline (requested bytes; allocated bytes within the measured rounding); the step's peak
    is not above the baseline's beyond Megatron's duplicate whole-storage reloads."""
    if res.predicted_drop <= 0:
        return ["nothing predicted in flight after the last forward: the check proves nothing"]
    problems = []
    if res.requested_drop != res.predicted_drop:
        problems += [
            f"memory after the last forward dropped by {res.requested_drop} requested bytes, "
            f"predicted {res.predicted_drop}",
            f"  predicted freed storages (bytes: count): {_sizes(res.predicted_sizes)}",
            f"  live only in the baseline: {_sizes(res.freed_sizes)}",
            f"  live only in the offload run: {_sizes(res.extra_sizes)}",
        ]
    if abs(res.allocated_drop - res.predicted_drop) > res.rounding:
        problems.append(
            f"memory_allocated dropped by {res.allocated_drop} B, predicted {res.predicted_drop} B;"
            f" the live blocks' rounding explains at most {res.rounding} B"
        )
    if res.offload_peak > res.baseline_peak + res.peak_allowance:
        problems.append(
            f"peak {res.offload_peak} B above the baseline's {res.baseline_peak} B by more than "
            f"the {res.peak_allowance} B of duplicate whole-storage reloads"
        )
    return problems


def _sizes(sizes: Counter[int], limit: int = 12) -> str:
    top = sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:limit]
    more = len(sizes) - len(top)
    return ", ".join(f"{size}: {count}" for size, count in top) + (
        f" (+{more} more)" if more else ""
    )
