"""The host footprint on CUDA (``harness.measure.footprint``): the caching host allocator's
power-of-two blocks are seen, the reference's pool buffers of their own size
(``harness.offload.pinned``) are pinned and hold at most its declared bound, and a pinned buffer
of its own round-trips a non-blocking copy bitwise.

With ``FOOTPRINT_FIXTURE=PATH`` the final steps of the reference and ``save-on-cpu`` on the seed
row are written there (``harness.measure.footprint.step_record``), the replay fixture
``tests/unit/test_footprint_replay.py`` reads on CPU. These tests skip without a GPU and must
pass on the GPU box (``scripts/gpu_verify``'s ``footprint`` part runs them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from harness.cases import SEED_CASE
from harness.execute.environment import Environment
from harness.execute.steps import run_case
from harness.measure import fingerprint
from harness.measure.footprint import step_record
from harness.offload.pinned import exact_pinned
from harness.offload.protocol import Capabilities
from harness.offload.reference import HOST_BOUND
from harness.verify.hostchecks import footprint_problems

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CORE_ATTN, ATTN_PROJ = 81920, 8192
"""The seed row's saved bytes per offloaded tensor (bf16): core_attn's [2, 4, 80, 64], attn_proj's
input [80, 2, 32] (``harness.vocab.spec``'s tiny preset)."""


def test_an_exact_pinned_buffer_is_pinned_and_round_trips_bitwise() -> None:
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    host = exact_pinned((5, 4096), torch.bfloat16)
    assert host is not None and host.is_pinned()
    assert host.untyped_storage().nbytes() == 5 * 4096 * 2  # whole pages, no power of two
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == before
    source = torch.randn(5, 4096, device="cuda").to(torch.bfloat16)
    host.copy_(source, non_blocking=True)
    back = torch.empty_like(source)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)


def _final(backend: str) -> tuple[object, object]:
    case = SEED_CASE
    res = run_case(case, Environment(device=torch.device("cuda"), backend=backend))
    return case, res


def _record(name: str, res: object) -> None:
    path = os.environ.get("FOOTPRINT_FIXTURE")
    if not path:
        return
    fixture = Path(path)
    data = json.loads(fixture.read_text()) if fixture.exists() else {}
    data["fingerprint"] = fingerprint.of(torch.device("cuda")).id
    data.setdefault("steps", {})[name] = step_record(res.final_observed)  # type: ignore[attr-defined]
    data.setdefault("ratios", {})[name] = res.footprint.ratio  # type: ignore[attr-defined]
    fixture.write_text(json.dumps(data, indent=1) + "\n")


def test_the_reference_holds_at_most_its_bound() -> None:
    case, res = _final("reference")
    final = res.footprint  # type: ignore[attr-defined]
    _record("reference", res)
    in_flight = 2 * (CORE_ATTN + ATTN_PROJ)  # sequential: one microbatch's 2 offloaded layers
    assert final.peak_in_flight == in_flight
    assert final.ratio is not None and final.ratio <= HOST_BOUND, final.as_record()
    caps = Capabilities(host_pool=True, host_bound=HOST_BOUND)
    assert footprint_problems(case, res, caps) == []  # type: ignore[arg-type]


def test_save_on_cpu_pays_the_allocators_rounding() -> None:
    """``save_on_cpu`` pins each copy in a caching-allocator block: core_attn's 81920 B in a
    131072 B block, so at its peak it holds at least 2 x (131072 + 8192) for 2 x (81920 + 8192)
    in flight: 1.55x, read from the allocator."""
    _, res = _final("save-on-cpu")
    final = res.footprint  # type: ignore[attr-defined]
    _record("save-on-cpu", res)
    assert final.peak_in_flight == 2 * (CORE_ATTN + ATTN_PROJ)
    assert final.source == "allocator"
    assert final.peak_held >= 2 * (131072 + ATTN_PROJ)
