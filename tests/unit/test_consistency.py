"""The consistency oracle for undeclared offloaders (``harness.execute.consistency``), the family's
new choices (layer subset, batched copies, byte threshold), the copy observer on other threads
(``harness.measure.threads``), the depth-rule memory prediction and the cost of a learned cadence.

Every expectation below is worked out by hand from the hand-built observations and counts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.execute.cadence import Cadence, StepCadence
from harness.execute.consistency import (
    OwnRule,
    describe_own,
    layer_words,
    learning_inconsistencies,
    own_rule,
    size_difference,
    steady_proof,
)
from harness.execute.learn import learn
from harness.execute.predict import Expected, prefetched_at_depth
from harness.measure.threads import observing, watch_threads
from harness.measure.transfers import Counts, TransferCounts
from harness.models.train import schedule_order
from harness.offload.config import OffloadConfig
from harness.offload.ranges import RangeKey
from harness.offload.recorder import GroupObservation, SavedInfo
from harness.offload.semantics import Semantics, eligible


def _saved(numel: int, itemsize: int = 4, sid: int = 0, parameter: bool = False) -> SavedInfo:
    return SavedInfo(
        shape=(numel,),
        stride=(1,),
        storage_offset=0,
        dtype=torch.float32 if itemsize == 4 else torch.bfloat16,
        itemsize=itemsize,
        storage_nbytes=numel * itemsize,
        storage_id=sid,
        contiguous=True,
        on_device=True,
        parameter=parameter,
    )


def _fields(copies: int, nbytes: int, back: bool = True) -> dict[str, int]:
    return {
        "d2h_copies": copies,
        "d2h_bytes": nbytes,
        "h2d_copies": copies if back else 0,
        "h2d_bytes": nbytes if back else 0,
    }


# Two microbatches, layers 0 and 1 of core_attn, each saving activations of 4096 and 2048
# float32 elements (16384 B and 8192 B) and a 16-element one; min_offloaded_tensor_size 1024.
def _observations(microbatches: int = 1, layers: tuple[int, ...] = (0, 1)) -> list:
    return [
        GroupObservation(
            microbatch=mb,
            layer=layer,
            name="core_attn",
            saved=(_saved(4096, sid=1), _saved(2048, sid=2), _saved(16, sid=3)),
            released=(),
        )
        for mb in range(microbatches)
        for layer in layers
    ]


CONFIG = OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=1024)


def test_a_layer_subset_is_learned_and_said() -> None:
    # layers 0 and 2 of 0-3 move (2 copies, 24576 B each), in both learning steps: no policy
    # keeping the last occurrences fits, the subset does
    observations = _observations(layers=(0, 1, 2, 3))
    step = {(0, layer, "core_attn"): _fields(2, 24576) for layer in (0, 2)}
    order = schedule_order("sequential", 1)
    rule = learn(observations, CONFIG, order, [step, step], "cuda", False)
    assert rule.exact and rule.semantics.layers == frozenset({0, 2}), rule.line
    assert rule.line.endswith("only layers 0 and 2 offloaded, every step"), rule.line
    # layer 0 of 0-2 alone: keeping the last two of the pass fits alike, said as undecided
    step = {(0, 0, "core_attn"): _fields(2, 24576)}
    rule = learn(_observations(layers=(0, 1, 2)), CONFIG, order, [step, step], "cuda", False)
    assert rule.exact, rule.line
    assert rule.line.endswith(
        "occurrences not decided by this case (the last 2 selected occurrence(s) of each pass "
        "stay or only layer 0 offloaded, every step)"
    ), rule.line


def test_one_copy_per_group_occurrence_is_learned_as_batched() -> None:
    step = {(0, layer, "core_attn"): _fields(1, 24576) for layer in (0, 1)}
    rule = learn(
        _observations(), CONFIG, schedule_order("sequential", 1), [step, step], "cuda", False
    )
    assert rule.exact and rule.semantics.batched, rule.line
    assert "one copy per group occurrence each way" in rule.line


def test_a_byte_threshold_is_learned_where_element_sizes_differ() -> None:
    # a bf16 tensor of 4096 elements (8192 B) and a float32 one of 2048 (8192 B) move; a bf16
    # one of 3000 elements (6000 B) stays: no element threshold keeps 3000 and moves 2048
    saved = (_saved(4096, 2, sid=1), _saved(2048, 4, sid=2), _saved(3000, 2, sid=3))
    observations = [
        GroupObservation(microbatch=0, layer=0, name="core_attn", saved=saved, released=())
    ]
    step = {(0, 0, "core_attn"): _fields(2, 16384)}
    rule = learn(observations, CONFIG, schedule_order("sequential", 1), [step, step], "cuda", False)
    assert rule.exact and rule.semantics.threshold_unit == "bytes", rule.line
    assert rule.semantics.threshold(CONFIG) == 8192
    assert "tensors under 8192 bytes stay" in rule.line
    assert not eligible(saved[2], CONFIG, rule.semantics) and eligible(
        saved[1], CONFIG, rule.semantics
    )


def test_an_element_threshold_stays_preferred_where_both_fit() -> None:
    saved = (_saved(4096, 2, sid=1), _saved(16, 4, sid=2))
    observations = [
        GroupObservation(microbatch=0, layer=0, name="core_attn", saved=saved, released=())
    ]
    step = {(0, 0, "core_attn"): _fields(1, 8192)}
    rule = learn(observations, CONFIG, schedule_order("sequential", 1), [step, step], "cuda", False)
    assert rule.exact and rule.semantics.threshold_unit == "elements", rule.line


def _own(warmup: dict, steady: dict, sizes: tuple[dict, dict] = ({}, {})) -> OwnRule:
    return OwnRule(warmup=warmup, steady=steady, sizes=sizes)


def test_the_own_tables_describe_what_moved() -> None:
    observations = _observations(layers=(0, 1, 2))
    table = {(0, layer, "core_attn"): _fields(1, 24576) for layer in (0, 1)}
    own = own_rule([table, table], [{}, {}])
    line = describe_own(own, observations, ("core_attn",), "cuda")
    assert line == (
        "observed: offloads core_attn of layers 0-1, every step; one copy per group occurrence; "
        "reloads copy back; held to its own first steady step"
    )
    warmup = {(0, layer, "core_attn"): _fields(3, 100, back=False) for layer in (0, 1, 2)}
    line = describe_own(_own(warmup, {}), observations, ("core_attn",), "cpu")
    assert line.startswith(
        "observed: offloads every core_attn occurrence in the warmup, nothing after; "
        "3 copies per group occurrence; CPU reload hands back the host copy"
    ), line


def test_warmup_passes_are_held_to_one_rule() -> None:
    observations = _observations(microbatches=2)
    sizes = {(0, 0, "core_attn"): {"d2h": (8192, 16384), "h2d": (8192, 16384)}}
    sizes[(1, 0, "core_attn")] = {"d2h": (16384,), "h2d": (16384,)}
    warmup = {
        (0, 0, "core_attn"): _fields(2, 24576),
        (0, 1, "core_attn"): _fields(2, 24576),
        (1, 0, "core_attn"): _fields(1, 16384),  # microbatch 1 drops the 2048-element tensor
        (1, 1, "core_attn"): _fields(2, 24576),
    }
    problems = learning_inconsistencies(
        _own(warmup, warmup, (sizes, sizes)), observations, "sequential", "cuda"
    )
    assert problems == [
        "step 0, microbatch 1, layer 0, group core_attn: copied 1 / 16384 B out, 1 / 16384 B "
        "back, microbatch 0 of the same warmup 2 / 24576 B out, 2 / 24576 B back: every pass of "
        "the warmup is held to one rule; missing out: 1 copy of 8192 B (saved tensor 2 of 3, "
        "(2048,) float32); missing back: 1 copy of 8192 B (saved tensor 2 of 3, (2048,) float32)"
    ]


def test_an_occurrence_moved_in_both_learning_steps_moves_alike() -> None:
    warmup = {(0, 0, "core_attn"): _fields(2, 24576)}
    steady = {(0, 0, "core_attn"): _fields(1, 16384)}
    problems = learning_inconsistencies(_own(warmup, steady), _observations(), "sequential", "cuda")
    assert len(problems) == 1 and problems[0].startswith(
        "step 1, microbatch 0, layer 0, group core_attn: copied 1 / 16384 B out"
    ), problems
    assert "an occurrence offloaded in both moves the same tensors" in problems[0]
    # a warmup moving an occurrence the steady state keeps is a policy, not an inconsistency
    assert learning_inconsistencies(_own(warmup, {}), _observations(), "sequential", "cuda") == []


def test_a_reload_brings_back_all_or_on_cpu_nothing() -> None:
    partial = {(0, 0, "core_attn"): {**_fields(2, 24576), "h2d_copies": 1, "h2d_bytes": 16384}}
    for device in ("cpu", "cuda"):
        problems = learning_inconsistencies(
            _own(partial, partial), _observations(), "sequential", device
        )
        assert len(problems) == 2 and "a reload brings back everything" in problems[0], problems
    handed = {(0, 0, "core_attn"): _fields(2, 24576, back=False)}
    assert (
        learning_inconsistencies(_own(handed, handed), _observations(), "sequential", "cpu") == []
    )
    problems = learning_inconsistencies(_own(handed, handed), _observations(), "sequential", "cuda")
    assert len(problems) == 2, problems


def _counts(moved: dict[tuple[int, int, str], tuple[int, int]]) -> TransferCounts:
    by_range = {}
    for (mb, layer, name), (out, back) in moved.items():
        by_range[RangeKey("d2h", name, mb, layer)] = Counts(1 if out else 0, out)
        by_range[RangeKey("h2d", name, mb, layer)] = Counts(1 if back else 0, back)
    return TransferCounts(by_range)


def test_every_steady_step_must_move_each_selected_name() -> None:
    both = {(0, 0, "core_attn"): (8, 8), (0, 0, "attn_proj"): (4, 4)}
    steps = [_counts(both), _counts(both), _counts({(0, 0, "core_attn"): (8, 8)}), _counts(both)]
    assert steady_proof(steps, {"core_attn", "attn_proj"}, hands_back=False) == [
        "step 2: no attn_proj group moved bytes both ways"
    ]
    out_only = {(0, 0, "core_attn"): (8, 0), (0, 0, "attn_proj"): (4, 0)}
    steps = [_counts(out_only)] * 3
    assert steady_proof(steps, {"core_attn", "attn_proj"}, hands_back=True) == []
    assert steady_proof(steps, {"core_attn"}, hands_back=False) == [
        "step 1: no core_attn group moved bytes both ways",
        "step 2: no core_attn group moved bytes both ways",
    ]


def test_a_size_difference_names_the_tensor() -> None:
    key = (0, 0, "core_attn")
    observations = _observations()
    one_short = size_difference(key, {"d2h": (16384,)}, {"d2h": (8192, 16384)}, observations)
    assert one_short == "; missing out: 1 copy of 8192 B (saved tensor 2 of 3, (2048,) float32)"
    batched = size_difference(key, {"d2h": (16384,)}, {"d2h": (24576,)}, observations)
    assert batched == (
        "; out: a copy of 16384 B where 24576 B was due, 8192 B short (saved tensor 2 of 3, "
        "(2048,) float32)"
    )
    assert size_difference(key, {"d2h": (8,)}, {"d2h": (8,)}, observations) == ""


def test_layer_words() -> None:
    assert [layer_words(x) for x in ({0, 1}, {0, 2}, {0, 2, 5}, {3})] == [
        "0-1",
        "0 and 2",
        "0, 2 and 5",
        "3",
    ]


def test_a_depth_rule_predicts_the_groups_reloaded_after_the_last_forward() -> None:
    # 1F1B over 2 microbatches: F0 F1 B0 B1; the last forward is index 1. Nothing of a
    # backward has ended then, so no depth reloads anything ahead after it.
    observations = _observations(microbatches=2)
    moved = Expected(decision="offloaded", copies=1, bytes=8, freed_storages=frozenset())
    expected = {(o.microbatch, o.layer, o.name): moved for o in observations}
    order = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert prefetched_at_depth(observations, expected, order, 1, 3) == set()
    # GPipe-like with a forward after B0: F0 B0 F1 B1, last forward index 2. B0 ended, so
    # depth 2 reloads what comes 2 places after microbatch 0's occurrences: both of
    # microbatch 1's (backward order: (0,1) (0,0) (1,1) (1,0)); depth 3 only (1,0); depth 0 none
    order = [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert prefetched_at_depth(observations, expected, order, 2, 2) == {
        (1, 1, "core_attn"),
        (1, 0, "core_attn"),
    }
    assert prefetched_at_depth(observations, expected, order, 2, 3) == {(1, 0, "core_attn")}
    assert prefetched_at_depth(observations, expected, order, 2, 0) == set()


def test_the_cost_of_a_learned_cadence_is_a_note() -> None:
    steps = (
        StepCadence(step=0, reloads=4, ahead_groups=3, ahead_bytes=300, where="microbatch 0"),
        StepCadence(step=1, reloads=4, ahead_groups=2, ahead_bytes=200, where="microbatch 0"),
    )
    cadence = Cadence(rule="r", steps=steps, marks=8, megatron_bytes=(100, 100))
    assert cadence.cost_note() == (
        "note: its learned cadence reloads up to 300 B ahead of their backward at once (step 0, "
        "microbatch 0); Megatron-Core's rule has at most 100 B ahead at any point of a step: "
        "200 B more device memory held early"
    )
    assert dataclasses.replace(cadence, megatron_bytes=(300, 0)).cost_note() == ""
    assert dataclasses.replace(cadence, megatron_bytes=()).cost_note() == ""


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_copy_on_a_pool_thread_reaches_the_observer() -> None:
    watch_threads()
    pool = concurrent.futures.ThreadPoolExecutor(1)  # its worker starts at the first submit
    try:
        source, target = torch.ones(4), torch.empty(4)
        seen = _Seen()
        with seen, observing(seen):
            pool.submit(target.copy_, source).result()
        assert "aten.copy_.default" in seen.ops, seen.ops
        # outside an observed step the relay runs the op unseen
        after = len(seen.ops)
        pool.submit(target.copy_, source).result()
        assert len(seen.ops) == after
    finally:
        pool.shutdown()


def test_the_semantics_fields_are_checked() -> None:
    try:
        Semantics(threshold_unit="words")
    except ValueError as exc:
        assert "threshold_unit" in str(exc)
    else:
        raise AssertionError("an unknown threshold unit was accepted")


def test_a_mark_whose_storage_is_gone_is_stale_at_its_address() -> None:
    import weakref

    from harness.measure.observe import _reused_address, _stale_mark, _WindowState

    state = _WindowState()
    activation = torch.ones(8)
    address = activation.untyped_storage().data_ptr()
    gone = torch.ones(2)
    state.marked_at[address] = (weakref.ref(gone), 3)  # marked in step 3 at that address
    del gone  # the marked tensor is freed: its address now holds the activation
    assert _stale_mark(state, activation) == 3
    # a mark still holding its memory (the activation itself marked) is no stale one
    state.marked_at[address] = (weakref.ref(activation), 4)
    assert _stale_mark(state, activation) is None
    # FSDP2's reshard: the marked parameter lives but its storage was resized to nothing
    resharded = torch.ones(8)
    state.marked_at[address] = (weakref.ref(resharded), 5)
    resharded.untyped_storage().resize_(0)
    assert _stale_mark(state, activation) == 5
    # an address an earlier saved tensor held and gave up is named as reused
    first = torch.ones(4)
    key = (0, 1, "core_attn")
    assert _reused_address(state, first, key) == ""
    state.saved_at[address] = (weakref.ref(resharded), key, 2)
    assert _reused_address(state, activation, (1, 1, "core_attn")).startswith(
        "its storage address held a tensor saved by group core_attn (microbatch 0, layer 1) in "
        "step 2, freed since"
    )


def test_the_reload_layout_is_learned_from_the_learning_steps_only() -> None:
    from harness.execute.learn import learn_from_steps
    from harness.measure.copyobserver import Observed

    steps = [Observed(), Observed(), Observed(relaid=2)]  # step 2 changes strides
    rule = learn_from_steps(_observations(), CONFIG, schedule_order("sequential", 1), steps, "cpu")
    assert rule.semantics.reload_layout == "saved", rule.line
    steps[1].relaid = 1
    rule = learn_from_steps(_observations(), CONFIG, schedule_order("sequential", 1), steps, "cpu")
    assert rule.semantics.reload_layout == "contiguous", rule.line


def test_a_layout_change_after_the_learning_steps_is_an_inconsistency() -> None:
    from types import SimpleNamespace

    from harness.execute.caserun import CaseRun

    rule = SimpleNamespace(steps=(0, 1))
    run = SimpleNamespace(rule=rule, relaid=(0, 0, 0, 3, 0, 1))
    assert CaseRun.relaid_inconsistencies(run) == [  # type: ignore[arg-type]
        "step 3: 3 reloads came back with other strides than the saved tensor's; steps 0 and 1 "
        "kept the saved strides",
        "step 5: 1 reloads came back with other strides than the saved tensor's; steps 0 and 1 "
        "kept the saved strides",
    ]
    learned_contiguous = SimpleNamespace(rule=rule, relaid=(2, 2, 2, 0))
    assert CaseRun.relaid_inconsistencies(learned_contiguous) == [  # type: ignore[arg-type]
        "step 3: every reload kept the saved strides; its learning steps' came back contiguous"
    ]
    declared = SimpleNamespace(rule=None, relaid=(0, 0, 5))
    assert CaseRun.relaid_inconsistencies(declared) == []  # type: ignore[arg-type]


def test_an_unordered_cadence_says_what_was_seen() -> None:
    from types import SimpleNamespace

    from harness.verify.checks import unordered_reason

    unmarked = Cadence(rule="r", steps=(StepCadence(step=0, unordered=4),), marks=0)
    reason = unordered_reason(SimpleNamespace(per_step=()), unmarked)  # type: ignore[arg-type]
    assert reason.startswith("4 reload copies were observed, but the backward of their group")
    none = Cadence(rule="r", steps=(StepCadence(step=0),), marks=6)
    stray = _counts({(0, 0, "core_attn"): (0, 8)})
    reason = unordered_reason(SimpleNamespace(per_step=(stray,)), none)  # type: ignore[arg-type]
    assert reason.startswith(
        "no reload of a selected group was ordered: the run's H2D copies (1 in"
    )
    reason = unordered_reason(SimpleNamespace(per_step=()), none)  # type: ignore[arg-type]
    assert reason.startswith("no reload copy was observed in any step, though the rule")


def test_a_proof_with_nothing_seen_names_the_threads_the_observer_cannot_see(monkeypatch) -> None:
    import harness.execute.steps as steps

    monkeypatch.setattr(steps, "unwatched", lambda: ["early-pool_0"])
    nothing = TransferCounts({})
    problems = [
        "microbatch 0: no core_attn group moved bytes both ways in the profiled warmup step"
    ]
    assert steps.with_unwatched(nothing, problems) == [
        *problems,
        "(threads started before the harness watched them, whose copies it cannot see: "
        "early-pool_0)",
    ]
    # something was seen, or nothing is wrong: no such line
    seen = _counts({(0, 0, "core_attn"): (8, 8)})
    assert steps.with_unwatched(seen, problems) == problems
    assert steps.with_unwatched(nothing, []) == []
