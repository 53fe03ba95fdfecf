"""The ``leaks`` check's rules on the host footprint (``harness.measure.footprint``): the bound a
backend declares on the host memory it holds per byte in flight, and no host memory new to a
pooled backend's copies after the warmup."""

from __future__ import annotations

from harness.cases import Case
from harness.execute.caserun import CaseRun
from harness.measure.footprint import bound_problem
from harness.offload.protocol import Capabilities
from harness.vocab.groups import GROUPS

BOUND_FROM = 2
"""The first step a declared bound holds at: the warmup (step 0) offloads every group and the
first steady step may still hold the warmup's buffers (a pool sizes itself to a steady step at
that step's end, as the reference's does); a run of fewer steps reports its footprint only."""


def _occurrence(key: tuple[int, int, str]) -> str:
    mb, layer, name = key
    return f"{name} (microbatch {mb}, layer {layer})"


def footprint_problems(case: Case, res: CaseRun, capabilities: Capabilities) -> list[str]:
    """The host memory the offloader holds (``harness.measure.footprint``): within the bound it
    declares at the final step's peak (``Capabilities.host_bound``); and for a backend with a
    pool (``Capabilities.host_pool``, or a log reporting pool buffers), no host memory new to its
    copies after the warmup (step 0) - a pool filled in the warmup serves every later step.
    Exempt: groups whose shapes follow the routing (no pool serves them) and a step whose
    capped pool was exhausted (the row's designed fallback)."""
    problems = []
    if capabilities.host_bound is not None and len(res.footprints) >= BOUND_FROM + 1:
        line = bound_problem(res.footprints[-1], capabilities.host_bound, len(res.footprints) - 1)
        if line:
            problems.append(line)
    logs = res.offload.logs[int(case.eval_first) :]
    pooled = capabilities.host_pool or any(log.pool_allocated for log in logs)
    if not pooled:
        return problems
    for step in range(1, len(res.new_host)):
        if step < len(logs) and logs[step].pool_exhausted > logs[step - 1].pool_exhausted:
            continue
        new = [(k, n) for k, n in res.new_host[step] if not _routing_dependent(k[2])]
        allocs = res.host_allocs[step] if step < len(res.host_allocs) else None
        if new:
            where = ", ".join(f"{n} B for {_occurrence(k)}" for k, n in new[:4])
            problems.append(
                f"step {step}: the offloader keeps a host pool, yet its D2H copies wrote "
                f"{len(new)} host buffers no earlier step had used ({where}): host memory "
                "allocated after the warmup"
                + (f"; the caching host allocator pinned {allocs} new blocks" if allocs else "")
            )
            break
    return problems


def _routing_dependent(name: str) -> bool:
    group = GROUPS.get(name)
    return group is not None and group.routing_dependent
