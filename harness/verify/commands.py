"""The command lines that rerun a case: ``offload-harness repro`` with every field explicit.

One builder (``repro_command``) for ``command.txt`` of a repro bundle (``harness.diagnose.repro``)
and the
``reproduce:`` hint of a failed check (``harness.verify.checks``), so both name the same command.
Its own module, below both, so the checks need not import the reproduction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from harness.cases import MCORE_FAMILY, Case, default_matrix, full_matrix
from harness.execute.environment import Environment
from harness.vocab.impls import IMPLS
from harness.vocab.spec import PRESETS

OVERRIDABLE = ("steps", "microbatches", "schedule", "precision", "max_inflight")
"""The case fields the ``run`` / ``repro`` flags override on a ``--case`` row."""


def repro_command(
    case: Case,
    *,
    backend: str,
    device: torch.device | str,
    model_size: str,
    seed: int = 1234,
    from_case: str | None = None,
    preset: str | None = None,
    pattern: str | None = None,
    bisect: bool = False,
) -> list[str]:
    """The fully explicit ``offload-harness repro`` command line of ``case``: ``--case
    from_case`` (a table row id) or, for a custom case, ``--preset``, ``--pattern`` and
    ``--offload``; then every overridable field (steps, microbatches, schedule, precision,
    max-inflight), the seed, the backend, the device and the model size, so that it reruns
    exactly this case whatever the defaults. One builder for ``command.txt`` and the
    ``reproduce:`` hint of a failed check."""
    argv = ["offload-harness", "repro"]
    if from_case is not None:
        argv += ["--case", from_case]
    else:
        assert preset is not None and pattern is not None, "a custom case names its preset"
        argv += ["--preset", preset, "--pattern", pattern, "--offload", ",".join(case.offload)]
        argv += ["--family", IMPLS[case.impl].family]  # whose models a custom case builds
    inflight = case.max_inflight
    argv += ["--steps", str(case.steps), "--microbatches", str(case.microbatches)]
    argv += ["--schedule", case.schedule, "--precision", case.precision]
    argv += ["--max-inflight", "none" if inflight is None else str(inflight)]
    argv += ["--seed", str(seed), "--backend", backend]
    argv += ["--device", str(device), "--model-size", model_size]
    return [*argv, "--bisect"] if bisect else argv


def table_row(case: Case) -> Case | None:
    """The case-table row ``case`` is, or was made from by overriding ``OVERRIDABLE`` fields
    (of several, the one it differs from in the fewest); None for a custom case."""
    rows = [*default_matrix(), *full_matrix(), *MCORE_FAMILY]
    fixed = [f.name for f in dataclasses.fields(Case) if f.name not in (*OVERRIDABLE, "marks")]

    def key(c: Case) -> tuple[Any, ...]:
        return tuple(getattr(c, name) for name in fixed)

    matches = [row for row in rows if key(row) == key(case)]
    if not matches:
        return None
    return min(
        matches, key=lambda row: sum(getattr(row, f) != getattr(case, f) for f in OVERRIDABLE)
    )


def case_command(case: Case, env: Environment, *, bisect: bool = False) -> list[str]:
    """The ``repro`` command line that reruns ``case`` as the judge ran it in ``env`` (its row
    id with the fields it overrides, or its custom pattern; the judge's seed, the backend,
    device and model size)."""
    seed = case.run_spec().seed
    row = table_row(case)
    model = case.model_spec(env.model_size)
    return repro_command(
        case,
        backend=env.backend,
        device=env.device,
        model_size=env.model_size,
        seed=seed,
        from_case=row.name if row is not None else None,
        preset=None if row is not None else model_family_preset(case.family, env.model_size),
        pattern=model.pattern,
        bisect=bisect,
    )


def model_family_preset(family: str, size: str) -> str:
    """The preset name of a family at a model size (``harness.vocab.spec.PRESETS``)."""
    return next(name for name, p in PRESETS.items() if (p.family, p.size) == (family, size))
