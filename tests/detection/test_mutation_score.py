"""The mutation score counts a catch only for its stated reason (``harness.tools.mutation_score``).

* every catalogue entry names an expected problem pattern for each of its catching checks, and
  ``golden`` (which reads the plain baseline alone) is never among the checks it judges;
* a case whose runs raised is reported apart, never as a catch; a named check failing for
  another reason is no catch either;
* a deliberately drifted golden folder changes no verdict: the reference stays uncaught, a
  broken offloader is caught by the same check for the same reason;
* ``--undeclared`` parses, and is passed to ``Environment`` only when on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness.cases import SEED_CASE
from harness.execute.environment import Environment
from harness.measure import fingerprint
from harness.tools import mutation_score
from harness.verify import detection, golden
from harness.verify.judge import CheckOutcome, Judgement, judge

CPU = torch.device("cpu")
CORRUPT = detection.entry("broken.corrupt_reload")


def test_every_catcher_names_its_reason_and_golden_is_never_judged() -> None:
    for item in detection.CATALOGUE:
        checks = mutation_score.named_checks(item)
        assert "golden" not in checks
        assert set(checks) == {check for check, _ in item.catchers}, item.name
        for check in checks:
            assert item.reason(check).pattern, (item.name, check)
        assert {check for check, _ in item.reasons} == set(checks), item.name


def _judged(*outcomes: CheckOutcome):
    def fake(case, env, *, checks=(), **_: object) -> Judgement:
        return Judgement(case=case, outcomes=tuple(o for o in outcomes if o.name in checks))

    return fake


def test_a_run_that_raised_is_reported_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    raised = CheckOutcome(
        name="equivalence",
        status="fail",
        problems=("the case's runs raised RuntimeError: boom",),
    )
    monkeypatch.setattr(mutation_score, "judge", _judged(raised))
    found = mutation_score.find(SEED_CASE, Environment(device=CPU), CORRUPT)
    assert found == mutation_score.Finding(
        check="equivalence", raised="the case's runs raised RuntimeError: boom"
    )


def test_a_failure_for_another_reason_is_no_catch(monkeypatch: pytest.MonkeyPatch) -> None:
    other = CheckOutcome(
        name="equivalence", status="fail", problems=("losses differ from step 2 on",)
    )
    monkeypatch.setattr(mutation_score, "judge", _judged(other))
    found = mutation_score.find(SEED_CASE, Environment(device=CPU), CORRUPT)
    assert found == mutation_score.Finding(other="[equivalence] losses differ from step 2 on")


def test_matching_line_with_the_line_it_heads() -> None:
    fraction = detection.entry("broken.fraction_count")
    problems = (
        "counted (offloader ranges) vs prediction in step 5 (the final step):",
        "step 5, microbatch 0, layer 2, group attn_proj: predicted {...} measured {...}",
    )
    assert fraction.matching("transfers", problems) == " ".join(problems)
    assert fraction.matching("transfers", ("the prediction moves nothing",)) is None


def test_undeclared_switch_parses_and_is_passed_only_when_on() -> None:
    parser = mutation_score.build_parser()
    assert parser.parse_args(["--undeclared"]).undeclared is True
    assert parser.parse_args([]).undeclared is False
    plain = mutation_score.environment("reference", "cpu", "tiny", False)
    assert plain == Environment(device=CPU, backend="reference", model_size="tiny")


def _drifted_root(tmp_path: Path) -> Path:
    """A golden folder whose trace for the seed case is this machine's but every loss 1.0."""
    losses = torch.ones(SEED_CASE.steps, SEED_CASE.microbatches)
    here = fingerprint.of(CPU)
    golden.update(SEED_CASE.name, losses, here, golden.variant("tiny"), root=tmp_path)
    return tmp_path


@pytest.mark.heavy
def test_drifted_golden_changes_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(golden.ROOT_VARIABLE, str(_drifted_root(tmp_path)))
    threads = torch.get_num_threads()
    reference = Environment(device=CPU, backend="reference")
    drifted = judge(SEED_CASE, reference, checks=("golden",)).outcomes[0]
    assert drifted.status == "fail", drifted  # the drift is there to be seen
    # the reference, posing as any entry, is caught by nothing
    assert mutation_score.find(SEED_CASE, reference, CORRUPT) == mutation_score.Finding()
    outcome = mutation_score.score_one(CORRUPT.name, "cpu", "tiny", "auto", threads)
    assert outcome.caught and outcome.check == "equivalence", outcome
    assert outcome.case == SEED_CASE.name
    assert "reloads differ from what was saved" in outcome.problem, outcome
    assert dataclasses.replace(outcome, seconds=0.0).raised == ""
