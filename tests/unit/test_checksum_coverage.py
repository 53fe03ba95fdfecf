"""Checksum coverage is reported and required (``harness.verify.checks.checksum_gap``): a run that
moved tensors but could checksum none of them says so in the equivalence check's reason, never a
silent pass; a run that compared its reloads, or moved nothing, has no such reason."""

from __future__ import annotations

from harness.verify.checks import checksum_gap


def test_no_checksum_taken_of_moved_tensors_is_a_visible_skip_reason() -> None:
    gap = checksum_gap({"compared": 0, "packed": 0, "offload_copies": 12})
    assert gap.startswith("checksum part skipped: the offload run made 12 offload copies")
    assert "0 saved tensors packed through the harness's group windows" in gap


def test_compared_reloads_or_nothing_moved_leave_no_reason() -> None:
    assert checksum_gap({"compared": 5, "packed": 5, "offload_copies": 5}) == ""
    assert checksum_gap({"compared": 0, "packed": 0, "offload_copies": 0}) == ""
