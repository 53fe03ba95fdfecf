"""The feature probes tell a missing feature from a bug (``harness.models.mcore.features``), on
stand-in megatron-core modules put in ``sys.modules``: no megatron-core is needed.

* a feature whose module, class, field and parameter are there is present;
* one that is absent is a refusal line naming it (``refusal``), as a row lacking it is skipped;
* a module that exists but cannot import a dependency leaves the feature unprobed, its line
  naming the failed import, never "lacks";
* anything else a probe raises - a ``KeyError``, an ``AttributeError`` of a direct lookup, a
  ``ValueError`` from a value of an unexpected type - propagates as a ``ProbeError`` naming the
  probe: a bug in the probe is not a refused row.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from harness.models.mcore import features

VERSION = {"version": "9.9", "commit": "", "path": ""}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Probe again in each test, on the stand-ins, as version 9.9, without setting
    TransformerEngine's environment (nothing imports it here). A stand-in module's source is
    empty (the manager-state probe reads the offload module's)."""
    monkeypatch.setattr(features, "apply_environment", lambda: None)
    real = inspect.getsource

    def source_of(thing: Any) -> str:
        stand_in = isinstance(thing, types.ModuleType) and thing.__name__.startswith("megatron")
        return "" if stand_in else real(thing)

    monkeypatch.setattr(features.inspect, "getsource", source_of)
    # an installed megatron-core stays out of sight: its modules are hidden, and an empty
    # package stands in for it, under which only the stand-ins a test adds exist
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    _put(monkeypatch, "megatron")
    monkeypatch.setattr(features, "installed", lambda: True)
    monkeypatch.setattr(features, "source", lambda: VERSION)
    features.findings.cache_clear()
    yield
    features.findings.cache_clear()


def _package(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> types.ModuleType:
    """A stand-in module (a package, so that a missing submodule is a plain not-found) with
    ``attributes``, and every package between it and the stand-in ``megatron``."""
    parts = name.split(".")
    for depth in range(2, len(parts)):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            _put(monkeypatch, parent)
    return _put(monkeypatch, name, **attributes)


def _put(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # type: ignore[attr-defined]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _config(*extra: str) -> type:
    """A ``TransformerConfig`` stand-in with the offloading fields and ``extra`` ones."""
    names = (*features.OFFLOAD_FIELDS, *extra)
    fields = [(n, int, dataclasses.field(default=0)) for n in names]
    return dataclasses.make_dataclass("TransformerConfig", fields)


def test_a_feature_that_is_there_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = "fine_grained_offloading_buffer_size_gib"
    _package(monkeypatch, features.CONFIG, TransformerConfig=_config(buffer))
    _package(monkeypatch, features.OFFLOAD, PinnedActivationBuffer=type("Buffer", (), {}))
    found = features.findings()
    assert found["offload_config_fields"].present
    assert found["pinned_activation_buffer"] == features.Finding(
        feature=features.FEATURES["pinned_activation_buffer"],
        present=True,
        detail="PinnedActivationBuffer, fine_grained_offloading_buffer_size_gib",
    )
    assert features.refusal(("pinned_activation_buffer",)) is None


def test_an_absent_feature_is_a_refusal_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config has no buffer field: the buffer rows are refused in one line; the module of
    Megatron-FSDP v2's adapter does not exist at all: the same."""
    _package(monkeypatch, features.CONFIG, TransformerConfig=_config())
    _package(monkeypatch, features.OFFLOAD, PinnedActivationBuffer=type("Buffer", (), {}))
    found = features.findings()
    buffer = found["pinned_activation_buffer"]
    assert (buffer.present, buffer.probed) == (False, True)
    assert buffer.detail == "TransformerConfig has no field fine_grained_offloading_buffer_size_gib"
    line = features.refusal(("offload_config_fields", "pinned_activation_buffer"))
    assert line is not None and "\n" not in line
    assert line.startswith("megatron-core 9.9 lacks PinnedActivationBuffer and ")
    assert "(feature pinned_activation_buffer, needed by rows with Case.offload_buffer_kib)" in line
    fsdp = found["megatron_fsdp_v2"]  # no stand-in of its modules: they do not exist
    assert (fsdp.present, fsdp.probed) == (False, True)
    assert fsdp.detail == f"no module {features.DDP_CONFIG}"


def test_a_module_whose_dependency_does_not_import_is_not_called_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """megatron-core's config module exists but imports triton, which is not installed: the
    feature is neither present nor missing, and its line names the import."""
    real = importlib.import_module

    def importing(name: str, package: str | None = None) -> Any:
        if name == features.CONFIG:
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
        return real(name, package)

    monkeypatch.setattr(features.importlib, "import_module", importing)
    found = features.findings()["offload_config_fields"]
    assert (found.present, found.probed) == (False, False)
    assert found.detail == f"import {features.CONFIG} failed: No module named 'triton'"
    line = features.required_missing()
    assert line is not None and "lacks" not in line
    assert line.startswith("megatron-core 9.9: feature offload_config_fields (")
    assert line.endswith(f"could not be probed: {found.detail}")
    expected = f"  --  offload_config_fields: not probed here: {found.detail}"
    assert expected in features.report_lines()


def _with_probe(monkeypatch: pytest.MonkeyPatch, name: str, probe: Any) -> None:
    feature = dataclasses.replace(features.FEATURES[name], probe=probe)
    monkeypatch.setitem(features.FEATURES, name, feature)


def _typo() -> str:  # a direct attribute lookup with a typo, not through ``_attr``
    return str(features._module(features.OFFLOAD).ChunkOfloadHandler)


def _lookup() -> str:  # a dict lookup gone wrong: a KeyError is a LookupError too
    return {"a": "b"}["c"]


@pytest.mark.parametrize(
    ("probe", "raised"),
    [(_typo, "AttributeError"), (_lookup, "KeyError")],
    ids=["attribute", "key"],
)
def test_a_bug_in_a_probe_propagates_naming_the_probe(
    monkeypatch: pytest.MonkeyPatch, probe: Any, raised: str
) -> None:
    _package(monkeypatch, features.OFFLOAD, ChunkOffloadHandler=type("Handler", (), {}))
    _with_probe(monkeypatch, "reset_process_group", probe)
    with pytest.raises(features.ProbeError) as info:
        features.refusal(("reset_process_group",))
    message = str(info.value)
    assert message.startswith(
        f"megatron-core feature probe reset_process_group ({probe.__qualname__}) raised {raised}: "
    )
    assert message.endswith("not a missing feature")


def test_a_value_of_an_unexpected_type_is_a_probe_error_not_a_missing_feature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The coverage probe formats the class attribute as a number; a string there is something
    the probe does not understand, so it says so instead of refusing the view rule."""
    handler = type("ChunkOffloadHandler", (), {"BASE_OFFLOAD_MIN_COVERAGE": "half"})
    _package(monkeypatch, features.OFFLOAD, ChunkOffloadHandler=handler)
    with pytest.raises(features.ProbeError, match=r"probe coverage_view_copy .* raised ValueError"):
        features.findings()
    handler.BASE_OFFLOAD_MIN_COVERAGE = 0.5
    features.findings.cache_clear()
    found = features.findings()["coverage_view_copy"]
    assert (found.present, found.detail) == (
        True,
        "views covering >= 0.5 of their storage copied whole",
    )
