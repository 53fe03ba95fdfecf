"""megatron-core by feature (``harness.models.mcore.features``): what the installed version
offers, the rules the ``mcore`` backend declares from its code, the one-line refusals of what
it lacks, the version and commit a report records, and the side-by-side table of two installs
(``harness.tools.mcore_versions``).

Run against each install by putting it first on ``PYTHONPATH`` (docs/megatron-core.md): the
expected values are read from the installed code itself (a dataclass field, a class
attribute, what ``TransformerConfig`` raises), never from a version string. Without any
megatron-core the tests that need one skip, and the rest run on stand-ins."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cases import MCORE_FAMILY, MCORE_MAIN_ROWS
from harness.measure import fingerprint
from harness.models.mcore import Bridge, features, knob_fields, transformer_config
from harness.models.mcore import loop as mcore_loop
from harness.models.mcore.sharding import TRAINER_NEEDS, TRAINERS
from harness.models.runs import Refused
from harness.offload.backends import capabilities
from harness.offload.mcore import SEMANTICS_0_19, installed_semantics
from harness.tools import mcore_versions
from harness.util import installed
from harness.vocab.groups import GROUPS
from harness.vocab.spec import ModelSpec

needs_megatron = pytest.mark.skipif(
    not features.installed(), reason="no megatron-core on sys.path (docs/megatron-core.md)"
)


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing sets TransformerEngine's environment first (as a run must); not in this test
    process, where nothing imports TransformerEngine."""
    monkeypatch.setattr(features, "apply_environment", lambda: None)


@pytest.fixture
def fresh_findings() -> Iterator[None]:
    """Probe again in this test (``findings`` caches per process)."""
    features.findings.cache_clear()
    yield
    features.findings.cache_clear()


# ------------------------------------------------------------------ against the installed code
@needs_megatron
def test_every_required_feature_is_found() -> None:
    found = features.findings()
    missing = [n for n, f in found.items() if f.feature.required and not f.present]
    assert missing == [], [found[n].detail for n in missing]
    assert features.required_missing() is None


@needs_megatron
def test_offered_names_are_the_ones_transformer_config_accepts() -> None:
    """The names read from ``__post_init__``'s source equal the set megatron-core's own
    refusal of an unknown name lists (it runs the check; the parse does not)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(AssertionError) as info:
        TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            fine_grained_activation_offloading=True,
            offload_modules=["no_such_group"],
        )
    listed = re.search(r"Allowed modules are: \{(.*)\}", str(info.value))
    assert listed is not None, str(info.value)
    allowed = {name.strip().strip("'\"") for name in listed.group(1).split(",")}
    assert set(features.offered_modules()) == allowed
    assert set(GROUPS) <= allowed  # every harness name is one megatron-core offers


@needs_megatron
def test_backend_declares_the_view_rule_of_the_installed_code() -> None:
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        ChunkOffloadHandler,
    )

    coverage = getattr(ChunkOffloadHandler, "BASE_OFFLOAD_MIN_COVERAGE", None)
    declared = capabilities("mcore").semantics
    assert declared == installed_semantics()
    assert declared.view_copy == ("gather" if coverage is None else "coverage")
    assert declared.skip == "object"
    assert fingerprint.megatron_core_source()["version"] in declared.label
    if coverage is None:  # 0.19's rules, unchanged but for the label
        assert dataclasses.replace(declared, label=SEMANTICS_0_19.label) == SEMANTICS_0_19


@needs_megatron
@pytest.mark.parametrize("row", MCORE_FAMILY, ids=lambda row: row.name)
def test_every_row_builds_its_config_or_is_refused_in_one_line(row) -> None:
    """A row whose features the install has builds megatron-core's config (or megatron-core
    itself refuses its knob); a row needing a missing feature is refused with the feature's
    line before any config is built, as ``train`` does."""
    spec = row.model_spec("small")
    buffer = ("pinned_activation_buffer",) if spec.offload_buffer_kib else ()
    needs = TRAINER_NEEDS[row.sharding] + buffer
    line = features.refusal(needs)
    if line is not None:
        assert "\n" not in line and "has it" in line
        assert any(f"feature {name}" in line for name in needs)
        return
    try:
        transformer_config(spec, row.run_spec(), row.offload_config())
    except Refused as refused:
        assert str(refused).startswith("megatron-core ")


@needs_megatron
def test_sharding_features_follow_the_installed_code() -> None:
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    assert features.has("megatron_fsdp_v2") == ("megatron_fsdp_version" in fields)
    v2_row = next(row for row in MCORE_MAIN_ROWS if row.sharding == "mfsdp-v2")
    line = features.refusal(TRAINER_NEEDS[v2_row.sharding])
    assert (line is None) == ("megatron_fsdp_version" in fields)


@needs_megatron
def test_a_row_lacking_a_feature_is_refused_before_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``train``'s first step refuses (a skip) what the install lacks; here the buffer rows,
    whose feature no megatron-core seen has, on whichever install is present."""
    monkeypatch.setattr(mcore_loop, "unavailable_reason", lambda device: None)
    row = next(row for row in MCORE_MAIN_ROWS if row.offload_buffer_kib)
    if features.has("pinned_activation_buffer"):
        pytest.skip("this megatron-core has the pinned activation buffer")
    with pytest.raises(Refused, match="feature pinned_activation_buffer"):
        mcore_loop._refuse(row.model_spec("small"), row.run_spec(), "cuda", row.sharding)


# ------------------------------------------------------------------------ on stand-ins
def test_a_missing_required_feature_is_one_line(
    monkeypatch: pytest.MonkeyPatch, fresh_findings: None
) -> None:
    def gone() -> str:
        raise features.Absent("FineGrainedActivationOffloadingInterface has no reset")

    feature = dataclasses.replace(features.FEATURES["offload_interface"], probe=gone)
    monkeypatch.setitem(features.FEATURES, "offload_interface", feature)
    monkeypatch.setattr(features, "installed", lambda: True)
    monkeypatch.setattr(features, "source", lambda: {"version": "9.9", "commit": "", "path": ""})
    for name in features.FEATURES:
        if name != "offload_interface":
            ok = dataclasses.replace(features.FEATURES[name], probe=lambda: "found")
            monkeypatch.setitem(features.FEATURES, name, ok)
    line = features.required_missing()
    assert line is not None and "\n" not in line
    assert line.startswith("megatron-core 9.9 lacks FineGrainedActivationOffloadingInterface")
    assert "(feature offload_interface, needed by the mcore backend and the bridge)" in line
    assert line.endswith("megatron-core 0.19 has it")


def test_without_megatron_core_nothing_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No install is ``unavailable_reason``'s line (it says how to install); the feature check
    adds none."""
    monkeypatch.setattr(features, "installed", lambda: False)
    assert features.required_missing() is None
    assert features.report_lines()[0].startswith("megatron-core: not installed")


def test_new_and_absent_names_are_one_line() -> None:
    harness_names = tuple(GROUPS)
    assert features.names_line(harness_names, "0.19.2") is None
    line = features.names_line((*harness_names, "gdp_qkv"), "0.20.0")
    assert line is not None and "\n" not in line
    assert "new to the harness: gdp_qkv" in line
    line = features.names_line(tuple(n for n in harness_names if n != "attn_norm"), "0.18")
    assert line == "megatron-core 0.18 lacks the harness's offload names attn_norm"


def test_every_sharding_declares_its_features() -> None:
    assert set(TRAINER_NEEDS) == set(TRAINERS)
    for needs in TRAINER_NEEDS.values():
        assert all(name in features.FEATURES for name in needs)


def test_buffer_knob_becomes_the_megatron_field_in_gib() -> None:
    spec = ModelSpec(pattern="+-", impl="mcore", offload_buffer_kib=1 << 20)
    assert knob_fields(spec) == {"fine_grained_offloading_buffer_size_gib": 1.0}
    assert knob_fields(spec.replace(offload_buffer_kib=0)) == {}
    with pytest.raises(ValueError, match="offload_buffer_kib is a megatron-core setting"):
        ModelSpec(pattern="+-", offload_buffer_kib=1)
    with pytest.raises(ValueError, match="offload_buffer_kib must be >= 0"):
        ModelSpec(pattern="+-", impl="mcore", offload_buffer_kib=-1)


def test_main_rows_keep_the_seeds_settings() -> None:
    seed = MCORE_FAMILY[0]
    names = [row.name for row in MCORE_MAIN_ROWS]
    assert names == [
        f"{seed.name}_mfsdp-v2",
        f"{seed.name}_buffer-1048576KiB",
        f"{seed.name}_buffer-1KiB",
    ]
    for row in MCORE_MAIN_ROWS:
        plain = row.replace(sharding="none", offload_buffer_kib=0, description=seed.description)
        assert plain == seed


def test_bridge_and_reset_watch_take_mains_process_group() -> None:
    """main's schedules call ``off_interface.reset(process_group=...)``; 0.19's call
    ``reset()``: the bridge and the backend's reset watch take both."""
    bridge = Bridge(offloader=None, layer=lambda: 0, te_flag=None)  # type: ignore[arg-type]
    assert bridge.reset() is None
    assert bridge.reset(process_group=object()) is None


def test_commit_of_a_build_a_checkout_and_a_release(tmp_path: Path) -> None:
    outside = tmp_path / "site" / "megatron" / "core"
    outside.mkdir(parents=True)
    assert installed._megatron_commit("0.20.0+gd98e8a64dd", outside) == "d98e8a64dd"
    assert installed._megatron_commit("0.19.2", outside) == ""
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "core").mkdir(parents=True)
    (checkout / "megatron" / "core" / "__init__.py").write_text("")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    sha = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert installed._megatron_commit("0.20.0", checkout / "megatron" / "core") == sha
    (checkout / "megatron" / "core" / "__init__.py").write_text("# changed\n")
    assert installed._megatron_commit("0.20.0", checkout / "megatron" / "core") == sha + "-dirty"
    # a folder inside another work tree (the harness's own, say) has no megatron commit
    inner = checkout / "vendor" / "megatron" / "core"
    inner.mkdir(parents=True)
    assert installed._megatron_commit("0.19.2", inner) == ""


# ---------------------------------------------------------------- the side-by-side table
def _summary(version: str, commit: str, verdicts: dict[str, str]) -> dict:
    cases = []
    for name, verdict in verdicts.items():
        case: dict = {"name": name, "verdict": verdict, "checks": {}}
        if verdict == "skip":
            case["checks"] = {"equivalence": {"status": "skip", "reason": f"{name} refused"}}
        elif verdict != "pass":
            case["problems"] = [f"{name}: losses differ", "second problem"]
        cases.append(case)
    return {"megatron_core": {"version": version, "commit": commit}, "cases": cases}


def test_table_has_a_row_per_case_and_a_column_per_install() -> None:
    old = _summary("0.19.2", "", {"seed": "pass", "v2": "skip", "buffer": "skip"})
    new = _summary(
        "0.20.0+gd98e8a64dd", "d98e8a64dd", {"seed": "pass", "v2": "fail", "gdp": "pass"}
    )
    assert mcore_versions.rows(old, new) == [
        ("seed", "pass", "pass"),
        ("v2", "skip", "fail"),
        ("buffer", "skip", "-"),
        ("gdp", "-", "pass"),
    ]
    text, differs = mcore_versions.table(old, new)
    lines = text.splitlines()
    assert differs
    assert lines[0].split(" | ") == ["case  ", "0.19.2 ", "0.20.0+gd98e8a64dd (d98e8a64dd)"]
    assert lines[2].rstrip().endswith("pass") and not lines[2].endswith("*")
    assert lines[3].endswith(" *") and "skip" in lines[3] and "fail" in lines[3]
    assert "4 cases: 1 with the same verdict, 3 differ" in lines
    assert "    0.19.2: skip: v2 refused" in lines
    assert "    0.20.0+gd98e8a64dd (d98e8a64dd): fail: v2: losses differ" in lines
    assert "    0.19.2: -: not run" in lines


def test_table_of_equal_verdicts_differs_nowhere_and_labels_fall_back() -> None:
    one = {"cases": [{"name": "seed", "verdict": "pass"}]}
    text, differs = mcore_versions.table(one, one)
    assert not differs
    assert text.splitlines()[0].split(" | ")[1:] == ["first  ", "second "]
    assert text.splitlines()[-1] == "1 cases: 1 with the same verdict, 0 differ"


def test_table_command_reads_two_summaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    paths = []
    for index, verdict in enumerate(("pass", "fail")):
        path = tmp_path / f"{index}.json"
        path.write_text(json.dumps(_summary(f"v{index}", "", {"seed": verdict})))
        paths.append(str(path))
    assert mcore_versions.main(["table", *paths]) == 1
    assert "seed | pass    | fail    *" in capsys.readouterr().out
    assert mcore_versions.main(["table", paths[0], paths[0]]) == 0
    assert mcore_versions.main(["tables"]) == 2


def test_report_lines_name_every_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {
        name: features.Finding(feature=f, present=f.required, detail="d")
        for name, f in features.FEATURES.items()
    }
    monkeypatch.setattr(features, "installed", lambda: True)
    monkeypatch.setattr(features, "findings", lambda: found)
    monkeypatch.setattr(features, "source", lambda: {"version": "x", "commit": "c", "path": "p"})
    lines = features.report_lines()
    assert lines[0] == "megatron-core x commit c at p"
    for name in features.FEATURES:
        assert any(line.split(":")[0].split()[-1] == name for line in lines[1:]), name
    assert lines[-1] == "  every required feature is there"


def test_manager_state_is_looked_for_as_assignments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend reads attributes megatron-core makes on CUDA only; the probe looks for
    their assignments in the source, and names the ones it does not find."""
    source = "".join(f"        self.{name} = None\n" for name in features.MANAGER_STATE[1:])
    monkeypatch.setattr(features, "_module", lambda name: types.ModuleType(name))
    monkeypatch.setattr(features.inspect, "getsource", lambda module: source)
    with pytest.raises(features.Absent, match=r"no assignment of cpu_tensor_pool in "):
        features._manager_state()
    compared = source + "        if self.cpu_tensor_pool == other:\n"
    monkeypatch.setattr(features.inspect, "getsource", lambda module: compared)
    with pytest.raises(features.Absent, match="cpu_tensor_pool"):  # a comparison is no assignment
        features._manager_state()
    assigned = source + "        self.cpu_tensor_pool: Pool = Pool()\n"
    monkeypatch.setattr(features.inspect, "getsource", lambda module: assigned)
    assert features._manager_state().startswith("the 11 ")


def test_a_session_with_megatron_rows_stops_on_a_missing_feature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from harness.plugin import options

    line = "megatron-core 9.9 lacks X (feature offload_interface, ...); megatron-core 0.19 has it"
    monkeypatch.setattr(features, "required_missing", lambda: line)
    cuda = types.SimpleNamespace(models="mcore", device=types.SimpleNamespace(type="cuda"))
    with pytest.raises(pytest.UsageError, match=re.escape(line)):
        options._check_megatron_core(cuda)  # type: ignore[arg-type]
    for models, device in (("harness", "cuda"), ("mcore", "cpu")):
        other = types.SimpleNamespace(models=models, device=types.SimpleNamespace(type=device))
        options._check_megatron_core(other)  # type: ignore[arg-type]  # not checked: no raise
