"""Golden loss traces: the plain baseline's per-microbatch losses of each case, stored as text per
device kind, so a change of the model, the runner or the libraries shows up as drift, separately
from the offload-vs-baseline verdict.

Paths: ``cases/golden/<device kind>/<case file>.txt``. The device kind is ``cpu`` or
``cuda-<short GPU name>`` (``cuda-h200``), with ``-<size>`` appended when the run uses another
model size than the device's default (``tiny`` on CPU, ``small`` on CUDA) and ``-ranks<N>`` for
sharded cases under torchrun at N ranks (rank 0's trace is the one stored). The case file is the
case id with characters that are awkward in file names (``*``) percent-encoded
(``moe-%2AE%2AE_...``).

Format (torchtitan's loss traces): one ``step microbatch loss`` line per microbatch, the loss
written with ``repr(float)`` so reading it back gives the same fp32 bits; ``#`` lines are comments
(torch version and CPU capability of the machine that wrote the file, for the drift message).
Files change only through ``--update-golden``.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.compare import first_divergence, loss_table

GOLDEN_ROOT = Path(__file__).resolve().parents[1] / "cases" / "golden"
"""Where the committed golden files live."""

DEFAULT_SIZE = {"cpu": "tiny", "cuda": "small"}
"""The model size a device runs unless told otherwise; golden folders without a size suffix
hold traces of this size."""

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_VARIANT = re.compile(r"^(\d+gb|sxm\d*|pcie|hbm\d*e?|nvl\d*|mig.*)$")


def gpu_short_name(device_name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA GeForce RTX 4090`` -> ``rtx-4090``: the model, without vendor, memory or form
    factor."""
    words = [w for w in re.split(r"[\s\-_]+", device_name.lower()) if w]
    kept: list[str] = []
    for word in words:
        if word in _VENDOR_WORDS:
            continue
        if _VARIANT.match(word):
            break
        kept.append(re.sub(r"[^a-z0-9]", "", word))
    return "-".join(w for w in kept if w) or "unknown"


def device_kind(device: torch.device, model_size: str) -> str:
    """``cpu``, ``cuda-h200``, or either with ``-<size>`` for a non-default model size."""
    if device.type == "cuda":
        kind = f"cuda-{gpu_short_name(torch.cuda.get_device_name(device))}"
    else:
        kind = device.type
    if model_size != DEFAULT_SIZE.get(device.type, "tiny"):
        kind += f"-{model_size}"
    return kind


def case_kind(device: torch.device, model_size: str, sharding: str, world_size: int) -> str:
    """The device kind of a case's golden file: ``device_kind``, plus ``-ranks<N>`` for a
    sharded case at world size N > 1 (each rank then trains on its own data shard, so rank 0's
    trace depends on N)."""
    kind = device_kind(device, model_size)
    return f"{kind}-ranks{world_size}" if sharding != "none" and world_size > 1 else kind


def golden_path(kind: str, case_name: str, root: Path = GOLDEN_ROOT) -> Path:
    """The golden file of a case for a device kind."""
    return root / kind / f"{urllib.parse.quote(case_name, safe='+-_.')}.txt"


def trace_text(losses: torch.Tensor, comments: tuple[str, ...] = ()) -> str:
    """A [steps, microbatches] loss tensor as ``step microbatch loss`` lines (``repr`` floats)."""
    lines = [f"# {c}" for c in comments]
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


def machine_comments() -> tuple[str, ...]:
    """What the writing machine was: the facts a drift message needs."""
    return (
        f"torch {torch.__version__}",
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}",
        f"torch threads {torch.get_num_threads()}",
    )


def _comments(text: str) -> list[str]:
    return [line[1:].strip() for line in text.splitlines() if line.startswith("#")]


@dataclass(frozen=True, kw_only=True, slots=True)
class GoldenCheck:
    """The outcome of comparing a baseline trace with its golden file."""

    status: str
    """``match``, ``mismatch``, ``missing`` (no file for this device kind) or ``updated``."""
    path: Path
    message: str

    @property
    def ok(self) -> bool:
        return self.status != "mismatch"

    def record(self) -> dict[str, str]:
        """The report fields of this check."""
        path = self.path
        if path.is_relative_to(GOLDEN_ROOT.parents[1]):
            path = path.relative_to(GOLDEN_ROOT.parents[1])
        return {"status": self.status, "path": str(path), "message": self.message}


def check(
    case_name: str, losses: torch.Tensor, kind: str, *, root: Path = GOLDEN_ROOT
) -> GoldenCheck:
    """Compare a plain-baseline trace with the golden file, bitwise."""
    path = golden_path(kind, case_name, root)
    if not path.is_file():
        return GoldenCheck(
            status="missing",
            path=path,
            message=f"no golden trace for device kind {kind!r} at {path}; create it with "
            f"`python -m pytest cases/test_golden.py --update-golden` (or "
            f"`offload-harness run --update-golden`) on this kind of machine and commit it",
        )
    text = path.read_text()
    golden = parse_trace(text, str(path))
    if golden.shape != losses.shape:
        return GoldenCheck(
            status="mismatch",
            path=path,
            message=f"baseline trace has {tuple(losses.shape)} (steps, microbatches), golden "
            f"{path} has {tuple(golden.shape)}",
        )
    divergence = first_divergence(golden, losses.float())
    if divergence is None:
        return GoldenCheck(status="match", path=path, message="baseline matches the golden trace")
    recorded = "; ".join(_comments(text)) or "unknown machine"
    here = "; ".join(machine_comments())
    return GoldenCheck(
        status="mismatch",
        path=path,
        message="\n".join(
            [
                f"the plain baseline drifted from its golden trace {path} (a model, runner or "
                f"library change, not the offloader): first at {divergence}",
                f"golden written with: {recorded}",
                f"this machine: {here}",
                loss_table(golden, losses.float(), labels=("golden", "this run")),
                "if the change is intended, rewrite it with --update-golden and commit the file",
            ]
        ),
    )


def update(
    case_name: str, losses: torch.Tensor, kind: str, *, root: Path = GOLDEN_ROOT
) -> GoldenCheck:
    """Write (or rewrite) the golden file of a case."""
    path = golden_path(kind, case_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace_text(losses, machine_comments()))
    return GoldenCheck(status="updated", path=path, message=f"wrote {path}")
