"""The memory case: its allocator readings (``harness.execute.memory``) from synthetic snapshots,
and its check (``harness.verify.memorycheck.memory_problems``) on synthetic results. ``run_memory``
on the observations of a real one-step run is in ``tests/e2e/test_memory_runs.py``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from memory_rows import rows_by_plain_key as _rows_by_plain_key

from harness.cases import MCORE_ROWS, SEED_CASE, Case
from harness.execute import baselines, environment, memory
from harness.execute.memory import MemoryResult
from harness.verify.memorycheck import memory_problems


def _segment(address: int, blocks: list[tuple[int, int, str]], **extra: object) -> dict:
    return {
        "device": 0,
        "address": address,
        "blocks": [{"size": s, "requested_size": r, "state": st, **extra} for s, r, st in blocks],
    }


def test_live_blocks_walk_each_segment_in_address_order(monkeypatch) -> None:
    snapshot = [
        _segment(
            1000,
            [
                (512, 500, "active_allocated"),
                (512, 512, "inactive"),
                (1024, 1000, "active_allocated"),
            ],
        ),
        {**_segment(9000, [(512, 512, "active_allocated")]), "device": 1},
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    live = memory._live_blocks(torch.device("cuda", 0))
    # the third block starts after the first two (1000 + 512 + 512); device 1 is not read
    assert live == {1000: (512, 500), 2024: (1024, 1000)}


def test_live_blocks_prefer_the_blocks_own_address(monkeypatch) -> None:
    snapshot = [
        {
            "device": 0,
            "address": 0,
            "blocks": [
                {"address": 4096, "size": 512, "requested_size": 512, "state": "active_allocated"}
            ],
        }
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    assert memory._live_blocks(torch.device("cuda", 0)) == {4096: (512, 512)}


def test_an_earlier_runs_memory_freed_meanwhile_is_not_taken_for_a_saving() -> None:
    floor = {0: (1 << 20, 1 << 20), 1 << 20: (512, 500)}  # an earlier run's block, then ours
    # the earlier block went away; this run allocated two blocks, one where the old one was
    now = {1 << 20: (512, 500), 4 << 20: (2048, 2000), 0: (512, 512)}
    assert memory._block_change(now, floor).new == Counter({(512, 512): 1, (2048, 2000): 1})
    assert memory._block_change(now, floor).gone == Counter({(1 << 20, 1 << 20): 1})
    assert memory._block_change(floor, floor).gone == Counter()


def test_a_cache_replaced_during_the_run_is_not_counted_wherever_it_lands() -> None:
    floor = {0: (131072, 131072), 1 << 20: (512, 8)}
    moved = {1 << 21: (131072, 131072), 1 << 20: (512, 8), 1 << 22: (4096, 4000)}
    same_place = {0: (131072, 131072), 1 << 20: (512, 8), 1 << 22: (4096, 4000)}
    for now in (moved, same_place):
        assert memory._block_change(now, floor).new == Counter({(4096, 4000): 1})
    assert memory._block_change(moved, floor).replaced == Counter({(131072, 131072): 1})
    assert memory._block_change(same_place, floor).replaced == Counter()
    # a freed block nothing replaced is not subtracted from anything
    assert memory._block_change({1 << 22: (4096, 4000)}, floor).new == Counter({(4096, 4000): 1})


_MEGATRON = "/root/te-site/megatron/core/transformer/dot_product_attention.py"
_FRAMES = [  # innermost first, as the allocator's snapshot lists them
    {
        "filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py",
        "line": 1,
        "name": "_call_impl",
    },
    {"filename": _MEGATRON, "line": 189, "name": "forward"},
    {"filename": "/repo/harness/models/mcore/loop.py", "line": 300, "name": "forward_step"},
    {"filename": "/repo/harness/train.py", "line": 12, "name": "train"},
]


def test_live_blocks_name_each_blocks_allocation_site(monkeypatch) -> None:
    snapshot = [
        _segment(0, [(131072, 131072, "active_allocated")], frames=_FRAMES),
        _segment(1 << 20, [(512, 8, "active_allocated")]),  # allocated before recording began
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    sites: dict[int, str] = {}
    live = memory._live_blocks(torch.device("cuda", 0), sites)
    assert live == {0: (131072, 131072), 1 << 20: (512, 8)}
    assert sites == {
        0: "megatron/core/transformer/dot_product_attention.py:189 (forward)"
        " < harness/models/mcore/loop.py:300 (forward_step)"
    }


def test_a_site_inside_torch_alone_is_still_named() -> None:
    site = memory.allocation_site(_FRAMES[:1], depth=1)
    assert site == "torch/nn/modules/module.py:1 (_call_impl)"


def _result(**changes: object) -> MemoryResult:
    sizes = Counter({4096: 1})
    res = MemoryResult(
        case=SEED_CASE,
        predicted_drop=4096,
        baseline_requested=14_096,
        offload_requested=10_000,
        baseline_allocated=14_096,
        offload_allocated=10_000,
        rounding=0,
        baseline_peak=0,
        offload_peak=0,
        peak_allowance=0,
        predicted_sizes=sizes,
        freed_sizes=sizes,
        extra_sizes=Counter(),
    )
    return dataclasses.replace(res, **changes)


def test_memory_freed_from_before_the_run_is_reported_with_a_problem_only() -> None:
    assert memory_problems(_result(floor_freed=(2, 937_000_000))) == []
    problems = memory_problems(_result(floor_freed=(2, 937_000_000), offload_requested=10_001))
    assert "dropped by 4095 requested bytes, predicted 4096" in problems[0]
    assert "also freed 2 blocks (937000000 B) allocated before they started" in problems[-1]


def test_peak_allows_one_smallest_block_per_slack_block() -> None:
    row = MCORE_ROWS[0]  # memory_slack 64
    slack = dict(
        case=row,
        extra_sizes=Counter({1: 1, 64: 1}),
        offload_requested=10_065,
        offload_allocated=10_065,
        rounding=2 * 512 - 65,
        baseline_peak=1_000_000,
    )
    assert memory_problems(_result(**slack, offload_peak=1_000_000 + 2 * 512)) == []
    (problem,) = memory_problems(_result(**slack, offload_peak=1_000_000 + 2 * 512 + 1))
    assert "by more than the 1024 B allowed" in problem
    # a small cache block replaced during a run: counted in neither reading, one block at the
    # peak (H200, the op-fuser MoE row: a 1-byte block, 512 B above the baseline's peak)
    exact = dict(case=row, baseline_peak=1_000_000, offload_peak=1_000_512)
    assert memory_problems(_result(**exact, replaced_sizes=Counter({1: 1}))) == []
    (problem,) = memory_problems(_result(**exact, replaced_sizes=Counter({131072: 1})))
    assert "by more than the 0 B allowed" in problem
    # the seed row declares no slack: the same extra blocks fail the drop, and the peak
    strict = memory_problems(_result(**{**slack, "case": SEED_CASE}, offload_peak=1_000_512))
    assert any("by more than the 0 B allowed" in p for p in strict)


def test_memory_problems_name_where_unexplained_blocks_were_allocated() -> None:
    site = "megatron/core/transformer/dot_product_attention.py:189 (forward)"
    res = _result(
        freed_sizes=Counter({4096: 1, 131072: 2}),
        baseline_requested=14_096 + 2 * 131072,
        baseline_allocated=14_096 + 2 * 131072,
        baseline_sites={4096: "harness/models/layers.py:40 (forward)", 131072: site},
        extra_sizes=Counter({4: 1}),
        offload_requested=10_004,
        offload_allocated=10_004,
        offload_sites={4: "harness/offload/reference.py:7 (commit)"},
    )
    problems = memory_problems(res)
    # the predicted storage (4096 B) is explained: only the others get a site line
    assert f"  baseline allocated 131072 B at {site}" in problems
    assert "  offload run allocated 4 B at harness/offload/reference.py:7 (commit)" in problems
    assert not any("4096 B at" in line for line in problems)


@pytest.mark.parametrize("floor_freed", [(0, 0), (3, 64)])
def test_memory_record_reports_what_was_freed_from_before(floor_freed) -> None:
    from harness.reporting.report import memory_record

    record = memory_record(_result(floor_freed=floor_freed))["memory"]
    assert (record["floor_freed_blocks"], record["floor_freed_bytes"]) == floor_freed


def _memory(case: Case, freed: dict[int, int], extra: dict[int, int]) -> MemoryResult:
    """Predicted storages 2 x 4096 B and 1024 B; the runs differ by ``freed`` and ``extra``."""
    predicted = Counter({4096: 2, 1024: 1})
    freed_c, extra_c = Counter(freed), Counter(extra)
    drop = sum(s * n for s, n in freed_c.items()) - sum(s * n for s, n in extra_c.items())
    return _result(
        case=case,
        predicted_drop=sum(s * n for s, n in predicted.items()),
        baseline_requested=10_000 + drop,
        baseline_allocated=10_000 + drop,
        predicted_sizes=predicted,
        freed_sizes=freed_c,
        extra_sizes=extra_c,
    )


def test_memory_slack_admits_only_small_blocks_beyond_the_prediction() -> None:
    row = MCORE_ROWS[0]
    exact = {4096: 2, 1024: 1}
    assert memory_problems(_memory(row, exact, {})) == []
    assert memory_problems(_memory(row, {**exact, 64: 1}, {})) == []
    assert memory_problems(_memory(row, exact, {1: 1})) == []
    too_big = memory_problems(_memory(row, exact, {128: 1}))
    assert too_big and "dropped by" in too_big[0]
    missed = memory_problems(_memory(row, {4096: 1, 1024: 1, 64: 1}, {}))
    assert missed and "predicted 9216" in missed[0]
    strict = memory_problems(_memory(SEED_CASE, exact, {1: 1}))
    assert strict and "dropped by 9215 requested bytes, predicted 9216" in strict[0]


def test_allocation_sites_are_recorded_only_during_the_memory_runs(monkeypatch) -> None:
    """The allocator's history is on (state only, Python stacks of allocations) for the memory
    runs and off again afterwards, also when a run raises."""
    calls: list[dict] = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    device = torch.device("cuda", 0)
    with memory._allocation_sites(device):
        assert calls == [dict(enabled="state", context="alloc", stacks="python", device=device)]
    assert calls[-1] == dict(enabled=None, device=device)
    calls.clear()
    with pytest.raises(RuntimeError), memory._allocation_sites(device):
        raise RuntimeError("a run failed")
    assert [c["enabled"] for c in calls] == ["state", None]


def test_a_zero3_reading_after_runs_freed_earlier_blocks_is_not_attributable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ZeRO-3 a reading whose runs freed blocks live before they started is a skip with the
    figures (on the H200 such readings were off by hundreds of MB with nothing to attribute);
    a clean one is judged exactly, and other shardings keep their exact judgement."""
    from harness.cases import zero3_rows
    from harness.verify import judge

    zero3 = zero3_rows(full=False)[0]

    class Runs:
        def __init__(self, case: Case, res: MemoryResult) -> None:
            self.case, self._res = case, res
            self.env = environment.Environment(device=torch.device("cuda", 0))

        def memory(self) -> MemoryResult:
            return self._res

        def case_run(self) -> SimpleNamespace:
            return SimpleNamespace(inert=None)  # a configured offload: the reading is judged

    dirty = _result(case=zero3, floor_freed=(18, 264_425_472), offload_requested=10_001)
    outcome = judge._memory(Runs(zero3, dirty))  # type: ignore[arg-type]
    assert outcome.status == "skip"
    assert "freed 18 blocks (264425472 B)" in outcome.reason
    assert outcome.record["memory"]["floor_freed_blocks"] == 18
    assert judge._memory(Runs(zero3, _result(case=zero3))).status == "pass"  # type: ignore[arg-type]
    wrong = _result(case=zero3, offload_requested=10_001)
    assert judge._memory(Runs(zero3, wrong)).status == "fail"  # type: ignore[arg-type]
    unsharded = dataclasses.replace(dirty, case=SEED_CASE)
    assert judge._memory(Runs(SEED_CASE, unsharded)).status == "fail"  # type: ignore[arg-type]


def test_backward_boundaries_that_cannot_be_matched_leave_the_check_undecided() -> None:
    """A backward reading whose boundaries do not match one to one (the harness's own marks) is
    a skip naming the first unmatched boundary, never a failure of the offloader; a problem
    after the last forward still fails the check."""
    from harness.execute.backwardpeak import END, START, BackwardReading, boundary_mismatch
    from harness.verify import judge

    a, b = (0, 4, "attn_proj"), (0, 4, "core_attn")
    base = [(START, a, 9_000), (END, a, 8_000), (START, b, 8_000)]
    off = [(START, a, 5_000), (END, a, 4_000)]
    reading = BackwardReading(baseline=base, offload=off, predicted=None)
    reading.unmatched = boundary_mismatch(base, off)
    assert reading.unmatched == (
        "1 group boundaries are marked in one run only (the first: the backward start of "
        "core_attn (microbatch 0, layer 4), in the baseline alone)"
    )

    class Runs:
        def __init__(self, res: MemoryResult) -> None:
            self.case, self._res = SEED_CASE, res
            self.env = environment.Environment(device=torch.device("cuda", 0))

        def memory(self) -> MemoryResult:
            return self._res

        def case_run(self) -> SimpleNamespace:
            return SimpleNamespace(inert=None)

    outcome = judge._memory(Runs(_result(backward=reading)))  # type: ignore[arg-type]
    assert outcome.status == "skip"
    assert outcome.reason.startswith("the backward reading is undecided: 1 group boundaries")
    assert outcome.record["memory"]["backward"]["unmatched"] == reading.unmatched
    wrong = _result(backward=reading, offload_requested=10_001)
    assert judge._memory(Runs(wrong)).status == "fail"  # type: ignore[arg-type]
    assert boundary_mismatch(base, [*base[1:], base[0]]) == ""  # order alone does not matter
    twice = [*base, base[0]]
    assert boundary_mismatch(base, twice) == (
        "the offload run marked the backward start of attn_proj (microbatch 0, layer 4) twice"
    )


def test_rows_sharing_a_plain_key_read_the_baseline_memory_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The no-offload reading depends only on the plain key: the second row of a key reuses
    the first's, a row of another key reads anew (and replaces it: one entry)."""
    from harness.execute.baselines import plain_key
    from harness.execute.environment import Environment
    from harness.models.train import schedule_order

    env = Environment(device=torch.device("cpu"))
    keys = _rows_by_plain_key(env)
    first, second = next(rows for rows in keys.values() if len(rows) > 1)[:2]
    other = next(rows[0] for key, rows in keys.items() if key != plain_key(first, env))
    read: list[tuple[str, int]] = []

    def fake_run(spec, run, offloader, device, last_mb, sharding):  # type: ignore[no-untyped-def]
        read.append((type(offloader).__name__, last_mb))
        return object()

    monkeypatch.setattr(memory, "_memory_run", fake_run)
    baselines.forget_plain_baselines()
    reading = memory.memory_baseline(first, env)
    assert (reading.key, reading.made_by) == (plain_key(first, env), first.name)
    assert memory.memory_baseline(second, env) is reading
    order = schedule_order(first.run_spec().schedule, first.run_spec().microbatches)
    last_mb = [mb for kind, mb in order if kind == "F"][-1]
    assert read == [("NoOffload", last_mb)]  # one read, after the last forward
    assert memory.memory_baseline(other, env) is not reading
    assert memory.memory_baseline(first, env) is not reading  # read anew: one entry kept
    assert len(read) == 3
