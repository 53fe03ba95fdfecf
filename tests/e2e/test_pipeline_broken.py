"""The broken offloaders of the pipeline (``harness.offload.broken.pipeline``) caught across
ranks: each catalogue entry's ``pipeline_catchers`` (``harness.verify.detection``) judged on
its pipeline row by forked gloo ranks, each rank its own stage through the one judge
(``harness.verify.judge.check``, as the pytest plugin calls it under torchrun), with the
reference on the same row as the control. The mutation score runs its rows in one process and
judges these entries on their one-rank catchers only.

A catch: on some rank the named check fails with a problem line the entry's reason pattern
matches, the combined verdict (``collective_problems``, every rank's lines) names that rank and
its stage; the reference passes the same check on every rank. Bounded as the other pipeline
jobs: the group's 30 s timeout, ``JOB_DEADLINE_S`` per job, every rank killed when the test ends.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked_ranks import run_ranks

from harness.cases import PP_ROWS
from harness.execute.environment import Environment
from harness.util import distributed
from harness.verify.detection import CATALOGUE, entry
from harness.verify.judge import CaseRuns, check

JOB_DEADLINE_S = 90.0
CATCHES = [
    (broken.name, name, row.name) for broken in CATALOGUE for name, row in broken.pipeline_catchers
]


def _rank(
    rank: int, store: str, folder: str, row: str, check_name: str, backends: list[str]
) -> None:
    torch.set_num_threads(1)
    case = next(r for r in PP_ROWS if r.name == row)
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, case.pipeline),
        rank=rank,
        world_size=case.pipeline,
        timeout=timeout,
    )
    said = {}
    for backend in backends:
        env = Environment(device=torch.device("cpu"), backend=backend, model_size="tiny")
        outcome = check(check_name, CaseRuns(case, env))
        problems = list(outcome.problems)
        said[backend] = {
            "status": outcome.status,
            "problems": problems,
            "combined": distributed.collective_problems(problems),
        }
    Path(folder, f"rank{rank}.json").write_text(json.dumps(said))
    dist.destroy_process_group()


def _run_job(folder: Path, row: str, check_name: str, backends: list[str]) -> list[dict]:
    case = next(r for r in PP_ROWS if r.name == row)
    args = (str(folder / "store"), str(folder), row, check_name, backends)
    run_ranks(_rank, args, case.pipeline, JOB_DEADLINE_S, f"the job of {row}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(case.pipeline)]


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "check_name", "row"), CATCHES)
def test_a_pipeline_broken_offloader_is_caught_across_ranks(
    name: str, check_name: str, row: str, tmp_path: Path
) -> None:
    broken = entry(name)
    ranks = _run_job(tmp_path, row, check_name, ["reference", name])
    for rank, said in enumerate(ranks):
        assert said["reference"]["status"] == "pass", (rank, said["reference"])
    caught = [
        rank
        for rank, said in enumerate(ranks)
        if said[name]["status"] == "fail" and broken.matching(check_name, said[name]["problems"])
    ]
    assert caught, [said[name] for said in ranks]
    combined = ranks[0][name]["combined"]
    for rank in caught:
        line = broken.matching(check_name, [p for p in combined if p.startswith(f"rank {rank}: ")])
        assert line is not None and re.match(rf"rank {rank}: stage {rank} of \d", line), combined
        print(f"{name} on {row}, {check_name}: {line}")  # shown with -s


@pytest.mark.heavy
def test_an_undeclared_offloader_is_learned_per_stage(tmp_path: Path) -> None:
    """A backend that declares nothing is learned on each stage from that stage's own steps 0
    and 1 (``harness.execute.pipeline_case``): ``StorageSkip`` passes ``transfers`` on every
    rank, and ``EvenStepsOnly`` (attn_proj moved on even steps only) fails it on every rank
    holding an attn_proj group - held to its own first steady step, which moved none, step 2
    moves it again."""
    row = next(r.name for r in PP_ROWS if r.name.endswith("_1f1b_bf16_3x4_pp2"))
    clean, drifting = "undeclared_offloaders:StorageSkip", "undeclared_offloaders:EvenStepsOnly"
    ranks = _run_job(tmp_path, row, "transfers", [clean, drifting])
    for rank, said in enumerate(ranks):
        assert said[clean]["status"] == "pass", (rank, said[clean])
        assert said[drifting]["status"] == "fail", (rank, said[drifting])
        assert any(
            re.search(
                r"step 2, microbatch \d, layer \d, group attn_proj: held to \{'d2h_copies': 0", p
            )
            for p in said[drifting]["problems"]
        ), said[drifting]["problems"]
