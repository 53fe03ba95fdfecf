"""Undeclared offloaders outside the family's first choices are held to their own consistency, and
their broken twins are caught (issue 58; ``tests/helpers/consistent_offloaders.py``).

* every correct style passes every check on CPU with no ``Capabilities``; what its rule line
  says is derived by hand from what the style does (below, per style);
* each broken twin fails the check that names its fault, for that reason;
* the two address-keyed flaws are named as such: a mark kept by address fails the ZeRO-3 row
  (FSDP2 reuses the addresses of resharded parameters) and no other, saying why; a copy
  deduplicated by address hands back another tensor's data, and the reload says whose address
  it was.

The plain baselines are shared between the rows' tests (``shared_runs``).
"""

from __future__ import annotations

import re

import pytest
import torch

from harness.cases import Case
from harness.execute.environment import Environment
from harness.verify.judge import judge

CPU = torch.device("cpu")
SEED = Case(family="hybrid", offload=("core_attn", "attn_proj"), custom_pattern="+-+-")
MOE = Case(family="moe", offload=("qkv_linear", "expert_fc1", "moe_act"), precision="bf16")
ZERO3 = Case(
    family="hybrid", offload=("core_attn", "attn_proj"), precision="bf16", sharding="zero3"
)
CHECKS = ("equivalence", "leaks", "transfers", "disabled", "fidelity", "weights", "cadence")

# (style, row, what its rule line must say), each derived from the style's code:
CORRECT = [
    # copies on a pool thread: seen like the hook's own, so StorageSkip's rule, every step
    (
        "ThreadCopier",
        SEED,
        r"^observed rule: skips marked and parameter storages, .*every "
        r"selected occurrence every step, reloads at its group's backward",
    ),
    # the MoE row's selected groups open in layers 0-3; the first two distinct ones move
    ("LayerSubset", MOE, r"only layers 0-1 offloaded, every step"),
    # the group's tensors packed into one buffer: one copy per occurrence each way
    ("BatchedCopy", SEED, r"one copy per group occurrence each way"),
    # everything still on the host comes back at the first unpack of backward: deep prefetch,
    # whose cost is noted against Megatron's rule (the cadence check's reason, below)
    ("PrefetchAll", MOE, r"reloads at most \d+ group\(s\) ahead of their backward"),
    ("TwoAhead", SEED, r"reloads at most \d+ group\(s\) ahead of their backward"),
    # 4 * min_offloaded_tensor_size bytes: on this row an element threshold predicts alike
    ("ByteThreshold", MOE, r"^observed rule: skips marked and parameter storages, tensors under"),
    # each tensor in pieces of 4096 elements: no rule of the family copies a tensor in pieces,
    # so it is held to its own first steady step
    (
        "ChunkedCopy",
        SEED,
        r"^observed: offloads every core_attn and attn_proj occurrence, every "
        r"step; 1 to \d+ copies per group occurrence; reloads copy back; held to its own first "
        r"steady step",
    ),
]


def _statuses(judgement) -> dict[str, str]:
    return {o.name: o.status for o in judgement.outcomes}


@pytest.mark.usefixtures("shared_runs")
@pytest.mark.parametrize(("style", "row", "line"), CORRECT, ids=[c[0] for c in CORRECT])
def test_a_correct_style_passes_held_to_its_own_rule(style: str, row: Case, line: str) -> None:
    judgement = judge(row, Environment(device=CPU, backend=f"consistent_offloaders:{style}"))
    statuses = _statuses(judgement)
    assert {c: statuses[c] for c in CHECKS} == dict.fromkeys(CHECKS, "pass"), judgement.problems
    rule = judgement.record()["rule"]
    assert re.search(line, rule["line"]), rule["line"]
    # the proof that the offload happened is the checksums of what moved
    transfers = next(o for o in judgement.outcomes if o.name == "transfers")
    assert "declare semantics to check it against Megatron's" in transfers.reason
    cadence = next(o for o in judgement.outcomes if o.name == "cadence")
    if style == "PrefetchAll":  # on the MoE row: 197120 B ahead at once, Megatron 131072 B
        assert re.search(
            r"note: its learned cadence reloads up to \d+ B ahead .*Megatron-Core's "
            r"rule has at most \d+ B ahead at any point of a step",
            cadence.reason,
        )
    else:  # no deeper than Megatron's: no note
        assert "note: its learned cadence" not in cadence.reason, cadence.reason


# (twin, row, the check that must fail, its problem's pattern, checks that must still pass)
BROKEN = [
    # layers 0 and 2 (the seed's attention layers) until step 2, layer 2 alone from step 3: the
    # learned subset is held on step 3 on, where layer 0 stops moving
    (
        "SubsetDrifts",
        SEED,
        "transfers",
        r"^step 3, microbatch 0, layer 0, group attn_proj: "
        r"predicted \{'d2h_copies': 1, .*measured \{'d2h_copies': 0",
        ("equivalence", "weights"),
    ),
    # microbatch 1 of step 3 leaves each batch's last tensor behind: one copy, fewer bytes,
    # and the difference is the size of that tensor
    (
        "BatchedDropsBytes",
        SEED,
        "transfers",
        r"^step 3, microbatch 1, layer \d, group core_attn: "
        r".*out: a copy of \d+ B where \d+ B was due, \d+ B short \(saved tensor",
        ("equivalence", "weights"),
    ),
    # from step 1 the reload reads the previous step's buffer: the checksums differ
    (
        "ThreadStaleBuffer",
        SEED,
        "equivalence",
        r"reloads differ from what was saved \(checksums "
        r"at pack and unpack, \d+ compared\); the first: step 1,",
        ("weights", "fidelity"),
    ),
]


@pytest.mark.usefixtures("shared_runs")
@pytest.mark.parametrize(
    ("flaw", "row", "check", "pattern"),
    [
        # a copy keyed by address: another tensor's copy comes back, and a reload that differs
        # names whose address it was (the first such, where it is not the first that differs)
        (
            "AddressDedup",
            SEED,
            "equivalence",
            r"\(its storage address held a tensor saved by "
            r"group \w+ \(microbatch \d, layer \d\) in step \d, freed since; an offloader keying "
            r"its copies by address goes stale",
        ),
        # FSDP2 frees resharded parameters and their addresses hold activations later: marks
        # kept as addresses skip some of them, and the transfer check says why first
        (
            "AddressMarks",
            ZERO3,
            "transfers",
            r"^step \d, microbatch \d, layer \d, group \w+: a "
            r"saved tensor of \d+ B was kept on the device at an address that held a storage "
            r"marked not-offloadable in step \d, freed since; marks kept by address go stale",
        ),
    ],
    ids=["AddressDedup", "AddressMarks"],
)
def test_an_address_keyed_flaw_says_why_where_the_allocator_reuses_an_address(
    flaw: str, row: Case, check: str, pattern: str
) -> None:
    """Whether an address is reused in a run is the allocator's choice (it depends on what the
    process allocated before), so the flaw may not show: where it fails, it says why; where it
    does not, no reload differed and every copy was consistent (no false alarm either way)."""
    judgement = judge(row, Environment(device=CPU, backend=f"consistent_offloaders:{flaw}"))
    outcome = next(o for o in judgement.outcomes if o.name == check)
    if outcome.status == "fail":
        assert any(re.search(pattern, p) for p in outcome.problems), outcome.problems
    else:
        assert judgement.verdict == "pass", judgement.problems


@pytest.mark.usefixtures("shared_runs")
@pytest.mark.parametrize(
    ("twin", "row", "check", "pattern", "passing"), BROKEN, ids=[b[0] for b in BROKEN]
)
def test_a_broken_twin_is_caught_for_its_reason(
    twin: str, row: Case, check: str, pattern: str, passing: tuple[str, ...]
) -> None:
    judgement = judge(row, Environment(device=CPU, backend=f"consistent_offloaders:{twin}"))
    outcome = next(o for o in judgement.outcomes if o.name == check)
    assert outcome.status == "fail", judgement.problems
    assert any(re.search(pattern, p) for p in outcome.problems), outcome.problems
    statuses = _statuses(judgement)
    assert all(statuses[c] == "pass" for c in passing), (statuses, judgement.problems)


@pytest.mark.usefixtures("shared_runs")
def test_address_marks_are_no_fault_where_no_address_is_reused() -> None:
    """The same offloader on the seed row (no FSDP2, no parameter freed): every check passes,
    so the ZeRO-3 catch above is the reuse, not the style."""
    judgement = judge(SEED, Environment(device=CPU, backend="consistent_offloaders:AddressMarks"))
    assert judgement.verdict == "pass", judgement.problems


@pytest.mark.usefixtures("shared_runs")
def test_two_steps_leave_an_undeclared_rule_nothing_to_be_held_to() -> None:
    """Steps 0 and 1 are the learning steps: with ``--steps 2`` the transfer and cadence checks
    would judge them by what they taught, so they skip, saying why."""
    row = SEED.replace(steps=2)
    judgement = judge(row, Environment(device=CPU, backend="undeclared_offloaders:StorageSkip"))
    outcomes = {o.name: o for o in judgement.outcomes}
    for check in ("transfers", "cadence"):
        assert outcomes[check].status == "skip", outcomes[check]
        assert "no later step to hold it to (run --steps 3 or more)" in outcomes[check].reason
    assert outcomes["equivalence"].status == "pass", outcomes["equivalence"].problems
