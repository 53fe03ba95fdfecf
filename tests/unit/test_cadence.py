"""The cadence check (``harness.execute.cadence``): hand-built backward orders with hand-derived
expectations. The marks a real run leaves, the pool-cap and inert rows and the cadence-broken
offloaders judged end to end are in ``tests/e2e/test_cadence_runs.py``.

Keys are (pass, layer, name); an order is a list of ``Event``s as ``step_events`` builds them
from the observer's record: ``start``/``end`` of each group occurrence's backward, ``reload``
copies with their bytes.
"""

from __future__ import annotations

import pytest

from harness.execute.backwardpeak import BackwardReading, backward_problems, block
from harness.execute.cadence import (
    END,
    RELOAD,
    START,
    Event,
    depth_allowed,
    judge_step,
    measured_depth,
    megatron_allowed,
    step_events,
)
from harness.measure.copyobserver import Copy, Observed
from harness.offload.semantics import Semantics

A, B, C, D = ((0, layer, "core_attn") for layer in range(4))
SEQUENTIAL_2 = [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
ONE_PASS = [("F", 0), ("B", 0)]


def _backward(*keys: tuple[int, int, str]) -> list[Event]:
    """Each group's backward start then end, in the order given (no nesting)."""
    return [Event(kind=kind, key=key) for key in keys for kind in (START, END)]


def _name(p: int) -> str:
    return f"microbatch {p}"


def test_megatron_rule_reloads_one_group_per_backward_end() -> None:
    # commit order A, B, C; C kept on the device, A and B offloaded. Backward runs C, B, A:
    # the end of C's backward (index 1) reloads B, the end of B's (index 3) reloads A.
    events = _backward(C, B, A)
    assert megatron_allowed(events, {0: [A, B]}, ONE_PASS) == {B: 1, A: 3}


def test_kept_groups_still_take_reload_slots() -> None:
    # #7575: C and D kept; the ends of D's and C's backward reload B and A, so after C's end
    # (index 3) both are ahead of their backward at once, and the rule predicts it.
    events = _backward(D, C, B, A)
    allowed = megatron_allowed(events, {0: [A, B]}, ONE_PASS)
    assert allowed == {B: 1, A: 3}
    with_reloads = [*events[:2], Event(kind=RELOAD, key=B, nbytes=10), *events[2:4]]
    with_reloads += [Event(kind=RELOAD, key=A, nbytes=20), *events[4:]]
    # the indices of the order the reloads are part of (as run_cadence computes them)
    allowed = megatron_allowed(with_reloads, {0: [A, B]}, ONE_PASS)
    assert allowed == {B: 1, A: 4}
    judged = judge_step(3, with_reloads, allowed, {A: 20, B: 10}, "the rule", _name)
    assert judged.problems == ()
    assert (judged.ahead_groups, judged.ahead_bytes, judged.allowed_bytes) == (2, 30, 30)


def test_a_started_group_is_passed_over() -> None:
    # The warmup: A and B offloaded, nothing prefetched B (the first to run backward), so it
    # is reloaded at its own unpack; the end of B's backward passes B over and reloads A.
    events = _backward(B, A)
    assert megatron_allowed(events, {0: [A, B]}, ONE_PASS) == {B: 0, A: 1}


def test_the_next_pass_is_prefetched_only_when_its_forward_is_done() -> None:
    first, second = (0, 0, "core_attn"), (1, 0, "core_attn")
    events = _backward(first, second)
    # 1F1B-like (F0 F1 B0 B1): the end of pass 0's only group, nothing left in pass 0,
    # prefetches pass 1's top group.
    gpipe = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert megatron_allowed(events, {1: [second]}, gpipe) == {second: 1}
    # sequential: pass 1's forward has not run at pass 0's backward: reloaded at its own start
    assert megatron_allowed(events, {1: [second]}, SEQUENTIAL_2) == {second: 2}


def test_depth_rule() -> None:
    events = _backward(C, B, A)  # starts at 0, 2, 4; ends at 1, 3, 5
    assert depth_allowed(events, [A, B], 0) == {A: 4, B: 2}
    assert depth_allowed(events, [A, B], 1) == {A: 3, B: 1}
    assert depth_allowed(events, [A, B], 2) == {A: 1, B: -1}
    assert depth_allowed(events, [D], 1) == {D: None}  # no backward seen: cannot be ordered


def test_measured_depth() -> None:
    backward = _backward(C, B, A)
    at_unpack = [*backward[:4], Event(kind=START, key=A), Event(kind=RELOAD, key=A, nbytes=1)]
    assert measured_depth(at_unpack) == 0
    one_ahead = [*backward[:4], Event(kind=RELOAD, key=A, nbytes=1), *backward[4:]]
    assert measured_depth(one_ahead) == 1  # after B's end, before A's start
    two_ahead = [*backward[:2], Event(kind=RELOAD, key=A, nbytes=1), *backward[2:]]
    assert measured_depth(two_ahead) == 2  # after C's end: two groups before A
    eager = [Event(kind=START, key=C), Event(kind=RELOAD, key=A, nbytes=1), *backward[1:]]
    assert measured_depth(eager) == 3  # during C's backward: only "anywhere" allows it


def test_an_early_reload_names_step_microbatch_group_and_bytes() -> None:
    # The rule allows A only after B's end (index 3); it comes after C's end instead.
    events = _backward(C, B, A)
    early = [*events[:2], Event(kind=RELOAD, key=B, nbytes=64)]
    early += [Event(kind=RELOAD, key=A, nbytes=32), *events[2:]]
    allowed = megatron_allowed(early, {0: [A, B]}, ONE_PASS)
    assert allowed == {B: 1, A: 5}  # after C's end; after B's end (index 5 with the reloads)
    judged = judge_step(4, early, allowed, {A: 32, B: 64}, "R", _name)
    assert judged.problems == (
        "step 4, microbatch 0, after the backward of core_attn (layer 2): 2 group(s) reloaded "
        "ahead of their backward, 96 B (core_attn (microbatch 0, layer 1) 64 B, core_attn "
        "(microbatch 0, layer 0) 32 B); R allowed 1 there (64 B); first too early: core_attn "
        "(microbatch 0, layer 0), which may come no earlier than the end of core_attn "
        "(microbatch 0, layer 1)'s backward (in the step, at most 2 group(s), 96 B, ahead at "
        "once)",
    )


def test_more_bytes_ahead_than_the_rule_is_a_problem_of_its_own() -> None:
    events = _backward(C, B, A)
    on_time = [*events[:2], Event(kind=RELOAD, key=B, nbytes=100), *events[2:]]
    allowed = megatron_allowed(on_time, {0: [A, B]}, ONE_PASS)
    judged = judge_step(1, on_time, allowed, {A: 32, B: 64}, "R", _name)
    assert len(judged.problems) == 1
    assert "1 group(s) reloaded ahead of their backward, 100 B" in judged.problems[0]
    assert "R allowed 1 there (64 B)" in judged.problems[0]
    assert "first too early" not in judged.problems[0]


def test_a_reload_in_its_own_backward_is_never_ahead() -> None:
    events = [*_backward(C), Event(kind=START, key=A), Event(kind=RELOAD, key=A, nbytes=8)]
    judged = judge_step(0, events, {A: 2}, {A: 8}, "R", _name)
    assert (judged.problems, judged.reloads, judged.ahead_groups) == ((), 1, 0)


def test_kept_group_reloaded_ahead_is_early() -> None:
    events = [*_backward(C)[:2], Event(kind=RELOAD, key=B, nbytes=8), *_backward(B)]
    judged = judge_step(2, events, {}, {}, "R", _name)
    assert "the rule never reloads ahead of its backward" in judged.problems[0]


def test_step_events_merge_marks_and_reloads_in_issue_order() -> None:
    observed = Observed(
        copies=[
            Copy("d2h", "copy_", 8, B, False, 0, None, 0),
            Copy("h2d", "copy_", 8, B, False, 0, None, 3),
            Copy("h2d", "copy_", 8, (0, 0, "attn_proj"), False, 0, None, 4),
        ],
        marks=[(1, START, C), (2, END, C), (5, START, B)],
    )
    assert step_events(observed, ["core_attn"]) == [
        Event(kind=START, key=C),
        Event(kind=END, key=C),
        Event(kind=RELOAD, key=B, nbytes=8),
        Event(kind=START, key=B),
    ]


def test_semantics_prefetch_depth_is_validated() -> None:
    assert Semantics(prefetch_depth=2).prefetch_depth == 2
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="prefetch_depth"):
            Semantics(prefetch_depth=bad)  # type: ignore[arg-type]


def test_allocator_blocks_and_backward_problems() -> None:
    assert [block(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    base = [(START, C, 10_000), (END, C, 9_000), (START, B, 8_000)]
    off = [(START, C, 6_000), (END, C, 5_000), (START, B, 7_000)]
    reading = BackwardReading(baseline=base, offload=off, predicted=[4_000, 4_000, 4_000])
    # at B's start the offload run dropped only 1000 B below the baseline: B's reload came early
    problems = backward_problems(reading)
    assert problems[0] == (
        "during backward (final step) the offload run peaked at 7000 B at the group boundaries, "
        "predicted 6000 B (baseline 10000 B); 1 boundaries differ:"
    )
    assert problems[1] == (
        "backward start of core_attn (microbatch 0, layer 1): 7000 requested bytes against "
        "the baseline's 8000 B, a drop of 1000 B, predicted 4000 B"
    )
    assert backward_problems(BackwardReading(baseline=base, offload=base, predicted=None)) == []


def test_a_deeper_prefetch_never_allows_less_where_groups_nest() -> None:
    # attn_norm N spans P and Q: its backward starts first and ends last (index 6). For Q,
    # depth 1 allows after P's end (2); depth 2 reaches N, whose end comes later, so it takes
    # the earliest end among the two before: still P's.
    N, P, Q = (0, 0, "attn_norm"), (0, 0, "attn_proj"), (0, 0, "core_attn")
    events = [Event(kind=START, key=N), *_backward(P), *_backward(Q), Event(kind=END, key=N)]
    assert depth_allowed(events, [Q], 1) == {Q: 2}
    assert depth_allowed(events, [Q], 2) == {Q: 2}
    assert depth_allowed(events, [Q], 3) == {Q: -1}
