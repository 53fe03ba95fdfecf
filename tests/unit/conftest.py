"""The rule of ``tests/unit`` (issue 57): a unit test trains nothing and starts no process.

Every test here runs watched (``tests/helpers/unit_rule.py``; the autouse fixture
``_trains_nothing_and_starts_no_process``): an optimizer step or a process started
(``subprocess.Popen``, a ``multiprocessing`` process's ``start``, ``os.fork`` and the like)
fails the test with one line naming what it did and saying to move it to ``tests/e2e``. What
happened in the test's call or its function-scoped fixtures' setup (this fixture is set up
before them and torn down after them) fails the test itself; what happened in their teardown,
or in a test that failed anyway, is an error of its teardown. A module- or session-scoped
fixture is set up before this one and is not watched: keep any that trains or starts a process
out of ``tests/unit`` too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from unit_rule import Watch, watching

_WATCH = pytest.StashKey[Watch]()


@pytest.fixture(autouse=True)
def _trains_nothing_and_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    with watching() as watch:
        request.node.stash[_WATCH] = watch
        yield
    if not watch.reported and (message := watch.message(request.node.name)):
        watch.reported = True
        pytest.fail(message, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test that passed but trained or started a process fails, with the fixture's line."""
    result = yield
    watch = item.stash.get(_WATCH, None)
    if watch is not None and not watch.reported and (message := watch.message(item.name)):
        watch.reported = True
        pytest.fail(message, pytrace=False)
    return result
