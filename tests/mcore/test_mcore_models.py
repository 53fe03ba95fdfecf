"""The ``mcore`` model family's plumbing that runs without megatron-core: the case table's
``impl`` column, ``--family`` selection and collection skips, and the bridge that lets a harness
offloader stand in for megatron-core's offloading interface (driven here the way megatron-core's
layers drive it). The models themselves need CUDA, TransformerEngine and megatron-core: the GPU
runs of ``pytest cases/ --family mcore`` exercise them."""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import warm
from child_pytest import pytest_command

from harness.cases import (
    MCORE_FAMILY,
    MCORE_KNOB_ROWS,
    MCORE_ROWS,
    MCORE_SHARDED_ROWS,
    SEED_CASE,
    Case,
    matrix,
)
from harness.models.mcore import (
    TRAINERS,
    Bridge,
    knob_fields,
    model_layers,
    transformer_config,
    unavailable_reason,
)
from harness.models.mcore.loop import _graph_scope
from harness.models.runs import Refused
from harness.offload.config import OffloadConfig
from harness.offload.recorder import RecordingOffloader
from harness.vocab.spec import ModelSpec, gpt_layers

ROOT = Path(__file__).resolve().parents[2]
PYTEST = tuple(pytest_command("-q", "--report-dir", ""))


def test_mcore_rows_are_named_apart_and_build_megatron_specs() -> None:
    names = [row.name for row in MCORE_ROWS]
    assert names[0] == "mcore-" + SEED_CASE.name
    assert all(name.startswith("mcore-") for name in names)
    assert len(set(names)) == len(names)
    assert {row.model_spec("small").impl for row in MCORE_ROWS} == {"mcore", "mcore-gpt"}
    fused = [row for row in MCORE_ROWS if row.family == "moe-fused"]
    assert {row.impl for row in fused} == {"mcore", "mcore-gpt"}
    assert all(row.model_spec("small").moe_path == "fused" for row in fused)
    gpt = [row for row in MCORE_ROWS if row.impl == "mcore-gpt"]
    assert [row.name.split("_")[0] for row in gpt] == [
        "mcore-gpt-moe-*E*E",
        "mcore-gpt-moe-fused-*E*E",
    ]


@pytest.mark.parametrize(
    ("pattern", "pairs"),
    [("*E*E", (("*", "E"), ("*", "E"))), ("*-*E", (("*", "-"), ("*", "E"))), ("+E", (("+", "E"),))],
)
def test_gpt_layers_pair_attention_with_mlp(pattern: str, pairs: tuple) -> None:
    assert gpt_layers(tuple(pattern)) == pairs
    assert ModelSpec(pattern=pattern, impl="mcore-gpt").layers == tuple(pattern)


@pytest.mark.parametrize("pattern", ["*E*", "E*E*", "**", "*E-E", "-"])
def test_gpt_model_refuses_patterns_that_are_not_layer_pairs(pattern: str) -> None:
    with pytest.raises(ValueError, match="a GPT model's layer is attention"):
        ModelSpec(pattern=pattern, impl="mcore-gpt")
    ModelSpec(pattern=pattern)  # fine for the hybrid models


def _fake_megatron(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Stand-ins for the megatron-core config classes ``transformer_config`` builds."""
    built: list[tuple[str, dict]] = []

    def config_class(name: str) -> type:
        return type(name, (), {"__init__": lambda self, **kw: built.append((name, kw))})

    enums = types.ModuleType("megatron.core.transformer.enums")
    enums.AttnBackend = types.SimpleNamespace(unfused="unfused")
    configs = types.ModuleType("megatron.core.transformer.transformer_config")
    configs.TransformerConfig = config_class("TransformerConfig")
    configs.MLATransformerConfig = config_class("MLATransformerConfig")
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, enums.__name__, enums)
    monkeypatch.setitem(sys.modules, configs.__name__, configs)
    return built


@pytest.mark.parametrize(
    ("impl", "pattern", "layers", "moe_freq"),
    [
        ("mcore-gpt", "*E*E", 2, [1, 1]),
        ("mcore-gpt", "*-*E", 2, [0, 1]),
        ("mcore", "*E*E", 4, None),
    ],
)
def test_transformer_config_counts_gpt_layers_as_pairs(
    monkeypatch: pytest.MonkeyPatch, impl: str, pattern: str, layers: int, moe_freq: list | None
) -> None:
    built = _fake_megatron(monkeypatch)
    spec = ModelSpec(pattern=pattern, impl=impl)
    transformer_config(spec, SEED_CASE.run_spec(), OffloadConfig(offload_modules=("core_attn",)))
    ((cls, fields),) = built
    assert cls == "TransformerConfig"
    assert fields["num_layers"] == layers
    assert fields.get("moe_layer_freq") == moe_freq
    assert fields["offload_modules"] == ["core_attn"]


def test_family_selects_rows() -> None:
    ours = matrix("default")
    assert all(row.impl == "harness" for row in ours)
    assert matrix("default", "mcore") == list(MCORE_FAMILY)
    assert matrix("default", "all") == ours + list(MCORE_FAMILY)
    assert MCORE_FAMILY[: len(MCORE_ROWS)] == MCORE_ROWS
    with pytest.raises(ValueError, match="unknown family 'gpt'"):
        matrix("default", "gpt")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(schedule="1f1b"), "impl 'mcore' runs schedule sequential, not '1f1b'"),
        (dict(sharding="zero3"), "impl 'mcore' runs sharding none or mfsdp or mfsdp2, not 'zero3'"),
        (dict(eval_first=True), "impl 'mcore' runs no evaluation pass before the first step"),
    ],
    ids=["1f1b", "zero3", "evalfirst"],
)
def test_mcore_rows_refuse_what_one_megatron_stage_cannot_run(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SEED_CASE.replace(impl="mcore", **changes)


def test_unknown_impl_is_one_line() -> None:
    with pytest.raises(ValueError, match="unknown impl 'te'; known: harness, mcore, mcore-gpt"):
        SEED_CASE.replace(impl="te")
    with pytest.raises(
        ValueError, match=r"ModelSpec\.impl must be one of harness, mcore, mcore-gpt"
    ):
        ModelSpec(pattern="+-", impl="te")


def test_cpu_has_no_megatron_models() -> None:
    assert "needs a CUDA device" in str(unavailable_reason("cpu"))


def test_family_mcore_skips_at_collection_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU skip reason")
    out = warm.run(
        [*PYTEST, "cases/test_equivalence.py", "--family", "mcore", "-rs"], cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SKIPPED [{2 * len(MCORE_FAMILY)}]" in out.stdout
    assert "impl 'mcore' needs a CUDA device" in out.stdout
    assert "passed" not in out.stdout.splitlines()[-1]


def test_bad_family_is_a_usage_error() -> None:
    out = warm.run([*PYTEST, "cases/", "--family", "gpt"], cwd=ROOT, timeout=300)
    assert out.returncode == 4
    assert "--family must be one of harness, mcore, all; got 'gpt'" in out.stderr


def _layer_norm_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight)


def test_bridge_drives_a_harness_offloader_at_megatron_boundaries() -> None:
    """Open, hook and commit as megatron-core's layers do; the recorder sees each selected group
    with the tracked layer, the flag is set only inside selected groups."""
    recorder = RecordingOffloader(OffloadConfig(offload_modules=("core_attn",)), "cpu")
    flag = types.SimpleNamespace(CPUOffloadEnabled=False)
    seen: list[bool] = []
    layer = [3]
    bridge = Bridge(recorder, lambda: layer[0], flag)
    weight = torch.nn.Parameter(torch.ones(8))
    bridge.init_chunk_handler(0, None, None, 1024, 0, 1.0, max_inflight_offloads=None)
    bridge.mark_not_offload(weight)
    recorder.begin_microbatch(0)
    x = torch.randn(2, 8, requires_grad=True)

    unselected = bridge(False, x, "attn_norm")
    with unselected as y:
        seen.append(flag.CPUOffloadEnabled)
        z = _layer_norm_like(y, weight)
    assert y is x
    assert unselected.group_offload(z, forced_released_tensors=[y]) is z

    selected = bridge(True, z, "core_attn")
    with selected as q:
        seen.append(flag.CPUOffloadEnabled)
        out = (q * q).sum(-1)
    seen.append(flag.CPUOffloadEnabled)
    out = selected.group_offload(out, forced_released_tensors=[q])
    bridge.reset()  # megatron-core's schedule calls it; the runner ends the iteration
    recorder.end_iteration()
    out.sum().backward()

    assert seen == [False, True, False]
    (observation,) = recorder.iterations[0]
    assert (observation.microbatch, observation.layer, observation.name) == (0, 3, "core_attn")
    assert [s.shape for s in observation.saved] == [(2, 8), (2, 8)]
    assert [s.shape for s in observation.released] == [(2, 8)]
    assert x.grad is not None


def test_bridge_refuses_interface_parts_it_does_not_offer() -> None:
    bridge = Bridge(
        RecordingOffloader(OffloadConfig(offload_modules=("core_attn",)), "cpu"), lambda: 0, None
    )
    with pytest.raises(NotImplementedError, match=r"off_interface\.forward_record"):
        bridge.forward_record()


def test_case_family_column_is_validated_with_the_rest() -> None:
    row = Case(impl="mcore", family="moe", offload=("expert_fc1", "moe_act"), precision="bf16")
    assert row.name == "mcore-moe-*E*E_expert_fc1+moe_act_sequential_bf16"


def test_memory_slack_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="memory slack needs a memory_slack_reason"):
        SEED_CASE.replace(memory_slack=8)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--family", "mcore", "--device", "cpu"],
        ["run", "--family", "mcore", "--backend", "reference", "--device", "cpu"],
        ["repro", "--case", MCORE_ROWS[0].name, "--device", "cpu"],
    ],
    ids=["run", "run-bridge", "repro"],
)
def test_cli_refuses_mcore_rows_without_cuda_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    from harness.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0]


def test_cli_lists_the_mcore_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main

    assert main(["cases", "--family", "mcore"]) == 0
    assert capsys.readouterr().out.split() == [row.name for row in MCORE_FAMILY]


def test_a_finished_runs_cached_forwards_are_emptied() -> None:
    """megatron-core's ``RotaryEmbedding.forward`` is an ``lru_cache`` keyed by the module, so a
    finished model's rotary table stayed live until later calls evicted it (the H200 memory
    case then saw a 131072-B block in one run of a pair only); a run's end empties such caches
    for every module class of its model and leaves other classes alone."""
    import functools

    from harness.models.mcore.loop import _clear_forward_caches

    class Rotary(torch.nn.Module):
        @functools.lru_cache(maxsize=32)  # noqa: B019 - the pattern under test
        def forward(self, n: int) -> torch.Tensor:
            return torch.arange(n)

    class Elsewhere(torch.nn.Module):  # not in the model: its cache stays
        @functools.lru_cache(maxsize=32)  # noqa: B019
        def forward(self, n: int) -> torch.Tensor:
            return torch.arange(n)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Rotary())
    other = Elsewhere()
    model[1](4), other(4)
    assert Rotary.forward.cache_info().currsize == 1
    _clear_forward_caches(model)
    assert Rotary.forward.cache_info().currsize == 0
    assert Elsewhere.forward.cache_info().currsize == 1


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
