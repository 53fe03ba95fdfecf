"""The rows on our own models (``Case.impl`` ``harness``) beside the generated matrix: one row
per (family, offload set) cycling the other axes, the ZeRO-3 rows, the detection rows and the
rows of the interleaved schedule.

Sharding ``zero3`` rows (flat ZeRO-3 through FSDP2, bf16) follow the unsharded ones: ``default``
has the seed's and one MoE row; ``full`` has one per (family, offload set) cycling schedule and
max-inflight, plus the seed's and the MoE row again with ``min_ranks=2`` (real sharding only:
they skip at world size 1).
"""

from __future__ import annotations

from typing import Any

from harness.cases.case import (
    FAMILIES,
    INFLIGHT_VALUES,
    PRECISION_VALUES,
    SCHEDULES_IN_MATRIX,
    SEED_CASE,
    Case,
    applicable_sets,
)

SEED_ZERO3_CASE = SEED_CASE.replace(
    sharding="zero3", description="the seed under flat ZeRO-3 (FSDP2), each rank its own data"
)
MOE_ZERO3_CASE = Case(
    family="hybrid-moe",
    offload=("expert_fc1", "moe_act"),
    schedule="1f1b",
    precision="bf16",
    max_inflight=None,
    sharding="zero3",
    description="MoE experts offloaded under flat ZeRO-3 (FSDP2)",
)


def _cycled_rows(**fixed: Any) -> list[Case]:
    """One row per (family, offload set), cycling schedule, precision and max-inflight so every
    value appears; ``fixed`` fields override the cycled ones."""
    rows = []
    sets = [(family, names) for family in FAMILIES for _, names in applicable_sets(family)]
    for index, (family, names) in enumerate(sets):
        cycled = {
            "schedule": SCHEDULES_IN_MATRIX[index % 2],
            "precision": PRECISION_VALUES[(index // 2) % 2],
            "max_inflight": INFLIGHT_VALUES[index % 3],
        }
        rows.append(Case(family=family, offload=names, **{**cycled, **fixed}))
    return rows


def zero3_rows(full: bool) -> list[Case]:
    """The ZeRO-3 rows of a matrix (see the module docstring)."""
    rows = [SEED_ZERO3_CASE, MOE_ZERO3_CASE]
    if not full:
        return rows
    taken = {r.name for r in rows}
    rows += [r for r in _cycled_rows(precision="bf16", sharding="zero3") if r.name not in taken]
    return rows + [row.replace(min_ranks=2) for row in (SEED_ZERO3_CASE, MOE_ZERO3_CASE)]


DETECTION_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        schedule="1f1b",
        microbatches=3,
        precision="bf16",
        description="1F1B with 3 microbatches: a forward runs between a reload and its use",
    ),
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        precision="bf16",
        eval_first=True,
        description="a no-grad evaluation pass before the first step must not become the warmup",
    ),
)
"""Rows the default matrix carries for bug classes the family rows cannot show (a pooled
buffer reused while its reload is pending; a no-grad pass taken as the warmup)."""


PIPELINE_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        schedule="interleaved",
        microbatches=4,
        precision="bf16",
        description="the seed's model and groups under the interleaved pipeline schedule (rank 0 "
        "of 2, 2 model chunks): chunks run backward in another order than forward",
    ),
    Case(
        family="hybrid-moe",
        offload=("expert_fc1", "moe_act"),
        schedule="interleaved",
        microbatches=4,
        max_inflight=None,
        description="MoE experts under the interleaved pipeline schedule",
    ),
    Case(
        family="hybrid",
        offload=("attn_norm", "qkv_linear", "core_attn", "attn_proj"),
        schedule="interleaved",
        microbatches=6,
        precision="bf16",
        max_inflight=0,
        description="every attention group under the interleaved schedule, 3 microbatch groups",
    ),
)
"""Rows of the ``interleaved`` schedule (``harness.models.train.interleaved_order``): the default
matrix has the first, the full one all."""
