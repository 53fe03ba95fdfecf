"""Import arrows point one way: every module of ``harness/`` belongs to one layer, and a module
imports only from its own layer or the layers below it.

    vocabulary -> offload -> models -> measure -> execute -> verify -> diagnose -> run -> top

A stage is a folder of ``harness/`` (``FOLDERS``: ``vocab/`` and ``util/`` are the vocabulary,
``cases/``, the case table, sits with the models, ``plugin/``, ``tools/`` and ``testing/`` are
the top); the few modules on top of ``harness/`` are placed one by one (``TOP_LEVEL``).

``top`` is the command line, the pytest plugin and the tools (and the test helpers). Reporting
is a leaf beside the stack: it imports only the vocabulary (and itself), and only ``verify``
and the layers above it import it. The offloaders never import the prediction or the case
table, the checks never import the reproduction.

``LAYER`` places every module by its folder (a module in an unplaced folder, or a new one on top
of ``harness/``, fails, so a new module must be placed);
``ALLOWED`` lists the arrows that still point the wrong way, each with its reason. The imports
are read with ``ast``: module-level and function-level ``import`` / ``from ... import`` of
``harness.*``, relative imports resolved, ``TYPE_CHECKING`` imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import harness

ROOT = Path(harness.__file__).parent

ORDER = (
    "vocabulary",
    "offload",
    "models",
    "measure",
    "execute",
    "verify",
    "diagnose",
    "run",
    "top",
)
"""The stack, lowest first; ``reporting`` is the leaf beside it."""
REPORTING = "reporting"
REPORTING_USERS = ORDER[ORDER.index("verify") :]
"""The layers that may import reporting."""

FOLDERS: dict[str, str] = {
    # harness/<folder>/ -> its layer: a folder is a pipeline stage
    "vocab": "vocabulary",  # the tables every layer reads
    "util": "vocabulary",  # utilities that import no other layer
    "offload": "offload",
    "models": "models",  # our models, megatron-core's, and the training loop
    "cases": "models",  # the case table: data over the vocabulary and offload config
    "measure": "measure",  # the instruments
    "execute": "execute",  # a case's runs: prediction, baselines, attribution
    "verify": "verify",  # checks, judge, golden traces, the catalogue's catchers
    "diagnose": "diagnose",  # repro, bisection
    "run": "run",  # settings, session, worker pool, forkserver
    "plugin": "top",
    "tools": "top",
    "testing": "top",
    "reporting": REPORTING,
}
"""Every folder of ``harness/`` and the layer of every module in it."""

TOP_LEVEL: dict[str, str] = {
    "harness": "vocabulary",
    "harness.overrides": "models",  # the case fields a run's flags override, declared once
    "harness.__main__": "top",
    "harness.entry": "top",
    "harness.cli": "top",
    "harness.cli_output": "top",  # the run's console lines and report writes
}
"""The modules that sit on top of ``harness/``, outside the stage folders."""


def layer_of(module: str) -> str | None:
    """The layer of a module of ``harness/``: its folder's, or its own entry in ``TOP_LEVEL``."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS):
        return FOLDERS.get(parts[1])
    return TOP_LEVEL.get(module)


ALLOWED: dict[tuple[str, str], str] = {
    # (importer, imported): why the arrow still points the wrong way
    ("harness.models.mcore.bridge", "harness.measure.observe"): (
        "a native run's wiring (_wired) hands the harness windows (isinstance Windowed) to "
        "megatron-core's manager's watcher (McoreOffloader.native), which tells them each group"
    ),
    ("harness.reporting.html", "harness.run.settings"): (
        "index.html resolves the plots setting (PLOTS_VARIABLE, resolve_plots) where it renders"
    ),
}
"""Known wrong-way arrows, each with its reason; a fixed one must leave this list."""


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of a module file under ``root`` (the ``harness`` package folder)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def harness_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports(source: str, module: str, *, package: bool, known: set[str]) -> set[str]:
    """The ``harness`` modules ``source`` (module ``module``; ``package``: an ``__init__``)
    imports, at any depth: ``from a import b`` names module ``a.b`` where that is a module,
    else ``a``; relative imports are resolved against ``module``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in known else target)
    return {name for name in found if name == "harness" or name.startswith("harness.")} - {module}


LAYER: dict[str, str] = {
    name: layer for name in harness_modules() if (layer := layer_of(name)) is not None
}
"""Every module of ``harness/`` (recursively) that has a layer -> its layer."""


def allowed(importer: str, imported: str) -> bool:
    """Whether a module of layer ``importer`` may import one of layer ``imported``."""
    if importer == REPORTING:
        return imported in ("vocabulary", REPORTING)
    if imported == REPORTING:
        return importer in REPORTING_USERS
    return ORDER.index(importer) >= ORDER.index(imported)


def wrong_way(
    sources: dict[str, tuple[str, bool]],
    layer: dict[str, str],
    exceptions: dict[tuple[str, str], str] | None = None,
) -> list[str]:
    """One line per import that points the wrong way (module -> (source, is a package))."""
    exceptions = ALLOWED if exceptions is None else exceptions
    known = set(sources) | set(layer)
    problems = []
    for module, (source, package) in sorted(sources.items()):
        for target in sorted(imports(source, module, package=package, known=known)):
            if target not in layer or (module, target) in exceptions:
                continue
            if not allowed(layer[module], layer[target]):
                problems.append(
                    f"{module} ({layer[module]}) imports {target} ({layer[target]}): "
                    f"{layer[module]} may not import {layer[target]}"
                )
    return problems


def _sources() -> dict[str, tuple[str, bool]]:
    return {
        name: (path.read_text(), path.name == "__init__.py")
        for name, path in harness_modules().items()
    }


def test_every_module_has_a_layer() -> None:
    """A module in a folder that is not a stage, or a new module on top of ``harness/``, fails:
    place it in a stage folder (or, for a new stage, in ``FOLDERS``)."""
    missing = sorted(name for name in harness_modules() if layer_of(name) is None)
    assert not missing, (
        f"modules without a layer (see FOLDERS in tests/unit/test_layers.py): {missing}"
    )
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FOLDERS), (sorted(folders - set(FOLDERS)), sorted(set(FOLDERS) - folders))
    assert set(LAYER.values()) <= {*ORDER, REPORTING}


def test_imports_point_one_way() -> None:
    problems = wrong_way(_sources(), LAYER)
    assert not problems, "imports pointing the wrong way:\n" + "\n".join(problems)


def test_allowed_wrong_way_arrows_still_exist() -> None:
    """Each allow-listed arrow is still an import and still points the wrong way: a fixed one
    leaves the list."""
    sources = _sources()
    known = set(sources)
    for importer, imported in ALLOWED:
        source, package = sources[importer]
        assert imported in imports(source, importer, package=package, known=known), (
            f"{importer} no longer imports {imported}: drop it from ALLOWED"
        )
        assert not allowed(LAYER[importer], LAYER[imported]), (importer, imported)


@pytest.mark.parametrize(
    ("source", "package"),
    [
        ("from harness.execute.predict import Semantics\n", False),
        ("def rule():\n    from harness.execute import predict\n    return predict\n", False),
        ("import harness.execute.predict\n", False),
        ("from ..execute.predict import skip_reason\n", False),
        ("from ..execute import predict\n", False),
    ],
    ids=["from", "function-level", "import", "relative", "relative-package"],
)
def test_a_wrong_way_import_is_flagged(source: str, package: bool) -> None:
    """A module claiming to be in ``harness/offload/`` that imports the prediction is flagged,
    naming both modules and their layers, however the import is spelled."""
    sources = {"harness.offload.injected": (source, package)}
    layer = {**LAYER, "harness.offload.injected": "offload"}
    problems = wrong_way(sources, layer, exceptions={})
    assert problems == [
        "harness.offload.injected (offload) imports harness.execute.predict (execute): "
        "offload may not import execute"
    ]


def test_reporting_is_a_leaf() -> None:
    layer = {**LAYER, "harness.offload.injected": "offload", "harness.injected": REPORTING}
    into = {
        "harness.offload.injected": ("from harness.reporting.report import run_folder\n", False)
    }
    assert wrong_way(into, layer, exceptions={}) == [
        "harness.offload.injected (offload) imports harness.reporting.report (reporting): "
        "offload may not import reporting"
    ]
    out = {"harness.injected": ("from harness.execute.steps import Environment\n", False)}
    assert wrong_way(out, layer, exceptions={}) == [
        "harness.injected (reporting) imports harness.execute.steps (execute): "
        "reporting may not import execute"
    ]
    fine = {"harness.injected": ("from harness.vocab.spec import ModelSpec\n", False)}
    assert wrong_way(fine, layer, exceptions={}) == []


def test_the_checker_reads_a_module_file(tmp_path: Path) -> None:
    """The same on a file: a tmp package laid out like ``harness/`` with an offload module
    importing the prediction."""
    root = tmp_path / "harness"
    (root / "offload").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "execute").mkdir()
    (root / "execute" / "__init__.py").write_text("")
    (root / "execute" / "predict.py").write_text("")
    (root / "offload" / "__init__.py").write_text("")
    (root / "offload" / "bad.py").write_text("from harness.execute.predict import Semantics\n")
    sources = {
        name: (path.read_text(), path.name == "__init__.py")
        for name, path in harness_modules(root).items()
    }
    assert set(sources) == {
        "harness",
        "harness.execute",
        "harness.execute.predict",
        "harness.offload",
        "harness.offload.bad",
    }
    layer = {**LAYER, "harness.offload.bad": "offload"}
    assert wrong_way(sources, layer, exceptions={}) == [
        "harness.offload.bad (offload) imports harness.execute.predict (execute): "
        "offload may not import execute"
    ]
