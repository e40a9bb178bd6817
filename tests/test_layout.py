"""The tree's rules, checked: floors, sizes and where environment variables are read.

Each package of ``engine`` and ``service`` stands on a floor (:data:`ENGINE_FLOORS`,
:data:`SERVICE_FLOORS`); a module may import its own floor and those below, never one
above, and no two modules import each other, directly or round a loop. Imports inside
functions count: a lazy import that runs back up is still a dependency upward.
docs/architecture.md draws the same floors in words.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A package not listed here fails the test: a new package takes a floor.
ENGINE_FLOORS: tuple[tuple[str, ...], ...] = (
    ("engine", "engine.common"),
    ("engine.memory",),
    ("engine.wire", "engine.text"),
    ("engine.kvcache", "engine.parallel"),
    ("engine.sampling",),
    ("engine.scheduler",),
    ("engine.layers",),
    ("engine.models",),
    ("engine.loader",),
    ("engine.core",),
    ("engine.worker",),
    ("engine.commands", "engine.bench"),
)

SERVICE_FLOORS: tuple[tuple[str, ...], ...] = ()  # filled in with the service's floors

MAX_LINES = 450


def _modules(top: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                out.add(c)
    return out


def _floor_of(module: str, floors: tuple[tuple[str, ...], ...]) -> int | None:
    best, best_len = None, -1
    for level, packages in enumerate(floors):
        for p in packages:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = level, len(p)
    return best


def _graph(top: str) -> dict[str, set[str]]:
    mods = _modules(top)
    return {m: {d for d in _imports(m, p, mods) if d.split(".")[0] == top} for m, p in mods.items()}


@pytest.mark.parametrize("top,floors", [("engine", ENGINE_FLOORS), ("service", SERVICE_FLOORS)])
def test_no_import_runs_up_a_floor(top, floors):
    if not floors:
        pytest.skip("floors not declared")
    graph = _graph(top)
    unplaced = sorted(m for m in graph if _floor_of(m, floors) is None)
    assert not unplaced, f"modules on no floor (give their package one): {unplaced}"
    upward = sorted(f"{m} (floor {_floor_of(m, floors)}) imports {d} (floor {_floor_of(d, floors)})"
                    for m, deps in graph.items() for d in deps
                    if _floor_of(d, floors) > _floor_of(m, floors))
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


@pytest.mark.parametrize("top", ["engine", "service", "kernels"])
def test_no_import_circles(top):
    graph = _graph(top)
    # Tarjan's strongly connected components; any component of two or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_source_file_over_the_limit():
    long = sorted(f"{p.relative_to(ROOT)}: {n}"
                  for top in ("engine", "service", "kernels", "tests")
                  for p in (ROOT / top).rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_benchmark_at_the_engine_root_or_in_its_commands():
    names = [p.name for p in (ROOT / "engine").glob("*.py")] + \
            [p.name for p in (ROOT / "engine" / "commands").glob("*.py")]
    assert not [n for n in names if "bench" in n], names
    core = _graph("engine")
    assert not [(m, d) for m, deps in core.items() if not m.startswith(("engine.bench", "engine.commands"))
                for d in deps if d.startswith("engine.bench")]
