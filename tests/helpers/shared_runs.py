"""Case runs and plain baselines shared between the harness's own tests that judge a case the
same way, so that identical trainings run once per process instead of once per test.

A test that judges cases in this process - ``harness.verify.judge.judge``, its ``run_case``, or a
tool calling them here (``mutation_score`` with one job) - and changes nothing of how a run
trains takes the ``shared_runs`` fixture (``tests/detection/conftest.py``). While it runs:

* ``judge`` reads the ``CaseRuns`` (``harness.verify.judge``) of an earlier test that judged the
  same case with the same environment (device, backend spelling, model size, declarations
  hidden or not), golden settings and intra-op threads, instead of training them again; the
  checks themselves run as before, on the same kind of runs. So does ``SharedRuns.case_run``,
  for a test that reads a ``run_case`` result. Runs that raised are never handed on: the next
  test trains its own (a run's exception is reported once per judgement, ``judge.reported_by``).
* Where this session's case tests (``cases/``, through the plugin's ``case_check``) made that
  row's runs with the same settings, those are read: a test that judges a default row joins
  that row's xdist group (``row_group``) so it runs on the same worker, after them.
* ``run_case``'s plain baseline is kept for every key (``KeptPlains``), not only the latest.

A test that patches training (a model, the runner, the offload protocol) does not take the
fixture: ``tests/conftest.py`` still forgets the process's own plain baseline around every test,
and such a test trains its own runs. Nothing here changes a run: the keys hold everything
``run_case`` reads besides the code itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from harness.cases import Case
from harness.execute import baselines
from harness.execute.baselines import Baselines, SharedPlain, sharing_key
from harness.execute.caserun import CaseRun
from harness.execute.environment import Environment
from harness.plugin.cases import row_groups
from harness.plugin.options import SETTINGS
from harness.verify import golden
from harness.verify import judge as judge_module

MADE_BY_CASE_RUNS = judge_module.CaseRuns
"""The judge's own ``CaseRuns``, which makes the runs (patched over while a test shares)."""


class KeptPlains(Baselines):
    """``harness.execute.baselines.Baselines`` keeping the plain baseline of every key trained
    on the CPU, each under the intra-op thread count it was trained with (``plain_baseline``
    keeps the latest only: rows sharing a key run one after another there). A baseline whose
    gradients live on a GPU is kept as the latest only, as there (each holds every step's)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int], SharedPlain] = {}
        self._latest: SharedPlain | None = None
        super().__init__()

    @property  # type: ignore[override]
    def plain(self) -> SharedPlain | None:
        return self._latest

    @plain.setter
    def plain(self, shared: SharedPlain | None) -> None:
        self._latest = shared
        if shared is not None and not _on_a_gpu(shared):
            self._kept[(shared.key, torch.get_num_threads())] = shared

    def plain_for(self, key: str) -> SharedPlain | None:
        latest = self._latest
        if latest is not None and latest.key == key and _on_a_gpu(latest):
            return latest
        return self._kept.get((key, torch.get_num_threads()))

    def forget(self) -> None:
        super().forget()
        self._kept.clear()


def _on_a_gpu(shared: SharedPlain) -> bool:
    return any(t.device.type != "cpu" for step in shared.result.grads for t in step.values())


def _raised(runs: Any) -> bool:
    """Whether one of ``runs``' made runs raised (``CaseRuns`` keeps the exception)."""
    return any(isinstance(made, judge_module._Raised) for made in runs._made.values())


class SharedRuns:
    """This process's shared ``CaseRuns`` (see the module docstring)."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, Environment, bool, str, int], Any] = {}
        self.plains = KeptPlains()
        self.session: dict[str, Any] = {}
        """The case tests' runs by row name (the plugin's ``_case_runs``)."""

    def runs(
        self,
        case: Case,
        env: Environment,
        *,
        update_golden: bool = False,
        golden_variant: str | None = None,
    ) -> Any:
        """The ``CaseRuns`` ``judge`` would make for these arguments: a shared one where the
        same were made before (by a test or by the case tests) and did not raise."""
        variant = golden_variant or golden.variant(env.model_size)
        same = (_bare(case), env, update_golden, variant)
        for runs in (self.session.get(case.name), self._runs.get(self._key(case, env, same))):
            if runs is not None and not _raised(runs) and _made_for(runs) == same:
                return runs
        runs = MADE_BY_CASE_RUNS(case, env, update_golden=update_golden, golden_variant=variant)
        self._runs[self._key(case, env, same)] = runs
        return runs

    @staticmethod
    def _key(case: Case, env: Environment, same: tuple[Any, ...]) -> tuple[Any, ...]:
        return (case.name, env, same[2], same[3], torch.get_num_threads())

    def case_run(self, case: Case, env: Environment) -> CaseRun:
        """``run_case(case, env)``'s result, shared as the judge's runs are."""
        return self.runs(case, env).case_run()

    @contextlib.contextmanager
    def installed(self, session: dict[str, Any]) -> Iterator[SharedRuns]:
        """``judge`` and ``run_case`` share while inside (see the module docstring)."""
        self.session = session
        kept, made_by = baselines.BASELINES, judge_module.CaseRuns
        baselines.BASELINES = self.plains
        judge_module.CaseRuns = self.runs  # type: ignore[assignment]
        try:
            yield self
        finally:
            baselines.BASELINES, judge_module.CaseRuns = kept, made_by
            self.session = {}


def _made_for(runs: Any) -> tuple[Any, ...]:
    return (_bare(runs.case), runs.env, runs.update_golden, runs.golden_variant)


def _bare(case: Case) -> Case:
    """``case`` without what no run reads: its description and its pytest marks (a row of the
    case table has both, the catalogue's spelling of the same row neither)."""
    return dataclasses.replace(case, description="", marks=())


SHARED = SharedRuns()
"""The process's shared runs."""


def row_group(config: pytest.Config, case: Case) -> str:
    """The xdist group of ``case``'s case tests in this session (``harness.plugin.cases``), so
    a test judging that row runs after them on the same worker; a case that is no row of the
    session's matrix gets a group of its own plain key (``detection-plain-<key>``)."""
    settings = config.stash[SETTINGS]
    for row, group in row_groups(settings):
        if _bare(row) == _bare(case):
            return group
    env = Environment(device=settings.device, model_size=settings.model_size)
    return f"detection-plain-{sharing_key(case, env)}"
