"""Profiler traces: ``--trace`` (one chrome trace of one steady step per variant, read by
``harness.measure.timeline``, host self time against the baseline's) and the device compute of a
traced baseline step, which the copies can hide behind."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from harness.measure import timeline
from harness.models.train import RunHooks, schedule_order, train
from harness.offload.backends import Factory
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.tools.bench.common import _line
from harness.tools.bench.measure import VariantResult, _with_offloader
from harness.tools.bench.models import _setup
from harness.tools.bench.phases import _Phased, _Phases
from harness.vocab.spec import ModelSpec, RunSpec


@contextlib.contextmanager
def _profiled(device: torch.device, path: Path) -> Iterator[None]:
    """A torch.profiler trace (CPU, and CUDA on a GPU) of the enclosed code, written to
    ``path`` (a chrome trace, gzipped)."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()  # the step's device work inside the trace
    plain = path.with_suffix("")  # x.json.gz -> x.json
    prof.export_chrome_trace(str(plain))
    with plain.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


def trace_step(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    warmup: int,
    path: Path,
) -> None:
    """Train ``warmup`` steps, then profile one steady step into ``path`` (phases as ranges)."""
    order = schedule_order(run.schedule, run.microbatches)
    phases = _Phases(device, order, annotate=True)

    def step_context(step: int) -> contextlib.AbstractContextManager[object]:
        if step != warmup:
            return contextlib.nullcontext()
        return phases.around(_profiled(device, path))

    hooks = RunHooks(
        step_context=step_context, after_forward=lambda step, mb: phases.forward_end(mb)
    )
    run = run.replace(steps=warmup + 1)
    train(spec, run, _Phased(offloader, phases), device, hooks=hooks)  # type: ignore[arg-type]


def trace_variant(
    factory: Factory,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
    path: Path,
) -> str:
    """The trace of one variant: its path, or why there is none."""

    def work(offloader: Offloader) -> str:
        trace_step(spec, run, offloader, device, warmup, path)
        return str(path)

    return _with_offloader(factory, config, device, work)


def baseline_compute(
    factory: Factory | str,
    spec: ModelSpec,
    run: RunSpec,
    config: OffloadConfig,
    device: torch.device,
    warmup: int,
) -> dict[str, float] | str:
    """The device compute of one traced steady baseline step (``harness.measure.timeline``): the
    compute stream's busy seconds in the whole step and in its forwards and backwards, or why
    there are none. A profiler slows the host, not the device, so busy time is what an
    untraced step computes; it is what the copies can hide behind."""
    if isinstance(factory, str):
        return factory
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "baseline.pt.trace.json.gz"
        traced = trace_variant(factory, spec, run, config, device, warmup, path)
        if traced != str(path):
            return traced
        try:
            found = timeline.analyse(path, phases=("bench.forward", "bench.backward"))
        except Exception as exc:
            return f"not analysed: {type(exc).__name__}: {_line(exc)}"
    if found is None:
        return "no device events in the baseline's trace"
    phases = found.phase_busy_s
    if not (phases["bench.forward"] and phases["bench.backward"]):
        return "no compute found inside the baseline trace's forward or backward ranges"
    return {
        "step_s": found.busy_s,
        "forward_s": phases["bench.forward"],
        "backward_s": phases["bench.backward"],
    }


def trace_one(
    entry: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    found: dict[str, Factory | str],
) -> None:
    """One trace per variant that ran in ``entry``'s timed run, into ``args.trace``."""
    model, _, config, run = _setup(entry["model"], args, device)
    args.trace.mkdir(parents=True, exist_ok=True)
    self_times: dict[str, dict[str, float]] = {}
    for name, result in entry["variants"].items():
        factory = found[name]
        if isinstance(factory, str) or result.status != "ok":
            result.trace = f"not traced: {result.status}"
            continue
        path = args.trace / f"{entry['model']}_{name}.pt.trace.json.gz"
        result.trace = trace_variant(factory, model.spec, run, config, device, args.warmup, path)
        if result.trace == str(path):
            result.timeline, host = trace_timeline(path)
            if host is not None:
                self_times[name] = host
    host_vs_baseline(entry["variants"], self_times)


def host_vs_baseline(
    variants: dict[str, VariantResult], self_times: dict[str, dict[str, float]], top: int = 5
) -> None:
    """Into each variant's ``timeline`` that has host self times (``trace_timeline``): its host
    self time minus the baseline's, in total and for the ``top`` names that grew most
    (``harness.measure.timeline.host_increase``)."""
    base = self_times.get("baseline")
    if base is None:
        return
    for name, own in self_times.items():
        if name != "baseline":
            variants[name].timeline["host_vs_baseline"] = {  # type: ignore[index]
                "total_s": sum(own.values()) - sum(base.values()),
                "top": [[n, s] for n, s in timeline.host_increase(base, own, top)],
            }


def trace_timeline(path: Path) -> tuple[dict[str, Any] | str, dict[str, float] | None]:
    """From one read of the trace at ``path``: ``harness.measure.timeline``'s figures, or why there
    are none, and its host self times (``harness.measure.timeline.host_self_times``; None without
    figures)."""
    try:
        trace = timeline.load_trace(path)
        found = timeline.analyse(trace)
        if found is None:
            return "no device events (CPU-only trace)", None
        return found.to_json(), timeline.host_self_times(trace)
    except Exception as exc:  # a trace we cannot read must not cost the run's other results
        return f"not analysed: {type(exc).__name__}: {_line(exc)}", None


def trace_line(result: VariantResult) -> str:
    """What ``--trace`` found for one variant: its timeline summary, or why there is none."""
    if isinstance(result.timeline, dict):
        host = result.timeline.get("host_vs_baseline")
        if host is None:
            return result.timeline["summary"]
        grown = ", ".join(f"{name} +{s * 1e3:.2f}" for name, s in host["top"]) or "nothing grew"
        return (
            f"{result.timeline['summary']}; host self time vs baseline "
            f"{host['total_s'] * 1e3:+.2f} ms ({grown})"
        )
    return result.timeline or result.trace or "not traced"
