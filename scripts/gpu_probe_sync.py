#!/usr/bin/env python3
"""The host-sync guard against real CUDA syncs, in under a minute: seven small offloaders, each
trained ``GUARDED_STEP + 1`` steps of ``hybrid-tiny`` with the guard armed on step
``GUARDED_STEP`` (``harness.measure.syncguard.run_guarded``), one line per scenario (the verdict
expected against the one got), and the fixture of what the guard recorded written to ``--out``
(format: ``harness.measure.syncdetect``; CPU tests replay it).

    PYTHONPATH=$PWD python3 scripts/gpu_probe_sync.py --out tests/fixtures/gpu/syncguard-h100.json

==================== ======================================================= ==================
scenario             the offloader                                           expected
==================== ======================================================= ==================
pack-item            ``.item()`` in its pack hook                            fail, pack
unpack-synchronize   ``torch.cuda.synchronize()`` in its unpack hook         fail, unpack
unpack-stream-sync   ``current_stream().synchronize()`` in its unpack hook   fail, unpack
unpack-blocking-copy a blocking ``host.to("cuda")`` in its unpack hook       fail, unpack
swallows-error       ``.item()`` in pack inside ``try/except RuntimeError``  fail, pack
function-backward    its own autograd Function at commit, ``.item()`` in     fail, backward of
                     that Function's backward                                the commit
clean-pinned         pinned host buffers, ``non_blocking`` copies both ways  pass
==================== ======================================================= ==================

Every run must also raise nothing, give the plain run's losses bitwise and record one hit per
sync the offloader made in the guarded step (it counts its own: none missed, none counted twice,
``Stream.synchronize()`` included), under a filter that would turn the sync warning into an error
(a user's ``-W error``). Exit 0 when every scenario got what it expected, 1 on a mismatch (the
fixture is written all the same), 2 on bad input. Needs the repository on ``PYTHONPATH`` (or the
package installed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.measure.syncdetect import SYNC_MESSAGE, Scenario, fixture
from harness.measure.syncguard import GUARDED_STEP, GuardedRun, SyncGuard, run_guarded
from harness.models.train import train
from harness.offload.passthrough import NoOffload, apply_to_first
from harness.vocab.spec import RunSpec, preset

SPEC = preset("hybrid-tiny")
RUN = RunSpec(steps=GUARDED_STEP + 1, microbatches=2, schedule="1f1b", precision="fp32")
SELECTED = ("core_attn", "attn_proj")
MIN_NUMEL = 1024


class _Group:
    def __init__(self, hooks: Any, x: torch.Tensor, commit: Callable[[Any], Any]) -> None:
        self.hooks, self.input, self._commit = hooks, x, commit

    def __enter__(self) -> _Group:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    def commit(self, output: Any, release: Any = ()) -> Any:
        return self._commit(output)


class Pinned:
    """A correct offloader: every saved activation of a selected group over ``MIN_NUMEL``
    elements to a pinned host buffer and back, ``non_blocking`` both ways on the current stream
    (the caching host allocator keeps a buffer until its copy is done). A subclass that
    synchronises counts each of its syncs per step (``synced``), so the probe can hold the
    guard's hits to one per sync: none missed, none counted twice."""

    name = "probe.pinned"

    def __init__(self) -> None:
        self.enabled = True
        self.step = 0
        self.syncs: Counter[int] = Counter()

    def synced(self) -> None:
        self.syncs[self.step] += 1

    def stays(self, t: torch.Tensor) -> bool:
        return not t.is_cuda or isinstance(t, torch.nn.Parameter) or t.numel() < MIN_NUMEL

    def pack(self, t: torch.Tensor) -> Any:
        if self.stays(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return (t.device, host)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return self.reload(host, device)

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device, non_blocking=True)

    def commit(self, output: Any) -> Any:
        return output

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> _Group:
        if self.enabled and name in SELECTED and torch.is_grad_enabled():
            hooks: Any = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            return _Group(hooks, x, self.commit)
        return _Group(contextlib.nullcontext(), x, lambda output: output)

    def begin_microbatch(self, microbatch: int) -> None:
        return None

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        return None  # a weight view it moves comes back unchanged: no loss and no sync differ

    def end_iteration(self) -> None:
        self.step += 1

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def iteration_logs(self) -> list[Any]:
        return []

    def close(self) -> None:
        return None


class PackItem(Pinned):
    def pack(self, t: torch.Tensor) -> Any:
        if not self.stays(t):
            self.synced()
            t.reshape(-1)[0].item()
        return super().pack(t)


class UnpackSynchronize(Pinned):
    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, torch.Tensor):
            self.synced()
            torch.cuda.synchronize()
        return super().unpack(packed)


class UnpackStreamSynchronize(Pinned):
    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, torch.Tensor):
            self.synced()
            torch.cuda.current_stream().synchronize()  # ATen's check flags it; not wrapped
        return super().unpack(packed)


class UnpackBlockingCopy(Pinned):
    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.synced()
        return host.to(device)  # blocking: the host waits for the copy


class SwallowsError(Pinned):
    def pack(self, t: torch.Tensor) -> Any:
        if not self.stays(t):
            self.synced()
            try:  # hides the error the debug mode "error" raised here
                t.reshape(-1)[0].item()
            except RuntimeError:
                pass
        return super().pack(t)


class _ItemOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: Pinned) -> torch.Tensor:
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.owner.synced()
        grad.reshape(-1)[0].item()
        return grad, None


class FunctionBackward(Pinned):
    def commit(self, output: Any) -> Any:
        return apply_to_first(output, _ItemOnBackward.apply, self)


@dataclass(frozen=True)
class Expected:
    name: str
    factory: Callable[[], Pinned]
    status: str
    kind: str = ""
    call: str = ""
    window_end: str = ""


SCENARIOS = (
    Expected("pack-item", PackItem, "fail", "pack", SYNC_MESSAGE, ": pack"),
    Expected(
        "unpack-synchronize",
        UnpackSynchronize,
        "fail",
        "unpack",
        "torch.cuda.synchronize()",
        ": unpack",
    ),
    Expected(
        "unpack-stream-sync",
        UnpackStreamSynchronize,
        "fail",
        "unpack",
        SYNC_MESSAGE,
        ": unpack",
    ),
    Expected(
        "unpack-blocking-copy", UnpackBlockingCopy, "fail", "unpack", SYNC_MESSAGE, ": unpack"
    ),
    Expected("swallows-error", SwallowsError, "fail", "pack", SYNC_MESSAGE, ": pack"),
    Expected(
        "function-backward",
        FunctionBackward,
        "fail",
        "backward",
        SYNC_MESSAGE,
        ": backward of the commit",
    ),
    Expected("clean-pinned", Pinned, "pass"),
)


def _mismatches(expected: Expected, run: GuardedRun, made: int, plain: torch.Tensor) -> list[str]:
    """What differs from ``expected`` in ``run``, whose offloader made ``made`` syncs in the
    guarded step ([]: as expected)."""
    out = []
    got = "fail" if run.hits else "pass"
    if got != expected.status:
        out.append(f"expected {expected.status}, got {got}")
    if len(run.hits) != made:
        out.append(f"{len(run.hits)} hits for the offloader's {made} syncs")
    if run.evidence_problems():
        out += run.evidence_problems()
    if run.losses is None or not torch.equal(run.losses, plain):
        out.append("losses differ from the plain run's")
    if run.hits:
        first = run.hits[0]
        if (first.kind, first.call) != (expected.kind, expected.call):
            out.append(
                f"first hit {first.kind}/{first.call}, expected {expected.kind}/{expected.call}"
            )
        if not first.window.endswith(expected.window_end):
            out.append(f"first hit's window {first.window!r}")
    return out


def probe(expected: Expected, plain: torch.Tensor) -> tuple[bool, Scenario | None]:
    """Run one scenario; print its line; its fixture entry (None if it raised)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=SYNC_MESSAGE, category=UserWarning)
        offloader = expected.factory()
        try:
            run = run_guarded(
                SPEC,
                RUN,
                offloader,
                "cuda",
                guarded={GUARDED_STEP},
                guard=SyncGuard("cuda"),
            )
        except Exception as exc:
            print(
                f"{expected.name:22} expected {expected.status:4} got raised  MISMATCH: "
                f"{type(exc).__name__}: {exc}"
            )
            return False, None
    problems = _mismatches(expected, run, offloader.syncs[GUARDED_STEP], plain)
    got = "fail" if run.hits else "pass"
    first = run.hits[0] if run.hits else None
    seen = (
        f"{len(run.hits)} hits, first {first.describe()} [thread {first.thread}]"
        if first
        else (f"{sum(run.windows.values())} windows, {run.observed_d2h} D2H copies seen")
    )
    verdict = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
    print(f"{expected.name:22} expected {expected.status:4} got {got:4}  {verdict}  ({seen})")
    return not problems, run.scenario(expected.name, expected.status)


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the fixture JSON to write")
    args = parser.parse_args(argv)
    if not args.out.parent.is_dir():
        print(f"gpu_probe_sync: --out: no folder {args.out.parent}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_probe_sync: needs a CUDA device (none is visible)", file=sys.stderr)
        return 2
    began = time.perf_counter()
    plain = train(SPEC, RUN, NoOffload(), "cuda").losses
    results = [probe(expected, plain) for expected in SCENARIOS]
    machine = (
        f"{torch.cuda.get_device_name()}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    provenance = (
        f"Written by scripts/gpu_probe_sync.py on {today} at commit {_commit()}; "
        "scripts/gpu_verify refreshes it: python3 scripts/gpu_probe_sync.py --out "
        "tests/fixtures/gpu/syncguard-h100.json"
    )
    scenarios = [scenario for _, scenario in results if scenario is not None]
    document = fixture(scenarios, machine=machine, provenance=provenance)
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    ok = all(passed for passed, _ in results)
    print(
        f"{sum(p for p, _ in results)}/{len(results)} as expected in "
        f"{time.perf_counter() - began:.1f} s; fixture: {args.out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
