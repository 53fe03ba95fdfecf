"""The memory case's glue on a real case run (moved from ``tests/unit/test_memory_reading.py``,
whose tests train nothing): ``run_memory`` reads the offload run against the baseline shared by
the rows of one plain key, with the observations a one-step hooks run recorded."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from memory_rows import rows_by_plain_key as _rows_by_plain_key

from harness.execute import baselines, memory


def test_run_memory_reads_the_offload_run_against_the_shared_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run_memory``'s glue, without a GPU (the readings faked): the case run's observations
    are used as given, the baseline is read once for two rows of one key, each row's offload
    run is read, and the result names the key and the row that read the baseline."""
    import contextlib

    from harness.execute.baselines import plain_key
    from harness.execute.environment import Environment
    from harness.execute.steps import record_observations
    from harness.offload.passthrough import NoOffload

    cpu = Environment(device=torch.device("cpu"))
    first, second = next(rows for rows in _rows_by_plain_key(cpu).values() if len(rows) > 1)[:2]
    observations = {row.name: record_observations(row, cpu) for row in (first, second)}
    runs: list[str] = []
    steps: list[int] = []

    def fake_run(spec, run, offloader, device, last_mb, sharding):  # type: ignore[no-untyped-def]
        base = isinstance(offloader, NoOffload)
        runs.append("baseline" if base else "offload")
        steps.append(run.steps)
        requested = 1000 if base else 400
        return memory._MemoryReading(
            allocated=requested + 24,
            requested=requested,
            rounding=24,
            peak=2 * requested,
            blocks=Counter({requested: 1}),
            floor_freed=(0, 0),
            replaced=Counter(),
            sites={},
        )

    cuda = Environment(device=torch.device("cuda", 0))
    monkeypatch.setattr(memory, "_memory_run", fake_run)
    monkeypatch.setattr(memory, "_allocation_sites", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(memory, "record_observations", lambda *a: pytest.fail("recorded again"))
    monkeypatch.setattr(Environment, "offloader", lambda self, config: _Off())
    monkeypatch.setattr(Environment, "spec", lambda self, case: case.model_spec("tiny"))
    monkeypatch.setattr(memory, "plain_key", lambda case, env: plain_key(case, cpu))
    baselines.forget_plain_baselines()
    results = [memory.run_memory(row, cuda, observations[row.name]) for row in (first, second)]
    assert runs == ["baseline", "offload", "offload"]
    # the warmup and one steady step, whatever the row's own steps (6 on these rows)
    assert first.steps > memory.MEMORY_STEPS and steps == [memory.MEMORY_STEPS] * 3
    for res in results:
        assert (res.baseline_key, res.baseline_made_by) == (plain_key(first, cpu), first.name)
        assert (res.requested_drop, res.allocated_drop, res.rounding) == (600, 600, 48)
    from harness.reporting.report import memory_record

    baseline = memory_record(results[1])["memory"]["baseline"]
    assert baseline == {"key": plain_key(first, cpu), "made_by": first.name}


class _Off:
    """A stand-in offloader for ``run_memory``'s offload run (never trained: faked)."""

    def close(self) -> None:
        pass
