"""The mutation score's worker call: one row judged for the control and for the broken
offloaders given, one after another, so they share the row's plain baseline
(``harness.execute.baselines``: each worker keeps the last one it trained).

What counts as a broken offloader's catch on a row is decided here (``find``): a check its
catalogue entry names failing with the entry's pattern for it (with the declarations hidden
too: an undeclared offloader is held to its own first steady step, whose failures read like
the prediction's, ``harness.verify.detection.HELD``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from harness.cases import Case
from harness.execute.environment import Environment
from harness.offload.backends import parse_race_delays, with_delays
from harness.offload.broken import NO_DELAYS
from harness.tools.mutation_control import ControlRow, first_line, judge_control
from harness.verify.detection import BrokenBackend, entry
from harness.verify.judge import CHECKS, judge

RAISED = "the case's runs raised"
"""How ``harness.verify.judge.raised`` starts a problem."""


def use(device: torch.device, threads: int) -> None:
    """This process's share of the cores; on CUDA the case's device becomes the current one
    (streams and allocator queries that name no device)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def named_checks(broken: BrokenBackend) -> tuple[str, ...]:
    """The checks ``broken``'s catalogue entry names, in the judge's order. Only these are
    judged: ``golden`` reads the plain baseline alone, so it can never show an offloader's
    bug, and any other check's failure would be a catch for a reason nobody stated."""
    named = {check for check, _ in broken.catchers}
    return tuple(check for check in CHECKS if check in named)


@dataclass(frozen=True)
class Catch:
    """A named check failing with the entry's pattern for it."""

    check: str
    line: str
    """The problem line that matched (with the line it heads where it is a header)."""


@dataclass(frozen=True)
class Finding:
    """One case's verdict on a broken offloader: the named checks' catches in the judge's
    order (up to a check whose runs raised), the exception its runs raised, and the first
    failure for another reason."""

    catches: tuple[Catch, ...] = ()
    raised: str = ""
    other: str = ""

    def catch(self) -> Catch | None:
        """The first catch."""
        return self.catches[0] if self.catches else None


def find(case: Case, env: Environment, broken: BrokenBackend) -> Finding:
    """Judge ``case`` on ``broken``'s named checks; a catch is a named check failing with the
    entry's pattern for it (``BrokenBackend.matching``)."""
    judgement = judge(case, env, checks=named_checks(broken))
    catches: list[Catch] = []
    other = ""
    for outcome in judgement.outcomes:
        if outcome.status != "fail":
            continue
        line = broken.matching(outcome.name, outcome.problems)
        if line is not None:
            catches.append(Catch(outcome.name, first_line([line])))
            continue
        first = first_line(list(outcome.problems))
        if first.startswith(RAISED):  # every later check reading the same runs is a skip
            return Finding(tuple(catches), raised=first, other=other)
        other = other or f"[{outcome.name}] {first}"
    return Finding(tuple(catches), other=other)


def broken_backend(broken: BrokenBackend, device: torch.device, delays: str) -> str:
    """The backend spelling a broken offloader runs as: with its race delays on CUDA."""
    if device.type != "cuda" or delays == "none":
        return broken.name
    chosen = broken.cuda_delays if delays == "auto" else parse_race_delays(delays)
    return broken.name if chosen == NO_DELAYS else with_delays(broken.name, chosen)


def environment(backend: str, device: str, model_size: str, undeclared: bool) -> Environment:
    """The scoring environment; ``undeclared`` (``--undeclared``) judges the backend as if it
    declared no semantics: its rule is learned from its copies (``harness.execute.learn``)."""
    return Environment(
        device=torch.device(device), backend=backend, model_size=model_size, undeclared=undeclared
    )


@dataclass(frozen=True)
class Judged:
    """One broken offloader judged on one row."""

    name: str
    row: str
    finding: Finding
    seconds: float


@dataclass(frozen=True)
class RowTask:
    """One worker call: a row, whether the control is judged on it (first), and the broken
    offloaders judged after it."""

    row: Case
    control: bool
    names: tuple[str, ...]


@dataclass(frozen=True)
class Where:
    """How every row of a score is run: device, model size, race delays, declarations hidden,
    the control's backend spelling and the worker's intra-op threads."""

    device: str
    model_size: str
    delays: str
    undeclared: bool
    control: str
    threads: int


@dataclass(frozen=True)
class RowResult:
    """What a worker call found: the control's verdict (None when not judged there) and each
    broken offloader's finding."""

    row: str
    control: ControlRow | None
    judged: tuple[Judged, ...]


def run_row(task: RowTask, where: Where) -> RowResult:
    """The worker call: the control on the row if asked, then each broken offloader."""
    use(torch.device(where.device), where.threads)
    control = None
    if task.control:
        env = environment(where.control, where.device, where.model_size, where.undeclared)
        control = judge_control(task.row, env)
    judged = []
    for name in task.names:
        broken = entry(name)
        backend = broken_backend(broken, torch.device(where.device), where.delays)
        env = environment(backend, where.device, where.model_size, where.undeclared)
        began = time.perf_counter()
        found = find(task.row, env, broken)
        judged.append(Judged(name, task.row.name, found, time.perf_counter() - began))
    return RowResult(task.row.name, control, tuple(judged))
