"""The trend gate proven on CPU (issue 60, point 4), with real runs of two default-matrix rows.

Three clean runs (``undeclared_offloaders:StorageSkip``) are recorded into one history by
``offload-harness run --history``; then a run whose offloader sleeps in its pack hook
(``slow_offloaders:SlowPack``) and one whose offloader keeps every host copy a step longer
(``slow_offloaders:HoldsTwice``): ``offload-harness trend`` flags each, naming the figure, its
band and the nights, and exits 1 (0 under ``--trend warn``); a last clean run is not flagged.
Every case passes its checks in every run: only the figures tell the runs apart.

The machine is shared: a load spike can push a clean run's seconds beyond a band learnt from a
few quiet runs (the band is the history's spread, and three quiet runs make a narrow one). The
last clean run is retried up to twice for that, and only for time and overhead flags: a host
footprint, a regression or a flake in a clean run fails at once.

Also: ``run --history`` refuses an unusable history before any training, and ``scripts/nightly
--history`` records each night and goes red on a flag (its pytest session replaced by summaries
written by hand, as ``test_nightly.py`` keeps the gate's own session out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.cases import default_matrix
from harness.cli import main
from harness.reporting import history as db

ROWS = (
    "hybrid-+-+-+-_core_attn+attn_proj_sequential_fp32",
    "moe-*E*E_moe_act_1f1b_fp32_inflight-0",
)
CLEAN = "undeclared_offloaders:StorageSkip"


def _run(tmp_path: Path, history: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> str:
    cases = [arg for row in ROWS for arg in ("--case", row)]
    reports = tmp_path / "reports"
    argv = ["run", "--device", "cpu", *cases, "--backend", backend, "--report-dir", str(reports)]
    code = main([*argv, "--history", str(history)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"history: recorded run #\d+ in ", out), out
    return out


def _trend(history: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["trend", "--history", str(history), *extra])
    captured = capsys.readouterr()
    assert not captured.err, captured.err
    return code, captured.out


def _flags(out: str) -> list[str]:
    return [line.strip()[len("FLAG ") :] for line in out.splitlines() if "FLAG " in line]


def test_the_gate_flags_a_slow_and_a_hoarding_offloader_and_not_a_clean_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    history = tmp_path / "nights.sqlite"
    for _ in range(3):
        _run(tmp_path, history, CLEAN, capsys)
    code, out = _trend(history, capsys)
    assert code == 0 and "trend: no flag" in out, out

    _run(tmp_path, history, "slow_offloaders:SlowPack", capsys)
    code, out = _trend(history, capsys)
    assert code == 1, out
    slow = [f for f in _flags(out) if f.startswith(f"time: {ROWS[0]}: offload run seconds")]
    assert len(slow) == 1, out  # 20 ms in each of its 252 packs; the other row packs 72
    # the figure, the band and the nights: the flagged run and each earlier one, by id
    assert re.search(r"is above its band [\d.]+ s \.\. [\d.]+ s \(median", slow[0]), slow[0]
    assert "on run #4 " in slow[0] and all(f"#{n} " in slow[0] for n in (1, 2, 3)), slow[0]
    assert all(f.startswith(("time: ", "overhead: ")) for f in _flags(out)), out
    code, warned = _trend(history, capsys, "--trend", "warn")
    assert code == 0 and _flags(warned) == _flags(out)

    _run(tmp_path, history, "slow_offloaders:HoldsTwice", capsys)
    monkeypatch.delenv("OFFLOAD_HARNESS_PLOTS", raising=False)  # the page draws its plots
    code, out = _trend(history, capsys, "--html", str(tmp_path / "page"))
    assert code == 1, out
    held = [f for f in _flags(out) if f.startswith("host footprint: ")]
    assert {row for row in ROWS if any(f"footprint: {row}:" in f for f in held)} == set(ROWS)
    assert re.search(r"host bytes held at a step's end [\d.]+ (MiB|B) on run #5 ", held[0])
    assert "is above its band 0 B .. 2 B (median 0 B, spread 0 B x 5, floor 2 B)" in held[0]
    assert all(f"#{n} " in held[0] for n in (1, 2, 3, 4)), held[0]
    page = (tmp_path / "page" / "trend.html").read_text()
    assert "trend-plots/trend.png" in page and "Trend of run #5" in page
    assert (tmp_path / "page" / "trend-plots" / "trend.png").stat().st_size > 10_000

    clean = 0
    while True:  # a load spike on the shared machine is retried, nothing else
        _run(tmp_path, history, CLEAN, capsys)
        clean += 1
        code, out = _trend(history, capsys)
        timing = [f for f in _flags(out) if f.startswith(("time: ", "overhead: "))]
        assert _flags(out) == timing, out
        if code == 0 or clean == 3:
            break
    assert code == 0 and "trend: no flag" in out, out
    assert f"against its last {4 + clean} run(s) #1 " in out

    conn = db.open_history(history, create=False)
    try:
        backends = [r["backend"] for r in db.runs(conn)]
        held_rows = db.rows(conn, "host", [5])
    finally:
        conn.close()
    slow_ones = ["slow_offloaders:SlowPack", "slow_offloaders:HoldsTwice"]
    assert backends == [CLEAN] * 3 + slow_ones + [CLEAN] * clean
    assert all(r["held_bytes"] > 0 and r["source"] == "boundaries-copies" for r in held_rows)
    assert all(r["peak_held"] >= r["peak_in_flight"] > 0 and r["ratio"] >= 1 for r in held_rows)


def test_run_refuses_an_unusable_history_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"not a database at all" * 100)
    argv = ["run", "--device", "cpu", "--case", ROWS[0], "--report-dir", str(tmp_path / "r")]
    for history, why in (
        (corrupt, "not a readable history"),
        (tmp_path / "no" / "such" / "h.sqlite", "does not exist"),
    ):
        assert main([*argv, "--history", str(history)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0] and err[0].startswith("offload-harness: error:")
    assert not (tmp_path / "r").exists()  # nothing ran, no report folder claimed


# ------------------------------------------------------------------------ scripts/nightly


def _night(seconds: float, failing: str | None = None) -> dict[str, Any]:
    """A nightly summary of the default matrix, every case passing in ``seconds``."""
    cases = []
    for row in default_matrix():
        verdict = "fail" if row.name == failing else "pass"
        cases.append(
            {
                "name": row.name,
                "verdict": verdict,
                "seconds": seconds,
                "checks": {"equivalence": {"status": verdict}, "leaks": {"status": "pass"}},
                "golden": {"status": "match", "fingerprint": "cpu-test-0000"},
                "leaks": {"host_held_bytes": [0, 0, 0]},
            }
        )
    return {
        "status": "complete",
        "commit": {"sha": "ab" * 20, "dirty": False},
        "device": "cpu",
        "matrix": "default",
        "model_size": "tiny",
        "backend": "reference",
        "tests": {"collected": 100, "failed": 1 if failing else 0},
        "failed_tests": [f"cases/test_x.py::{failing}"] if failing else [],
        "cases": cases,
    }


@pytest.fixture
def nightly(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``harness.tools.nightly`` whose pytest session writes the next summary of ``nights``."""
    import harness.tools.nightly as module

    nights: list[dict[str, Any]] = []
    real = subprocess.run

    def session(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "--report-name" not in argv:  # git, asked for the commit
            return real(argv, **kwargs)
        folder = Path(argv[argv.index("--report-dir") + 1]) / argv[argv.index("--report-name") + 1]
        folder.mkdir(parents=True)
        night = nights.pop(0)
        (folder / "summary.json").write_text(json.dumps(night))
        failed = night["tests"]["failed"]
        return subprocess.CompletedProcess(argv, 1 if failed else 0)

    names = (f"night-{i}" for i in itertools.count(1))
    monkeypatch.setattr(module, "folder_name", lambda: next(names))  # several in one second
    monkeypatch.setattr(module.subprocess, "run", session)
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: 0)
    return argparse.Namespace(main=module.main, nights=nights)


def test_nightly_records_each_night_and_goes_red_on_a_flag(
    tmp_path: Path, nightly: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    history = tmp_path / "h.sqlite"
    argv = ["--matrix", "default", "--report-dir", str(tmp_path), "--history", str(history)]
    nightly.nights += [_night(1.0), _night(1.01), _night(0.99), _night(3.0), _night(1.0)]
    for _ in range(3):
        assert nightly.main(argv) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert nightly.main(argv) == 1
    out = capsys.readouterr().out
    assert "nightly: RED" in out and "trend: 25 flag(s)" in out and "case seconds 3.000 s" in out
    assert (tmp_path / "night-4" / "trend.html").is_file()
    assert 'href="trend.html"' in (tmp_path / "night-4" / "index.html").read_text()
    assert nightly.main([*argv, "--trend", "warn"]) == 0
    assert "nightly: green" in capsys.readouterr().out


def test_nightly_flags_a_check_that_regressed(
    tmp_path: Path, nightly: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    history = tmp_path / "h.sqlite"
    argv = ["--matrix", "default", "--report-dir", str(tmp_path), "--history", str(history)]
    failing = default_matrix()[0].name
    nightly.nights += [_night(1.0), _night(1.0), _night(1.0), _night(1.0, failing=failing)]
    for _ in range(3):
        assert nightly.main(argv) == 0
    capsys.readouterr()
    assert nightly.main([*argv, "--trend", "warn"]) == 1  # the failed case is red anyway
    out = capsys.readouterr().out
    assert f"FLAG regression: {failing}: check equivalence on run #4 " in out
    assert "after passing on the last 3 run(s): #1 " in out


def test_nightly_refuses_an_unusable_history_before_the_session(
    tmp_path: Path, nightly: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt = tmp_path / "h.sqlite"
    corrupt.write_text("garbage " * 200)
    argv = ["--matrix", "default", "--report-dir", str(tmp_path), "--history", str(corrupt)]
    assert nightly.main(argv) == 2  # no night queued: a session started would raise
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable history" in err[0]
    bench = ["--matrix", "default", "--report-dir", str(tmp_path), "--bench", "b.json"]
    assert nightly.main(bench) == 2
    assert "--bench is recorded into --history" in capsys.readouterr().err


def _bench(copy_gbs: float, ratio: float = 1.05) -> dict[str, Any]:
    """A ``bench.json`` of one model: the baseline and the reference variant."""
    variants = {
        "baseline": {"status": "ok", "step_s": 0.100, "round_ratio": [1.0], "ratio": 1.0},
        "reference": {
            "status": "ok",
            "step_s": 0.100 * ratio,
            "ratio": ratio,
            "effective_gbs": copy_gbs,
            "peak_bytes": 2**30,
            "host_time": {"total_s": 0.002},
        },
    }
    return {
        "created_utc": "2026-12-06T03:00:00+00:00",
        "commit": {"sha": "cd" * 20, "dirty": False},
        "device": "cpu",
        "models": [{"model": "small", "variants": variants}],
    }


def test_bench_variants_are_recorded_and_a_slower_copy_rate_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = tmp_path / "h.sqlite"
    for night, (rate, ratio) in enumerate([(20.1, 1.05), (19.8, 1.06), (20.0, 1.05), (9.0, 1.05)]):
        path = tmp_path / f"bench-{night}.json"
        path.write_text(json.dumps(_bench(rate, ratio)))
        code, out = _trend(history, capsys, "--bench", str(path))
        assert f"history: recorded run #{night + 1} in " in out
    assert code == 1, out
    (flag,) = _flags(out)
    assert flag.startswith("copy rate: small/reference: bench copy rate 9 GB/s on run #4 ")
    assert "is below its band" in flag and "/bench" in out.splitlines()[1]
