"""The ``mcore`` family's Megatron-FSDP rows and knobs (recompute, CUDA graphs, multi-token
prediction) and the plumbing of a megatron-core run that works without megatron-core: the knobs
checked before any training and turned into megatron-core config fields, megatron-core's
refusals told apart from our errors, the layer tracker, sharded parameters' marks, a refused
configuration as a skipped case, and a CUDA-graph row's side stream and reset. The rows, the
``impl`` column, ``--models`` and the bridge are in ``test_mcore_models.py``."""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fake_megatron import fake_megatron as _fake_megatron

from harness.cases import (
    MCORE_FAMILY,
    MCORE_KNOB_ROWS,
    MCORE_ROWS,
    MCORE_SHARDED_ROWS,
    SEED_CASE,
    Case,
)
from harness.models.mcore import (
    TRAINERS,
    knob_fields,
    model_layers,
    transformer_config,
)
from harness.models.mcore.loop import _graph_scope
from harness.models.runs import Refused
from harness.offload.config import OffloadConfig
from harness.offload.recorder import RecordingOffloader
from harness.vocab.spec import ModelSpec


# ---------------------------------------------------------- Megatron-FSDP rows and the knobs
def test_family_rows_are_named_apart_and_every_sharding_has_a_trainer() -> None:
    names = [row.name for row in MCORE_FAMILY]
    assert len(set(names)) == len(names)
    seed = MCORE_ROWS[0]
    assert [row.name for row in MCORE_SHARDED_ROWS] == [f"{seed.name}_mfsdp", f"{seed.name}_mfsdp2"]
    # The seed's settings are kept: only the sharding differs.
    for row in MCORE_SHARDED_ROWS:
        assert row.replace(sharding="none", description=seed.description) == seed
    assert {row.sharding for row in MCORE_FAMILY} == set(TRAINERS)
    assert {row.recompute for row in MCORE_KNOB_ROWS} >= {"core_attn", "full", "moe"}
    assert {row.cuda_graph for row in MCORE_KNOB_ROWS} == {"", "te", "local-moe"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(sharding="mfsdp"), "impl 'harness' runs sharding none or zero3, not 'mfsdp'"),
        (dict(recompute="full"), "ModelSpec.recompute is a megatron-core setting"),
        (dict(cuda_graph="te"), "ModelSpec.cuda_graph is a megatron-core setting"),
        (dict(mtp="+-"), "impl 'harness' builds no multi-token-prediction layers"),
    ],
    ids=["mfsdp", "recompute", "graphs", "mtp"],
)
def test_our_models_refuse_megatron_knobs(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SEED_CASE.replace(**changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(recompute="attn"), "ModelSpec.recompute: unknown module 'attn'"),
        (dict(cuda_graph="full"), "ModelSpec.cuda_graph must be one of"),
        (dict(mtp="+-/+"), r"ModelSpec.mtp '\+-/\+': every depth must be the same"),
        (dict(mtp="*-"), "mixes '\\+' \\(mla\\) and '\\*' \\(attention\\)"),
    ],
    ids=["module", "graph", "depths", "mix"],
)
def test_knob_values_are_checked_before_any_training(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SEED_CASE.replace(impl="mcore", **changes)


def test_gpt_model_has_no_mtp_layers() -> None:
    with pytest.raises(ValueError, match="impl 'mcore-gpt' builds no multi-token-prediction"):
        Case(impl="mcore-gpt", family="moe", offload=("core_attn",), mtp="*E")


def test_mtp_layers_are_numbered_after_the_main_pattern() -> None:
    spec = SEED_CASE.replace(impl="mcore", mtp="+-/+-").model_spec("tiny")
    assert spec.mtp_depths == 2
    assert spec.all_layers == tuple("+-+-+-" + "+-+-")
    assert spec.group_sequence(("core_attn",)) == tuple((i, "core_attn") for i in (0, 2, 4, 6, 8))

    def layer() -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    depth = types.SimpleNamespace(mtp_model_layer=types.SimpleNamespace(layers=[layer(), layer()]))
    main = [layer() for _ in range(6)]
    model = types.SimpleNamespace(
        decoder=types.SimpleNamespace(layers=main), mtp=types.SimpleNamespace(layers=[depth])
    )
    assert model_layers(model) == [*main, *depth.mtp_model_layer.layers]


@pytest.mark.parametrize(
    ("knobs", "fields"),
    [
        (dict(recompute="full"), dict(recompute_granularity="full", recompute_method="uniform")),
        (
            dict(recompute="core_attn+mlp"),
            dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
        ),
        (dict(cuda_graph="te"), dict(cuda_graph_impl="transformer_engine")),
        (
            dict(cuda_graph="local-moe"),
            dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router", "moe_preprocess"]),
        ),
        (dict(mtp="+-/+-"), dict(mtp_num_layers=2)),
    ],
    ids=["full", "selective", "te-graphs", "local-graphs", "mtp"],
)
def test_knobs_become_megatron_config_fields(knobs: dict, fields: dict) -> None:
    made = knob_fields(ModelSpec(pattern="+-+-+-", impl="mcore", **knobs))
    assert fields.items() <= made.items()
    assert knob_fields(ModelSpec(pattern="+-+-+-", impl="mcore")) == {}


def _refusing_megatron(monkeypatch: pytest.MonkeyPatch, refuse: str) -> list[tuple[str, dict]]:
    """``_fake_megatron`` whose configs raise like megatron-core's ``__post_init__`` when given
    the field ``refuse``."""
    built = _fake_megatron(monkeypatch)
    configs = sys.modules["megatron.core.transformer.transformer_config"]
    # compiled as megatron-core's module, as its __post_init__ raises from its own code
    scope = {"__name__": configs.__name__, "built": built, "refuse": refuse}
    exec(
        "def init(self, **kw):\n"
        "    built.append((type(self).__name__, kw))\n"
        "    if refuse in kw:\n"
        "        raise ValueError(f'{refuse} cannot be used with fine-grained activation "
        "offloading.')\n",
        scope,
    )
    init = scope["init"]

    for name in ("TransformerConfig", "MLATransformerConfig"):
        setattr(configs, name, type(name, (), {"__init__": init}))
    return built


def test_a_knob_megatron_refuses_is_a_refusal_with_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = _refusing_megatron(monkeypatch, "recompute_granularity")
    spec = ModelSpec(pattern="+-+-+-", impl="mcore", recompute="full")
    with pytest.raises(Refused, match=r"refuses recompute full with this case: ValueError: "):
        transformer_config(
            spec, SEED_CASE.run_spec(), OffloadConfig(offload_modules=("core_attn",))
        )
    # first without the knobs (accepted), then with them
    assert [("recompute_granularity" in fields) for _, fields in built] == [False, True]


def test_an_error_of_ours_with_a_knob_is_no_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A knob field megatron-core does not take (a field we renamed: a TypeError) and an error
    raised outside megatron-core's code are errors of the case, never a refusal (a skip)."""
    built = _fake_megatron(monkeypatch)
    configs = sys.modules["megatron.core.transformer.transformer_config"]

    def strict(self: object, **kw: object) -> None:
        built.append((type(self).__name__, kw))
        if "recompute_granularity" in kw:
            raise TypeError("__init__() got an unexpected keyword 'recompute_granularity'")

    for name in ("TransformerConfig", "MLATransformerConfig"):
        monkeypatch.setattr(configs, name, type(name, (), {"__init__": strict}))
    spec = ModelSpec(pattern="+-+-+-", impl="mcore", recompute="full")
    offload = OffloadConfig(offload_modules=("core_attn",))
    with pytest.raises(TypeError, match="unexpected keyword") as raised:
        transformer_config(spec, SEED_CASE.run_spec(), offload)
    assert not isinstance(raised.value, Refused)

    def ours(self: object, **kw: object) -> None:
        if "recompute_granularity" in kw:
            raise ValueError("a value our bridge computed wrongly")

    for name in ("TransformerConfig", "MLATransformerConfig"):
        monkeypatch.setattr(configs, name, type(name, (), {"__init__": ours}))
    with pytest.raises(ValueError, match="computed wrongly") as raised_here:
        transformer_config(spec, SEED_CASE.run_spec(), offload)
    assert not isinstance(raised_here.value, Refused)


def test_te_graph_rows_need_torchs_stale_capture_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without torch's stale-capture-stream switch the TransformerEngine graph row is refused
    before any training, naming the torch; with it, the config is built as for any knob."""
    built = _refusing_megatron(monkeypatch, "no such field")
    spec = ModelSpec(pattern="+-+-+-", impl="mcore", cuda_graph="te")
    offload = OffloadConfig(offload_modules=("core_attn",))
    # Both ways whichever torch this is (2.11 has no such switch, 2.13 has it).
    switch = "set_override_stale_capture_stream"
    monkeypatch.setattr(torch.autograd.graph, switch, print, raising=False)
    transformer_config(spec, SEED_CASE.run_spec(), offload)
    assert built[-1][1]["cuda_graph_impl"] == "transformer_engine"
    monkeypatch.delattr(torch.autograd.graph, switch)
    with pytest.raises(Refused, match=rf"torch {re.escape(torch.__version__)} lacks"):
        transformer_config(spec, SEED_CASE.run_spec(), offload)
    local = ModelSpec(pattern="*E*E", impl="mcore", cuda_graph="local-moe")
    transformer_config(local, SEED_CASE.run_spec(), OffloadConfig(offload_modules=("moe_act",)))


def test_a_config_error_without_knobs_is_the_harness_error_not_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _refusing_megatron(monkeypatch, "offload_modules")
    spec = ModelSpec(pattern="+-+-+-", impl="mcore", recompute="full")
    with pytest.raises(ValueError, match="offload_modules cannot be used") as raised:
        transformer_config(
            spec, SEED_CASE.run_spec(), OffloadConfig(offload_modules=("core_attn",))
        )
    assert not isinstance(raised.value, Refused)


def test_layer_tracker_without_hooks_leaves_layers_capturable() -> None:
    """CUDA-graph rows track layers by wrapping ``forward``: megatron-core refuses to capture a
    module with pre-forward hooks."""
    from harness.models.mcore import LayerTracker

    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=layers))
    tracker = LayerTracker(model, hooks=False)
    assert not any(layer._forward_pre_hooks for layer in layers)
    layers[2](torch.ones(1, 2))
    assert tracker() == 2
    layers[1](torch.ones(1, 2))
    assert tracker() == 1
    tracker.remove()
    assert all("forward" not in vars(layer) for layer in layers)
    hooked = LayerTracker(model)
    assert all(layer._forward_pre_hooks for layer in layers)
    layers[0](torch.ones(1, 2))
    assert hooked() == 0
    hooked.remove()


def test_sharded_parameters_are_marked_by_their_local_shard() -> None:
    """Megatron-FSDP v2 marks its DTensor parameters not-offloadable; a DTensor has no storage
    of its own (its ``untyped_storage`` raised on the H200, first in the copy observer, then in
    the recording offloader), so the observer, the recorder and the reference offloader each
    keep the mark by the shard's storage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from harness.measure.observe import CopyObserver, _WindowState
    from harness.offload.reference import OffloadContext
    from harness.util import distributed

    started = not distributed.initialized()
    distributed.ensure_process_group(torch.device("cpu"))
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        observer = CopyObserver(_WindowState(), torch.device("cpu"))
        observer.mark([weight])
        assert observer._is_marked(weight.to_local())
        assert not observer._is_marked(torch.ones(4, 4))
        config = OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=1)
        recorder = RecordingOffloader(config, "cpu")
        recorder.mark_not_offloadable(weight)
        assert recorder.describe(weight.to_local()).parameter
        assert not recorder.describe(torch.ones(4, 4)).parameter
        reference = OffloadContext(config, "cpu")
        reference.mark_not_offloadable(weight)
        assert reference._is_marked(weight.to_local())
        assert reference._eligible(torch.ones(4, 4))
    finally:
        if started:  # the tests that need a process without a group still find one
            distributed.shutdown()


def test_a_refused_configuration_is_a_skipped_case_everywhere(tmp_path: Path) -> None:
    """A case whose every check skipped (the library refused its configuration) is neither a
    pass nor a failure: its verdict, the JUnit file and the check itself say skip."""
    from xml.etree import ElementTree

    from harness.reporting.report import write_junit
    from harness.verify import judge

    refused = "megatron-core 0.19.2 refuses recompute moe with this case: AssertionError: no"
    outcomes = (
        judge.CheckOutcome(name="equivalence", status="skip", reason=refused),
        judge.CheckOutcome(name="sync", status="skip", reason="not guarded"),
    )
    skipped = judge.Judgement(case=MCORE_KNOB_ROWS[0], outcomes=outcomes)
    assert skipped.verdict == "skip"
    passed = judge.CheckOutcome(name="leaks", status="pass")
    assert judge.Judgement(case=MCORE_KNOB_ROWS[0], outcomes=(*outcomes, passed)).verdict == "pass"
    failed = judge.CheckOutcome(name="leaks", status="fail", problems=("x",))
    assert judge.Judgement(case=MCORE_KNOB_ROWS[0], outcomes=(*outcomes, failed)).verdict == "fail"

    junit = write_junit(tmp_path, {"cases": [skipped.record()]})
    suite = ElementTree.parse(junit).getroot()[0]
    assert (suite.get("skipped"), suite.get("failures")) == ("1", "0")
    assert suite[0][0].tag == "skipped" and suite[0][0].get("message") == refused

    def refusing(runs: object) -> judge.CheckOutcome:
        raise Refused(refused)

    saved = judge.CHECKS["leaks"]
    judge.CHECKS["leaks"] = refusing
    try:
        outcome = judge.check("leaks", None)  # type: ignore[arg-type]
    finally:
        judge.CHECKS["leaks"] = saved
    assert (outcome.status, outcome.reason) == ("skip", refused)


def test_a_graph_row_runs_on_a_side_stream_and_resets_megatron_graph_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA-graph row trains on a side stream (a capture must not depend on the legacy
    default stream), and megatron-core's process-wide graph state is reset when its run ends,
    a run that raised mid-capture included; the other rows are left alone."""
    calls: list[str] = []
    graphs = types.ModuleType("megatron.core.transformer.cuda_graphs")
    graphs._set_capture_end = lambda: calls.append("capture end")  # type: ignore[attr-defined]
    graphs.delete_cuda_graphs = lambda: calls.append("delete graphs")  # type: ignore[attr-defined]
    micro = types.ModuleType("megatron.core.num_microbatches_calculator")
    micro.destroy_num_microbatches_calculator = lambda: calls.append("calculator")  # type: ignore[attr-defined]
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["megatron.core.transformer"].cuda_graphs = graphs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, graphs.__name__, graphs)
    monkeypatch.setitem(sys.modules, micro.__name__, micro)

    class Stream:
        def __init__(self, device: object = None) -> None:
            self.device = device

        def wait_stream(self, other: object) -> None:
            calls.append("wait")

    made: list[Stream] = []
    entered: list[Stream] = []

    def new_stream(device: object = None) -> Stream:
        made.append(Stream(device))
        return made[-1]

    @contextlib.contextmanager
    def on(stream: Stream) -> Iterator[None]:
        entered.append(stream)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", on)
    graph_row = next(c for c in MCORE_KNOB_ROWS if c.cuda_graph == "te")
    with pytest.raises(RuntimeError, match="capture failed"):
        with _graph_scope(graph_row.model_spec("tiny"), torch.device("cuda", 0)):
            assert entered == made[:1]
            raise RuntimeError("capture failed")
    assert calls == ["wait", "wait", "capture end", "delete graphs", "calculator"]
    calls.clear()
    entered.clear()
    with _graph_scope(MCORE_KNOB_ROWS[0].model_spec("tiny"), torch.device("cuda", 0)):
        pass
    assert not calls and not entered
