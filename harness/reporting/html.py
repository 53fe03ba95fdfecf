"""``index.html`` of a report folder, rendered from its ``summary.json`` (never the reverse):
run facts, links to the JSON, JUnit XML and repro bundles, the plots of ``harness.reporting.plots``
and a table of the cases with the problems of each failing one."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from harness.reporting.plots import render_plots
from harness.reporting.report import is_failure
from harness.run.settings import PLOTS_VARIABLE, resolve_plots

_STYLE = """
body { font-family: sans-serif; font-size: 13px; margin: 1.5em; }
table { border-collapse: collapse; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #eee; }
.pass { color: #070; } .fail { color: #b00; font-weight: bold; }
.skip, .missing { color: #777; }
pre { background: #f6f6f6; padding: 6px; overflow-x: auto; font-size: 11px; }
img { max-width: 100%; border: 1px solid #ddd; margin: 4px 0; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _facts(summary: dict[str, Any]) -> list[tuple[str, str]]:
    machine, commit = summary.get("machine", {}), summary.get("commit", {})
    sha = commit.get("sha") or "unknown"
    facts = [
        ("created (UTC)", summary.get("created_utc", "")),
        ("commit", f"{sha}{' (dirty)' if commit.get('dirty') else ''}"),
        ("host", machine.get("host", "")),
        ("torch / CUDA", f"{machine.get('torch')} / {machine.get('cuda') or '-'}"),
        ("GPUs", ", ".join(machine.get("gpus", [])) or "none"),
        ("driver", machine.get("driver") or "-"),
    ]
    for key in ("backend", "device", "matrix", "model_size", "world_size", "seconds"):
        if key in summary:
            facts.append((key.replace("_", " "), str(summary[key])))
    if "exit_status" in summary:
        facts.append(("pytest exit status", str(summary["exit_status"])))
    return facts


def _outcomes(cases: list[dict[str, Any]]) -> str:
    passed = sum(c.get("verdict") == "pass" for c in cases)
    skipped = sum(c.get("verdict") == "skip" for c in cases)
    inert = sum(c.get("verdict") == "inert" for c in cases)
    golden = [c.get("golden", {}).get("status") for c in cases]
    drift = golden.count("mismatch")
    return (
        f"{passed}/{len(cases)} cases passed"
        + (f", {skipped} skipped" if skipped else "")
        + (f", {inert} inert" if inert else "")
        + f"; golden traces: {golden.count('match')} match, "
        f"{drift} drifted, {golden.count('missing')} missing"
        + (f", {golden.count('updated')} updated" if "updated" in golden else "")
    )


def _cell(status: str | None) -> str:
    status = status or "-"
    css = {"pass": "pass", "match": "pass", "fail": "fail", "mismatch": "fail"}.get(status, "skip")
    return f'<td class="{css}">{_e(status)}</td>'


def _row(index: int, case: dict[str, Any]) -> str:
    t = case.get("transfers", {})
    tests = case.get("tests", {})
    failed_tests = [name for name, outcome in tests.items() if outcome == "failed"]
    name = _e(case["name"])
    if is_failure(case):
        name = f'<a href="#case-{index}">{name}</a>'
    memory = case.get("memory")
    mem = (
        f"drop {memory['allocated_drop']} / predicted {memory['predicted_drop']} B"
        if memory
        else "-"
    )
    return (
        f"<tr><td>#{index}</td><td>{name}</td>{_cell(case.get('verdict'))}"
        f"{_cell(case.get('equivalence'))}{_cell(case.get('golden', {}).get('status'))}"
        f"<td>{_e(', '.join(failed_tests) or '-')}</td>"
        f"<td>{_e(','.join(t.get('names_moved', [])) or '-')}</td>"
        f"<td>{_e(t.get('d2h_copies', '-'))} / {_e(t.get('h2d_copies', '-'))}</td>"
        f"<td>{_e(t.get('d2h_bytes', '-'))}</td><td>{_e(mem)}</td>"
        f"<td>{_e(case.get('duration', case.get('seconds', '-')))}</td></tr>"
    )


def _problems(index: int, case: dict[str, Any]) -> str:
    problems = list(case.get("problems", []))
    golden = case.get("golden", {})
    if golden.get("status") == "mismatch" and golden.get("message") not in problems:
        problems.append(golden["message"])
    body = "\n".join(problems) or "(no message recorded)"
    return f'<h3 id="case-{index}">#{index} {_e(case["name"])}</h3><pre>{_e(body)}</pre>'


def render_index(folder: Path) -> Path:
    """Write ``plots/*.png`` and ``index.html`` into a report folder from its summary.json."""
    summary = json.loads((folder / "summary.json").read_text())
    cases: list[dict[str, Any]] = summary.get("cases", [])
    plots: list[Path] = []
    if not resolve_plots():
        note = f"<p>No plots: {PLOTS_VARIABLE}=0.</p>"
    else:
        try:
            plots, note = render_plots(cases, folder / "plots"), ""
        except ImportError as exc:  # matplotlib is the optional part of a report
            note = f"<p>No plots: {_e(exc)} (pip install matplotlib).</p>"
    links = [("summary.json", "summary.json")]
    links += [(n, n) for n in ("junit.xml",) if (folder / n).exists()]
    links += [("repro bundle", "repro/")] if (folder / "repro").is_dir() else []
    links += [("trend page", "trend.html")] if (folder / "trend.html").is_file() else []
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>offload-harness report {_e(folder.name)}</title><style>{_STYLE}</style>",
        f"</head><body><h1>offload-harness report {_e(folder.name)}</h1>",
        "<table>",
        *(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in _facts(summary)),
        "</table>",
        f"<p><b>{_e(_outcomes(cases))}</b></p>",
        "<p>" + " | ".join(f'<a href="{h}">{_e(t)}</a>' for t, h in links) + "</p>",
        "<h2>Cases</h2><table><tr><th>#</th><th>case</th><th>verdict</th><th>equivalence</th>"
        "<th>golden</th><th>failed tests</th><th>groups moved</th><th>DtoH / HtoD copies</th>"
        "<th>bytes each way</th><th>memory after forward</th><th>seconds</th></tr>",
        *(_row(i, c) for i, c in enumerate(cases, start=1)),
        "</table>",
        "<h2>Plots</h2>",
        note,
        *(f'<p><img src="plots/{p.name}" alt="{_e(p.stem)}"></p>' for p in plots),
    ]
    failed = [(i, c) for i, c in enumerate(cases, start=1) if is_failure(c)]
    if failed:
        parts += ["<h2>Failures</h2>", *(_problems(i, c) for i, c in failed)]
    parts.append("</body></html>")
    path = folder / "index.html"
    path.write_text("\n".join(parts) + "\n")
    return path
