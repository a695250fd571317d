"""The import structure of the `xlserve` package: no cycles, and the layers stay apart.

The folders server/ and models/ install as `xlserve.server` and `xlserve.models` (pyproject.toml,
package-dir). These tests read the source with `ast` (nothing is imported for the graph) and,
for what only a real interpreter can tell, import a module in a fresh subprocess.

What counts as an import edge A -> B (A, B project modules):
- `import xlserve.server.x.y` and `from xlserve.server.x import y` (absolute), and the relative
  forms (`from . import y`, `from ..x import y`), resolved against A's package;
- `from pkg import name` is an edge to the submodule `pkg.name` when that is a module under
  server/ or models/, and otherwise an edge to `pkg` itself (the name is defined in pkg's
  __init__);
- imports at module level AND inside functions/methods: a function-level import only runs when
  the function is first called, but a cycle through it is still a cycle at that moment (and a
  latent one for whoever later hoists the import), so it counts; the failure message says which
  edges are function-level and where they are, so a reviewer can judge;
- NOT counted: imports under `if TYPE_CHECKING:` (they never run), and modules loaded from
  strings with importlib (a package __init__ resolving names lazily via `import_module(...)`,
  or the BENCHMARKS / IMPORTERS tables): that is deliberate deferral, not a static dependency;
- importing `a.b.c` also runs `a/__init__` and `a/b/__init__` first; those implicit parent edges
  are left out, because a submodule importing a sibling while its package's __init__ is still
  running is fine at run time and would otherwise show up as a false cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "xlserve"
# source folder -> import name, from pyproject.toml's [tool.setuptools] package-dir
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
SOURCES = {folder: name for name, folder in PACKAGE_DIR.items()}


@dataclass(frozen=True)
class Module:
    name: str  # dotted import name, e.g. xlserve.server.engine.process
    path: Path
    is_package: bool  # an __init__.py


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    function_level: bool
    statement: str

    def where(self, modules: dict[str, Module]) -> str:
        place = f"{modules[self.source].path.relative_to(ROOT)}:{self.line}"
        return f"{self.source} -> {self.target}  ({place}, {'in a function' if self.function_level else 'module level'}: {self.statement})"


def project_modules() -> dict[str, Module]:
    modules = {}
    for folder, prefix in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join((prefix, *parts))
            modules[name] = Module(name, path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module):
    """(node, inside a function) for every Import/ImportFrom that can run: module level, in
    classes, in try/if blocks and in functions; `if TYPE_CHECKING:` bodies are skipped."""

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:  # the else branch does run
                    yield from walk(ast.Module(body=[other], type_ignores=[]), in_function)
            else:
                nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, nested)

    yield from walk(tree, False)


def _absolute_base(node: ast.ImportFrom, module: Module) -> str:
    """The module a `from X import ...` names, with relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        raise AssertionError(f"{module.path.relative_to(ROOT)}:{node.lineno}: relative import beyond the top package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _project_target(name: str, modules: dict[str, Module]) -> str | None:
    """The longest prefix of `name` that is a project module (None: not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imported_names(module: Module) -> list[tuple[str, ast.stmt, bool]]:
    """Every fully-qualified name `module` imports: (name, node, inside a function). For
    `from pkg import a, b` both `pkg.a` and `pkg.b` are listed (a submodule or an attribute)."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    names = []
    for node, in_function in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node, in_function) for alias in node.names]
        else:
            base = _absolute_base(node, module)
            names += [(f"{base}.{alias.name}" if alias.name != "*" else base, node, in_function) for alias in node.names]
    return names


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, Edge]]:
    graph: dict[str, dict[str, Edge]] = {name: {} for name in modules}
    for module in modules.values():
        for name, node, in_function in imported_names(module):
            target = _project_target(name, modules)
            if target is None or target == module.name:
                continue
            statement = ast.unparse(node)
            edge = Edge(module.name, target, node.lineno, in_function, statement)
            # keep a module-level edge over a function-level one for the report
            if target not in graph[module.name] or (graph[module.name][target].function_level and not in_function):
                graph[module.name][target] = edge
    return graph


def find_cycles(graph: dict[str, dict[str, Edge]]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component with more than one module
    (Tarjan's algorithm, iterative), each reported from its smallest module name."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)

    cycles = []
    for component in components:
        start = min(component)
        # breadth-first inside the component: the shortest way from start back to start
        previous = {start: None}
        queue, found = [start], None
        while queue and found is None:
            node = queue.pop(0)
            for child in sorted(graph[node]):
                if child == start:
                    found = node
                    break
                if child in component and child not in previous:
                    previous[child] = node
                    queue.append(child)
        path = [start]
        node = found
        while node is not None and node != start:
            path.append(node)
            node = previous[node]
        path = [start] + list(reversed(path[1:])) + [start]
        cycles.append([graph[a][b] for a, b in zip(path, path[1:])])
    return cycles


MODULES = project_modules()


def test_the_sources_are_found():
    # the walk itself must see the package, or every check below passes on nothing
    assert SOURCES == {"server": f"{PACKAGE}.server", "models": f"{PACKAGE}.models"}
    assert {f"{PACKAGE}.server.engine.process", f"{PACKAGE}.server.app", f"{PACKAGE}.models.checkpoint"} <= MODULES.keys()
    graph = import_graph(MODULES)
    assert f"{PACKAGE}.server.engine.scheduler" in graph[f"{PACKAGE}.server.engine.process"]


def test_no_import_cycle_among_project_modules():
    modules = MODULES
    cycles = find_cycles(import_graph(modules))
    report = []
    for cycle in cycles:
        names = " -> ".join([cycle[0].source] + [e.target for e in cycle])
        report.append(f"cycle: {names}\n" + "\n".join(f"    {e.where(modules)}" for e in cycle))
    assert not cycles, f"{len(cycles)} import cycle(s) among server/ and models/:\n" + "\n".join(report)


def test_the_cycle_finder_finds_cycles():
    # the checker on a made-up graph: a -> b -> c -> a (c's edge function-level), and d -> a
    def edge(a, b, function_level=False):
        return Edge(a, b, 1, function_level, f"import {b}")

    graph = {"a": {"b": edge("a", "b")}, "b": {"c": edge("b", "c")}, "c": {"a": edge("c", "a", True)},
             "d": {"a": edge("d", "a")}}
    (cycle,) = find_cycles(graph)
    assert [(e.source, e.target) for e in cycle] == [("a", "b"), ("b", "c"), ("c", "a")]
    assert find_cycles({"a": {"b": edge("a", "b")}, "b": {}}) == []


def test_relative_and_from_imports_resolve():
    # a relative `from . import x` in a package's __init__ and in a plain module, and
    # `from pkg import submodule` versus `from pkg import attribute`
    init = Module(f"{PACKAGE}.server.cache", ROOT / "server" / "cache" / "__init__.py", True)
    plain = Module(f"{PACKAGE}.server.cache.codec", ROOT / "server" / "cache" / "codec.py", False)
    (node,) = ast.parse("from . import errors").body
    assert _absolute_base(node, init) == f"{PACKAGE}.server.cache"
    assert _absolute_base(node, plain) == f"{PACKAGE}.server.cache"
    (node,) = ast.parse("from ..engine import wire").body
    assert _absolute_base(node, plain) == f"{PACKAGE}.server.engine"
    assert _project_target(f"{PACKAGE}.server.cache.errors", MODULES) == f"{PACKAGE}.server.cache.errors"
    assert _project_target(f"{PACKAGE}.server.cache.SessionCache", MODULES) == f"{PACKAGE}.server.cache"


def test_every_project_import_names_an_existing_module():
    """`xlserve.*` imports point at modules that exist (a stale name fails at run time only when
    the import runs, which for a function-level import may be late); the old top-level names
    `server` and `models` are not importable from an installed package at all."""
    wrong = []
    for module in MODULES.values():
        for name, node, _ in imported_names(module):
            top = name.split(".")[0]
            where = f"{module.path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
            if top in ("server", "models"):
                wrong.append(f"{where}  (the package is `{PACKAGE}.{top}`)")
            elif top == PACKAGE:
                # `from pkg import name`: pkg itself must be a module, name may be an attribute
                base = name if isinstance(node, ast.Import) else name.rsplit(".", 1)[0]
                if isinstance(node, ast.ImportFrom) and base == PACKAGE:
                    base = name  # `from xlserve import server`
                if base not in MODULES:
                    wrong.append(f"{where}  (no module {base})")
    assert not wrong, "imports of modules that do not exist:\n" + "\n".join(wrong)


def test_models_import_nothing_from_server():
    """models/ is the model library; the server depends on it, never the other way round."""
    server = f"{PACKAGE}.server"
    wrong = []
    for module in MODULES.values():
        if not module.name.startswith(f"{PACKAGE}.models"):
            continue
        for name, node, _ in imported_names(module):
            if name == server or name.startswith(server + ".") or name.split(".")[0] == "server":
                wrong.append(f"{module.path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        # importlib strings too (`import_module("xlserve.server...")`)
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == server or node.value.startswith(server + ".")):
                wrong.append(f"{module.path.relative_to(ROOT)}:{node.lineno}: the string {node.value!r}")
    assert not wrong, "models/ must not depend on server/:\n" + "\n".join(wrong)


# layer -> the project packages it must never import (docs/design.md section 1): the arrows point
# down only (api -> engine -> cache -> models), and the settings, which both processes read, sit
# beside the layers: a layer is handed its group of settings, and the settings import no layer
NEVER_IMPORTS = {
    "server.cache": ("server.engine", "server.api", "server.app", "server.settings", "server.cli"),
    "server.engine": ("server.api", "server.app", "server.cli"),
    "server.settings": ("server.cache", "server.engine", "server.api", "server.app"),
    "server.redis_urls": ("server.cache", "server.engine", "server.api", "server.app", "server.settings"),
    "server.errors": ("server.cache", "server.engine", "server.api", "server.app", "server.settings"),
}


def test_the_layers_import_downwards_only():
    wrong = []
    for module in MODULES.values():
        for layer, forbidden in NEVER_IMPORTS.items():
            layer_name = f"{PACKAGE}.{layer}"
            if not (module.name == layer_name or module.name.startswith(layer_name + ".")):
                continue
            for name, node, _ in imported_names(module):
                for other in forbidden:
                    other_name = f"{PACKAGE}.{other}"
                    if name == other_name or name.startswith(other_name + "."):
                        wrong.append(f"{module.path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} ({layer} -> {other})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def loaded_after_import(modules: list[str], tmp_path: Path) -> set[str]:
    """sys.modules after importing `modules` in a fresh interpreter started outside the
    repository (so nothing is found through the working directory)."""
    code = f"import sys, {', '.join(modules)}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(done.stdout.split())
    assert set(modules) <= loaded
    return loaded


def _under(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_the_engine_process_loads_no_web_framework(tmp_path):
    """The engine process (`python -m xlserve.server.engine.process`) runs the models; the HTTP
    side (FastAPI, Starlette, uvicorn, the API routers and app) belongs to the API process."""
    loaded = loaded_after_import([f"{PACKAGE}.server.engine.process"], tmp_path)
    assert "torch" in loaded  # it did import what it runs on
    wrong = _under(loaded, ("fastapi", "starlette", "uvicorn", f"{PACKAGE}.server.api", f"{PACKAGE}.server.app"))
    assert not wrong, f"the engine process imported: {wrong}"


def test_the_api_process_loads_no_torch(tmp_path):
    """The API process holds no model: the app and the CLI import without torch (the session
    cache's package imports only its torch-free names for this), and so do the modules `serve`
    imports when it runs (a check of the state directory from server/cache/stores.py once loaded
    torch there: 200 MB more in the API process)."""
    import ast

    cli = Path(__file__).resolve().parents[1] / "server" / "cli.py"
    serve = next(node for node in ast.walk(ast.parse(cli.read_text()))
                 if isinstance(node, ast.FunctionDef) and node.name == "cmd_serve")
    lazy = sorted({node.module for node in ast.walk(serve)
                   if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{PACKAGE}.")})
    assert f"{PACKAGE}.server.cache.state_directory" in lazy
    loaded = loaded_after_import([f"{PACKAGE}.server.app", f"{PACKAGE}.server.cli", *lazy], tmp_path)
    assert "fastapi" in loaded
    wrong = _under(loaded, ("torch",))
    assert not wrong, f"the API process imported: {wrong[:20]}"
