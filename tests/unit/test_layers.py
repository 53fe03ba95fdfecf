"""Import arrows point one way: every module of ``harness/`` belongs to one layer, and a module
imports only from its own layer or the layers below it.

    vocabulary -> offload -> models -> measure -> verify -> diagnose -> run -> top

``top`` is the command line, the pytest plugin and the tools (and the test helpers). Reporting
is a leaf beside the stack: it imports only the vocabulary (and itself), and only ``verify``
and the layers above it import it. The offloaders never import the prediction or the case
table, the checks never import the reproduction.

``LAYER`` places every module (a module missing from it fails, so a new module must be placed);
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

ORDER = ("vocabulary", "offload", "models", "measure", "verify", "diagnose", "run", "top")
"""The stack, lowest first; ``reporting`` is the leaf beside it."""
REPORTING = "reporting"
REPORTING_USERS = ORDER[ORDER.index("verify") :]
"""The layers that may import reporting."""

_VOCABULARY = (
    # the tables every layer reads, and utilities that import no other harness module
    "harness",
    "harness.vocab.groups",
    "harness.vocab.impls",
    "harness.vocab.spec",
    "harness.util.distributed",
    "harness.util.progress",
    "harness.util.globalstate",
    "harness.run.lifeline",
    "harness.run.forkserver",
    "harness.run.forkserver_guard",
    "harness.util.leftovers",
    "harness.util.sanitizer",
    "harness.util.bytecode",
    "harness.util.compare",
    "harness.measure.fingerprint",
)
_OFFLOAD = (
    "harness.offload",
    "harness.offload.adapters",
    "harness.offload.backends",
    "harness.offload.broken",
    "harness.offload.broken_cadence",
    "harness.offload.config",
    "harness.offload.copies",
    "harness.offload.groupstate",
    "harness.offload.layout",
    "harness.offload.mcore",
    "harness.offload.passthrough",
    "harness.offload.policy",
    "harness.offload.pool",
    "harness.offload.protocol",
    "harness.offload.ranges",
    "harness.offload.recorder",
    "harness.offload.reference",
    "harness.offload.semantics",
)
_MODELS = (
    "harness.models",
    "harness.models.hybrid",
    "harness.models.layers",
    "harness.models.moe",
    "harness.models.mcore",
    "harness.models.mcore.bridge",
    "harness.models.mcore.build",
    "harness.models.mcore.config",
    "harness.models.mcore.loop",
    "harness.models.mcore.sharding",
    "harness.models.runs",
    "harness.models.train",
)
_MEASURE = (
    "harness.cases",  # the case table: what a run measures
    "harness.execute",
    "harness.execute.environment",  # where and with what a case runs
    "harness.execute.attribution",
    "harness.execute.baselines",  # the plain baseline and memory reading rows share
    "harness.execute.caserun",
    "harness.execute.memory",  # the memory case's reading
    "harness.execute.backwardpeak",
    "harness.measure.observe",
    "harness.measure.copyobserver",
    "harness.measure.checksums",
    "harness.measure.transfers",
    "harness.measure.timeline",
    "harness.execute.predict",
    "harness.execute.learn",
    "harness.execute.cadence",
    "harness.measure.syncguard",
    "harness.measure.hostclock",
)
_VERIFY = (
    "harness.verify.checks",
    "harness.verify.judge",
    "harness.verify.golden",
    "harness.verify.detection",
    "harness.verify.commands",
)
_DIAGNOSE = ("harness.diagnose.bisect", "harness.diagnose.repro")
_RUN = ("harness.run.session", "harness.run.parallel", "harness.run.settings")
_TOP = (
    "harness.__main__",
    "harness.entry",
    "harness.cli",
    "harness.plugin",
    "harness.plugin.cases",
    "harness.plugin.dist",
    "harness.plugin.models",
    "harness.plugin.options",
    "harness.plugin.properties",
    "harness.plugin.report",
    "harness.plugin.stopping",
    "harness.plugin.workers",
    "harness.testing",
    "harness.testing.autograd",
    "harness.testing.strategies",
    "harness.tools",
    "harness.tools.bench",
    "harness.tools.bench.__main__",
    "harness.tools.bench.cli",
    "harness.tools.bench.common",
    "harness.tools.bench.copies",
    "harness.tools.bench.driver",
    "harness.tools.bench.hosttime",
    "harness.tools.bench.measure",
    "harness.tools.bench.models",
    "harness.tools.bench.output",
    "harness.tools.bench.peers",
    "harness.tools.bench.phases",
    "harness.tools.bench.targets",
    "harness.tools.bench.trace",
    "harness.tools.bench_offload",
    "harness.tools.host_profile",
    "harness.tools.mutation_score",
    "harness.tools.nightly",
)
_REPORTING = ("harness.reporting.report", "harness.reporting.html", "harness.reporting.plots")

LAYER: dict[str, str] = {
    module: layer
    for layer, modules in (
        ("vocabulary", _VOCABULARY),
        ("offload", _OFFLOAD),
        ("models", _MODELS),
        ("measure", _MEASURE),
        ("verify", _VERIFY),
        ("diagnose", _DIAGNOSE),
        ("run", _RUN),
        ("top", _TOP),
        (REPORTING, _REPORTING),
    )
    for module in modules
}
"""Every module of ``harness/`` (recursively) -> its layer."""

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
    modules = set(harness_modules())
    missing = sorted(modules - set(LAYER))
    assert not missing, (
        f"modules without a layer (place them in tests/unit/test_layers.py): {missing}"
    )
    gone = sorted(set(LAYER) - modules)
    assert not gone, f"LAYER names modules that do not exist: {gone}"
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
        ("def rule():\n    from harness import predict\n    return predict\n", False),
        ("import harness.execute.predict\n", False),
        ("from ..predict import skip_reason\n", False),
        ("from .. import predict\n", False),
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
        "harness.offload.injected (offload) imports harness.execute.predict (measure): "
        "offload may not import measure"
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
        "harness.injected (reporting) imports harness.execute.steps (measure): "
        "reporting may not import measure"
    ]
    fine = {"harness.injected": ("from harness.vocab.spec import ModelSpec\n", False)}
    assert wrong_way(fine, layer, exceptions={}) == []


def test_the_checker_reads_a_module_file(tmp_path: Path) -> None:
    """The same on a file: a tmp package laid out like ``harness/`` with an offload module
    importing the prediction."""
    root = tmp_path / "harness"
    (root / "offload").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "predict.py").write_text("")
    (root / "offload" / "__init__.py").write_text("")
    (root / "offload" / "bad.py").write_text("from harness.execute.predict import Semantics\n")
    sources = {
        name: (path.read_text(), path.name == "__init__.py")
        for name, path in harness_modules(root).items()
    }
    assert set(sources) == {
        "harness",
        "harness.execute.predict",
        "harness.offload",
        "harness.offload.bad",
    }
    layer = {**LAYER, "harness.offload.bad": "offload"}
    assert wrong_way(sources, layer, exceptions={}) == [
        "harness.offload.bad (offload) imports harness.execute.predict (measure): "
        "offload may not import measure"
    ]
