"""The worker pool (``harness.run.parallel``) and the shared plain baseline
(``harness.execute.baselines.plain_baseline``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from harness.cases import default_matrix
from harness.execute.attribution import total
from harness.execute.baselines import plain_baseline, plain_key
from harness.execute.environment import Environment
from harness.execute.steps import run_case
from harness.run.parallel import worker_pool

CPU = torch.device("cpu")


def _seen() -> tuple[str | None, str, bool, bool]:
    import torch.cuda

    return (
        os.environ.get("OFFLOAD_HARNESS_TEST_VAR"),
        os.getcwd(),
        "/offload-harness-test-path" in sys.path,
        torch.cuda.is_initialized(),
    )


def test_a_worker_inherits_what_the_parent_has_when_its_pool_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forkserver may have started with an earlier pool; a worker of a later pool still
    sees the parent's variables, directory and import path of that moment."""
    with worker_pool(1) as pool:  # starts the forkserver (if no earlier test did)
        pool.submit(os.getpid).result()
    monkeypatch.setenv("OFFLOAD_HARNESS_TEST_VAR", "later")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("/offload-harness-test-path")
    with worker_pool(2) as pool:
        seen = pool.submit(_seen).result()
    assert seen == ("later", str(tmp_path), True, False)


def _cores_and_threads() -> tuple[int, int]:
    from harness.run.settings import usable_cores

    return usable_cores(), torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_worker_runs_on_the_parents_cores_with_its_share_of_threads() -> None:
    """The forkserver started unconfined; a pool made while the parent is confined to one core
    (``taskset -c N``, a test's share) forks workers on that core, each with one thread - not
    one per core of the machine, spinning against the others'."""
    with worker_pool(1) as pool:  # starts the forkserver (if no earlier test did)
        pool.submit(os.getpid).result()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        with worker_pool(2) as pool:
            seen = {pool.submit(_cores_and_threads).result() for _ in range(4)}
    finally:
        os.sched_setaffinity(0, before)
    assert seen == {(1, 1)}


def _rows() -> tuple:
    rows = default_matrix()
    by_key: dict[str, list] = {}
    env = Environment(device=CPU)
    for row in rows:
        group = by_key.setdefault(plain_key(row, env), [])
        if all(row.offload != other.offload for other in group):  # one row per selection
            group.append(row)
    return next(group for group in by_key.values() if len(group) > 1)


def test_plain_key_depends_on_the_run_not_on_the_offload_selection() -> None:
    env = Environment(device=CPU)
    first, second = _rows()[:2]
    assert first.offload != second.offload and plain_key(first, env) == plain_key(second, env)
    assert plain_key(first.replace(steps=5), env) != plain_key(first, env)
    assert plain_key(first.replace(precision="fp32"), env) != plain_key(first, env)
    assert plain_key(first.replace(sharding="zero3"), env) != plain_key(first, env)
    assert plain_key(first, Environment(device=CPU, model_size="small")) != plain_key(first, env)
    assert plain_key(first, Environment(device=CPU, backend="hooks")) == plain_key(first, env)


def _two_step_rows() -> tuple:
    """``_rows``' first two rows trained for two steps (the warmup and a steady step), so that
    "the first iteration only" and "every step" still differ: they share their plain key."""
    return tuple(row.replace(steps=2) for row in _rows()[:2])


def test_rows_sharing_a_key_share_one_plain_run_and_judge_alike() -> None:
    """The second row reuses the first's plain run (named in its record) and gets the verdict
    a fresh plain run gives it; a passing row's hooks baseline ran its first iteration only."""
    env = Environment(device=CPU)
    first, second = _two_step_rows()
    a = run_case(first, env)
    b = run_case(second, env)
    for res in (a, b):  # the offload happened in both, before their equality is trusted
        assert res.proof_problems == [] and total(res.counts).bytes > 0
    assert (a.plain_made_by, b.plain_made_by) == (first.name, first.name)
    assert a.plain_key == b.plain_key
    assert torch.equal(a.plain.losses, b.plain.losses)
    assert b.verdict.ok and b.hooks.losses.shape[0] == 1 < b.plain.losses.shape[0]
    assert plain_baseline(second, env).made_by == first.name
    from harness.execute.baselines import forget_plain_baselines

    forget_plain_baselines()
    fresh = run_case(second, env)
    assert fresh.plain_made_by == second.name
    assert torch.equal(fresh.plain.losses, b.plain.losses)
    assert torch.equal(fresh.offload.losses, b.offload.losses)


def test_a_mismatch_gets_every_step_of_the_hooks_baseline() -> None:
    """The classification (graph change or transport) compares the hooks baseline in every
    step, so a row whose offload losses differ trains it in full."""
    row = _two_step_rows()[0]
    res = run_case(row, Environment(device=CPU, backend="broken.corrupt_reload"))
    assert not res.verdict.ok and res.verdict.kind == "transport"
    assert res.hooks.losses.shape == res.plain.losses.shape == (2, row.microbatches)


def _collected_after_freeze() -> tuple[int, bool]:
    """In a worker: how many objects its start froze, and whether a host storage kept only by
    a reference cycle made now is still freed by a collection (what the leak check's held
    storages rely on, ``harness.measure.observe.held``)."""
    import gc
    import weakref

    storage = torch.empty(16).untyped_storage()
    alive = weakref.ref(storage)
    cycle: list[object] = [storage]
    cycle.append(cycle)
    del storage, cycle
    gc.collect()
    return gc.get_freeze_count(), alive() is None


def test_a_worker_freezes_its_imports_and_still_collects_a_cases_cycles() -> None:
    """Every observed step ends with a full collection; a worker's imports (torch, the
    harness) are frozen at its start so that collection skips them, and what a case makes
    afterwards is collected as before."""
    with worker_pool(1) as pool:
        frozen, freed = pool.submit(_collected_after_freeze).result()
    assert frozen > 10_000 and freed


def test_stopping_the_forkserver_kills_it_and_a_later_pool_starts_another() -> None:
    import multiprocessing.forkserver

    from harness.run import forkserver

    with worker_pool(1) as pool:
        first = pool.submit(os.getppid).result()  # a worker's parent: the forkserver
    forkserver.stop()
    assert getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is None
    assert (
        not Path(f"/proc/{first}").exists() or "zombie" in Path(f"/proc/{first}/status").read_text()
    )
    with worker_pool(1) as pool:
        second = pool.submit(os.getppid).result()
    assert second != first
    # the new server stays, for the next pool (stopping it would cost the next one a start)
