"""A stand-in for megatron-core's config classes, for the ``mcore`` tests that run without
megatron-core (``tests/mcore/test_mcore_models.py``, ``tests/mcore/test_mcore_knobs.py``)."""

from __future__ import annotations

import sys
import types

import pytest


def fake_megatron(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
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
