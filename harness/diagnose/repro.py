"""Reproducing a mismatch: run the plain baseline, the hooks baseline and the offload run of one
case, print the loss table and the first divergence; on divergence name the first parameter
gradient and the first layer output that differ and tell a graph change from a transport bug;
optionally bisect (``harness.diagnose.bisect``); write a bundle to rerun it.

The bundle, ``<report folder>/repro/``: ``spec.json`` (case, model spec, run spec, backend,
device), ``baseline.txt`` and ``offload.txt`` (loss traces, one ``step microbatch loss`` line
each, floats with ``repr``), ``command.txt`` (the exact command line) and ``output.txt`` (what
was printed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from harness.cases import Case
from harness.diagnose.bisect import Bisector
from harness.execute.learn import learn_from_steps
from harness.execute.steps import first_grad_difference
from harness.measure.observe import Observed, Windowed, corrupted_reloads, observe
from harness.models.hybrid import HybridModel
from harness.models.train import RunHooks, TrainResult, schedule_order, train
from harness.offload.backends import capabilities, resolve_backend
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Offloader
from harness.offload.recorder import GroupObservation, RecordingOffloader
from harness.reporting.report import run_folder
from harness.util.compare import first_divergence, first_tensor_difference, loss_table, verdict
from harness.verify.commands import (  # the builders' old home: importable from here too
    OVERRIDABLE,  # noqa: F401
    case_command,  # noqa: F401
    model_family_preset,  # noqa: F401
    repro_command,
    table_row,  # noqa: F401
)
from harness.verify.golden import trace_text
from harness.vocab.spec import ModelSpec, RunSpec


@dataclass(frozen=True, kw_only=True)
class ReproSpec:
    """Everything that fixes a reproduction."""

    case: Case
    model: ModelSpec
    run: RunSpec
    backend: str
    device: torch.device
    model_size: str
    preset: str | None = None
    """Model preset of a custom case (the command line's, or its family's); None for ``--case``."""
    from_case: str | None = None
    """The case id it was taken from (``--case``); None for a custom case."""

    def command(self, *, bisect: bool = False) -> list[str]:
        """The fully explicit command line that reruns this reproduction (``repro_command``)."""
        return repro_command(
            self.case,
            backend=self.backend,
            device=self.device,
            model_size=self.model_size,
            seed=self.run.seed,
            from_case=self.from_case,
            preset=self.preset,
            pattern=self.model.pattern,
            bisect=bisect,
        )

    def to_json(self) -> dict[str, Any]:
        case = {
            f.name: getattr(self.case, f.name)
            for f in dataclasses.fields(self.case)
            if f.name != "marks"
        }
        return {
            "case_id": self.case.name,
            "case": case,
            "model": dataclasses.asdict(self.model),
            "run": dataclasses.asdict(self.run),
            "backend": self.backend,
            "device": str(self.device),
            "model_size": self.model_size,
            "preset": self.preset,
            "torch": torch.__version__,
        }


# --------------------------------------------------------------------------------- the runs


def _progress(
    label: str, steps: int, observed: tuple[Windowed, torch.device, list[Observed]] | None = None
) -> tuple[RunHooks, Callable[[], None]]:
    """Run hooks that advance a tqdm bar once per step, and the bar's closer; with ``observed``
    the harness's copy observer (and its checksums) watches every step."""
    bar = tqdm(total=steps, desc=f"{label:>8}", unit="step", leave=False, dynamic_ncols=True)

    @contextlib.contextmanager
    def step_context(step: int) -> Iterator[None]:
        with observe(*observed) if observed is not None else contextlib.nullcontext():
            yield
        bar.update(1)

    return RunHooks(step_context=step_context), bar.close


def _train(
    spec: ReproSpec,
    offloader: Offloader,
    label: str,
    *,
    keep: bool,
    run: RunSpec | None = None,
    seen: list[Observed] | None = None,
) -> TrainResult:
    """One run with a progress bar; with ``seen`` the offloader runs inside the harness's
    windows with checksums, and every step's observation is appended there."""
    run = run or spec.run
    observed = None
    if seen is not None:
        offloader = Windowed(offloader, checksums=True)
        observed = (offloader, spec.device, seen)
    hooks, close = _progress(label, run.steps, observed)
    try:
        return train(
            spec.model,
            run,
            offloader,
            spec.device,
            hooks=hooks,
            keep_grads=keep,
            keep_final_state=keep,
            sharding=spec.case.sharding,
        )
    finally:
        close()
        offloader.close()


def _backend(spec: ReproSpec) -> Offloader:
    return resolve_backend(spec.backend)(spec.case.offload_config(), spec.device)


def rule_line(
    spec: ReproSpec, observations: list[GroupObservation], own: Observed, seen: list[Observed]
) -> str:
    """The rule the case's transfers are predicted with, in one line: the backend's declared
    one, or the one learned from the offload run's warmup and first steady step
    (``harness.execute.learn``), as ``offload-harness run`` prints it."""
    declared = capabilities(spec.backend).semantics
    if declared is not None:
        return f"declared rule: {declared.label}"
    mine = [s.without(own) for s in seen]
    order = schedule_order(spec.run.schedule, spec.run.microbatches)
    config = spec.case.offload_config()
    return learn_from_steps(observations, config, order, mine, spec.device.type).line


# ------------------------------------------------------------------------- layer outputs


@contextlib.contextmanager
def capture_layer_outputs(
    step: int, microbatch: int, schedule: list[tuple[str, int]]
) -> Iterator[dict[str, torch.Tensor]]:
    """While active, record every layer's output (``layers.<i>``, ``final_norm``, ``logits``)
    of the forward of (``step``, ``microbatch``), as CPU fp32 copies. Global module hooks, so
    the runner needs no change; the normal runs never have them."""
    forwards = [mb for kind, mb in schedule if kind == "F"]
    seen: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    calls = [0]
    target = [False]

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, HybridModel):
            index = calls[0]
            calls[0] += 1
            in_step = index // len(forwards) == step
            target[0] = in_step and forwards[index % len(forwards)] == microbatch
            if target[0] and not names:
                names.update({id(m): f"layers.{i}" for i, m in enumerate(module.layers)})
                names[id(module.final_norm)] = "final_norm"
                names[id(module)] = "logits"

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module)) if target[0] else None
        if name is not None:
            first = output[0] if isinstance(output, tuple | list) else output
            seen[name] = first.detach().float().cpu().clone()

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
        torch.nn.modules.module.register_module_forward_hook(hook),
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def first_layer_difference(spec: ReproSpec, step: int, microbatch: int) -> tuple[str, float] | None:
    """Re-run baseline and offload up to ``step`` with layer hooks; the first layer output of
    (step, microbatch), in forward order, that is not bitwise equal (name, max |diff|)."""
    run = spec.run.replace(steps=step + 1)
    schedule = schedule_order(run.schedule, run.microbatches)
    with capture_layer_outputs(step, microbatch, schedule) as base:
        _train(spec, NoOffload(), "baseline", keep=False, run=run)
    with capture_layer_outputs(step, microbatch, schedule) as off:
        _train(spec, _backend(spec), "offload", keep=False, run=run)
    return first_tensor_difference(base, off)


# ---------------------------------------------------------------------------------- repro


@dataclass(kw_only=True)
class ReproResult:
    """What a reproduction found."""

    diverged: bool
    lines: list[str]
    """The printed report."""
    bundle: Path | None = None


def reproduce(
    spec: ReproSpec,
    *,
    bisect: bool = False,
    report_root: Path | None = Path("reports"),
    folder: Path | None = None,
    out: Callable[[str], None] = print,
) -> ReproResult:
    """Run, compare, localise, write the bundle (none when ``report_root`` is None, as
    ``--report-dir ''`` asks); every report line also goes to ``out``."""
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        out(text)

    say(f"case {spec.case.name} (backend {spec.backend}, {spec.device}, seed {spec.run.seed})")
    plain = _train(spec, NoOffload(), "baseline", keep=True)
    recorder = RecordingOffloader(spec.case.offload_config(), spec.device)
    own: list[Observed] = []  # the model's own copies inside group windows
    hooks = _train(spec, recorder, "hooks", keep=False, seen=own)
    seen: list[Observed] = []
    offload = _train(spec, _backend(spec), "offload", keep=True, seen=seen)
    say(rule_line(spec, recorder.iterations[int(spec.run.eval_first)], own[0], seen))
    say(loss_table(plain.losses, offload.losses))
    corrupted = corrupted_reloads(seen)
    if corrupted:
        step, where = corrupted[0]
        say(
            f"first reload that differs from what was saved (checksums at pack and unpack; "
            f"{len(corrupted)} of {sum(o.checksummed for o in seen)}): step {step}, {where}"
        )
    else:
        say(f"checksums: all {sum(o.checksummed for o in seen)} reloads equal what was saved")
    tolerance = spec.case.tolerance
    divergence = first_divergence(plain.losses, offload.losses, tolerance)
    say(f"first divergence: {divergence if divergence is not None else 'none'}")
    grad = first_grad_difference(plain, offload)
    weights = first_tensor_difference(plain.final_state, offload.final_state)
    diverged = divergence is not None or grad is not None or weights is not None or bool(corrupted)
    if diverged:
        say(_grad_line(grad))
        if weights is not None:
            say(f"first final weight that differs: {weights[0]} (max |diff| {weights[1]:.3e})")
        if divergence is not None:
            layer = first_layer_difference(spec, divergence.step, divergence.microbatch)
            say(_layer_line(layer, divergence.step, divergence.microbatch))
            if grad is not None and grad[0] < divergence.step:
                say(
                    f"  (step {grad[0]}'s gradients already differ, so the weights entering step "
                    f"{divergence.step} differ and so does every layer from the first: look at "
                    "the backward side - reloads, saved tensors)"
                )
        say(_baselines_line(plain, hooks, offload, tolerance))
    if bisect and diverged:
        bisector = Bisector(
            spec=spec.model,
            run=spec.run,
            config=spec.case.offload_config(),
            make_offloader=lambda config: resolve_backend(spec.backend)(config, spec.device),
            device=spec.device,
            baseline=plain,
            tolerance=tolerance,
            sharding=spec.case.sharding,
        )
        with tqdm(desc="  bisect", unit="run", leave=False) as bar:
            bisector.on_probe = lambda _: bar.update(1)
            found = bisector.search()
        for line in found.lines():
            say(f"bisect: {line}")
    elif bisect:
        say("bisect: nothing diverges, nothing to bisect")
    if report_root is None:
        out("repro bundle: none (--report-dir '')")
        return ReproResult(diverged=diverged, lines=lines, bundle=None)
    bundle = write_bundle(spec, plain, offload, lines, report_root, bisect=bisect, folder=folder)
    out(f"repro bundle: {bundle}")
    return ReproResult(diverged=diverged, lines=lines, bundle=bundle)


def _grad_line(grad: tuple[int, str, float] | None) -> str:
    if grad is None:
        return "first parameter gradient that differs: none (every step's gradients are equal)"
    step, name, diff = grad
    return f"first parameter gradient that differs: step {step}, {name} (max |diff| {diff:.3e})"


def _layer_line(layer: tuple[str, float] | None, step: int, mb: int) -> str:
    where = f"step {step} microbatch {mb}"
    if layer is None:
        return f"first layer output that differs at {where}: none (only the loss differs)"
    return f"first layer output that differs at {where}: {layer[0]} (max |diff| {layer[1]:.3e})"


def _baselines_line(
    plain: TrainResult, hooks: TrainResult, offload: TrainResult, tolerance: float
) -> str:
    agree = first_divergence(plain.losses, hooks.losses, tolerance) is None
    kind = verdict(plain.losses, hooks.losses, offload.losses, tolerance).kind
    cause = {
        "graph_change": "graph change (the offload machinery changes the computation)",
        "transport": "transport bug (the copies corrupt data)",
    }.get(kind, kind)
    state = "agree" if agree else "differ"
    return f"plain and hooks baselines {state}: {cause}"


def write_bundle(
    spec: ReproSpec,
    plain: TrainResult,
    offload: TrainResult,
    lines: list[str],
    report_root: Path,
    *,
    bisect: bool = False,
    folder: Path | None = None,
) -> Path:
    """``<new report folder>/repro/`` with spec.json, both traces, command.txt, output.txt."""
    bundle = (folder if folder is not None else run_folder(report_root)) / "repro"
    bundle.mkdir()
    (bundle / "spec.json").write_text(json.dumps(spec.to_json(), indent=2, default=str) + "\n")
    (bundle / "baseline.txt").write_text(trace_text(plain.losses))
    (bundle / "offload.txt").write_text(trace_text(offload.losses))
    (bundle / "command.txt").write_text(shlex.join(spec.command(bisect=bisect)) + "\n")
    (bundle / "output.txt").write_text("\n".join(lines) + "\n")
    return bundle
