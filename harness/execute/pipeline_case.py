"""Running a pipeline row (``Case.pipeline`` > 1) on one rank: this rank's stage of the pipeline
across ranks (``harness.models.pipeline``) and the runs its checks read.

Called on every rank of the process group (``WORLD_SIZE`` = the row's stages) by the same check,
``run_pipeline_case`` makes, on each rank:

* the one-rank plain run of the same spec, run and schedule (``harness.execute.baselines``'s
  shared plain baseline: the whole model on this process, no offloader) - what this stage's
  losses, gradients and final weights must equal bitwise;
* the one-rank hooks run's first iteration (``RecordingOffloader``): what every group saves. The
  pass ids of the pipeline are the one-rank runner's (``microbatch * chunks + chunk``), so this
  stage's observations are those of its layers;
* the prediction for this stage (``harness.execute.predict.predict``) from its observations and
  its own order (``harness.models.pipeline.stage_order``: its warmup differs per stage);
* the pipeline's offload run, this rank's offloader inside the harness's windows, every step
  observed (``Windowed``), and one step with the offloader disabled.

The checks of a stage live in ``harness.verify.pipeline_checks``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.distributed as dist

from harness.cases import Case
from harness.execute.attribution import observe_steps
from harness.execute.baselines import plain_baseline
from harness.execute.cadence import Cadence, run_cadence
from harness.execute.consistency import own_expected
from harness.execute.environment import Environment, closing
from harness.execute.learn import ObservedRule, learn_from_steps
from harness.execute.predict import Expected, inert_reason, predict
from harness.measure.observe import Observed, Windowed
from harness.measure.transfers import TransferCounts
from harness.models.p2p import PipelineLayout
from harness.models.pipeline import stage_layers, stage_order, train_pipeline
from harness.models.runs import TrainResult
from harness.models.train import train
from harness.offload.protocol import plan_of
from harness.offload.recorder import GroupObservation, RecordingOffloader
from harness.offload.semantics import GroupKey, Semantics
from harness.util import distributed
from harness.vocab.spec import pass_label


@dataclass(kw_only=True)
class StageRun:
    """What one rank's stage of a pipeline row ran, for its checks."""

    case: Case
    rank: int
    stage: int
    layout: PipelineLayout
    layers: tuple[range, ...]
    """The layers of each of this stage's model chunks."""
    order: list[tuple[str, int]]
    """This stage's ("F"|"B", pass) order of one step."""
    plain: TrainResult
    """The one-rank plain run (the whole model): what the stage must equal bitwise."""
    offload: TrainResult
    """This stage's part of the pipeline's offload run (its gradients and weights)."""
    seen: list[Observed]
    """Every step of the offload run, by the harness's windows."""
    per_step: list[TransferCounts]
    observations: list[GroupObservation]
    """What this stage's groups save (the one-rank hooks run's first iteration, its layers)."""
    semantics: Semantics | None
    """The rule the stage is held to: the backend's declared one, or the one learned from this
    stage's steps 0 and 1 (``rule``)."""
    rule: ObservedRule | None = None
    """An undeclared backend's rule, learned per stage (``harness.execute.learn``); where none
    fits, the stage is held to its own first steady step (``ObservedRule.own``)."""
    warmup: dict[GroupKey, Expected] = field(default_factory=dict)
    steady: dict[GroupKey, Expected] = field(default_factory=dict)
    steady_copies: list[int] = field(default_factory=list)
    """Every stage's predicted copies of a steady step (by stage): some stage must move."""
    disabled: Observed | None = None
    """Step 0 of the pipeline run with this rank's offloader disabled."""
    cadence: Cadence | None = None
    inert: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``stage 1 of 2 (layers 2-3, 5; 1f1b, 0 warmup forwards)``: names the stage in
        every verdict line."""
        spans = ", ".join(
            f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in self.layers
        )
        warmup = next((i for i, (kind, _) in enumerate(self.order) if kind == "B"), 0)
        return (
            f"stage {self.stage} of {self.layout.stages} (layers {spans}; "
            f"{self.case.schedule}, {warmup} forwards before its first backward)"
        )

    def where(self, step: int, key: GroupKey) -> str:
        """``step 2, microbatch 1 chunk 0, layer 3, group core_attn``."""
        return (
            f"step {step}, {pass_label(key[0], self.case.schedule)}, layer {key[1]}, group {key[2]}"
        )


def check_world(case: Case) -> None:
    """Refuse a pipeline row outside a process group of exactly its stages."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != case.pipeline:
        raise ValueError(
            f"{case.name} is a pipeline of {case.pipeline} stages: it runs on exactly "
            f"{case.pipeline} ranks (torchrun --nproc-per-node={case.pipeline}), not {world}"
        )


def run_pipeline_case(case: Case, env: Environment) -> StageRun:
    """This rank's runs of the pipeline row ``case`` (module docstring); collective."""
    check_world(case)
    seconds: dict[str, float] = {}
    began = time.perf_counter()
    spec, run, config = env.spec(case), case.run_spec(), case.offload_config()
    layout = PipelineLayout(case.pipeline, case.vpp)
    stage = dist.get_rank()
    layers = tuple(stage_layers(len(spec.layers), layout, stage))
    owned = {index for chunk in layers for index in chunk}
    plain = plain_baseline(case, env).result
    recorder = RecordingOffloader(config, env.device)
    train(spec, run.replace(steps=1), recorder, env.device)
    observations = [o for o in recorder.iterations[0] if o.layer in owned]
    order = stage_order(case.schedule, case.microbatches, case.pipeline, stage)
    seconds["one-rank"] = round(time.perf_counter() - began, 3)
    semantics = env.declared
    began = time.perf_counter()
    seen: list[Observed] = []
    with closing(Windowed(env.offloader(config), checksums=True)) as offloader:
        first = order[0][1]
        plan_of(offloader, [(o.layer, o.name) for o in observations if o.microbatch == first])
        hooks = observe_steps(env.device, set(range(run.steps)), offloader, seen)
        hooks.model_ready = offloader.note_model
        result = train_pipeline(
            spec, run, offloader, env.device, hooks=hooks, keep_grads=True, keep_final_state=True
        )
    seconds["pipeline"] = round(time.perf_counter() - began, 3)
    rule = None
    if semantics is None:  # learned from this stage's own steps 0 and 1, as on one rank
        rule = learn_from_steps(observations, config, order, seen, env.device.type, case.schedule)
        semantics = rule.semantics
    warmup, steady = predict(observations, config, order, semantics)
    if rule is not None and rule.own is not None:
        warmup, steady = own_expected(rule.own, observations, steady)
    # collective, on every rank at the same point: whether any stage moves anything
    steady_copies = distributed.all_gather_object(sum(e.copies for e in steady.values()))
    mode = "device" if env.device.type == "cuda" else "cpu"
    made = StageRun(
        case=case,
        rank=dist.get_rank(),
        stage=stage,
        layout=layout,
        layers=layers,
        order=order,
        plain=plain,
        offload=result,
        seen=seen,
        per_step=[o.counts(mode) for o in seen],
        observations=observations,
        semantics=semantics,
        rule=rule,
        warmup=warmup,
        steady=steady,
        steady_copies=steady_copies,
        inert=inert_reason(observations, config, [warmup, steady]),
        seconds=seconds,
    )
    made.disabled = _disabled_step(case, env)
    if semantics.reloads_on(env.device.type):
        made.cadence = run_cadence(
            observations,
            order,
            seen,
            [warmup, steady],
            semantics,
            case.offload,
            lambda p: pass_label(p, case.schedule),
        )
    return made


def _disabled_step(case: Case, env: Environment) -> Observed:
    """One step of the pipeline with this rank's offloader disabled, by the harness's windows."""
    seen: list[Observed] = []
    with closing(Windowed(env.offloader(case.offload_config()))) as offloader:
        offloader.set_enabled(False)
        hooks = observe_steps(env.device, {0}, offloader, seen)
        train_pipeline(
            env.spec(case), case.run_spec().replace(steps=1), offloader, env.device, hooks=hooks
        )
    return seen[0]
