"""Golden loss traces: the plain baseline's per-microbatch losses of each case, stored as text per
machine numerics fingerprint (``harness.measure.fingerprint``), so a change of the model, the runner
or the libraries shows up as drift, separately from the offload-vs-baseline verdict.

Paths: ``<golden root>/<fingerprint id>/<variant>/<case file>.txt``.

* The golden root is the checkout's ``cases/golden/`` (installed: the package's copy,
  ``harness/suite/golden/``), or the folder named by the environment variable
  ``OFFLOAD_HARNESS_GOLDEN_DIR`` (a CI's own goldens); ``golden_root`` says which.
* The fingerprint id (``cpu-avx2-1a2b3c4d``) names the machine kind; its folder holds a
  ``FINGERPRINT`` file with every field, and each trace repeats them in its header.
* The variant is the model size, with ``-ranks<N>`` for sharded cases under torchrun at N ranks
  (each rank then trains on its own data shard, so rank 0's trace - the one stored - depends on
  N): ``tiny``, ``small``, ``tiny-ranks2``.
* The case file is the case id with characters awkward in file names (``*``) percent-encoded
  (``moe-%2AE%2AE_...``).

Format (torchtitan's loss traces): ``#:`` lines are the writer's fingerprint fields, other ``#``
lines comments, then one ``step microbatch loss`` line per microbatch, the loss written with
``repr(float)`` so reading it back gives the same fp32 bits. Files change only through
``--update-golden``.

Verdicts: ``match``; ``mismatch`` (this machine's fingerprint equals the writer's, so the numbers
really changed); ``missing`` (no trace for this machine's fingerprint: reported, never a failure,
except where a gate asks for it); ``malformed`` (a golden file that cannot be read: a failure).
A folder recorded before fingerprints existed has ``?`` for the fields nobody wrote down: a
machine that agrees with every recorded field compares against it, and a match there counts,
but a mismatch reads as ``missing`` - such a trace can confirm the numbers, never refute them.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.measure.fingerprint import Fingerprint
from harness.util.compare import first_divergence, loss_table

CHECKOUT_ROOT = Path(__file__).resolve().parents[2] / "cases" / "golden"
"""Where a checkout keeps the committed golden files."""
INSTALLED_ROOT = Path(__file__).resolve().parents[1] / "suite" / "golden"
"""Where an installed package keeps them (the checkout's ``cases/`` is ``harness.suite``)."""

ROOT_VARIABLE = "OFFLOAD_HARNESS_GOLDEN_DIR"
"""The environment variable that names another golden root."""

FINGERPRINT_FILE = "FINGERPRINT"


def golden_root() -> Path | None:
    """``$OFFLOAD_HARNESS_GOLDEN_DIR`` if set, else the checkout's ``cases/golden/`` if this
    package runs from a checkout, else the installed package's copy, else None."""
    named = os.environ.get(ROOT_VARIABLE)
    if named:
        return Path(named)
    for root in (CHECKOUT_ROOT, INSTALLED_ROOT):
        if root.is_dir():
            return root
    return None


def variant(model_size: str, sharding: str = "none", world_size: int = 1) -> str:
    """``tiny``, ``small``, or either with ``-ranks<N>`` for a sharded case at N > 1 ranks."""
    return (
        f"{model_size}-ranks{world_size}" if sharding != "none" and world_size > 1 else model_size
    )


def golden_path(fingerprint_id: str, variant_name: str, case_name: str, root: Path) -> Path:
    """The golden file of a case for a fingerprint and variant."""
    name = f"{urllib.parse.quote(case_name, safe='+-_.')}.txt"
    return root / fingerprint_id / variant_name / name


def trace_text(
    losses: torch.Tensor, comments: tuple[str, ...] = (), fingerprint: Fingerprint | None = None
) -> str:
    """A [steps, microbatches] loss tensor as ``step microbatch loss`` lines (``repr`` floats),
    after the fingerprint's ``#:`` lines and ``#`` comments."""
    lines = [f"#: {line}" for line in (fingerprint.lines() if fingerprint else [])]
    lines += [f"# {c}" for c in comments]
    steps, microbatches = losses.shape
    lines += [
        f"{step} {mb} {float(losses[step, mb])!r}"
        for step in range(steps)
        for mb in range(microbatches)
    ]
    return "\n".join(lines) + "\n"


def parse_trace(text: str, source: str = "trace") -> torch.Tensor:
    """The fp32 [steps, microbatches] tensor of a trace; a malformed line is a ``ValueError``."""
    rows: dict[tuple[int, int], float] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            step, mb, loss = line.split()
            rows[(int(step), int(mb))] = float(loss)
        except ValueError:
            raise ValueError(
                f"{source}:{number}: expected 'step microbatch loss', got {line!r}"
            ) from None
    if not rows:
        raise ValueError(f"{source}: no 'step microbatch loss' lines")
    steps = max(s for s, _ in rows) + 1
    microbatches = max(m for _, m in rows) + 1
    if set(rows) != {(s, m) for s in range(steps) for m in range(microbatches)}:
        raise ValueError(f"{source}: the (step, microbatch) pairs do not form a full grid")
    out = torch.empty(steps, microbatches, dtype=torch.float32)
    for (step, mb), loss in rows.items():
        out[step, mb] = loss
    return out


def trace_fingerprint(text: str, source: str = "trace") -> Fingerprint | None:
    """The writer's fingerprint from a trace's ``#:`` lines (None if it has none)."""
    lines = [line[2:].strip() for line in text.splitlines() if line.startswith("#:")]
    return Fingerprint.parse(lines, source) if lines else None


def read_fingerprint(folder: Path) -> Fingerprint:
    """The ``FINGERPRINT`` file of a golden folder; a malformed one is a ``ValueError``."""
    path = folder / FINGERPRINT_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return Fingerprint.parse(text.splitlines(), str(path))


@dataclass(frozen=True, kw_only=True, slots=True)
class GoldenCheck:
    """The outcome of comparing a baseline trace with its golden file."""

    status: str
    """``match``, ``mismatch``, ``missing``, ``malformed`` or ``updated``."""
    path: Path | None
    message: str
    fingerprint: str = ""
    """This machine's fingerprint id."""

    @property
    def ok(self) -> bool:
        return self.status not in ("mismatch", "malformed")

    def record(self) -> dict[str, str]:
        """The report fields of this check."""
        path = self.path
        if path is not None and path.is_relative_to(CHECKOUT_ROOT.parents[1]):
            path = path.relative_to(CHECKOUT_ROOT.parents[1])
        return {
            "status": self.status,
            "path": str(path) if path is not None else "",
            "fingerprint": self.fingerprint,
            "message": self.message,
        }


def _other_traces(
    root: Path, here: Fingerprint, variant_name: str, case_name: str
) -> list[tuple[Path, Fingerprint]]:
    """The case's golden files in other machines' folders, each with its folder's fingerprint,
    in folder-name order."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != here.id):
        path = golden_path(folder.name, variant_name, case_name, root)
        if path.is_file():
            found.append((path, read_fingerprint(folder)))
    return found


def _elsewhere(others: list[tuple[Path, Fingerprint]], here: Fingerprint) -> str:
    """Which other machines have a trace of this case, and how they differ from this one."""
    listed = []
    for path, recorded in others:
        diff = "; ".join(recorded.differences(here, keyed_only=True))
        listed.append(f"{path.parents[1].name} ({diff})" if diff else path.parents[1].name)
    return f"; traces of this case exist for: {', '.join(listed)}" if listed else ""


def _missing(here: Fingerprint, path: Path | None, why: str, extra: str = "") -> GoldenCheck:
    return GoldenCheck(
        status="missing",
        path=path,
        fingerprint=here.id,
        message=f"no golden trace for this machine (fingerprint {here.id}: {here.summary()})"
        f"{why}{extra}; record one with --update-golden (`offload-harness run --update-golden` "
        f"or `python -m pytest cases/test_golden.py --update-golden`) and commit it",
    )


def check(
    case_name: str,
    losses: torch.Tensor,
    here: Fingerprint,
    variant_name: str,
    *,
    root: Path | None = None,
) -> GoldenCheck:
    """Compare a plain-baseline trace with the golden file of this machine, bitwise."""
    root = root if root is not None else golden_root()
    if root is None or not root.is_dir():
        where = f"{root} is not a folder" if root is not None else "not a checkout"
        return _missing(
            here, root, f" - no golden root ({where}; set {ROOT_VARIABLE} to a golden folder)"
        )
    own = golden_path(here.id, variant_name, case_name, root)
    try:
        others = _other_traces(root, here, variant_name, case_name)
        # This machine's own folder first, then partial ones (recorded before fingerprints)
        # whose recorded fields it fits.
        candidates = [own] if own.is_file() else []
        candidates += [path for path, fp in others if fp.partial and fp.fits(here)]
        if not candidates:
            return _missing(here, own, "", _elsewhere(others, here))
        unconfirmed = []
        for path in candidates:
            text = path.read_text()
            golden = parse_trace(text, str(path))
            recorded = trace_fingerprint(text, str(path)) or read_fingerprint(path.parents[1])
            outcome = _compare(path, golden, losses.float(), here, recorded)
            if outcome.status == "match" or not recorded.partial:
                return outcome
            unconfirmed.append(f"{path.parents[1].name} ({outcome.message.splitlines()[0]})")
    except (OSError, ValueError) as exc:
        return GoldenCheck(
            status="malformed", path=own, fingerprint=here.id, message=f"golden file: {exc}"
        )
    why = (
        " - the traces recorded before fingerprints that this machine fits do not match, and "
        "they cannot tell a numerics change from a machine that differs in a field they did "
        f"not record: {'; '.join(unconfirmed)}"
    )
    return _missing(here, own, why)


def _compare(
    path: Path, golden: torch.Tensor, losses: torch.Tensor, here: Fingerprint, recorded: Fingerprint
) -> GoldenCheck:
    if golden.shape != losses.shape:
        message = (
            f"this run's trace has {tuple(losses.shape)} (steps, microbatches), golden {path} "
            f"has {tuple(golden.shape)}"
        )
        return GoldenCheck(status="mismatch", path=path, fingerprint=here.id, message=message)
    divergence = first_divergence(golden, losses, labels=("golden", "this run"))
    if divergence is None:
        note = (
            f" ({path.parents[1].name}, recorded before fingerprints)" if recorded.partial else ""
        )
        return GoldenCheck(
            status="match",
            path=path,
            fingerprint=here.id,
            message=f"baseline matches the golden trace{note}",
        )
    differing = recorded.differences(here)
    machines = (
        "fingerprint fields that differ (golden vs this machine): " + "; ".join(differing)
        if differing
        else "the machines' fingerprints are identical: a real numerics change (model, runner "
        "or library), not a different machine"
    )
    message = "\n".join(
        [
            f"the plain baseline drifted from its golden trace {path}: first at {divergence}",
            machines,
            loss_table(golden, losses, labels=("golden", "this run")),
            "if the change is intended, rewrite it with --update-golden and commit the file",
        ]
    )
    return GoldenCheck(status="mismatch", path=path, fingerprint=here.id, message=message)


def update(
    case_name: str,
    losses: torch.Tensor,
    here: Fingerprint,
    variant_name: str,
    *,
    root: Path | None = None,
) -> GoldenCheck:
    """Write (or rewrite) the golden file of a case for this machine, and its folder's
    ``FINGERPRINT`` file."""
    root = root if root is not None else golden_root()
    if root is None:
        raise ValueError(f"--update-golden: no golden root (not a checkout; set {ROOT_VARIABLE})")
    path = golden_path(here.id, variant_name, case_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    (root / here.id / FINGERPRINT_FILE).write_text("\n".join(here.lines()) + "\n")
    path.write_text(trace_text(losses, fingerprint=here))
    return GoldenCheck(status="updated", path=path, fingerprint=here.id, message=f"wrote {path}")
