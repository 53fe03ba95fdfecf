"""The corpus of issue 58 on CUDA (``tests/helpers/consistent_offloaders.py``): copies issued from
a thread of the offloader's own and on a stream of its own are attributed to their group as the
profiler sees them, and every correct style passes there too.

On CUDA the transfer check compares the copy observer's totals with the profiler's DtoH/HtoD
memcpys: a copy the observer missed (one made on a worker thread, where the dispatch mode would
not reach without ``harness.measure.threads``) fails it as "memcpys outside any offload group".
A pass of ``transfers`` for ``ThreadCopier`` is therefore the proof that its worker thread's
copies were seen and attributed. These tests skip without a GPU and must pass on the GPU box
(``scripts/gpu_verify``'s ``tests`` section runs them).
"""

from __future__ import annotations

import pytest
import torch

from harness.cases import Case
from harness.execute.environment import Environment
from harness.verify.judge import judge

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SEED = Case(family="hybrid", offload=("core_attn", "attn_proj"), precision="bf16")
CHECKS = ("equivalence", "leaks", "transfers", "disabled", "fidelity", "weights", "cadence")


@pytest.mark.parametrize(
    "style",
    [
        "ThreadCopier",
        "LayerSubset",
        "BatchedCopy",
        "PrefetchAll",
        "TwoAhead",
        "ByteThreshold",
        "ChunkedCopy",
    ],
)
def test_a_correct_style_passes_on_cuda(style: str) -> None:
    env = Environment(device=torch.device("cuda"), backend=f"consistent_offloaders:{style}")
    judgement = judge(SEED, env)
    statuses = {o.name: o.status for o in judgement.outcomes}
    assert {c: statuses[c] for c in CHECKS} == dict.fromkeys(CHECKS, "pass"), judgement.problems


def test_worker_thread_copies_are_the_profilers_memcpys() -> None:
    env = Environment(device=torch.device("cuda"), backend="consistent_offloaders:ThreadCopier")
    judgement = judge(SEED, env)
    transfers = next(o for o in judgement.outcomes if o.name == "transfers")
    assert transfers.status == "pass", transfers.problems
    assert transfers.record["attribution"] == "harness windows", transfers.record
