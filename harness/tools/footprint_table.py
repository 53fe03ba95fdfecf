"""The host footprint of every case in one or more runs' ``summary.json``: per backend and case the
final step's peak host memory held, its peak bytes in flight, their ratio and which reading gave
the peak (``harness.measure.footprint``; the ``leaks`` check's ``host_footprint`` record).

    python3 -m harness.tools.footprint_table reports/*/summary.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIB = 2**20


def rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case of ``summary`` that recorded a host footprint."""
    out = []
    for case in summary.get("cases", []):
        found = (case.get("leaks") or {}).get("host_footprint")
        if not isinstance(found, dict):
            continue
        out.append(
            {
                "backend": str(summary.get("backend")),
                "case": case.get("name"),
                "leaks": (case.get("checks") or {}).get("leaks", case.get("verdict")),
                **found,
            }
        )
    return out


def render(found: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """A table of ``rows``' output."""
    head = ("backend", "case", "held MiB", "in flight MiB", "ratio", "source")
    lines = []
    for r in found:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            (
                r["backend"],
                str(r["case"]),
                f"{r['peak_held_bytes'] / MIB:.3f}",
                f"{r['peak_in_flight_bytes'] / MIB:.3f}",
                ratio,
                r["source"],
            )
        )
    if markdown:
        table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(table + ["| " + " | ".join(line) + " |" for line in lines])
    width = [max(len(x) for x in col) for col in zip(head, *lines, strict=False)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(line, width, strict=True)) for line in [head, *lines]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m harness.tools.footprint_table", description=__doc__
    )
    p.add_argument("summaries", nargs="+", type=Path, help="summary.json files")
    p.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = p.parse_args(argv)
    found = []
    for path in args.summaries:
        try:
            found += rows(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"footprint_table: {path}: {exc}", file=sys.stderr)
            return 2
    print(render(found, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
