"""Reports: ``summary.json`` first (machine, commit, per-case results); everything printed is
rendered from it.

Folder names: ``reports/<UTC time>_<harness sha>[_dirty]/``, each created atomically
(``run_folder``: ``mkdir`` without ``exist_ok``, the next ``-2``, ``-3``... suffix on
``FileExistsError``), so runs started together on one parent never share a folder.
``claim_run_folder`` also proves the folder writable before any training (``ReportDirError``).
The commit recorded is the harness's own (its package's checkout; where git cannot tell, as in
a copy of the tree without ``.git``, ``$OFFLOAD_HARNESS_COMMIT``; else its installed version),
not the current directory's.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import torch

import harness


def _version() -> str:
    try:
        return importlib.metadata.version("offload-harness")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


HARNESS_VERSION = _version()

PACKAGE_DIR = Path(harness.__file__).resolve().parent
"""The harness package's folder: its git checkout (if any) is the commit a report records."""

COMMIT_VARIABLE = "OFFLOAD_HARNESS_COMMIT"
"""Environment variable: the harness's commit where git cannot tell (a copy of the work tree
without ``.git``, as a lent GPU machine receives it); git's answer wins where there is one."""

_SHA = re.compile(r"[0-9a-f]{7,64}")

STATUSES = ("complete", "running", "interrupted", "terminated", "timed-out", "aborted")
"""``summary.json``'s ``status``: the run ended by itself (``complete``, the default), it is
still going and the file is rewritten as cases finish (``running``; also what a run killed
with SIGKILL leaves), Ctrl-C stopped it (``interrupted``), SIGTERM or SIGHUP stopped it
(``terminated``), a case outlived its
timeout and could not be unwound (``timed-out``), another rank of a torchrun job died or the
process group broke (``aborted``)."""


REPORT_INCOMPLETE = 6
"""The exit code of a run or pytest session whose report folder could not be written
completely (disk full, folder removed, permissions changed mid-run): distinct from pytest's
own 0-5 and from 128 + a signal. The console output holds every verdict."""


class ReportDirError(ValueError):
    """A report folder that cannot be created or written; the message is one line,
    ``--report-dir <path>: <reason>``."""


def _git(*args: str, cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=10, cwd=cwd
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip()


def _checkout_commit(where: Path | None) -> dict[str, Any]:
    """Sha and dirty flag of the git checkout holding ``where`` (None: the current
    directory); ``sha`` None when it is in none."""
    sha = _git("rev-parse", "HEAD", cwd=where)
    if not sha:
        return {"sha": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=where)
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def _harness_checkout() -> Path | None:
    """The harness package's folder when a git checkout tracks it (an editable install or a
    run from the source tree); None for an installed copy (even one inside another
    repository's work tree, e.g. a virtual environment in a project)."""
    tracked = _git("ls-files", "--error-unmatch", "__init__.py", cwd=PACKAGE_DIR)
    return PACKAGE_DIR if tracked else None


def given_commit() -> str | None:
    """``$OFFLOAD_HARNESS_COMMIT``, lowercased; None when unset or empty. A value that is no
    commit sha (7 to 64 hex digits) is a ``ValueError`` with one line: the entry points that
    write a report call this before any work (``claim_run_folder`` does)."""
    value = os.environ.get(COMMIT_VARIABLE, "").strip()
    if not value:
        return None
    if not _SHA.fullmatch(value.lower()):
        raise ValueError(
            f"{COMMIT_VARIABLE} must be a git commit sha (7 to 64 hex digits); the "
            f"environment has {value!r}"
        )
    return value.lower()


def commit_info() -> dict[str, Any]:
    """The harness's own commit: ``sha`` and ``dirty`` (uncommitted changes to tracked files)
    of the checkout its package lives in, ``source`` ``git``; where git cannot tell (no
    checkout tracks the package, e.g. a copy of the tree without ``.git``) the sha
    ``$OFFLOAD_HARNESS_COMMIT`` names, ``dirty`` None (unknown) and ``source``
    ``environment``; without it ``sha`` and ``dirty`` are None and ``source`` is ``package``.
    ``version`` is the installed package version in every case."""
    checkout = _harness_checkout()
    found = _checkout_commit(checkout) if checkout is not None else {"sha": None, "dirty": None}
    source = "git"
    if not found["sha"]:
        given = given_commit()
        found = {"sha": given, "dirty": None}
        source = "environment" if given else "package"
    return {**found, "source": source, "version": HARNESS_VERSION}


def cwd_commit_info(harness_commit: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The current directory's checkout (``path``, ``sha``, ``dirty``) when it is a git
    checkout at another commit than the harness's (e.g. a project that runs the harness from
    its own tree); None when it is in no checkout or at the harness's commit."""
    harness_commit = harness_commit if harness_commit is not None else commit_info()
    found = _checkout_commit(None)
    if not found["sha"] or found["sha"] == harness_commit.get("sha"):
        return None
    return {"path": str(Path.cwd()), **found}


def machine_info() -> dict[str, Any]:
    """Host, torch, CUDA and GPU facts."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        info["driver"] = driver.splitlines()[0] if driver else None
    return info


def folder_name() -> str:
    """``<UTC time>_<harness sha>[_dirty]`` for a new report folder (the sha from git or
    ``$OFFLOAD_HARNESS_COMMIT``; ``v<version>`` instead for an installed copy without either,
    ``nogit`` when nothing is known)."""
    commit = commit_info()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if commit["sha"]:
        ident = commit["sha"][:10]
    else:
        ident = f"v{commit['version']}" if commit["version"] != "unknown" else "nogit"
    return f"{stamp}_{ident}{'_dirty' if commit['dirty'] else ''}"


def free_folder(root: Path, name: str) -> Path:
    """``root/name``, or ``name-2``, ``name-3``... when taken; not created, so only a guess:
    another run may take it first. Create folders with ``run_folder``."""
    for attempt in range(1, 1000):
        folder = root / _suffixed(name, attempt)
        if not folder.exists():
            return folder
    raise FileExistsError(f"no free report folder name under {root} for {name}")


def _suffixed(name: str, attempt: int) -> str:
    return name if attempt == 1 else f"{name}-{attempt}"


def run_folder(root: Path, name: str | None = None) -> Path:
    """Create a new report folder ``root/name`` (default ``folder_name()``), or ``name-2``,
    ``name-3``... when taken: each ``mkdir`` is atomic (no ``exist_ok``), so of several runs
    claiming one name at once each gets its own folder. Raises the ``OSError`` of a parent
    that cannot hold it (``claim_run_folder`` turns that into a one-line ``ReportDirError``)."""
    base = name or folder_name()
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        folder = root / _suffixed(base, attempt)
        try:
            folder.mkdir()
        except FileExistsError:  # another run's (or a file): the next suffix
            continue
        return folder
    raise FileExistsError(f"no free report folder name under {root} for {base}")


_PROBE = ".write-test"


def claim_run_folder(root: Path, name: str | None = None, *, exact: bool = False) -> Path:
    """Create this run's report folder under ``root`` (``run_folder``; with ``exact``, exactly
    ``root/name``, which must not exist yet) and prove it writable with a probe file, before
    any training. Raises ``ReportDirError`` with one line, ``--report-dir <root>: <reason>``
    (a file, a read-only or unwritable folder, ``/proc``...; with ``exact``, ``--report-name
    <name>: ... already exists``); a malformed ``$OFFLOAD_HARNESS_COMMIT`` is the
    ``ValueError`` of ``given_commit``, before anything is created."""
    given_commit()
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ReportDirError(f"--report-dir {root}: not a folder (a file is in the way)")
    try:
        if exact:
            if not name:
                raise ValueError("an exact report folder needs a name")
            folder = root / name
            root.mkdir(parents=True, exist_ok=True)
            try:
                folder.mkdir()
            except FileExistsError:
                raise ReportDirError(
                    f"--report-name {name}: {folder} already exists (pick a new name)"
                ) from None
        else:
            folder = run_folder(root, name)
    except OSError as exc:
        raise ReportDirError(
            f"--report-dir {root}: cannot create a folder there: {_why(exc)}"
        ) from None
    probe = folder / _PROBE
    try:
        with probe.open("x", encoding="utf-8") as file:
            file.write("offload-harness write test\n")
        probe.unlink()
    except OSError as exc:
        for leftover in (probe.unlink, folder.rmdir):  # leave nothing behind
            try:
                leftover()
            except OSError:
                pass
        reason = f"cannot write into {folder}: {_why(exc)}"
        raise ReportDirError(f"--report-dir {root}: {reason}") from None
    return folder


def _why(exc: OSError) -> str:
    """An OSError as one line: its message and the path it names."""
    text = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename else ""
    return " ".join(f"{text}{where}".split())


@functools.lru_cache(maxsize=8)
def _session_facts(
    package_dir: Path, cwd: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Machine, harness commit and current-directory commit, read once per (package folder,
    current directory): a run rewrites summary.json after every case, and each read costs five
    git calls (and nvidia-smi on CUDA). The summary describes the tree the run started from."""
    commit = commit_info()
    return machine_info(), commit, cwd_commit_info(commit)


def summary_text(cases: list[dict[str, Any]], *, status: str = "complete", **extra: Any) -> str:
    """The JSON text of a session summary: version, time, ``status`` (one of ``STATUSES``),
    machine, commit (the harness's), ``cwd_commit`` (only when the current directory is
    another checkout or commit), ``extra``, cases."""
    if status not in STATUSES:
        raise ValueError(f"summary status must be one of {', '.join(STATUSES)}; got {status!r}")
    machine, commit, cwd_commit = _session_facts(PACKAGE_DIR, Path.cwd())
    summary = {
        "harness_version": HARNESS_VERSION,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "machine": machine,
        "commit": commit,
        **({"cwd_commit": cwd_commit} if cwd_commit is not None else {}),
        **extra,
        "cases": cases,
    }
    return json.dumps(summary, indent=2, sort_keys=False, default=str) + "\n"


def write_summary(
    folder: Path, cases: list[dict[str, Any]], *, status: str = "complete", **extra: Any
) -> Path:
    """Write ``summary.json`` into ``folder`` atomically (a temporary file in the same folder,
    then ``os.replace``): a caller may rewrite it after every case (``status="running"``) and
    a reader sees the old file or the new one, never half of one. Returns its path."""
    path = folder / "summary.json"
    text = summary_text(cases, status=status, **extra)
    fd, temporary = tempfile.mkstemp(prefix=".summary.", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the report from other users
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def is_failure(case: dict[str, Any]) -> bool:
    """Whether a case record counts as a failure: a verdict other than ``pass``, ``skip`` or
    ``inert`` (a skip is a configuration the model's library refused, neither a pass nor a
    failure; an inert case is configured to move nothing, moved nothing and stayed bitwise)."""
    return case.get("verdict") not in ("pass", "skip", "inert")


def inert_reason(case: dict[str, Any]) -> str:
    """Why a case record with the verdict ``inert`` moves nothing (``inert: nothing eligible
    ...``)."""
    return str(case.get("inert") or "inert: nothing eligible")


def skip_reason(case: dict[str, Any]) -> str:
    """Why a case record with the verdict ``skip`` skipped: its first skipped check's reason."""
    reasons = [
        c.get("reason", "") for c in case.get("checks", {}).values() if c["status"] == "skip"
    ]
    return next((r for r in reasons if r), "skipped")


def write_junit(folder: Path, summary: dict[str, Any]) -> Path:
    """``junit.xml`` of a CLI run: one testcase per case, its problems as the failure text
    (pytest sessions get pytest's own JUnit XML instead)."""
    cases = summary["cases"]
    failures = sum(map(is_failure, cases))
    skips = sum(c["verdict"] == "skip" for c in cases)
    suite = ElementTree.Element(
        "testsuite",
        name="offload-harness",
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped=str(skips),
        time=str(summary.get("seconds", 0)),
        timestamp=summary.get("created_utc", ""),
        hostname=summary.get("machine", {}).get("host", ""),
    )
    for case in cases:
        element = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"offload-harness.{summary.get('backend', 'run')}",
            name=case["name"],
            time=str(case.get("duration", case.get("seconds", 0))),
        )
        if case["verdict"] == "skip":
            skip = ElementTree.SubElement(element, "skipped")
            skip.set("message", skip_reason(case)[:500])
        elif case["verdict"] != "pass":
            problems = case.get("problems") or ["failed"]
            failure = ElementTree.SubElement(element, "failure", message=problems[0][:500])
            failure.text = "\n".join(problems)
    path = folder / "junit.xml"
    tree = ElementTree.ElementTree(ElementTree.Element("testsuites"))
    tree.getroot().append(suite)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path


CHECK_COLUMNS = (
    ("equivalence", "equiv"),
    ("leaks", "leaks"),
    ("transfers", "transfers"),
    ("disabled", "disabled"),
    ("fidelity", "fidelity"),
    ("weights", "weights"),
    ("cadence", "cadence"),
    ("memory", "memory"),
    ("sync", "sync"),
    ("golden", "golden"),
)
"""The judge's checks (``harness.verify.judge.CHECKS``) and their console column headers."""


def verdict_table(summary: dict[str, Any]) -> str:
    """Console table of a summary: case, verdict, one column per check (pass / fail / skip /
    n-a), groups moved, DtoH/HtoD copies and bytes."""
    header = ("case", "verdict", *(h for _, h in CHECK_COLUMNS))
    rows = [(*header, "groups moved", "DtoH", "HtoD", "bytes each way")]
    for case in summary["cases"]:
        t = case.get("transfers", {})
        checks = case.get("checks", {})
        rows.append(
            (
                case["name"],
                case["verdict"],
                *(checks.get(name, {}).get("status", "-") for name, _ in CHECK_COLUMNS),
                ",".join(t.get("names_moved", [])) or "-",
                str(t.get("d2h_copies", "-")),
                str(t.get("h2d_copies", "-")),
                _mib(t.get("d2h_bytes")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _mib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value} ({value / 2**20:.2f} MiB)"


def case_record(res: Any) -> dict[str, Any]:
    """Report fields of a ``CaseRun``: losses of the three runs, verdict, transfers."""
    return {
        "losses": {
            "plain": res.plain.losses.tolist(),
            "hooks": res.hooks.losses.tolist(),
            "offload": res.offload.losses.tolist(),
            **({"layout": res.layout.losses.tolist()} if res.layout is not None else {}),
        },
        "baseline": "layout" if res.layout is not None else "plain",
        "plain_baseline": {"key": res.plain_key, "made_by": res.plain_made_by},
        "equivalence": res.verdict.kind,
        "equivalence_message": res.verdict.message,
        "warmup_transfers": {
            d: {"copies": c.copies, "bytes": c.bytes}
            for d, c in res.warmup_transfers.totals().items()
        },
        "checksums": _checksum_fields(res),
        "seconds": round(res.seconds, 3),
        "run_seconds": dict(res.run_seconds),
        "rule": rule_record(res),
        **_transfer_fields(res),
    }


def rule_record(res: Any) -> dict[str, Any]:
    """The rule a case's transfers were predicted with: declared by the backend (its label), or
    learned from its copies (``harness.execute.learn``: the one-line description)."""
    if res.rule is not None:
        return res.rule.record()
    return {"source": "declared", "line": f"declared rule: {res.semantics.label}"}


def _checksum_fields(res: Any) -> dict[str, int]:
    """Checksum coverage of the offload run: reloads compared, saved tensors packed in the
    harness's windows, offload copies made
    (``harness.execute.caserun.CaseRun.checksum_coverage``)."""
    return res.checksum_coverage()


def _transfer_fields(res: Any) -> dict[str, Any]:
    totals = res.counts.totals()
    per_name = {
        f"{direction}:{name}": {"copies": c.copies, "bytes": c.bytes}
        for (direction, name), c in sorted(res.counts.by_name().items())
    }
    return {
        "transfers": {
            "names_moved": sorted(res.moved_names()),
            "d2h_copies": totals["d2h"].copies,
            "d2h_bytes": totals["d2h"].bytes,
            "h2d_copies": totals["h2d"].copies,
            "h2d_bytes": totals["h2d"].bytes,
            "per_name": per_name,
            "pageable": res.counts.pageable,
            "unattributed": {d: c.copies for d, c in res.counts.unattributed.items()},
            "mode": res.counts.mode,
        },
    }


def memory_record(res: Any) -> dict[str, Any]:
    """Report fields of a ``MemoryResult``."""
    return {
        "memory": {
            "predicted_drop": res.predicted_drop,
            "requested_drop": res.requested_drop,
            "allocated_drop": res.allocated_drop,
            "rounding": res.rounding,
            "baseline_allocated_after_forward": res.baseline_allocated,
            "offload_allocated_after_forward": res.offload_allocated,
            "baseline_peak": res.baseline_peak,
            "offload_peak": res.offload_peak,
            "peak_allowance": res.peak_allowance,
            "floor_freed_blocks": res.floor_freed[0],
            "floor_freed_bytes": res.floor_freed[1],
            "baseline": {"key": res.baseline_key, "made_by": res.baseline_made_by},
            "backward": res.backward.record() if getattr(res, "backward", None) else None,
        }
    }
