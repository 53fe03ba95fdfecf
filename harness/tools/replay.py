"""GPU recordings for the CPU replay tests: what a CUDA-only code path read on a GPU, kept as
small JSON fixtures under ``tests/fixtures/gpu/`` so that CI, which has no GPU, runs that code
path again on the same data (``tests/replay/``).

    python -m harness.tools.replay backward SUMMARY [SUMMARY...] --out FILE

``backward`` keeps, for the rows in ``BACKWARD_ROWS`` found in the ``summary.json`` files given,
the memory check's backward reading (``harness.execute.backwardpeak``): both runs' samples at
every group boundary of the final step's backward, the predicted drops, and the verdict the
check gave there. ``scripts/gpu_verify`` refreshes it on every GPU run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BACKWARD_ROWS = (
    "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16",
    "moe-*E*E_expert_fc1+moe_act_sequential_fp32_inflight-none",
    "hybrid-+-+-+-_core_attn+attn_proj_1f1b_bf16_6x3",
    "hybrid-+-+-+-_core_attn+attn_proj_interleaved_bf16_6x4",
    "moe-fused-*E*E_fused_group_mlp_1f1b_fp32",
    "moe-*E*E_qkv_linear+core_attn+attn_proj_1f1b_bf16",
)
"""Rows whose backward readings are kept: the seed's, the one where a group's committed output
is the next group's input twice in a layer (expert_fc1 into moe_act), 1F1B with a pass in
flight, the interleaved order with two model chunks, the fused expert group, and one where a
selected group's input is used outside the group too (qkv_linear's in ``*`` layers, the residual
add's as well: the sampler's end mark at afb5c10 read the two runs at different moments there,
``harness.execute.backwardpeak.BackwardSampler``)."""


def recorded_by(summary: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """Where and at what a case was recorded: commit, card, torch, fingerprint, date."""
    machine = summary.get("machine") or {}
    commit = summary.get("commit") or {}
    return {
        "commit": commit.get("sha") or commit.get("version"),
        "gpu": ", ".join(machine.get("gpus") or []) or None,
        "torch": machine.get("torch"),
        "fingerprint": (case.get("golden") or {}).get("fingerprint"),
        "created_utc": summary.get("created_utc"),
    }


def backward_fixture(summaries: Iterable[dict[str, Any]], rows: Sequence[str]) -> dict[str, Any]:
    """The backward readings of ``rows`` (the newest summary's where several have one)."""
    found: dict[str, Any] = {}
    for summary in summaries:
        for case in summary.get("cases", []):
            backward = (case.get("memory") or {}).get("backward")
            if case.get("name") not in rows or not backward or "samples" not in backward:
                continue
            found[case["name"]] = {
                "recorded": recorded_by(summary, case),
                "memory": (case.get("checks") or {}).get("memory", {}),
                "backward": backward,
            }
    return {
        "what": "the memory check's backward reading at every group boundary, read on a GPU "
        "(harness.tools.replay backward; refreshed by scripts/gpu_verify)",
        "rows": {name: found[name] for name in rows if name in found},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.replay", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    backward = sub.add_parser("backward", help="the backward readings of BACKWARD_ROWS")
    backward.add_argument("summaries", nargs="+", type=Path, help="summary.json files")
    backward.add_argument("--out", type=Path, required=True, help="the fixture to write")
    args = parser.parse_args(argv)
    try:
        summaries = [json.loads(path.read_text()) for path in args.summaries]
    except (OSError, ValueError) as exc:
        print(f"replay: cannot read a summary: {exc}", file=sys.stderr)
        return 2
    fixture = backward_fixture(summaries, BACKWARD_ROWS)
    if not fixture["rows"]:
        print("replay: no backward reading of the kept rows in those summaries", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"replay: {len(fixture['rows'])} backward readings -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
