"""The detection tests' shared runs (``tests/helpers/shared_runs.py``) hand a test the runs of an
earlier judgement only where everything that decides them is the same, never runs that raised,
and are gone outside the tests that ask for them. Nothing here trains: ``CaseRuns`` makes its
runs on first use. And the session's process has frozen what it imported (the plugin calls
``harness.run.parallel.freeze_imported``), which every observed step's collection would
otherwise walk, while what a test makes is still collected."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch
from shared_runs import MADE_BY_CASE_RUNS, SHARED, KeptPlains, SharedRuns

from harness.cases import default_matrix
from harness.execute import baselines
from harness.execute.baselines import SharedPlain
from harness.execute.environment import Environment
from harness.models.runs import TrainResult
from harness.verify import detection
from harness.verify import judge as judge_module

CPU = torch.device("cpu")
SEED = detection.SEED


def test_the_same_judgement_reads_the_same_runs_and_any_other_its_own() -> None:
    shared = SharedRuns()
    env = Environment(device=CPU)
    with shared.installed({}):
        first = judge_module.CaseRuns(SEED, env)
        assert judge_module.CaseRuns(SEED, env) is first
        described = dataclasses.replace(SEED, description="the seed")
        assert judge_module.CaseRuns(described, env) is first, "a description changes no run"
        others = [
            judge_module.CaseRuns(SEED, Environment(device=CPU, backend="broken.noop")),
            judge_module.CaseRuns(SEED, Environment(device=CPU, undeclared=True)),
            judge_module.CaseRuns(SEED, env, update_golden=True),
            judge_module.CaseRuns(SEED, env, golden_variant="small"),
            judge_module.CaseRuns(dataclasses.replace(SEED, steps=5), env),
        ]
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1)
        try:
            others.append(judge_module.CaseRuns(SEED, env))
        finally:
            torch.set_num_threads(threads)
    assert all(isinstance(runs, MADE_BY_CASE_RUNS) for runs in [first, *others])
    assert len({id(runs) for runs in [first, *others]}) == 1 + len(others)


def test_runs_that_raised_are_never_handed_on() -> None:
    shared = SharedRuns()
    env = Environment(device=CPU)
    with shared.installed({}):
        first = judge_module.CaseRuns(SEED, env)
        first._made["case"] = judge_module._Raised(RuntimeError("boom"))
        again = judge_module.CaseRuns(SEED, env)
    assert again is not first and not again._made


def test_the_case_tests_runs_of_a_row_are_read_where_made_alike() -> None:
    """The plugin's runs of the matrix row (described, with marks) serve the catalogue's
    spelling of it with the same environment and golden settings, and nothing else."""
    row = next(case for case in default_matrix() if case.name == SEED.name)
    env = Environment(device=CPU)
    theirs = MADE_BY_CASE_RUNS(row, env, update_golden=False, golden_variant="tiny")
    shared = SharedRuns()
    with shared.installed({row.name: theirs}):
        assert judge_module.CaseRuns(SEED, env) is theirs
        assert judge_module.CaseRuns(SEED, env, update_golden=True) is not theirs
        other = Environment(device=CPU, backend="broken.noop")
        assert judge_module.CaseRuns(SEED, other) is not theirs
    with shared.installed({}):
        assert judge_module.CaseRuns(SEED, env) is not theirs


def _plain(key: str) -> SharedPlain:
    grads = [{"w": torch.zeros(2)}]
    return SharedPlain(
        key, "a row", TrainResult(losses=torch.zeros(1, 1), logs=[], grads=grads), None
    )


def test_plain_baselines_are_kept_per_key_and_thread_count() -> None:
    kept = KeptPlains()
    a, b = _plain("a"), _plain("b")
    kept.plain = a
    kept.plain = None  # plain_baseline clears the latest before training another key
    kept.plain = b
    assert kept.plain_for("a") is a and kept.plain_for("b") is b and kept.plain_for("c") is None
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert kept.plain_for("a") is None, "trained with another thread count"
    finally:
        torch.set_num_threads(threads)
    kept.forget()
    assert kept.plain_for("a") is None and kept.plain is None


def test_outside_a_sharing_test_the_judge_and_the_baselines_are_their_own() -> None:
    assert judge_module.CaseRuns is MADE_BY_CASE_RUNS
    assert baselines.BASELINES is not SHARED.plains
    assert isinstance(baselines.BASELINES, baselines.Baselines)


def test_this_process_froze_its_imports_and_still_collects_a_tests_cycles() -> None:
    assert gc.get_freeze_count() > 10_000, "the plugin froze nothing before the first test"
    storage = torch.empty(16).untyped_storage()
    alive = weakref.ref(storage)
    cycle: list[object] = [storage]
    cycle.append(cycle)
    del storage, cycle
    gc.collect()
    assert alive() is None, "a host storage kept only by a reference cycle is freed"
