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
import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    assert str(refused.value) == ("xlserve bench vs-hf needs transformers, from the bench extra: make bench "
                                  "(or .venv/bin/pip install -c constraints.txt -e '.[bench]') in the checkout")
    assert bench.missing_packages("continuation") == []


# --- what each make target installs (item 1 of issue 39)

MAKEFILE = (ROOT / "Makefile").read_text()


def make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """target -> (prerequisites, recipe lines) of the Makefile, variables as written ($(VENV))."""
    rules, current = {}, None
    lines = MAKEFILE.replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("\t") and current is not None:
            rules[current][1].append(line.strip())
        elif re.match(r"^[^\s#=:]+(\s[^\s#=:]+)*\s*:(?!=)", line) and not line.startswith(".PHONY"):
            targets, _, prerequisites = line.partition(":")
            current = targets.strip()
            rules[current] = (prerequisites.split(), [])
        elif line.strip() and not line.startswith("\t"):
            current = None
    return rules


def installs_of(target: str, rules: dict) -> list[str]:
    """Every `pip install` line that making `target` can run, its prerequisites' first."""
    prerequisites, recipe = rules.get(target, ([], []))
    lines = [line for prerequisite in prerequisites for line in installs_of(prerequisite, rules)]
    return lines + [line for line in recipe if "pip install" in line]


def extras_installed(lines: list[str]) -> set[str]:
    """The extras of xlserve that these pip lines install (`-e ".[test]"` -> {"test"})."""
    extras = set()
    for line in lines:
        for match in re.finditer(r'-e "?\.(\[([^\]]*)\])?"?', line):
            extras.update(filter(None, (match.group(2) or "").split(",")))
    return extras


def test_make_serve_installs_no_extra_and_make_test_the_test_extra():
    rules = make_rules()
    serve = installs_of("serve", rules)
    assert any(re.search(r"-e \.(\s|$)", line) for line in serve), serve  # the package itself, editable
    assert extras_installed(serve) == set(), f"make serve installs extras: {serve}"
    assert extras_installed(installs_of("bench", rules)) == {"bench"}
    for target in ("test", "fuzz", "chaos", "gpu-check"):
        assert extras_installed(installs_of(target, rules)) == {"test"}, target
    # the test extra brings the bench extra: the benchmarks' quick forms are tested
    assert "xlserve[bench]" in PROJECT["optional-dependencies"]["test"]


def test_the_serve_install_brings_no_test_or_bench_package():
    """What `pip install .` installs (the dependencies and everything they require, as installed
    here) holds no package that only the test or bench extras declare."""
    declared = distribution_names(PROJECT["dependencies"])
    extras_only = (TEST_ONLY | with_their_requirements(BENCH)) - with_their_requirements(declared)
    assert {"transformers", "matplotlib", "pytest", "selenium", "schemathesis", "hypothesis"} <= extras_only
    assert not extras_only & RUNTIME, sorted(extras_only & RUNTIME)


def test_the_install_imports_no_torch_and_shows_its_progress():
    recipes = [line for _, recipe in make_rules().values() for line in recipe]
    installs = [line for line in recipes if "pip install" in line]
    assert installs
    # pip's own progress is shown: no -q on an install (torch alone is about 190 MB)
    assert not [line for line in installs if re.search(r"\s-q{1,3}\b|--quiet", line.split("pip install", 1)[1])]
    # before numpy is installed, `import torch` prints "Failed to initialize NumPy": the Makefile
    # reads torch's version from its metadata instead, and imports it nowhere
    imports_torch = re.compile(r"\bimport\s+(?:[\w.]+\s*,\s*)*torch\b")
    assert imports_torch.search('python -c "import sys, torch"') and not imports_torch.search("importing torch")
    assert not imports_torch.search(MAKEFILE), imports_torch.search(MAKEFILE)
    assert "importlib.metadata" in MAKEFILE
    # and each long step says what it does first
    for target in ("$(SERVE_INSTALLED)", "$(BENCH_INSTALLED)", "$(TEST_INSTALLED)"):
        recipe = make_rules()[target][1]
        assert recipe[0].startswith("@echo"), (target, recipe)


# --- one Python floor (item 2 of issue 39)

FLOOR = tuple(int(part) for part in re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["requires-python"]).groups())


def test_the_python_floor_is_the_same_everywhere():
    floor = "%d.%d" % FLOOR
    assert sys.version_info[:2] >= FLOOR, "the tests run on an interpreter below the floor"
    readme = (ROOT / "README.md").read_text()
    stated = set(re.findall(r"Python ≥ (\d+\.\d+)", readme))
    assert stated == {floor}, f"README states Python ≥ {sorted(stated)}, pyproject {floor}"
    cpu = re.search(r"^ARG PYTHON_IMAGE=python:(\d+)\.(\d+)", (ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert cpu and tuple(map(int, cpu.groups())) >= FLOOR, "docker/Dockerfile's Python is below the floor"
    cuda = re.search(r"^ARG PYTHON=python(\d+)\.(\d+)$", (ROOT / "docker" / "Dockerfile.cuda").read_text(), re.M)
    assert cuda and tuple(map(int, cuda.groups())) >= FLOOR, "docker/Dockerfile.cuda's Python is below the floor"
    # the Makefile refuses an older interpreter before installing anything, reading the same floor
    assert "requires-python" in MAKEFILE and "CHECK_PYTHON" in make_rules()["$(VENV)/constraints.txt"][1][0]


def package_index() -> str:
    """The index pip uses here (PIP_INDEX_URL, pip's configuration, else PyPI)."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                capture_output=True, text=True, timeout=60)
    return configured.stdout.strip() if configured.returncode == 0 and configured.stdout.strip() else \
        "https://pypi.org/simple/"


def test_the_constraints_resolve_for_the_python_floor(tmp_path):
    """Every pin of constraints.txt, with what each requires, resolves for the oldest Python that
    pyproject allows: binary wheels only (what an install on that Python gets), a dry run."""
    index = package_index()
    try:
        urllib.request.urlopen(index.rstrip("/") + "/numpy/", timeout=20).close()
    except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
        pytest.skip(f"the package index {index} is unreachable ({error}): cannot resolve constraints.txt")
    report = tmp_path / "report.json"
    floor = "%d.%d" % FLOOR
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
         "--python-version", floor, "--target", str(tmp_path / "target"), "--report", str(report), "--quiet", "-r", str(ROOT / "constraints.txt")],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"constraints.txt does not resolve for Python {floor}:\n{done.stderr[-4000:]}"
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert resolved.get(name, "").split("+")[0] == version, (name, version, resolved.get(name))
