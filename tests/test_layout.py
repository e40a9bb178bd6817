"""The tree's rules, checked: floors, sizes and where environment variables are read.

Each package of ``engine`` and ``service`` stands on a floor (:data:`ENGINE_FLOORS`,
:data:`SERVICE_FLOORS`); a module may import its own floor and those below, never one
above, and no two modules import each other, directly or round a loop. Imports inside
functions count: a lazy import that runs back up is still a dependency upward.
docs/architecture.md draws the same floors in words.
"""

from __future__ import annotations

import ast
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

SERVICE_FLOORS: tuple[tuple[str, ...], ...] = (
    ("service", "service.common"),
    ("service.events",),
    ("service.supervision",),
    ("service.vram",),
    ("service.api",),
    ("service.control",),
    ("service.http",),
    ("service.autostart", "service.bench", "service.tray"),
    ("service.cli", "service.doctor"),
)

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


# The one module that reads headroom's environment variables (HEADROOM_*): options and
# env-only settings alike go through it (engine.common.environment's docstring).
ENVIRONMENT_READER = "engine/common/environment.py"
# What a module may do with os.environ without reading a variable: copy it whole for a
# child process, or set and drop variables.
_ENVIRON_WRITES = ("copy", "update", "pop", "setdefault")


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _variable_read(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    """What a use of ``os.environ``/``os.getenv`` reads: ``""`` for nothing (a copy for a
    child, a write), the variable's name where it is written out, ``"?"`` where it is
    not (a name computed at run time, or the environment handed on as a mapping)."""
    up = parents.get(node)
    if (isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "dict" and up.args == [node]) \
            or (isinstance(up, ast.Dict) and node in up.values) \
            or (isinstance(up, ast.Attribute) and up.attr in _ENVIRON_WRITES) \
            or (isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del))):
        return ""
    while isinstance(up, ast.IfExp):  # (os.environ if env is None else env).get(...)
        node, up = up, parents.get(up)
    key = None
    if isinstance(up, ast.Call) and up.func is node:  # os.getenv(NAME)
        key = up.args[0] if up.args else None
    elif isinstance(up, ast.Attribute) and up.attr == "get" and isinstance(parents.get(up), ast.Call):
        call = parents[up]
        key = call.args[0] if call.args else None
    elif isinstance(up, ast.Subscript):
        key = up.slice
    elif isinstance(up, ast.Compare) and node in up.comparators:  # NAME in os.environ
        key = up.left
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    return "?"


def _headroom_reads(tree: ast.AST) -> list[str]:
    """``line: variable`` of each read of a ``HEADROOM_*`` variable, or of a variable whose
    name is not written out (which could be one)."""
    parents = _parents(tree)
    found = []
    for node in ast.walk(tree):
        if _is_os_environ(node):
            name = _variable_read(node, parents)
            if name == "?" or name.startswith("HEADROOM_"):
                found.append(f"{node.lineno}: {name}")
    return found


def test_only_the_environment_module_reads_headroom_variables():
    """No module of engine/, service/ or kernels/ but :data:`ENVIRONMENT_READER` reads a
    ``HEADROOM_*`` variable, or a variable whose name it does not write out: an option
    is read by the option system, an env-only setting through its declaration there.
    Other programs' variables (``CUDA_VISIBLE_DEVICES``, ``TRITON_INTERPRET``, ``CC``)
    are read where they are used, by name."""
    offenders = []
    for top in ("engine", "service", "kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where != ENVIRONMENT_READER:
                offenders += [f"{where}:{read}" for read in _headroom_reads(ast.parse(path.read_text(), where))]
    assert not offenders, "reads of the environment outside " + ENVIRONMENT_READER + ":\n" + "\n".join(offenders)


def test_the_environment_check_sees_a_read():
    """The check above catches the ways a module reads a variable, and lets another
    program's variable, a copy for a child or a write pass."""
    def flagged(code: str) -> bool:
        return bool(_headroom_reads(ast.parse(code)))

    assert flagged('import os\nx = os.environ.get("HEADROOM_PDL")')
    assert flagged('import os\nx = os.getenv("HEADROOM_PDL")')
    assert flagged('import os\nx = "HEADROOM_PDL" in os.environ')
    assert flagged('import os\nx = os.environ["HEADROOM_PORT"]')
    assert flagged('import os\nfrom p import ENV_PREFIX\nx = os.environ[ENV_PREFIX + "PORT"]')
    assert flagged('import os\ndef flag(name):\n    return os.environ.get(name)')
    assert flagged('import os\ndef f(env=None):\n    env = os.environ if env is None else env\n'
                   '    return env.get("HEADROOM_CONFIG")')
    assert not flagged('"""HEADROOM_PDL=0 turns it off."""\nimport os\nx = os.environ.get("CC")')
    assert not flagged('import os\nx = (os.environ if e is None else e).get("CUDA_VISIBLE_DEVICES", "")')
    assert not flagged('import os\nenv = dict(os.environ)\nenv["HEADROOM_CONFIG"] = "x"')
    assert not flagged('import os\nos.environ.update(NCCL_ENV)\nos.environ["HEADROOM_X"] = "1"')
