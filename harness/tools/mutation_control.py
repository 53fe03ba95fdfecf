"""The mutation score's control: the reference offloader judged on the very rows and device the
broken offloaders are scored on (``harness.tools.mutation_score``).

A catch means something only where the correct offloader passes: on a card where a check fails
the reference too (a memory reading that does not fit the card, a drifted prediction), every
broken offloader fails it as well, and "caught 20/20" says nothing about them. So the score
judges the reference on every row it scores a broken offloader on, with every check, and is
invalid when the reference fails any check but ``golden`` there.

What the control may do on a row, and why each is fine or not:

* ``pass``, ``inert`` (nothing eligible to move, by design), ``skip`` (the model's library
  refuses the configuration), a check ``n-a`` or ``skip`` on a row that passes: fine - the
  reference did nothing wrong, a check that cannot decide here cannot catch a broken offloader
  here either;
* ``golden`` failing: fine, and noted - it compares the plain baseline with this machine's
  golden trace, reads no offloader and is never judged for a broken one; a trace ``missing``
  is a skip already;
* any other check failing, its runs raising included: the score is invalid (``invalid: the
  control fails N rows``, each row with its failing checks).

With ``--undeclared`` the reference runs with its declaration hidden too.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from harness.cases import Case
from harness.execute.environment import Environment
from harness.offload.backends import parse_race_delays, with_delays
from harness.verify.judge import judge

NEVER_INVALIDATES = ("golden",)
"""Checks whose failure of the control leaves the score valid: ``golden`` reads the plain
baseline alone (no offloader) and is never judged for a broken offloader."""


@dataclass(frozen=True)
class ControlRow:
    """The control's verdict on one row."""

    case: str
    verdict: str
    """The judge's verdict (``harness.verify.judge.Judgement.verdict``) by the checks that can
    invalidate the score: ``fail`` exactly when ``failures`` is not empty."""
    failures: tuple[tuple[str, str], ...] = ()
    """(check, its first problem line) of every failing check that invalidates the score."""
    noted: tuple[tuple[str, str], ...] = ()
    """(check, first problem line) of failing checks that do not (``NEVER_INVALIDATES``)."""
    seconds: float = 0.0
    """Wall seconds of the row's judgement (with the row's plain baseline when it trained it:
    the broken offloaders judged after it on the same worker reuse that)."""

    @property
    def clean(self) -> bool:
        return not self.failures


def control_backend(device: torch.device, delays: str) -> str:
    """The control's backend: the reference, with the race delays when ``--race-delays`` sets
    them for every offloader on CUDA (``auto`` gives each broken one its own; the reference
    has none of its own, so it runs without)."""
    if device.type != "cuda" or delays in ("auto", "none"):
        return "reference"
    return with_delays("reference", parse_race_delays(delays))


def first_line(problems: tuple[str, ...] | list[str]) -> str:
    """The first problem line, with the line it heads when it is a header (``...:``),
    shortened to 240 characters."""
    lines = [line.strip() for p in problems for line in p.splitlines() if line.strip()]
    if not lines:
        return ""
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:
        head = f"{head} {lines[1]}"
    return head if len(head) <= 240 else head[:237] + "..."


def judge_control(case: Case, env: Environment) -> ControlRow:
    """Judge the control on ``case`` with every check."""
    began = time.perf_counter()
    judgement = judge(case, env)
    failures, noted = [], []
    # its verdict by the checks that count (a golden drift alone leaves a passing row)
    counted = [o for o in judgement.outcomes if o.name not in NEVER_INVALIDATES]
    verdict = dataclasses.replace(judgement, outcomes=tuple(counted)).verdict
    for outcome in judgement.outcomes:
        if outcome.status != "fail":
            continue
        found = (outcome.name, first_line(outcome.problems))
        (noted if outcome.name in NEVER_INVALIDATES else failures).append(found)
    return ControlRow(
        case=case.name,
        verdict=verdict,
        failures=tuple(failures),
        noted=tuple(noted),
        seconds=time.perf_counter() - began,
    )


class InvalidScore(Exception):
    """The control failed on a row the score was taken on (raised by ``score_one`` of
    ``harness.tools.mutation_score``): no verdict on a broken offloader means anything there."""


def invalid_lines(rows: list[ControlRow]) -> list[str]:
    """``invalid: the control fails N rows`` and one line per failing row, naming its failing
    checks and each one's first problem; empty when every row is clean."""
    failing = [row for row in rows if not row.clean]
    if not failing:
        return []
    lines = [f"invalid: the control fails {len(failing)} rows"]
    for row in failing:
        checks = "; ".join(f"[{check}] {problem}" for check, problem in row.failures)
        lines.append(f"  {row.case}: {checks}")
    return lines


def summary_line(
    rows: list[ControlRow], backend: str, device: torch.device, undeclared: bool
) -> str:
    """The control's one line: its backend, rows, verdicts and worker time."""
    verdicts: dict[str, int] = {}
    for row in rows:
        verdicts[row.verdict] = verdicts.get(row.verdict, 0) + 1
    counted = ", ".join(f"{n} {verdict}" for verdict, n in sorted(verdicts.items()))
    hidden = ", declaration hidden" if undeclared else ""
    seconds = sum(row.seconds for row in rows)
    where = f"the {len(rows)} rows" if len(rows) != 1 else "the 1 row"
    return (
        f"control: {backend}{hidden} on {where} scored on {device.type}: "
        f"{counted or 'none run'} ({seconds:.0f}s of worker time)"
    )


def noted_lines(rows: list[ControlRow]) -> list[str]:
    """One line per row where a check that leaves the score valid failed (golden drift)."""
    return [
        f"  note: {row.case} [{check}] {problem} (no broken offloader is judged by it)"
        for row in rows
        for check, problem in row.noted
    ]
