"""The memory check's problems (CUDA): what a memory reading of the offload run against its
baseline must show after the last forward and at the step's peak, and where the blocks nothing
explains were allocated (``harness.execute.memory`` reads; ``harness.verify.judge`` decides)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: the memory reading runs before the check reads it
    from harness.execute.memory import MemoryResult


def memory_problems(res: MemoryResult) -> list[str]:
    """After the last forward the offload run holds exactly the predicted bytes less than the
    baseline (requested bytes; allocated bytes within the measured rounding); the step's peak
    is not above the baseline's beyond Megatron's duplicate whole-storage reloads."""
    if res.predicted_drop <= 0:
        return ["nothing predicted in flight after the last forward: the check proves nothing"]
    problems = []
    slack = res.case.memory_slack
    others = _slack_blocks(res)
    small = None if others is None else sum(size * n for size, n in others.items())
    if res.requested_drop != res.predicted_drop and (
        small is None or abs(res.requested_drop - res.predicted_drop) > small
    ):
        problems += [
            f"memory after the last forward dropped by {res.requested_drop} requested bytes, "
            f"predicted {res.predicted_drop}",
            f"  predicted freed storages (bytes: count): {_sizes(res.predicted_sizes)}",
            f"  live only in the baseline: {_sizes(res.freed_sizes)}",
            f"  live only in the offload run: {_sizes(res.extra_sizes)}",
        ]
        if res.predicted_extra:
            problems.append(
                "  predicted live only in the offload run (reloads of groups reloaded ahead of "
                f"their backward, beyond the storages they freed): {_sizes(res.predicted_extra)}"
            )
        problems += _site_lines(
            "baseline", res.freed_sizes - res.predicted_sizes, res.baseline_sites
        )
        problems += _site_lines("offload run", res.extra_sizes, res.offload_sites)
    if abs(res.allocated_drop - res.predicted_drop) > res.rounding + (small or 0):
        problems.append(
            f"memory_allocated dropped by {res.allocated_drop} B, predicted {res.predicted_drop} B;"
            f" the live blocks' rounding explains at most {res.rounding} B"
        )
    # a block within the slack takes one of the allocator's smallest blocks at the peak too,
    # and so may a replaced cache block within the slack while old and new are both live
    small_blocks = sum((others or Counter()).values())
    if others is not None:
        small_blocks += sum(n for size, n in res.replaced_sizes.items() if size <= slack)
    allowance = res.peak_allowance + MIN_BLOCK * small_blocks
    if res.offload_peak > res.baseline_peak + allowance:
        problems.append(
            f"peak {res.offload_peak} B above the baseline's {res.baseline_peak} B by more than "
            f"the {allowance} B allowed (duplicate whole-storage reloads, slack blocks)"
        )
    if res.backward is not None:
        problems += res.backward.problems
    count, freed = res.floor_freed
    if problems and count:
        problems.append(
            f"  note: the runs also freed {count} blocks ({freed} B) allocated before they "
            "started; they are not counted in either reading"
        )
    return problems


MIN_BLOCK = 512
"""Bytes of the CUDA caching allocator's smallest block: any request up to it takes one."""


def _slack_blocks(res: MemoryResult) -> Counter[int] | None:
    """Requested sizes of the blocks that differ between the runs beyond the predicted
    storages, when the case allows a memory slack, every predicted storage was freed and each
    other block is within the slack (None otherwise)."""
    slack = res.case.memory_slack
    if not slack or res.predicted_sizes - res.freed_sizes:
        return None
    others = (res.freed_sizes - res.predicted_sizes) + res.extra_sizes
    if any(size > slack for size in others):
        return None
    return others


def _site_lines(run: str, sizes: Counter[int], sites: dict[int, str], limit: int = 6) -> list[str]:
    """Where ``run`` allocated its unexplained blocks, largest first (sizes without a recorded
    site are left out)."""
    known = sorted((size for size in sizes if size in sites), reverse=True)
    lines = [f"  {run} allocated {size} B at {sites[size]}" for size in known[:limit]]
    if len(known) > limit:
        lines.append(f"  ... and {len(known) - limit} more sizes")
    return lines


def _sizes(sizes: Counter[int], limit: int = 12) -> str:
    top = sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:limit]
    more = len(sizes) - len(top)
    return ", ".join(f"{size}: {count}" for size, count in top) + (
        f" (+{more} more)" if more else ""
    )
