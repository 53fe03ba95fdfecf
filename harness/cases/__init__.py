"""The case table: frozen rows, generated in a fixed order, shared by pytest and the CLI.

A row names a model family, an offload set, a schedule, a precision and a max-inflight cap; its
``name`` is the pytest id and the report key, e.g. ``hybrid-+-+-+-_core_attn+attn_proj_1f1b_bf16``.
The model's size comes from the device (``-tiny`` presets on CPU, ``-small`` on CUDA) unless the
run asks for one.

Matrix: families x applicable offload sets x schedules x max-inflight x precisions. ``full`` is
all of it; ``default`` keeps one row per (family, offload set), cycling the other axes so every
value appears, plus the seed's own case first.

Sharding ``zero3`` rows (flat ZeRO-3 through FSDP2, bf16) follow the unsharded ones: ``default``
has the seed's and one MoE row; ``full`` has one per (family, offload set) cycling schedule and
max-inflight, plus the seed's and the MoE row again with ``min_ranks=2`` (real sharding only:
they skip at world size 1).

The rows live by family: ``case`` (the ``Case`` record, the matrix's axes and offload sets,
the seed's row), ``harness_rows`` (the cycled, ZeRO-3, detection and interleaved rows on our
models), ``cadence_rows`` (fraction, pool cap, inert threshold) and ``mcore_rows``
(megatron-core's models), ``pp_rows`` (the pipeline across ranks, added to a pytest session's
rows by its plugin, not to these matrices); this module puts them together into the matrices
and re-exports every name.
"""

from __future__ import annotations

import itertools

from harness.cases.cadence_rows import CADENCE_ROWS, FULL_CADENCE_ROWS
from harness.cases.case import (
    ATTENTION_NAMES,
    FAMILIES,
    INFLIGHT_VALUES,
    MODEL_SIZES,
    OFFLOAD_SETS,
    PRECISION_VALUES,
    SCHEDULES_IN_MATRIX,
    SEED_CASE,
    Case,
    applicable_sets,
    model_spec,
)
from harness.cases.harness_rows import (
    DETECTION_ROWS,
    MOE_ZERO3_CASE,
    PIPELINE_ROWS,
    SEED_ZERO3_CASE,
    _cycled_rows,
    zero3_rows,
)
from harness.cases.mcore_rows import (
    MCORE_FAMILY,
    MCORE_KNOB_ROWS,
    MCORE_MAIN_ROWS,
    MCORE_ROWS,
    MCORE_SHARDED_ROWS,
)
from harness.cases.pp_rows import PP_ROWS

__all__ = [
    "ATTENTION_NAMES",
    "CADENCE_ROWS",
    "DETECTION_ROWS",
    "FAMILIES",
    "FULL_CADENCE_ROWS",
    "INFLIGHT_VALUES",
    "MATRICES",
    "MCORE_FAMILY",
    "MCORE_KNOB_ROWS",
    "MCORE_MAIN_ROWS",
    "MCORE_ROWS",
    "MCORE_SHARDED_ROWS",
    "MODELS_CHOICES",
    "MODEL_SIZES",
    "MOE_ZERO3_CASE",
    "OFFLOAD_SETS",
    "PIPELINE_ROWS",
    "PP_ROWS",
    "PRECISION_VALUES",
    "SCHEDULES_IN_MATRIX",
    "SEED_CASE",
    "SEED_ZERO3_CASE",
    "Case",
    "applicable_sets",
    "default_matrix",
    "find_case",
    "full_matrix",
    "matrix",
    "model_spec",
    "zero3_rows",
]

MODELS_CHOICES = ("harness", "mcore", "all")
"""``--models``: whose models the rows build (ours, megatron-core's, or both)."""
"""``--family``: whose models the session's rows build (``Case.impl``), or both."""


def full_matrix() -> list[Case]:
    """Every family x applicable set x schedule x max-inflight x precision, then the ZeRO-3
    rows."""
    rows = []
    for family in FAMILIES:
        for _, names in applicable_sets(family):
            for schedule, inflight, precision in itertools.product(
                SCHEDULES_IN_MATRIX, INFLIGHT_VALUES, PRECISION_VALUES
            ):
                rows.append(
                    Case(
                        family=family,
                        offload=names,
                        schedule=schedule,
                        precision=precision,
                        max_inflight=inflight,
                    )
                )
    return (
        rows
        + list(DETECTION_ROWS)
        + list(PIPELINE_ROWS)
        + list(CADENCE_ROWS + FULL_CADENCE_ROWS)
        + zero3_rows(full=True)
    )


def default_matrix() -> list[Case]:
    """The seed case, then one row per (family, offload set) cycling the other axes, then the
    detection rows, the seed's row under the interleaved schedule, the cadence rows (fraction,
    pool cap, inert), then the seed's and one MoE row under ZeRO-3."""
    rows = [SEED_CASE, *(r for r in _cycled_rows() if r.name != SEED_CASE.name)]
    return (
        rows
        + list(DETECTION_ROWS)
        + list(PIPELINE_ROWS[:1])
        + list(CADENCE_ROWS)
        + zero3_rows(full=False)
    )


MATRICES = {"default": default_matrix, "full": full_matrix}


def matrix(name: str, models: str = "harness") -> list[Case]:
    """A matrix by name (``default`` or ``full``): its rows on our models (``models``
    ``harness``), the ``MCORE_ROWS`` (``mcore``) or both (``all``)."""
    try:
        rows = MATRICES[name]()
    except KeyError:
        raise ValueError(f"unknown matrix {name!r}; known: {', '.join(MATRICES)}") from None
    if models not in MODELS_CHOICES:
        raise ValueError(f"unknown models {models!r}; known: {', '.join(MODELS_CHOICES)}")
    return {"harness": rows, "mcore": list(MCORE_FAMILY), "all": rows + list(MCORE_FAMILY)}[models]


def find_case(case_id: str) -> Case:
    """The row of the full matrix (or the default one) whose name is ``case_id``."""
    for row in [*default_matrix(), *full_matrix(), *MCORE_FAMILY, *PP_ROWS]:
        if row.name == case_id:
            return row
    raise ValueError(
        f"unknown case id {case_id!r}; list them with `offload-harness cases --matrix full`"
    )
