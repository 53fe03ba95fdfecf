"""The GPU ledger (``harness.tools.gpu_ledger``): entries decided from a ``scripts/gpu_verify``
runs folder, written into the status page's table. The folders here are built by hand the way
the script leaves them: ``verify.txt`` lines, one log per section, report folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.tools import gpu_ledger
from harness.tools.gpu_ledger import BEGIN, END, Runs, apply, collect

REFERENCE = "reference, default matrix (`run --device cuda`)"
MEMORY = "memory check: after the last forward and at every backward boundary"
PROBE = "sync check: the guard on real syncs (`scripts/gpu_probe_sync.py`)"
BROKEN_SYNC = "sync check: `broken.host_sync` caught (`cases/test_sync.py`)"
FULL = "reference, full matrix (`run --matrix full --device cuda`)"
MACHINE = {"card": "NVIDIA H100 80GB HBM3", "commit": "abcdef0123", "date": "2026-12-06"}
PAGE = f"# Status\n\n## GPU ledger\n\n{BEGIN}\n{END}\n\nthe rest\n"


def _case(name: str, verdict: str, memory: str = "pass", problems: list[str] | None = None):
    return {
        "name": name,
        "verdict": verdict,
        "problems": problems or [],
        "checks": {"memory": {"status": memory}, "transfers": {"status": "pass"}},
    }


def _runs(tmp_path: Path, verify: str, reports: dict[str, list], logs: dict[str, str]) -> Runs:
    root = tmp_path / "runs"
    for section, cases in reports.items():
        folder = root / section / "20261206T000000Z_abc"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"cases": cases}))
    for section, text in logs.items():
        root.mkdir(exist_ok=True)
        (root / f"{section}.log").write_text(text)
    (tmp_path / "verify.txt").write_text(verify)
    return Runs.read(root, tmp_path / "verify.txt")


def test_entries_are_decided_from_reports_exit_codes_and_logs(tmp_path: Path) -> None:
    runs = _runs(
        tmp_path,
        "== reference rc=1 in 30s\n== sync-probe rc=0 in 40s\n== sync-broken rc=1 in 9s\n"
        "== full skipped: VERIFY_DEADLINE=300s reached\n",
        {
            "reference": [
                _case("seed", "pass"),
                _case("moe", "fail", "fail", ["memory: backward drop 0 B, predicted 8192 B"]),
                _case("inert", "inert", "n-a"),
            ]
        },
        {"sync-probe": "7/7 scenarios right\n", "sync-broken": "broken synchronised the host\n"},
    )
    entries = collect(runs, MACHINE)["entries"]
    assert entries[REFERENCE] == {
        "status": "fail",
        "detail": "1/3 rows: moe: memory: backward drop 0 B, predicted 8192 B",
    }
    assert entries[MEMORY]["status"] == "fail"
    assert entries[PROBE] == {"status": "pass", "detail": "7/7 scenarios right"}
    assert entries[BROKEN_SYNC]["status"] == "pass"  # exit 1 with the catch in its log
    # a section skipped for the deadline, or never named, was not run: not a failure
    assert entries[FULL]["status"] == "not run"
    assert all(
        entries[e]["status"] == "not run" for e in entries if e.startswith("undeclared corpus")
    )


def test_a_broken_catch_without_its_message_is_not_a_pass(tmp_path: Path) -> None:
    runs = _runs(tmp_path, "== sync-broken rc=1 in 9s\n", {}, {"sync-broken": "Traceback\n"})
    assert collect(runs, MACHINE)["entries"][BROKEN_SYNC]["status"] == "fail"


def test_apply_moves_a_pass_keeps_the_last_pass_on_a_failure_and_leaves_not_run(
    tmp_path: Path,
) -> None:
    first = {
        "machine": MACHINE,
        "entries": {
            REFERENCE: {"status": "pass", "detail": ""},
            PROBE: {"status": "pass", "detail": ""},
        },
    }
    later = {
        "machine": {**MACHINE, "commit": "1234567890", "card": "NVIDIA H200"},
        "entries": {
            REFERENCE: {"status": "fail", "detail": "2/25 rows: a | b"},
            PROBE: {"status": "not run", "detail": ""},
        },
    }
    page = apply([first], PAGE)
    page = apply([later], page)
    table = page.split(BEGIN)[1].split(END)[0]
    was = "abcdef0123, NVIDIA H100 80GB HBM3, 2026-12-06"
    assert (
        f"| {REFERENCE} | {was} | fail (1234567890, NVIDIA H200, 2026-12-06): 2/25 rows: a / b |"
        in table
    )
    assert f"| {PROBE} | {was} | pass ({was}) |" in table
    assert page.endswith(f"{END}\n\nthe rest\n")  # nothing outside the markers is touched


def test_the_command_line_refuses_a_page_without_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"machine": MACHINE, "entries": {}}))
    page = tmp_path / "status.md"
    page.write_text("# no table here\n")
    assert gpu_ledger.main(["apply", str(ledger), str(page)]) == 2
    assert "no <!-- gpu-ledger:begin -->" in capsys.readouterr().err
    assert page.read_text() == "# no table here\n"
