"""The guard of ``tests/unit``'s rule (``tests/unit/conftest.py``, ``tests/helpers/unit_rule.py``):
every unit test runs watched; a watch records an optimizer step and every way of starting a
process, in one line that says to move the test to ``tests/e2e``, and nothing on clean code.

The process starts are made against stand-ins put under the watch, so no process starts here;
the optimizer step is one real step of one parameter, recorded by a watch opened inside the
test's own (watches nest: only the innermost records). That a guarded test really fails (and
a breach in a fixture's teardown errors) is shown on a pytest session of its own in
``tests/e2e/test_unit_rule_processes.py``."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import unit_rule
from torch.optim.optimizer import _global_optimizer_post_hooks
from unit_rule import PROCESS_STARTS, RULE, watching


def test_every_unit_test_runs_watched() -> None:
    (watch,) = unit_rule._WATCHES
    assert watch.steps == 0 and watch.processes == []
    for owner, name, _ in PROCESS_STARTS:
        assert hasattr(getattr(owner, name), "__wrapped__"), name
    hooks = _global_optimizer_post_hooks.values()
    assert any(getattr(hook, "__self__", None) is watch for hook in hooks)
    labels = {label for _, _, label in PROCESS_STARTS}
    assert {"subprocess.Popen", "multiprocessing process start", "os.fork"} <= labels


def test_an_optimizer_step_is_named_in_one_line() -> None:
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.grad = torch.ones(2)
    hooks = len(_global_optimizer_post_hooks)
    with watching() as inner:
        assert len(_global_optimizer_post_hooks) == hooks + 1
        torch.optim.SGD([parameter], lr=0.5).step()
    assert len(_global_optimizer_post_hooks) == hooks, "the watch's hook was not removed"
    assert torch.equal(parameter.detach(), torch.full((2,), 0.5)), "the step was made"
    assert inner.steps == 1 and inner.processes == []
    assert inner.message("test_x") == f"test_x stepped an optimizer 1 time(s); {RULE}"
    assert RULE.endswith("move it to tests/e2e")
    (outer,) = unit_rule._WATCHES
    assert outer.steps == 0, "the test's own watch recorded the inner one's step"


@pytest.fixture
def stand_ins() -> Iterator[list[str]]:
    """Every process start replaced by a stand-in that records its name and starts nothing;
    the test's own watch's wrappers put back afterwards (before that watch closes)."""
    called: list[str] = []
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PROCESS_STARTS]

    def stand_in(name: str) -> Any:
        def start(*args: Any, **kwargs: Any) -> int | None:
            called.append(name)
            if name == "__init__":
                args[0]._child_created = False  # what Popen.__del__ reads
                return None
            return 0

        return start

    try:
        for owner, name, _ in PROCESS_STARTS:
            setattr(owner, name, stand_in(name))
        yield called
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def test_every_way_of_starting_a_process_is_named_in_one_line(stand_ins: list[str]) -> None:
    command = ["git", "rev-parse", "--git-dir", "x" * 100]
    with watching() as inner:
        subprocess.Popen(command)
        multiprocessing.Process(target=print).start()
        os.fork()
        for name in ("forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                getattr(os, name)("true")
    assert stand_ins[:3] == ["__init__", "start", "fork"], "nothing really started"
    assert inner.steps == 0 and len(inner.processes) == len(PROCESS_STARTS)
    assert inner.processes[1:3] == ["multiprocessing process start", "os.fork"]
    message = inner.message("test_y[a]")
    assert message is not None and "\n" not in message
    first = "subprocess.Popen git rev-parse --git-dir " + "x" * (77 - 24) + "..."  # 80 at most
    assert message == (
        f"test_y[a] started a process ({len(PROCESS_STARTS)} call(s), the first {first}); {RULE}"
    )
    (outer,) = unit_rule._WATCHES
    assert outer.processes == [], "the test's own watch recorded the inner one's starts"


def test_both_at_once_are_one_line() -> None:
    watch = unit_rule.Watch()
    watch.steps, watch.processes = 3, ["os.fork"]
    assert watch.message("t") == (
        f"t stepped an optimizer 3 time(s) and started a process (1 call(s), the first os.fork); "
        f"{RULE}"
    )


def test_clean_code_is_not_named() -> None:
    layer = torch.nn.Linear(4, 4)
    with watching() as inner:
        layer(torch.ones(2, 4)).sum().backward()  # a forward and a backward are not training
        with torch.no_grad():
            layer.weight -= 0.1 * layer.weight.grad  # nor is an update by hand
    assert inner.steps == 0 and inner.processes == [] and inner.message("t") is None
