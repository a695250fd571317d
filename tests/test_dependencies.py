"""What the wheel imports is what it declares: every third-party package that code under server/
and models/ imports is a runtime dependency of pyproject.toml, except that the benchmarks
(server/bench/) may also use the `bench` extra; nothing in the wheel imports a test-only package.

Imports are read from the source with `ast` (nested ones too: a benchmark imports matplotlib
inside the function that plots), and a module is mapped to the distribution that installs it by
the venv's own metadata (`importlib.metadata.packages_distributions`), so `yaml` is `pyyaml`. A
package that a declared dependency itself requires (starlette under fastapi, anyio under
starlette) is installed wherever that one is, so it counts as declared.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def distribution_names(requirements: list[str]) -> set[str]:
    """'transformers==4.37.2', 'uvloop>=0.19; sys_platform != "win32"' -> {'transformers', 'uvloop'}."""
    names = set()
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        names.add(name.lower().replace("_", "-"))
    return names


def with_their_requirements(names: set[str]) -> set[str]:
    """`names` and every distribution they require (not their extras), as installed here."""
    closure, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            requirements = requires(name) or []
        except PackageNotFoundError:  # a dependency for another platform (uvloop on Windows)
            continue
        todo.extend(distribution_names([r for r in requirements if "extra ==" not in r]))
    return closure


RUNTIME = with_their_requirements(distribution_names(PROJECT["dependencies"]))
BENCH = distribution_names(PROJECT["optional-dependencies"]["bench"])
TEST_ONLY = distribution_names(PROJECT["optional-dependencies"]["test"]) - RUNTIME - with_their_requirements(BENCH) - {"xlserve"}


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """Top-level module imported -> the files under `folder` that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found.setdefault(module.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def third_party(folder: Path) -> dict[str, set[str]]:
    """Distribution -> files, for every import under `folder` that is neither the standard
    library nor xlserve itself."""
    distributions = packages_distributions()
    found: dict[str, set[str]] = {}
    for module, files in imported_modules(folder).items():
        if module in sys.stdlib_module_names or module in ("xlserve", "__future__"):
            continue
        names = distributions.get(module)
        assert names, f"{module}, imported by {sorted(files)}, is installed by no distribution in this venv"
        for name in names:
            found.setdefault(name.lower().replace("_", "-"), set()).update(files)
    return found


def test_the_server_and_models_import_only_runtime_dependencies():
    imports = third_party(ROOT / "models")
    for name, files in third_party(ROOT / "server").items():
        outside_bench = {file for file in files if not file.startswith("server/bench/")}
        if outside_bench:
            imports.setdefault(name, set()).update(outside_bench)
    undeclared = {name: sorted(files) for name, files in imports.items() if name not in RUNTIME}
    assert not undeclared, f"imported by the server or models but not a runtime dependency: {undeclared}"


def test_the_benchmarks_import_runtime_dependencies_and_the_bench_extra_only():
    imports = third_party(ROOT / "server" / "bench")
    undeclared = {name: sorted(files) for name, files in imports.items() if name not in RUNTIME | BENCH}
    assert not undeclared, f"imported by a benchmark but in neither the dependencies nor the bench extra: {undeclared}"
    assert BENCH <= set(imports), f"the bench extra lists packages no benchmark imports: {BENCH - set(imports)}"
    assert not BENCH & RUNTIME, "a package of the bench extra is a runtime dependency already"


def test_nothing_in_the_wheel_imports_a_test_only_package():
    assert TEST_ONLY >= {"pytest", "httpx", "selenium", "schemathesis"}, TEST_ONLY
    imports = {**third_party(ROOT / "models"), **third_party(ROOT / "server")}
    leaked = {name: sorted(files) for name, files in imports.items() if name in TEST_ONLY}
    assert not leaked, f"test-only packages imported by the wheel: {leaked}"


def test_each_benchmark_declares_what_it_needs_from_the_bench_extra():
    from xlserve.server.bench import BENCHMARKS, EXTRA_PACKAGES

    assert set(EXTRA_PACKAGES) == set(BENCHMARKS)
    modules_of_extra = {module for module, names in packages_distributions().items()
                        if {name.lower() for name in names} & BENCH}
    for name, module in BENCHMARKS.items():
        source = ROOT / "server" / "bench" / f"{module}.py"
        needed = set(EXTRA_PACKAGES[name])
        assert needed <= modules_of_extra, (name, needed)
        # a benchmark that imports transformers itself says so (common.py's helpers need it only
        # when a vs-hf benchmark asks)
        if "transformers" in imported_modules_of(source):
            assert "transformers" in needed, name


def imported_modules_of(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def test_xlserve_bench_without_the_extra_says_what_to_install(monkeypatch):
    import xlserve.server.bench as bench
    from xlserve.server.cli import main

    real_find_spec = bench.find_spec
    monkeypatch.setattr(bench, "find_spec", lambda name: None if name == "transformers" else real_find_spec(name))
    with pytest.raises(SystemExit) as refused:
        main(["bench", "vs-hf", "--quick"])
    assert str(refused.value) == 'xlserve bench vs-hf needs transformers, from the bench extra: pip install "xlserve[bench]"'
    assert bench.missing_packages("continuation") == []
