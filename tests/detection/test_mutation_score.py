"""The mutation score counts a catch only for its stated reason (``harness.tools.mutation_score``).

* every catalogue entry names an expected problem pattern for each of its catching checks, and
  ``golden`` (which reads the plain baseline alone) is never among the checks it judges;
* a case whose runs raised is reported apart, never as a catch; a named check failing for
  another reason is no catch either;
* a deliberately drifted golden folder changes no verdict: the reference stays uncaught, a
  broken offloader is caught by the same check for the same reason;
* ``--undeclared`` parses, and is passed to ``Environment`` only when on;
* the control: a failing check but golden on a scored row makes the score invalid (exit 1, the
  rows and checks named; stand-in judges, and a real broken offloader as the control); pass,
  inert, refused, n-a or skipped checks and a golden drift leave it valid;
* the schedule: the control once per row, before the entries sharing its worker call; the
  rest of the matrix only after the catchers missed; a learnable fault judged on its catchers
  only when undeclared.

The two scores of real runs judge the seed row in this process: they read the runs the seed
row's case tests and detection tests made on the same worker (``shared_runs``, ``judges_row``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness.cases import SEED_CASE, default_matrix
from harness.execute.baselines import MAX_ROWS_SHARING
from harness.execute.environment import Environment
from harness.measure import fingerprint
from harness.tools import mutation_control, mutation_rows, mutation_score
from harness.verify import detection, golden
from harness.verify.judge import CHECKS, CheckOutcome, Judgement, judge

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
    monkeypatch.setattr(mutation_rows, "judge", _judged(raised))
    found = mutation_score.find(SEED_CASE, Environment(device=CPU), CORRUPT)
    assert found == mutation_score.Finding(raised="the case's runs raised RuntimeError: boom")
    assert found.catch() is None


def test_a_failure_for_another_reason_is_no_catch(monkeypatch: pytest.MonkeyPatch) -> None:
    other = CheckOutcome(
        name="equivalence", status="fail", problems=("losses differ from step 2 on",)
    )
    monkeypatch.setattr(mutation_rows, "judge", _judged(other))
    found = mutation_score.find(SEED_CASE, Environment(device=CPU), CORRUPT)
    assert found == mutation_score.Finding(other="[equivalence] losses differ from step 2 on")
    assert found.catch() is None


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


@pytest.mark.judges_row(SEED_CASE)
@pytest.mark.usefixtures("shared_runs")
def test_drifted_golden_changes_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(golden.ROOT_VARIABLE, str(_drifted_root(tmp_path)))
    threads = torch.get_num_threads()
    reference = Environment(device=CPU, backend="reference")
    drifted = judge(SEED_CASE, reference, checks=("golden",)).outcomes[0]
    assert drifted.status == "fail", drifted  # the drift is there to be seen
    # the reference, posing as any entry, is caught by nothing
    assert mutation_score.find(SEED_CASE, reference, CORRUPT) == mutation_score.Finding()
    result = mutation_score.score([CORRUPT], CPU, "tiny", "auto", 1, threads=threads)
    (outcome,) = result.outcomes
    assert outcome.caught and outcome.check == "equivalence", outcome
    assert outcome.case == SEED_CASE.name
    assert "reloads differ from what was saved" in outcome.problem, outcome
    assert dataclasses.replace(outcome, seconds=0.0).raised == ""
    # the control saw the drift on its row, and it leaves the score valid
    (control,) = result.control
    assert control.case == SEED_CASE.name and control.clean and control.verdict == "pass"
    assert [check for check, _ in control.noted] == ["golden"]
    assert result.invalid == []


# ------------------------------------------------------------------------------ the control

FRACTION = detection.entry("broken.fraction_count")
RELOADS_LINE = "1 reloads differ from what was saved (checksums at pack and unpack, 9 compared)"


def _fail(check: str, line: str) -> CheckOutcome:
    return CheckOutcome(name=check, status="fail", problems=(line,))


class Judges:
    """Stand-ins for the judge: the control's outcomes (every check passes unless its row
    changes some) and the broken offloaders' (their named checks, failing as given per entry
    and row); every call recorded as (backend name, row)."""

    def __init__(
        self,
        control: dict[str, list[CheckOutcome]] | None = None,
        broken: dict[tuple[str, str], list[CheckOutcome]] | None = None,
    ) -> None:
        self.control = control or {}
        self.broken = broken or {}
        self.calls: list[tuple[str, str]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Judges:
        monkeypatch.setattr(mutation_control, "judge", self.control_judge)
        monkeypatch.setattr(mutation_rows, "judge", self.broken_judge)
        return self

    def control_judge(self, case, env, **_: object) -> Judgement:
        assert env.record.name == "reference", env.record  # the control is the reference
        self.calls.append(("control", case.name))
        changed = {o.name: o for o in self.control.get(case.name, [])}
        passes = [CheckOutcome(name=name, status="pass") for name in CHECKS]
        return Judgement(case=case, outcomes=tuple(changed.get(o.name, o) for o in passes))

    def broken_judge(self, case, env, *, checks, **_: object) -> Judgement:
        name = env.record.name
        self.calls.append((name, case.name))
        given = {o.name: o for o in self.broken.get((name, case.name), [])}
        outcomes = [given.get(c, CheckOutcome(name=c, status="pass")) for c in checks]
        return Judgement(case=case, outcomes=tuple(outcomes))

    def rows_of(self, backend: str) -> list[str]:
        return [row for name, row in self.calls if name == backend]


def _score(*only: str, undeclared: bool = False) -> list[str]:
    argv = ["--device", "cpu", "--jobs", "1", *(f"--only={n}" for n in only)]
    return [*argv, "--undeclared"] if undeclared else argv


def test_a_control_failing_a_check_makes_the_score_invalid(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The H100 case: the broken offloader is caught, but the reference fails the memory check
    on that very row, so "caught 1/1" would mean nothing: exit 1, the row and check named."""
    memory = "the baseline's and the offload run's backward group boundaries differ"
    judges = Judges(
        control={SEED_CASE.name: [_fail("memory", memory)]},
        broken={(CORRUPT.name, SEED_CASE.name): [_fail("equivalence", RELOADS_LINE)]},
    ).install(monkeypatch)
    assert mutation_score.main(_score(CORRUPT.name)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [
        "invalid: the control fails 1 rows",
        f"  {SEED_CASE.name}: [memory] {memory}",
    ]
    assert not any(line.startswith("caught ") for line in lines), lines
    assert judges.calls == [("control", SEED_CASE.name), (CORRUPT.name, SEED_CASE.name)]


@pytest.mark.parametrize(
    "check",
    [
        _fail("leaks", "saved tensors never unpacked: 3"),
        _fail("equivalence", "the case's runs raised RuntimeError: boom"),
    ],
    ids=["leaks", "raised"],
)
def test_any_failing_check_but_golden_invalidates(
    monkeypatch: pytest.MonkeyPatch, check: CheckOutcome
) -> None:
    Judges(
        control={SEED_CASE.name: [check]},
        broken={(CORRUPT.name, SEED_CASE.name): [_fail("equivalence", RELOADS_LINE)]},
    ).install(monkeypatch)
    result = mutation_score.score([CORRUPT], CPU, "tiny", "auto", 1)
    assert result.outcomes[0].caught
    assert result.invalid == [
        "invalid: the control fails 1 rows",
        f"  {SEED_CASE.name}: [{check.name}] {check.problems[0]}",
    ]
    with pytest.raises(mutation_control.InvalidScore, match=f"{check.name}"):
        mutation_score.score_one(CORRUPT.name, "cpu", "tiny", "auto", 1)


FINE = {
    "pass": ([], "pass"),
    "checks that cannot decide here": (
        [
            CheckOutcome(name="memory", status="n-a", reason="needs a CUDA device"),
            CheckOutcome(name="cadence", status="skip", reason="no reload copy was observed"),
            CheckOutcome(name="golden", status="skip", reason="no golden trace (missing)"),
        ],
        "pass",
    ),
    "inert": (
        [CheckOutcome(name="equivalence", status="pass", record={"inert": "nothing eligible"})],
        "inert",
    ),
    "refused": ([CheckOutcome(name=c, status="skip", reason="refused") for c in CHECKS], "skip"),
    "golden drift": ([_fail("golden", "losses differ from the golden trace at step 3")], "pass"),
}


@pytest.mark.parametrize("outcomes", FINE.values(), ids=FINE.keys())
def test_a_clean_control_gives_a_valid_score(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    outcomes: tuple[list[CheckOutcome], str],
) -> None:
    """Pass, inert, a refused row, checks n-a or skipped, a golden drift: the reference did
    nothing wrong on the row, so the score stands (the drift noted)."""
    changed, verdict = outcomes
    Judges(
        control={SEED_CASE.name: changed},
        broken={(CORRUPT.name, SEED_CASE.name): [_fail("equivalence", RELOADS_LINE)]},
    ).install(monkeypatch)
    assert mutation_score.main(_score(CORRUPT.name)) == 0
    lines = capsys.readouterr().out.splitlines()
    control = next(line for line in lines if line.startswith("control: "))
    assert control.startswith(f"control: reference on the 1 row scored on cpu: 1 {verdict} (")
    drift = [line for line in lines if line.startswith("  note: ")]
    drifted = [o for o in changed if o.name == "golden" and o.status == "fail"]
    assert len(drift) == len(drifted), lines
    assert lines[-1] == "caught 1/1"
    assert lines[-2].startswith("caught 1/1 on cpu (") and "the control's 1: " in lines[-2]


# ------------------------------------------------------------------------------ the schedule

NOOP = detection.entry("broken.noop")
BEFORE_D2H = detection.entry("broken.reload_before_d2h")
EAGER = detection.entry("broken.eager_reload")
ATTENTION = detection.ATTENTION_1F1B.name
NOT_OFFLOADED_LINE = "the offload did not happen in step 0 (the warmup step): microbatch 0: ..."
PREDICTED_LINE = "counted (offloader ranges) vs prediction in step 5 (the final step): ..."


def test_a_row_is_judged_once_for_the_control_and_shared_by_the_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three entries start on the seed row: one worker call, the control first; the one that
    row does not catch goes on to its second catcher row, which gets its own control."""
    seed = SEED_CASE.name
    judges = Judges(
        broken={
            (NOOP.name, seed): [_fail("equivalence", NOT_OFFLOADED_LINE)],
            (FRACTION.name, seed): [_fail("transfers", PREDICTED_LINE)],
            (BEFORE_D2H.name, ATTENTION): [_fail("equivalence", RELOADS_LINE)],
        }
    ).install(monkeypatch)
    result = mutation_score.score([BEFORE_D2H, NOOP, FRACTION], CPU, "tiny", "auto", 1)
    assert judges.calls == [
        ("control", seed),
        (BEFORE_D2H.name, seed),
        (NOOP.name, seed),
        (FRACTION.name, seed),
        ("control", ATTENTION),
        (BEFORE_D2H.name, ATTENTION),
    ]
    before, noop, fraction = result.outcomes
    assert (before.caught, before.case, before.cases_run) == (True, ATTENTION, 2)
    assert (noop.caught, noop.case, noop.cases_run) == (True, seed, 1)
    assert (fraction.caught, fraction.check, fraction.cases_run) == (True, "transfers", 1)
    assert [row.case for row in result.control] == [seed, ATTENTION]


@pytest.mark.parametrize("undeclared", [False, True])
def test_a_learnable_fault_is_judged_on_its_catchers_only_when_undeclared(
    monkeypatch: pytest.MonkeyPatch, undeclared: bool
) -> None:
    """``eager_reload`` passes everywhere here: declared, its miss is looked for on the whole
    matrix; undeclared, learning takes its early reloads for its prefetch depth, so only its
    catcher rows are judged and the miss says why."""
    judges = Judges().install(monkeypatch)
    result = mutation_score.score([EAGER], CPU, "tiny", "auto", 1, undeclared=undeclared)
    (outcome,) = result.outcomes
    catchers = list(dict.fromkeys(case.name for _, case in EAGER.catchers))
    expected = catchers if undeclared else [row.name for row in default_matrix()]
    assert judges.rows_of(EAGER.name)[: len(catchers)] == catchers
    assert sorted(judges.rows_of(EAGER.name)) == sorted(expected)
    assert sorted(judges.rows_of("control")) == sorted(expected)
    assert not outcome.caught and outcome.absorbed == undeclared
    assert outcome.note.startswith(
        f"absorbed by learning: {EAGER.learnable}" if undeclared else "no default case caught it"
    )


def test_worker_calls_group_a_row_with_the_control_first() -> None:
    """Each wave's judgements of one row go to calls of at most ``MAX_ROWS_SHARING`` (fewer
    where the workers would idle), the control in the first call of a row new to the score."""
    entries = [e for e in detection.CATALOGUE if e.cpu]
    where = mutation_rows.Where("cpu", "tiny", "auto", False, "reference", 1)
    scoring = mutation_score.Scoring(entries, where, jobs=8)
    wanted = [(scoring.rows[e.name][0], e.name) for e in entries]
    by_row: dict[str, list[str]] = {}
    for row, name in wanted:
        by_row.setdefault(row.name, []).append(name)
    units = len(wanted) + len(by_row)  # each row's control too
    for jobs in (1, 2, 8, 64):
        size = max(1, min(MAX_ROWS_SHARING, -(-units // jobs)))
        tasks = scoring.tasks(wanted, jobs)
        assert max(len(t.names) + t.control for t in tasks) == size, jobs
        for row, names in by_row.items():
            mine = [t for t in tasks if t.row.name == row]
            assert [t.control for t in mine] == [True] + [False] * (len(mine) - 1)
            assert [n for t in mine for n in t.names] == names


@pytest.mark.judges_row(SEED_CASE)
@pytest.mark.usefixtures("shared_runs")
def test_a_broken_control_backend_invalidates_a_real_score(monkeypatch: pytest.MonkeyPatch) -> None:
    """No stand-ins: the control's backend is made a broken offloader, which fails the seed
    row's equivalence for real; the noop entry is caught there, and the score is invalid."""
    monkeypatch.setattr(mutation_score, "control_backend", lambda device, delays: CORRUPT.name)
    result = mutation_score.score([NOOP], CPU, "tiny", "auto", 1, threads=torch.get_num_threads())
    (outcome,) = result.outcomes
    assert outcome.caught and outcome.case == SEED_CASE.name, outcome
    assert result.invalid[0] == "invalid: the control fails 1 rows"
    assert result.invalid[1].startswith(f"  {SEED_CASE.name}: [equivalence] ")
    assert "reloads differ from what was saved" in result.invalid[1]
