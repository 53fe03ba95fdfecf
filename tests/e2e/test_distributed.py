"""``harness.util.distributed`` and the process-group plugin (``harness.plugin.dist``).

* the helpers without a group (world size 1) and across two spawned gloo ranks that rendezvous on
  a ``FileStore`` in a temporary folder (no port);
* the pure pieces of the plugin: collection-order comparison, collection-time skip reasons;
* acceptance in subprocesses: a test that sleeps past ``--case-timeout`` fails the run with every
  thread's stack instead of hanging; ``-n`` under ``WORLD_SIZE`` > 1 is refused in one line; and
  a real ``torchrun --standalone --nproc-per-node=2`` session where one rank fails an assertion:
  both ranks raise the same message naming that rank, the next test still runs on both, and
  every rank's log lands in the report folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import warm
from child_pytest import pytest_command, torchrun_pytest_command

from harness.cases import SEED_CASE, Case
from harness.plugin.cases import skip_reason
from harness.plugin.dist import collection_difference
from harness.util import distributed

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


# ------------------------------------------------------------------------- without a group
def test_helpers_without_a_group_are_world_size_one() -> None:
    distributed.shutdown()  # a one-rank group an earlier test of this worker started, if any
    if distributed.initialized():  # torchrun's, or one started outside the harness
        pytest.skip("a process group is up in this process")
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    distributed.barrier()
    obj = {"a": [1, 2]}
    assert distributed.broadcast_object(obj) is obj
    assert distributed.all_gather_object(obj) == [obj]
    problems = ["loss differs at step 1", "two\nlines"]
    assert distributed.collective_problems(problems) == problems


def test_env_int_rejects_non_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an int"):
        distributed.env_int("WORLD_SIZE", 1)


# -------------------------------------------------------------------------- two gloo ranks
def _two_rank_worker(rank: int, store_path: str, out: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        distributed.barrier()
        result = {
            "rank": distributed.rank(),
            "world": distributed.world_size(),
            "broadcast": distributed.broadcast_object(f"from {rank}"),
            "gathered": distributed.all_gather_object(rank * 10),
            "problems": distributed.collective_problems(
                ["first divergence: step 2, microbatch 1\n  loss table"] if rank == 1 else []
            ),
            "none": distributed.collective_problems([]),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_helpers_across_two_gloo_ranks(tmp_path: Path) -> None:
    # forked from the forkserver that imported torch once (the harness's and
    # tests/helpers/warm.py's), not two interpreters importing it again
    args = (str(tmp_path / "store"), str(tmp_path))
    mp.start_processes(_two_rank_worker, args=args, nprocs=2, start_method="forkserver")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected_problems = ["rank 1: first divergence: step 2, microbatch 1\nrank 1:   loss table"]
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, 2)
        assert result["broadcast"] == "from 0"
        assert result["gathered"] == [0, 10]
        assert result["problems"] == expected_problems, "every rank sees the same problems"
        assert result["none"] == []


def _in_a_child(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter outside any torchrun world (no group of this process
    reaches it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_single_rank_group_needs_no_port_and_is_destroyed(tmp_path: Path) -> None:
    # A child process of its own, outside any torchrun world: this process's group, if any,
    # does not reach it (``python -m`` of a module written here, forked warm: warm.py).
    (tmp_path / "single_rank.py").write_text(
        "import torch; from harness.util import distributed as d\n"
        "d.ensure_process_group(torch.device('cpu'))\n"
        "assert d.initialized() and d.world_size() == 1\n"
        "d.shutdown(); assert not d.initialized(); print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_PORT")}
    done = warm.run([sys.executable, "-m", "single_rank"], cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_collectives_released_waits_for_nccl_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL the memory reading waits for the watchdog to drop finished collectives'
    tensors; gloo keeps none, and no group means nothing to wait for."""
    waited: list[str] = []

    class Group:
        def _wait_for_pending_works(self) -> None:
            waited.append("nccl")

    monkeypatch.setattr(distributed, "initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: Group())
    for backend in ("gloo", "nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda backend=backend: backend)
        distributed.collectives_released()
    assert waited == ["nccl"]
    monkeypatch.setattr(distributed, "initialized", lambda: False)
    distributed.collectives_released()
    assert waited == ["nccl"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_nccl_lets_go_of_a_finished_collective_once_released() -> None:
    """The mechanism the ZeRO-3 memory reading relies on, on the device: after a one-rank NCCL
    all-gather whose tensors the caller dropped, ``collectives_released`` leaves nothing of it
    allocated (in a child process: NCCL's group stays out of this one)."""
    code = (
        "import torch; from harness.util import distributed as d\n"
        "dev = torch.device('cuda', 0); d.ensure_process_group(dev)\n"
        "torch.cuda.synchronize(); torch.cuda.empty_cache()\n"
        "floor = torch.cuda.memory_allocated()\n"
        "x = torch.ones(1 << 24, device=dev); out = torch.empty_like(x)\n"
        "torch.distributed.all_gather_into_tensor(out, x); del x, out\n"
        "torch.cuda.synchronize(); d.collectives_released(); torch.cuda.empty_cache()\n"
        "print(torch.cuda.memory_allocated() - floor); d.shutdown()\n"
    )
    done = _in_a_child(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0", done.stdout


# ----------------------------------------------------------------------- plugin, pure parts
def test_collection_difference_names_the_first_differing_position() -> None:
    same = [["a", "b"], ["a", "b"]]
    assert collection_difference(same) == ""
    message = collection_difference([["a", "b", "c"], ["a", "c", "b"]])
    assert "position 1" in message and "rank 1 has 'c'" in message and "rank 0 has 'b'" in message
    shorter = collection_difference([["a", "b"], ["a"]])
    assert "position 1" in shorter and "'<end>'" in shorter and "2 vs 1 tests" in shorter


def test_skip_reasons_at_collection() -> None:
    two = SEED_CASE.replace(sharding="zero3", min_ranks=2)
    assert skip_reason(SEED_CASE, 1, CPU, 0) == ""
    assert skip_reason(two, 2, CPU, 0) == ""
    assert "needs 2 ranks, WORLD_SIZE is 1" in skip_reason(two, 1, CPU, 0)
    assert "needs 2 GPUs (one per rank), 1 visible" in skip_reason(
        two, 2, torch.device("cuda", 0), 1
    )


def test_zero3_case_rows() -> None:
    row = SEED_CASE.replace(sharding="zero3")
    assert row.name == f"{SEED_CASE.name}_zero3"
    assert row.replace(min_ranks=2).name == f"{SEED_CASE.name}_zero3_ranks-2"
    with pytest.raises(ValueError, match="unknown sharding 'zero2'"):
        Case(family="hybrid", offload=("core_attn",), sharding="zero2")
    with pytest.raises(ValueError, match="min_ranks must be an int >= 1"):
        Case(family="hybrid", offload=("core_attn",), min_ranks=0)


# ------------------------------------------------------------------- acceptance, subprocess
CONFTEST = """
pytest_plugins = ["harness.plugin"]
"""

SLEEPER = """
import time

def test_sleeps_past_the_timeout():
    time.sleep(60)


def test_runs_after_the_timeout():
    pass
"""


def _clean_env() -> dict[str, str]:
    drop = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _pytest(folder: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return warm.run(
        pytest_command("--device", "cpu", *args), cwd=folder, env=_clean_env(), timeout=timeout
    )


@pytest.mark.heavy
def test_timeout_dumps_stacks_fails_the_test_and_the_session_goes_on(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sleeper=SLEEPER)
    done = _pytest(pytester.path, "--case-timeout", "3", "--report-dir", "", "-p", "no:xdist")
    assert done.returncode != 0
    label = "rank 0 pid "
    assert (
        label in done.stderr
        and "timed out in test_sleeper.py::test_sleeps_past_the_timeout after 3 s" in done.stderr
    ), done.stderr
    assert "most recent call first" in done.stderr, "every thread's stack follows the label"
    assert "in test_sleeps_past_the_timeout" in done.stderr, "the dump shows the test's frame"
    assert "CaseTimeout: rank 0 pid" in done.stdout, "the test fails with the interrupt"
    assert "1 failed, 1 passed" in done.stdout, "the session goes on after the timeout"


@pytest.mark.heavy
def test_xdist_with_torchrun_world_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sleeper="def test_nothing():\n    pass\n")
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    done = warm.run(
        pytest_command("-n", "2", "--device", "cpu"),
        cwd=pytester.path,
        env={**_clean_env(), **env},
        timeout=120,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    # Only pytest's error lines: other plugins may warn on stderr (pytest-benchmark does).
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert errors == ["ERROR: -n/--dist (xdist) cannot be combined with torchrun WORLD_SIZE > 1"]
    assert "Traceback" not in done.stderr


RANK_TESTS = """
from harness.util import distributed


def test_rank_one_fails():
    problems = ["loss differs at step 3"] if distributed.rank() == 1 else []
    combined = distributed.collective_problems(problems)
    assert not combined, "\\n".join(combined)


def test_next_test_still_runs():
    assert distributed.all_gather_object(distributed.rank()) == [0, 1]
"""


CASE_ROW_TEST = """
import pytest

pytestmark = pytest.mark.case_matrix


def test_loss_equivalence(case, case_check):
    case_check("equivalence", case)
"""

SEED = "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"


@pytest.mark.torchrun
def test_torchrun_two_ranks_collective_verdict(pytester: pytest.Pytester) -> None:
    """On 2 gloo ranks: one rank's failure is every rank's verdict, the next test still runs,
    rank 0 owns the console, each rank keeps a log; and a case row's report entry carries each
    rank's transfer counts and bytes (``transfers_per_rank``), not rank 0's alone (one session
    for both: a torchrun job costs two interpreters importing torch)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=RANK_TESTS, test_case_row=CASE_ROW_TEST)
    row = f"{SEED} and not zero3 and not evalfirst and not 6x3 and not pool and not min-"
    command = torchrun_pytest_command("-rA", "-k", f"test_ranks or {row}")
    command += ["--device", "cpu", "--report-dir", "reports", "--case-timeout", "120"]
    done = subprocess.run(
        command, cwd=pytester.path, env=_clean_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0, "one test failed"
    console = done.stdout
    assert "FAILED test_ranks.py::test_rank_one_fails" in console, console
    assert "PASSED test_ranks.py::test_next_test_still_runs" in console, console
    assert f"PASSED test_case_row.py::test_loss_equivalence[{SEED}]" in console, console
    assert "1 failed, 2 passed" in console, console
    assert console.count("1 failed, 2 passed") == 1, "only rank 0 writes to the console"
    logs = sorted(pytester.path.glob("reports/*/rank*.log"))
    assert [p.name for p in logs] == ["rank0.log", "rank1.log"], logs
    for log in logs:
        text = log.read_text()
        assert "rank 1: loss differs at step 3" in text, f"{log.name} lacks the verdict"
        assert "1 failed, 2 passed" in text
    (summary,) = pytester.path.glob("reports/*/summary.json")
    (case,) = json.loads(summary.read_text())["cases"]
    assert case["name"] == SEED, case
    ranks = case["transfers_per_rank"]
    assert len(ranks) == 2 and ranks[0] == case["transfers"], ranks
    for counts in ranks:  # each rank moves the same groups
        assert counts["d2h_copies"] == counts["h2d_copies"] > 0, counts
        assert counts["d2h_bytes"] == counts["h2d_bytes"] > 0, counts
        assert set(counts["names_moved"]) == {"core_attn", "attn_proj"}, counts


def _torchrun(folder: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    command = torchrun_pytest_command("-rA", "-v")
    command += ["--device", "cpu", "--report-dir", "reports", *args]
    began = time.perf_counter()
    done = subprocess.run(
        command, cwd=folder, env=_clean_env(), capture_output=True, text=True, timeout=300
    )
    return done, time.perf_counter() - began


def _summary(folder: Path) -> dict:
    (path,) = folder.glob("reports/*/summary.json")
    return json.loads(path.read_text())


def _rank_logs(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.glob("reports/*/rank*.log")}


HANG_ON_RANK_ONE = """
import time

from harness.util import distributed


def test_passes_first():
    assert True


def test_rank_one_hangs():
    if distributed.rank() == 1:
        time.sleep(600)


def test_runs_after_the_hang():
    assert distributed.all_gather_object(distributed.rank()) == [0, 1]
"""


@pytest.mark.torchrun
def test_torchrun_hang_on_one_rank_fails_that_test_and_the_session_goes_on(
    pytester: pytest.Pytester,
) -> None:
    """Rank 1 hangs in rank-local code while rank 0 waits after the test: at --case-timeout both
    write labelled stacks, rank 1's test is interrupted (CaseTimeout), rank 0 reports rank 1's
    timeout as its own failure, and the next test runs on both ranks; summary.json is complete."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_hang=HANG_ON_RANK_ONE)
    # The other tests take milliseconds: a short timeout is ample and keeps the test short.
    done, seconds = _torchrun(pytester.path, "--case-timeout", "6")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert seconds < 6 + 60, seconds
    test = "test_hang.py::test_rank_one_hangs"
    assert re.search(
        rf"rank 0 pid \d+ timed out in {re.escape(test)} after 6 s .*ranks still inside it: \[1\]",
        out,
    ), out
    assert re.search(rf"rank 1 pid \d+ timed out in {re.escape(test)}", out), out
    assert "most recent call first" in out, "every thread's stack follows the label"
    assert f"FAILED {test}" in out and "rank 1 timed-out: " in out, out
    assert "PASSED test_hang.py::test_runs_after_the_hang" in out, "the session went on"
    assert "1 failed, 2 passed" in out, out
    summary = _summary(pytester.path)
    assert summary["status"] == "complete", summary
    assert summary["failed_tests"] == [test], summary
    logs = _rank_logs(pytester.path)
    assert set(logs) == {"rank0.log", "rank1.log"}, logs
    assert all("timed out in" in text for text in logs.values()), logs
    assert "CaseTimeout" in logs["rank1.log"], "rank 1's own failure is the interrupt"


STUCK_IN_A_COLLECTIVE = """
import time

from harness.util import distributed


def test_passes_first():
    assert True


def test_rank_one_hangs_before_a_collective():
    if distributed.rank() == SLEEPER:
        time.sleep(600)
    distributed.all_gather_object(distributed.rank())


def test_never_reached():
    pass
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("stuck", [0, 1], ids=["rank0-stuck", "rank1-stuck"])
def test_torchrun_rank_stuck_in_a_collective_ends_with_a_partial_summary(
    pytester: pytest.Pytester, stuck: int
) -> None:
    """One rank sleeps in test code before a collective that the other (``stuck``) already
    waits in. The sleeper is interrupted and unwinds; the stuck rank cannot be (it is inside
    gloo), so ``grace_s`` after the timeout it ends the job - bounded, with a partial
    summary.json that says ``timed-out`` whichever rank was stuck: written by rank 0's watchdog
    when rank 0 is stuck, by rank 0's SIGTERM thread when torchrun stops it after rank 1 ended.
    The unwound rank leaves the ending to the stuck one (both ending it at once once made the
    summary say ``aborted``)."""
    from harness.plugin.dist import grace_s

    pytester.makeconftest(CONFTEST)
    sleeper = 1 - stuck
    pytester.makepyfile(test_stuck=f"SLEEPER = {sleeper}\n" + STUCK_IN_A_COLLECTIVE)
    done, seconds = _torchrun(pytester.path, "--case-timeout", "5")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert seconds < 5 + grace_s(5) + 45, seconds
    test = "test_stuck.py::test_rank_one_hangs_before_a_collective"
    assert re.search(rf"rank 0 pid \d+ timed out in {re.escape(test)} .*\[0, 1\]", out), out
    logs = _rank_logs(pytester.path)
    assert set(logs) == {"rank0.log", "rank1.log"}, logs
    ended = rf"rank {stuck} pid \d+: {re.escape(test)} did not end within"
    assert re.search(ended, logs[f"rank{stuck}.log"]), logs[f"rank{stuck}.log"]
    assert not re.search(r"did not end within", logs[f"rank{sleeper}.log"]), (
        "the unwound rank left the ending to the stuck one"
    )
    summary = _summary(pytester.path)
    assert summary["status"] == "timed-out", summary
    why = summary["timed_out"]
    assert why["test"] == test and stuck in why["missing"], why
    if stuck == 0:
        assert why["missing"] == [0, 1], why
    else:  # rank 0 had unwound: torchrun stopped it after rank 1 ended the job
        assert why["signal"] == "SIGTERM" and why["missing"] == [1], why
    assert summary["tests"]["passed"] == 1, "what ran before is in the partial summary"
    assert "test_passes_first PASSED" in logs["rank1.log"], logs["rank1.log"]


KILLED_RANK = """
import os
import signal

from harness.util import distributed


def test_passes_first():
    assert True


def test_rank_one_is_killed():
    if distributed.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.torchrun
def test_torchrun_killed_rank_leaves_labelled_stacks_and_a_partial_summary(
    pytester: pytest.Pytester,
) -> None:
    """kill -9 of rank 1: torchrun stops rank 0 with SIGTERM, which writes a labelled stack dump
    and a partial summary.json (aborted: the test, the rank that never finished it); rank 1's
    log holds every line it wrote before it died."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_kill=KILLED_RANK)
    done, seconds = _torchrun(pytester.path, "--case-timeout", "60")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert seconds < 45, seconds
    test = "test_kill.py::test_rank_one_is_killed"
    assert re.search(
        rf"rank 0 pid \d+ stopped by torchrun \(SIGTERM: another rank exited\) in "
        rf"{re.escape(test)}; ranks that had not finished it: \[1\]",
        out,
    ), out
    summary = _summary(pytester.path)
    assert summary["status"] == "aborted", summary
    assert summary["aborted"] == {"test": test, "rank": 0, "signal": "SIGTERM", "missing": [1]}
    logs = _rank_logs(pytester.path)
    assert "stopped by torchrun" in logs["rank0.log"], logs["rank0.log"]
    assert "test_passes_first PASSED" in logs["rank1.log"], logs["rank1.log"]


def test_a_short_case_timeout_shortens_the_grace() -> None:
    from harness.plugin.dist import GRACE_S, grace_s

    assert grace_s(5) == 5 and grace_s(600) == GRACE_S == 10
    assert grace_s(0) == GRACE_S  # no timeout: the grace of the backstop's arithmetic
