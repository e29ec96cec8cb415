"""The package's layering: no import circles inside `rasd/`, nothing imports `rasd.cli`, and `decoding/`
never imports Ray or the layers above it. Read from the source (ast), so a lazy import inside a function
counts as much as one at the top: both make a circle a reader has to untangle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rasd"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module a dotted import names: itself, or the package it is an attribute of."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The rasd modules `name` imports anywhere in its file (`from pkg import sub` counts `pkg.sub`)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "rasd":
                continue
            resolved = _resolve(target, known)
            if resolved and resolved != name:
                found.add(resolved)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_nothing_imports_the_cli() -> None:
    graph = import_graph()
    assert sorted(m for m, deps in graph.items() if "rasd.cli" in deps) == []


def test_decoding_stays_below_the_service() -> None:
    """decoding/ and index/ are the bottom: no Ray, and no import of the layers that use them."""
    upper = ("rasd.serve", "rasd.apps", "rasd.eval", "rasd.distributed", "rasd.cli", "rasd.train")
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith(("rasd.decoding", "rasd.index")):
            assert not [d for d in deps if d.startswith(upper)], name
            assert "import ray" not in modules()[name].read_text(), name


def test_ray_actors_stay_below_the_service() -> None:
    """distributed/ holds placement around the plain classes: it never imports serve, apps, eval or the CLI
    (the verifier actor is started from plain settings and builds its own `LocalBackend`)."""
    upper = ("rasd.serve", "rasd.apps", "rasd.eval", "rasd.cli")
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("rasd.distributed"):
            assert not [d for d in deps if d.startswith(upper)], name


def test_the_checker_finds_a_circle() -> None:
    """The checker itself can fail: a two-module circle is found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
