"""The ``leaks`` check's rules on the host footprint (``harness.measure.footprint``): the bound a
backend declares on the host memory it holds per byte in flight, and no host memory new to a
pooled backend's copies after the warmup."""

from __future__ import annotations

from harness.cases import Case
from harness.execute.caserun import CaseRun
from harness.measure.footprint import bound_problem
from harness.offload.config import MOE_EXPERT_NAMES
from harness.offload.protocol import Capabilities
from harness.verify.checks import _occurrences

BOUND_FROM = 2
"""The first step a declared bound holds at: the warmup (step 0) offloads every group and the
first steady step may still hold the warmup's buffers (a pool sizes itself to a steady step at
that step's end, as the reference's does); a run of fewer steps reports its footprint only."""


def footprint_problems(case: Case, res: CaseRun, capabilities: Capabilities) -> list[str]:
    """The host memory the offloader holds (``harness.measure.footprint``): within the bound it
    declares at the final step's peak (``Capabilities.host_bound``); and for a backend with a
    pool (``Capabilities.host_pool``, or a log reporting pool buffers), no host memory new to its
    copies after the warmup (step 0) - a pool filled in the warmup serves every later step.
    Exempt: groups whose shapes follow the routing (no pool serves them) and a step whose
    capped pool was exhausted (the row's designed fallback)."""
    problems = []
    steps = len(res.new_host)
    if capabilities.host_bound is not None and res.footprint and steps >= BOUND_FROM + 1:
        line = bound_problem(res.footprint, capabilities.host_bound, steps - 1)
        if line:
            problems.append(line)
    logs = res.offload.logs[int(case.eval_first) :]
    pooled = capabilities.host_pool or any(log.pool_allocated for log in logs)
    if not pooled:
        return problems
    for step in range(1, len(res.new_host)):
        if step < len(logs) and logs[step].pool_exhausted > logs[step - 1].pool_exhausted:
            continue
        new = [(k, n) for k, n in res.new_host[step] if k[2] not in MOE_EXPERT_NAMES]
        allocs = res.host_allocs[step] if step < len(res.host_allocs) else None
        if new:
            where = ", ".join(f"{n} B for {_occurrences([k])}" for k, n in new[:4])
            problems.append(
                f"step {step}: the offloader keeps a host pool, yet its D2H copies wrote "
                f"{len(new)} host buffers no earlier step had used ({where}): host memory "
                "allocated after the warmup"
                + (f"; the caching host allocator pinned {allocs} new blocks" if allocs else "")
            )
            break
    return problems
