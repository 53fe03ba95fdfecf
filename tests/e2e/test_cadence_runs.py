"""The cadence check end to end (moved from ``tests/unit/test_cadence.py``, whose tests train
nothing): the marks a real run leaves, the pool-cap and inert rows judged, and the cadence-broken
offloaders caught by the cadence check alone."""

from __future__ import annotations

import pytest
import torch

from harness.cases import CADENCE_ROWS, SEED_CASE
from harness.execute.environment import Environment
from harness.verify.judge import judge

CPU = torch.device("cpu")


def _row(description_word: str):
    return next(r for r in CADENCE_ROWS if description_word in r.description)


def test_the_pool_cap_is_hit_handled_and_reported() -> None:
    row = _row("pinned pool").replace(steps=2)
    judgement = judge(
        row, Environment(device=CPU, backend="reference"), checks=("equivalence", "leaks")
    )
    assert judgement.verdict == "pass", judgement.problems
    pool = judgement.record()["pool"]
    assert pool["cap"] == 2 and pool["allocated"] == [2, 2], pool
    assert pool["exhausted"][-1] > pool["exhausted"][0] > 0, pool
    leaks = next(o for o in judgement.outcomes if o.name == "leaks")
    assert f"exhausted {pool['exhausted'][-1]} times" in leaks.reason


def test_an_inert_configuration_is_its_own_verdict() -> None:
    row = _row("inert").replace(steps=2)
    judgement = judge(
        row,
        Environment(device=CPU, backend="reference"),
        checks=("equivalence", "transfers", "disabled", "cadence"),
    )
    statuses = {o.name: o.status for o in judgement.outcomes}
    assert judgement.verdict == "inert", judgement.problems
    assert statuses == {
        "equivalence": "pass",
        "transfers": "pass",
        "disabled": "n-a",
        "cadence": "n-a",
    }
    assert judgement.record()["inert"].startswith("inert: nothing eligible")


def test_an_offloader_moving_on_an_inert_row_fails() -> None:
    # save-on-cpu has no size threshold: on the inert row its declared rule moves everything,
    # so the row is not inert for it and the ordinary checks apply (and pass).
    row = _row("inert").replace(steps=2)
    judgement = judge(row, Environment(device=CPU, backend="save-on-cpu"), checks=("equivalence",))
    assert judgement.verdict == "pass", judgement.problems
    assert "inert" not in judgement.record()


def test_the_reference_marks_every_group_backward() -> None:
    judgement = judge(
        SEED_CASE.replace(steps=2),
        Environment(device=CPU, backend="reference"),
        checks=("cadence",),
    )
    record = judgement.record()["cadence"]
    assert judgement.verdict == "pass", judgement.problems
    # every group window, selected or not: 3 MLA layers x 4 names (attn_norm, qkv_linear,
    # core_attn, attn_proj) x 2 microbatches, a start and an end each, in 2 steps
    assert record["marks"] == 3 * 4 * 2 * 2 * 2
    assert record["ahead_groups"][1] >= 1


@pytest.mark.parametrize("backend", ["broken.eager_reload", "broken.two_ahead"])
def test_cadence_broken_offloaders_are_caught_by_cadence_alone(backend: str) -> None:
    # Bitwise losses, exact counts, no leak, nothing unselected, no weight: only the order of
    # the reloads shows them (memory and sync are CUDA's; golden reads the plain run alone).
    row = SEED_CASE.replace(steps=3)
    checks = ("equivalence", "leaks", "transfers", "disabled", "fidelity", "weights", "cadence")
    judgement = judge(row, Environment(device=CPU, backend=backend), checks=checks)
    statuses = {o.name: o.status for o in judgement.outcomes}
    assert statuses == {**dict.fromkeys(checks[:-1], "pass"), "cadence": "fail"}, statuses
    cadence = next(o for o in judgement.outcomes if o.name == "cadence")
    assert len(cadence.problems) == 3, cadence.problems  # one per step, steps 0, 1 and 2
    assert cadence.problems[1].startswith("step 1, microbatch 0, ")
    assert "reloaded ahead of their backward" in cadence.problems[1]
    assert "; first too early: " in cadence.problems[1]
