"""Rows of the pipeline across ranks (``Case.pipeline`` > 1, ``harness.models.pipeline``): our
models split into pipeline stages, one per rank, each rank judged on its own stage
(``harness.execute.pipeline_case``). Their ids end ``_pp2``, ``_pp2x2`` (PP=2 with VPP=2) or
``_pp4``, so ``torchrun --standalone --nproc-per-node=2 -m pytest cases/ -k pp`` runs the PP=2
rows and ``--nproc-per-node=4 ... -k pp4`` the PP=4 one; at any other world size (a plain
``pytest`` included) they skip at collection with the reason.

They are not in the ``default`` or ``full`` matrix (which ``offload-harness run`` and the
mutation score run in one process): the pytest plugin adds them to the session's rows
(``harness.plugin.cases.row_groups``)."""

from __future__ import annotations

from harness.cases.case import ATTENTION_NAMES, SEED_CASE, Case

_SEED_PP = SEED_CASE.replace(schedule="1f1b", steps=3, microbatches=4, pipeline=2)

PP_ROWS: tuple[Case, ...] = (
    _SEED_PP.replace(
        description="the seed's +-+-+- and groups at PP=2 under 1F1B: stage 0 warms up one "
        "microbatch ahead, stage 1 none",
    ),
    _SEED_PP.replace(
        schedule="interleaved",
        description="the seed at PP=2 with VPP=2 (interleaved 1F1B): rank 0 runs layers 0-1 "
        "and 4, rank 1 layers 2-3 and 5, each its two model chunks",
    ),
    _SEED_PP.replace(
        pipeline=4,
        description="the seed at PP=4 under 1F1B: four stages, warmups of 3, 2, 1, 0",
    ),
    Case(
        family="hybrid-moe",
        offload=("expert_fc1", "moe_act"),
        schedule="1f1b",
        precision="bf16",
        max_inflight=None,
        steps=3,
        microbatches=4,
        pipeline=2,
        description="MoE experts offloaded at PP=2 under 1F1B",
    ),
    _SEED_PP.replace(
        pool_cap=2,
        description="the pinned pool capped at 2 buffers on each stage at PP=2: exhausted, "
        "handled, every loss bitwise",
    ),
    _SEED_PP.replace(
        offload=ATTENTION_NAMES,
        fraction=0.5,
        description="activation_offload_fraction 0.5 at PP=2 under 1F1B: each stage keeps its "
        "own chunks' trailing groups",
    ),
)
"""The pipeline rows: the seed at PP=2 (1F1B), PP=2 x VPP=2 (interleaved) and PP=4 (1F1B),
MoE at PP=2, and the pool and fraction knobs on a PP=2 row each."""
