"""The host footprint of steps recorded on a GPU (``tests/fixtures/gpu/footprint-*.json``, written
by ``tests/gpu/test_host_footprint_cuda.py`` under ``scripts/gpu_verify``'s ``footprint`` part),
replayed on CPU: the same copies, backward marks and readings give the same ratio, the reference
stays within its bound, and ``save-on-cpu`` is read from the caching host allocator's blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.measure.footprint import footprint, step_from
from harness.offload.reference import HOST_BOUND

FIXTURES = sorted((Path(__file__).parents[1] / "fixtures" / "gpu").glob("footprint-*.json"))


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_a_recorded_step_replays_to_its_recorded_ratio(fixture: Path) -> None:
    data = json.loads(fixture.read_text())
    for name, step in data["steps"].items():
        assert footprint(step_from(step)).ratio == data["ratios"][name], name
    reference = footprint(step_from(data["steps"]["reference"]))
    assert reference.ratio is not None and reference.ratio <= HOST_BOUND
    peer = footprint(step_from(data["steps"]["save-on-cpu"]))
    assert peer.source == "allocator" and peer.ratio is not None and peer.ratio > HOST_BOUND
