"""Offloaders that declare nothing: their rule is learned from what they do
(``harness.execute.learn``), then every step is held to it.

* ``learn`` on hand-built observations finds each freedom the protocol leaves (skip rule, size
  threshold, view copy, CPU hand-back, occurrence policy) and says which ones a case cannot
  decide; copies no single rule explains are named as such;
* the corpus of correct undeclared offloaders (``tests/helpers/undeclared_offloaders.py``, six
  styles) passes every check with no ``Capabilities``, and the rule it was held to is in the report;
* each broken variant of them is caught, by the check that should catch it, for its reason:
  where no rule of the family fits, by its own consistency (``harness.execute.consistency``);
* a declared backend is judged against its declaration as before, and the same backend with its
  declaration hidden (``Environment(undeclared=True)``) is learned to follow the same rule.

Runs judged twice (``EvenStepsOnly`` on the first row) are made once per process, and the plain
baselines are shared between the rows' tests (``shared_runs``).
"""

from __future__ import annotations

import re

import pytest
import torch
from shared_runs import SharedRuns

from harness.cases import Case
from harness.execute.environment import Environment
from harness.execute.learn import learn
from harness.models.train import schedule_order
from harness.offload.config import OffloadConfig
from harness.offload.recorder import GroupObservation, SavedInfo
from harness.verify.judge import judge

CPU = torch.device("cpu")
ROWS = (
    Case(family="hybrid", offload=("core_attn", "attn_proj"), custom_pattern="+-+-"),
    Case(family="moe", offload=("qkv_linear", "expert_fc1", "moe_act"), precision="bf16"),
)
CHECKS = ("equivalence", "transfers", "disabled", "fidelity", "weights", "cadence")
CORRECT = ("StorageSkip", "ObjectSkip", "SizeThreshold", "WholeStorage", "HandBack")
HANDS_BACK = ("SizeThreshold", "HandBack")
"""The styles whose unpack on a CPU device returns the host copy itself (their code: the
``packed[0].type == "cpu"`` branch, and ``host.to(device)``, a no-op there): no reload copy."""


def _saved(numel: int, *, parameter: bool = False, contiguous: bool = True, sid: int = 0):
    return SavedInfo(
        shape=(numel,),
        stride=(1,),
        storage_offset=0,
        dtype=torch.float32,
        itemsize=4,
        storage_nbytes=numel * 4 * (1 if contiguous else 2),
        storage_id=sid,
        contiguous=contiguous,
        on_device=True,
        parameter=parameter,
    )


# One microbatch, two layers of one group, each saving: a view of a weight (2048 elements,
# parameter storage, not a Parameter object itself) and activations of 4096, 600 and 16
# elements. Under Megatron's skip rule with min_offloaded_tensor_size 1024 only the 4096 one
# moves: 1 copy of 16384 B per occurrence.
OBSERVATIONS = [
    GroupObservation(
        microbatch=0,
        layer=layer,
        name="core_attn",
        saved=(
            _saved(2048, parameter=True, sid=1),
            _saved(4096, sid=2),
            _saved(600, sid=3),
            _saved(16, sid=4),
        ),
        released=(),
    )
    for layer in (0, 1)
]
CONFIG = OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=1024)
ORDER = schedule_order("sequential", 1)


def _counts(copies: int, nbytes: int, back: bool = True) -> dict[str, int]:
    return {
        "d2h_copies": copies,
        "d2h_bytes": nbytes,
        "h2d_copies": copies if back else 0,
        "h2d_bytes": nbytes if back else 0,
    }


def test_learns_storage_skip_a_threshold_and_a_cpu_hand_back() -> None:
    # 1 copy of 4096 * 4 B per occurrence, out only, in both learning steps
    step = {(0, layer, "core_attn"): _counts(1, 16384, back=False) for layer in (0, 1)}
    rule = learn(OBSERVATIONS, CONFIG, ORDER, [step, step], "cpu", relaid=False)
    assert rule.exact, rule.line
    semantics = rule.semantics
    assert semantics.observed and semantics.skip == "storage" and not semantics.host_reload
    assert semantics.threshold(CONFIG) == 1024, "the configured threshold fits and is preferred"
    # Skipping the weight view by storage with a threshold in (600, 4096] fits, and so does
    # moving it (skip by object or nothing) with a threshold in (2048, 4096]: both are said.
    assert rule.line == (
        "observed rule: skip rule not decided by this case (storages or objects or nothing), "
        "tensors under 1024 to 4096 elements stay (not decided by this case exactly), view copy "
        "not decided by this case (gathered or whole storage or base), CPU reload hands back the "
        "host copy, reloads keep the saved strides, every selected occurrence every step"
    )


def test_learns_a_threshold_of_its_own_and_moving_weight_views() -> None:
    # the weight view, the 4096 and the 600 one move (skip by object), the 16 one stays:
    # 3 copies, (2048 + 4096 + 600) * 4 = 26976 B; a threshold in (16, 600], not the
    # configured 1024, and 600 is the one saved size there
    step = {(0, layer, "core_attn"): _counts(3, 26976) for layer in (0, 1)}
    rule = learn(OBSERVATIONS, CONFIG, ORDER, [step, step], "cpu", relaid=False)
    assert rule.exact and rule.semantics.skip == "object", rule.line
    assert rule.semantics.threshold(CONFIG) == 600
    assert "tensors under 600 elements stay" in rule.line
    assert "CPU reload copies back" in rule.line


def test_learns_the_last_occurrence_kept() -> None:
    # TransformerEngine's style: the last occurrence of the pass stays in every step
    step = {(0, 0, "core_attn"): _counts(1, 16384)}
    rule = learn(OBSERVATIONS, CONFIG, ORDER, [step, step], "cuda", relaid=True)
    assert rule.exact and rule.semantics.keep_last == 1, rule.line
    assert "the last 1 selected occurrence(s) of each pass stay" in rule.line
    assert "reloads come back contiguous" in rule.line and "CPU reload" not in rule.line


def test_copies_no_single_rule_explains_are_named() -> None:
    warmup = {(0, layer, "core_attn"): _counts(1, 16384) for layer in (0, 1)}
    steady = {(0, 0, "core_attn"): _counts(1, 16384)}  # layer 1 stops moving, layer 0 goes on
    steady_wrong = {**steady, (0, 1, "core_attn"): _counts(1, 64)}  # 64 B: no tensor's size
    rule = learn(OBSERVATIONS, CONFIG, ORDER, [warmup, steady_wrong], "cpu", relaid=False)
    assert not rule.exact and rule.misfits == 1, rule.line
    assert rule.line.startswith("no single rule explains its copies in steps 0 and 1; the closest")


def _statuses(judgement) -> dict[str, str]:
    return {o.name: o.status for o in judgement.outcomes}


@pytest.mark.usefixtures("shared_runs")
@pytest.mark.parametrize("style", CORRECT)
@pytest.mark.parametrize("row", ROWS, ids=lambda c: c.name)
def test_a_correct_undeclared_offloader_passes(style: str, row: Case) -> None:
    judgement = judge(row, Environment(device=CPU, backend=f"undeclared_offloaders:{style}"))
    statuses = _statuses(judgement)
    assert judgement.verdict == "pass", judgement.problems
    expected = dict.fromkeys(CHECKS, "pass")
    rule = judgement.record()["rule"]
    if style in HANDS_BACK:  # no reload copy to order
        expected["cadence"] = "n-a"
    assert {c: statuses[c] for c in CHECKS} == expected, statuses
    transfers = next(o for o in judgement.outcomes if o.name == "transfers")
    assert "declare semantics to check it against Megatron's" in transfers.reason
    assert rule["source"] == "observed" and rule["exact"], rule
    assert rule["line"].startswith("observed rule: "), rule


EVEN_STEPS_GROUP = pytest.mark.xdist_group("detection-undeclared-EvenStepsOnly")
"""The tests judging ``EvenStepsOnly`` on the first row: one worker makes its runs once."""

BROKEN = [
    # (variant, the check that must fail, its problem's pattern, checks that must still pass)
    (
        # the second tensor of each group is handed back, the others copied back: on a CUDA
        # device that is a host tensor given to backward
        "DropsOneReload",
        "transfers",
        r"a reload brings back everything its occurrence offloaded or, handing back the host "
        r"copies, nothing",
        ("equivalence", "weights"),
    ),
    pytest.param(
        # attn_proj moves on even steps only: held to step 1, which moved none, step 2 moves it
        "EvenStepsOnly",
        "transfers",
        r"^counted \(harness windows\) vs its own first steady step in the steps before the final",
        ("weights",),
        marks=EVEN_STEPS_GROUP,
    ),
    (
        "MovesMarked",
        "weights",
        r"D2H copies of weights .* in steps \[0, 1, 2, 3, 4, 5\]",
        ("equivalence", "transfers"),
    ),
    (
        # the warmup's threshold, then one 64 times larger than any saved tensor of the row:
        # nothing moves after step 0, which no steady step may do
        "ThresholdDrifts",
        "equivalence",
        r"^the offload did not happen in every steady step",
        ("weights", "fidelity"),
    ),
]


@pytest.mark.usefixtures("shared_runs")
@pytest.mark.parametrize(("variant", "check", "pattern", "passing"), BROKEN)
def test_a_broken_undeclared_offloader_is_caught(
    variant: str, check: str, pattern: str, passing: tuple[str, ...]
) -> None:
    row = ROWS[0]
    judgement = judge(row, Environment(device=CPU, backend=f"undeclared_offloaders:{variant}"))
    outcome = next(o for o in judgement.outcomes if o.name == check)
    assert outcome.status == "fail", judgement.problems
    assert any(re.search(pattern, p) for p in outcome.problems), outcome.problems
    statuses = _statuses(judgement)
    assert all(statuses[c] == "pass" for c in passing), (statuses, judgement.problems)


@EVEN_STEPS_GROUP
@pytest.mark.usefixtures("shared_runs")
def test_its_own_tables_name_the_first_occurrence_that_breaks_them() -> None:
    judgement = judge(
        ROWS[0], Environment(device=CPU, backend="undeclared_offloaders:EvenStepsOnly")
    )
    outcomes = {o.name: o for o in judgement.outcomes}
    problems = outcomes["transfers"].problems
    # attn_proj stops moving in step 1 (an odd step): no rule fits, step 1 is what it is held
    # to, and step 2 moves it again - the size names the tensor
    assert re.match(
        r"step 2, microbatch 0, layer 0, group attn_proj: held to \{'d2h_copies': 0, .*\} "
        r"measured \{'d2h_copies': 1, .* - as in its first steady step \(step 1\); extra out: "
        r"1 copy of \d+ B \(saved tensor 1 of 2",
        problems[1],
    ), problems
    rule = judgement.record()["rule"]
    assert rule["held_to"] == "its own first steady step" and not rule["exact"], rule
    assert rule["closest"].startswith("no single rule explains its copies in steps 0 and 1")
    # and a selected name that stops moving in a steady step is no offload there
    assert outcomes["equivalence"].problems[1:] == (
        "step 1: no attn_proj group moved bytes both ways",
        "step 3: no attn_proj group moved bytes both ways",
        "step 5: no attn_proj group moved bytes both ways",
    ), outcomes["equivalence"].problems


def test_the_reference_with_its_declaration_hidden_is_learned_to_follow_megatrons_rules(
    shared_runs: SharedRuns,
) -> None:
    row = Case(family="hybrid", offload=("core_attn", "attn_proj"), schedule="1f1b")
    declared = shared_runs.case_run(row, Environment(device=CPU))
    hidden = shared_runs.case_run(row, Environment(device=CPU, undeclared=True))
    assert declared.rule is None and declared.mismatches() == []
    assert hidden.rule is not None and hidden.rule.exact, hidden.rule
    assert hidden.step_mismatches() == [] and hidden.mismatches() == []
    # the same prediction, step by step, as the declaration's
    expected = {k: (e.copies, e.bytes) for k, e in declared.expected.items()}
    assert {k: (e.copies, e.bytes) for k, e in hidden.expected.items()} == expected
    assert "Megatron's warmup and steady-state policies" in hidden.rule.line


def test_with_declarations_hidden_a_copy_made_twice_is_caught_as_such() -> None:
    """``mutation-score --undeclared``: ``broken.extra_round_trip`` copies every tensor out (and
    back) twice. Doubling is a consistent rule of its own, so consistency cannot tell; the
    absolute bound can: no saved storage is copied out more than its saves hold."""
    from harness.tools.mutation_score import score_one

    outcome = score_one("broken.extra_round_trip", "cpu", "tiny", "none", 1, undeclared=True)
    assert outcome.caught and outcome.check == "transfers", outcome
    assert "copied out more than the saved storages hold (the same data moved twice)" in (
        outcome.problem
    ), outcome.problem
