"""The package's structure: no import cycle inside ``harness/`` (module-level and
function-level imports alike), no module is over ``MAX_MODULE_LINES`` lines nor any function
over ``MAX_FUNCTION_LINES``, and every package is listed for the wheel. What a fresh interpreter
imports (the case table without torch, the backends table without the broken catalogue) is in
``tests/e2e/test_layout_processes.py``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
"""The size bar (issue 57): a module of at most 600 lines, a function or method of at most 80
(``end_lineno - lineno + 1``, decorators not counted)."""


def _import_graph() -> dict[str, set[str]]:
    """harness module -> the harness modules it imports anywhere in its source."""
    modules = {}
    for path in (REPO / "harness").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """An import path from ``start`` back to itself, if any (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycle_in_harness() -> None:
    graph = _import_graph()
    assert len(graph) > 30 and graph["harness.verify.judge"], "the graph reads the imports"
    cycles = [c for name in graph if (c := _cycle_through(graph, name))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(graph, "d") is None


def _python_files() -> list[Path]:
    """Every Python file the size bar covers: ``harness/``, ``cases/``, ``tests/`` and
    ``examples/`` recursively, ``scripts/`` (``*.py`` and the extension-less Python wrappers)
    and ``conftest.py``."""
    files = [REPO / "conftest.py"]
    for folder in ("harness", "cases", "tests", "examples"):
        files += (REPO / folder).rglob("*.py")
    for path in (REPO / "scripts").iterdir():
        if path.suffix == ".py" or (path.is_file() and not path.suffix and _python_script(path)):
            files.append(path)
    return sorted({f for f in files if f.is_file()})


def _python_script(path: Path) -> bool:
    with path.open("rb") as file:
        first = file.readline()
    return first.startswith(b"#!") and b"python" in first


def oversized(path: Path, root: Path = REPO) -> list[str]:
    """One line per breach of the size bar in ``path``: the module's line count over
    ``MAX_MODULE_LINES``, each function or method over ``MAX_FUNCTION_LINES``."""
    text = path.read_text()
    shown = path.relative_to(root)
    problems = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        problems.append(f"{shown}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if length > MAX_FUNCTION_LINES:
                problems.append(
                    f"{shown}:{node.lineno}: {node.name} is {length} lines "
                    f"(at most {MAX_FUNCTION_LINES})"
                )
    return problems


def test_modules_and_functions_are_within_the_size_bar() -> None:
    files = _python_files()
    assert len(files) > 150 and REPO / "harness" / "cli.py" in files, "the walk finds them"
    problems = [line for path in files for line in oversized(path)]
    for line in problems:
        print(line)
    assert not problems, "over the size bar:\n" + "\n".join(problems)


def test_the_size_bar_finds_a_long_module_and_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    short = "def short():\n    return 1\n"
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n" + "\n" * MAX_MODULE_LINES)
    (tmp_path / "fine.py").write_text(short)
    assert oversized(tmp_path / "fine.py", tmp_path) == []
    assert oversized(tmp_path / "long.py", tmp_path) == [
        f"long.py: {MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES} lines (at most 600)",
        f"long.py:1: long is {MAX_FUNCTION_LINES + 1} lines (at most 80)",
    ]


def test_every_package_is_listed_for_the_wheel() -> None:
    """pyproject.toml lists the packages explicitly (cases/ installs as harness.suite): a new
    subpackage must be added there or the wheel lacks it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(root).parts)
        for init in (root / "harness").rglob("__init__.py")
    }
    assert found | {"harness.suite"} == listed
