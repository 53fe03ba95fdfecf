"""Detection power: the correct offloader passes every catcher case of the catalogue, and every
broken offloader of the catalogue (``harness.offload.broken``, its catchers in
``harness.verify.detection``) fails one of its own catcher cases with a message naming the step, the
microbatch and the group.

In process, through the judge. The catalogue's cases run in this process through
``harness.verify.judge.judge``: the one judge that decides every check for pytest's case files
(``cases/``, through the plugin's ``case_check``), for ``offload-harness run`` and for mutation
scoring, so a case the judge fails here is a case test that fails under pytest and a case that
``run`` reports failed (``tests/e2e/test_judge.py::test_pytest_and_run_decide_every_check_alike``
checks that pytest's case files and ``offload-harness run`` give every check the same status).
A broken offloader runs its entry's catcher cases in the catalogue's order and stops at the
first one with a failing check, as ``-x`` over its catcher tests would. The failing check must
be one the entry names for that case: when an earlier check of the judge fails first (a real
failure too), the case is judged again on the named checks alone, which must fail as well. The
failure's problems must name a step, a microbatch and a group. The control judges every catcher
case of every entry with the reference, one test per case: no check may fail, and each check an
entry names for the case must pass there. On CUDA a broken offloader runs with its entry's race
delays, as ``scripts/mutation_score`` runs it; classes CPU cannot show (pinned memory, host
syncs) run on CUDA only, and on CPU the memory and sync catchers are dropped (both are ``n-a``
there).

End to end, once. ``test_pytest_fails_a_broken_offloader`` (``slow``) runs one inner pytest
session in a subprocess (``pytester``; an in-process session would re-import torch modules that
register operator libraries) with ``broken.corrupt_reload`` on its first catcher test and
``-x``: it proves that the pytest path itself - the plugin's options, the case parametrization
and ``case_check`` - turns a broken offloader into a failing case test whose failure names the
step, the microbatch and the group. The inner session runs on this session's device with this
process's share of the cores: one with all the cores' threads spins against the other xdist
workers and runs many times slower.

Shared and left behind. The in-process tests share this process's runs
(``tests/helpers/shared_runs.py``, the ``shared_runs`` fixture): nothing here patches how a run
trains, the plain run has no offloader (so it is the same for every backend, as ``offload-harness
run`` and ``scripts/mutation_score`` share it between backends), and a case judged the same way
twice - the control on a catcher row and that row's case tests under ``cases/``, a broken
offloader here and in ``test_third_party.py`` or ``test_mutation_score.py`` - is trained once.
Each test judges the rows of one xdist group: the control's and an entry's (its first catcher's)
are the groups of those rows' case tests (``judges_row``), whose runs they then read. A broken
offloader keeps no module-level state (``harness.offload.broken`` has none; the judge closes
every offloader it builds); each in-process test checks that its runs left no saved-tensor
hooks, dispatch or function modes, grad mode, deterministic-algorithm flags or default dtype
behind. Entries the default matrix cannot show (see each entry's ``needs``) are skipped with
that reason.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import warm
from child_pytest import CHILD_OPTIONS

from harness.cases import Case
from harness.execute.environment import Environment
from harness.offload.backends import with_delays
from harness.offload.broken import NO_DELAYS
from harness.offload.reference import RaceDelays
from harness.plugin.options import SETTINGS, Settings
from harness.run.parallel import threads_per_worker
from harness.verify.detection import CATALOGUE, BrokenBackend, entry
from harness.verify.judge import CASE_TESTS, CHECKS, judge
from harness.vocab.spec import ALL_GROUP_NAMES

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]

NAMES_A_GROUP = re.compile(r"\b(" + "|".join(ALL_GROUP_NAMES) + r")\b")

NAMED = (
    ("step", re.compile(r"\bstep \d+")),
    ("microbatch", re.compile(r"\bmicrobatch \d+")),
    ("group", NAMES_A_GROUP),
)
"""What every failure must name, and how to spot it."""

CUDA_ONLY_CHECKS = ("memory", "sync")
"""Checks that are ``n-a`` off CUDA: catchers naming them are dropped on CPU."""

END_TO_END = entry("broken.corrupt_reload")
"""The broken offloader the one subprocess test runs (CPU and CUDA; a cheap seed-case catch)."""


# ------------------------------------------------------------------------------ catalogue


def _catchers(broken: BrokenBackend, device: torch.device) -> list[tuple[str, Case]]:
    """The (check, case) pairs that must catch ``broken`` on ``device``, in catalogue order."""
    return [
        (check, case)
        for check, case in broken.catchers
        if device.type == "cuda" or check not in CUDA_ONLY_CHECKS
    ]


def _catcher_cases(
    broken: BrokenBackend, device: torch.device
) -> list[tuple[Case, tuple[str, ...]]]:
    """Each catcher case once, in catalogue order, with the checks named for it (in the
    judge's order)."""
    named: dict[str, tuple[Case, set[str]]] = {}
    for check, case in _catchers(broken, device):
        named.setdefault(case.name, (case, set()))[1].add(check)
    return [(case, tuple(c for c in CHECKS if c in checks)) for case, checks in named.values()]


def _backend(broken: BrokenBackend, device: torch.device) -> str:
    """The backend spelling ``broken`` runs as: on CUDA with its entry's race delays
    (``harness.tools.mutation_score``'s default)."""
    if device.type != "cuda" or broken.cuda_delays == NO_DELAYS:
        return broken.name
    return with_delays(broken.name, broken.cuda_delays)


def _environment(settings: Settings, backend: str = "reference") -> Environment:
    return Environment(device=settings.device, backend=backend, model_size=settings.model_size)


judges_row = pytest.mark.judges_row
"""Runs in the xdist group of that row's case tests, reading their runs (``conftest.py``)."""


def _param(broken: BrokenBackend, device: torch.device) -> object:
    cases = _catcher_cases(broken, device)
    marks = [judges_row(cases[0][0])] if cases else []
    if not broken.cpu:
        marks.append(pytest.mark.gpu)
    if not broken.catchers:
        marks.append(pytest.mark.skip(reason=f"the default matrix cannot show it: {broken.needs}"))
    elif not _catchers(broken, device):
        reason = f"every catcher of it is a {'/'.join(CUDA_ONLY_CHECKS)} check: needs CUDA"
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(broken, id=broken.name, marks=marks)


def _every_catcher(device: torch.device) -> list[tuple[Case, set[str]]]:
    """Every catcher case of the catalogue once, in catalogue order, with the checks any entry
    names for it."""
    named: dict[str, tuple[Case, set[str]]] = {}
    for broken in CATALOGUE:
        for check, case in _catchers(broken, device):
            named.setdefault(case.name, (case, set()))[1].add(check)
    return list(named.values())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``entry``: every catalogue entry; ``catcher``: every catcher case with its named checks;
    each in the xdist group of the case tests of the (first) row it judges."""
    device = metafunc.config.stash[SETTINGS].device
    if "entry" in metafunc.fixturenames:
        metafunc.parametrize("entry", [_param(broken, device) for broken in CATALOGUE])
    if "catcher" in metafunc.fixturenames:
        # not the row's bare name: the session report reads ``::test[<row>]`` as a case test
        params = [
            pytest.param((case, checks), id=f"catcher-{case.name}", marks=[judges_row(case)])
            for case, checks in _every_catcher(device)
        ]
        metafunc.parametrize("catcher", params)


def test_reload_before_d2h_is_caught_alike_on_both_devices() -> None:
    """``broken.reload_before_d2h`` is caught where an inline reload finds its D2H still
    queued: on rows without a cap of 0 in-flight offloads (that cap lands each D2H at its
    commit; ``tests/detection/test_broken.py``), with the same catchers on both devices and no
    race delays on CUDA (its D2H is deferred there too), so no card's speed decides the catch."""
    broken = entry("broken.reload_before_d2h")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert broken.catchers and _catchers(broken, cuda) == _catchers(broken, cpu)
    for check, case in broken.catchers:
        assert check == "equivalence" and case.max_inflight != 0, case.name
    assert broken.cuda_delays == NO_DELAYS and _backend(broken, cuda) == broken.name


# ------------------------------------------------------------------------------ fixtures


def _global_state() -> dict[str, object]:
    """Process-global torch state a run could leave behind."""
    return {
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic warn only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "default dtype": torch.get_default_dtype(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
    }


@pytest.fixture
def in_process(request: pytest.FixtureRequest, settings: Settings) -> Iterator[None]:
    """This process's intra-op threads for the judge's runs (an xdist worker keeps the share
    the plugin gave it; a session of its own uses every core unless ``OMP_NUM_THREADS`` says
    otherwise), restored afterwards; then a check that the runs left no global state behind,
    and a CUDA device's memory released (as the plugin's ``case_check`` does)."""
    threads = torch.get_num_threads()
    if not hasattr(request.config, "workerinput") and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(threads_per_worker(1))
    before = _global_state()
    yield
    after = _global_state()
    torch.set_num_threads(threads)
    if settings.device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(settings.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(settings.device)
    changed = {name: (before[name], after[name]) for name in before if before[name] != after[name]}
    assert not changed, f"the runs left global state behind (before, after): {changed}"


@pytest.fixture
def threads_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions start with this process's intra-op thread count (``OMP_NUM_THREADS``)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))


# ------------------------------------------------------------------------------ in process


def _names_where(text: str) -> list[str]:
    """What ``text`` fails to name of the step, the microbatch and the group."""
    return [what for what, pattern in NAMED if not pattern.search(text)]


@pytest.mark.usefixtures("in_process", "shared_runs")
def test_correct_offloader_passes_every_catcher(
    catcher: tuple[Case, set[str]], settings: Settings
) -> None:
    case, checks = catcher
    judgement = judge(case, _environment(settings))
    outcomes = {outcome.name: outcome for outcome in judgement.outcomes}
    problems = [f"{case.name}: {problem}" for problem in judgement.problems]
    problems += [
        f"{case.name}: {name} is {outcomes[name].status} ({outcomes[name].reason}); a "
        "broken offloader's catcher must pass with the reference"
        for name in sorted(checks)
        if outcomes[name].status not in ("pass", "fail")
    ]
    assert not problems, "\n".join(problems)


def _named_failures(
    broken: BrokenBackend, case: Case, checks: tuple[str, ...], env: Environment
) -> tuple[dict[str, str], list[str]]:
    """Judge ``case`` on ``checks`` alone: the matching problem line of each named check that
    failed for the entry's stated reason, and what every other named check did instead."""
    judgement = judge(case, env, checks=checks)
    caught: dict[str, str] = {}
    missed: list[str] = []
    for outcome in judgement.outcomes:
        line = broken.matching(outcome.name, outcome.problems)
        if line is not None:
            caught[outcome.name] = _without_diagnosis(outcome.problems)
            continue
        first = outcome.problems[0] if outcome.problems else outcome.reason
        missed.append(
            f"{case.name}: {outcome.name} is {outcome.status}, not a failure matching "
            f"{broken.reason(outcome.name).pattern!r}: {first}"
        )
    return caught, missed


def _without_diagnosis(problems: tuple[str, ...]) -> str:
    """A failure's problems up to the diagnosis every equivalence failure appends (the
    suspect-groups line, the loss table, the reproduce hint): what is left must name the step,
    the microbatch and the group itself."""
    kept = []
    for problem in problems:
        if problem.startswith("suspect groups"):
            break
        kept.append(problem)
    return "\n".join(kept)


@pytest.mark.usefixtures("in_process", "shared_runs")
def test_broken_offloader_is_caught(entry: BrokenBackend, settings: Settings) -> None:
    """Every named catcher fires, for its stated reason, with only the named checks judged."""
    env = _environment(settings, _backend(entry, settings.device))
    missed: list[str] = []
    for case, checks in _catcher_cases(entry, settings.device):
        caught, not_caught = _named_failures(entry, case, checks, env)
        missed += not_caught
        for check, text in caught.items():
            missing = _names_where(text)
            assert not missing, (
                f"{entry.name}: the {check} failure on {case.name} names no "
                f"{', '.join(missing)} (its diagnosis lines left out):\n{text}"
            )
    assert not missed, f"{entry.name}: named catchers that did not fire:\n" + "\n".join(missed)


# ------------------------------------------------------------------------------ end to end


def _inner(pytester: pytest.Pytester, settings: Settings, *args: str) -> pytest.RunResult:
    """An inner pytest session over this repository's cases, on this session's device and
    model size."""
    return warm.runpytest(
        pytester,
        *("--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), "-o", "addopts="),
        *CHILD_OPTIONS,
        *("--tb=short", "--report-dir", ""),
        *("--device", settings.device.type, "--model-size", settings.model_size),
        *args,
        timeout=300,
    )


def _delays(delays: RaceDelays) -> tuple[str, ...]:
    if delays == NO_DELAYS:
        return ()
    return ("--race-delays", f"d2h={delays.d2h},h2d={delays.h2d},compute={delays.compute}")


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.usefixtures("threads_share")
def test_pytest_fails_a_broken_offloader(pytester: pytest.Pytester, settings: Settings) -> None:
    check, case = END_TO_END.catchers[0]
    node = f"{CASE_TESTS[check]}[{case.name}]"
    delays = _delays(END_TO_END.cuda_delays) if settings.device.type == "cuda" else ()
    result = _inner(
        pytester, settings, "-x", "--backend", END_TO_END.name, *delays, f"{REPO}/{node}"
    )
    text = "\n".join(result.outlines)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, f"{END_TO_END.name} was not caught:\n{text}"
    failed = [line for line in result.outlines if line.startswith("FAILED ")]
    assert result.parseoutcomes().get("failed") == 1 and len(failed) == 1, text
    assert failed[0].split()[1].endswith(node), f"not the failure of {node}:\n{text}"
    failure = text[text.index("FAILURES") :]
    missing = _names_where(failure)
    assert not missing, f"{END_TO_END.name}: the failure names no {', '.join(missing)}:\n{failure}"
