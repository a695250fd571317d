"""The wheel is the whole product: built, installed outside the venv and served from there.

One test, end to end (about 15-30 s on 2 cores): build the wheel, check what is in it, install
it with `pip install --target` into a temporary folder (not into the venv), and from a working
directory outside the repository run `xlserve new` and `xlserve serve` with PYTHONPATH pointing
at that folder. The venv also holds an editable install of xlserve (this checkout); PYTHONPATH
entries come before it on sys.path, and the test first proves that `xlserve` is really imported
from the installed wheel. The client side is plain urllib over loopback: no torch here.

The wheel is built from a fresh copy of what the images copy into their build stage
(pyproject.toml, README.md, models/, server/; docker/Dockerfile): building in the checkout
itself would write build/ and xlserve.egg-info/ into a tree several people work in, and
setuptools' build/lib keeps files from earlier builds (a module deleted from server/ would
still ship, and the test would pass on a stale tree).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md", "models", "server")  # what docker/Dockerfile copies
# source folder -> its place in the wheel, from pyproject.toml's [tool.setuptools] package-dir
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
SOURCES = {folder: name.replace(".", "/") for name, folder in PACKAGE_DIR.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def get_json(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def build_wheel(tmp: Path) -> Path:
    source = tmp / "src"
    source.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    out = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", out, source], timeout=120)
    (wheel,) = out.glob("xlserve-*.whl")
    return wheel


def check_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    check_wheel_requirements(metadata)
    top = {name.split("/", 1)[0] for name in names}
    (dist_info,) = [t for t in top if t.endswith(".dist-info")]
    assert dist_info.startswith("xlserve-")
    assert top == {"xlserve", dist_info}, f"top-level entries besides xlserve/ and its dist-info: {sorted(top)}"

    # every module of the source tree ships, under its package name, and nothing else does
    expected = {f"{prefix}/{p.relative_to(ROOT / folder).as_posix()}"
                for folder, prefix in SOURCES.items() for p in (ROOT / folder).rglob("*.py")
                if "__pycache__" not in p.parts}
    # and the playground's page (package data)
    expected |= {f"xlserve/server/api/playground/{p.name}" for p in (ROOT / "server/api/playground").iterdir()}
    shipped = {n for n in names if n.startswith("xlserve/")}
    assert SOURCES == {"server": "xlserve/server", "models": "xlserve/models"}
    assert {n.split("/")[1] for n in shipped} == {"server", "models"}, sorted({n.split("/")[1] for n in shipped})
    missing = sorted(expected - shipped)
    assert not missing, f"modules missing from the wheel (a package not in pyproject's `packages`?): {missing}"
    extra = sorted(shipped - expected)
    assert not extra, f"files in the wheel that are not modules of server/ or models/: {extra}"
    assert not [n for n in names if n.endswith((".safetensors", ".pt", ".bin")) or "/weights/" in n or "/tests/" in n]
    assert "[console_scripts]" in scripts and "xlserve = xlserve.server.cli:main" in scripts, scripts


def check_wheel_requirements(metadata: str) -> None:
    """What `pip install xlserve` (and `make serve`, `-e .`) installs is the wheel's requirements
    without an `extra ==` marker: pyproject's dependencies, none of the test or bench extras'
    packages; those come only with `xlserve[test]` / `xlserve[bench]`. The wheel states the same
    Python floor as pyproject."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    fields = [line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line]
    requirements = [value for field, value in fields if field == "Requires-Dist"]
    assert [value for field, value in fields if field == "Requires-Python"] == [project["requires-python"]]

    def name(requirement: str) -> str:
        return requirement.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()

    unconditional = {name(r) for r in requirements if "extra ==" not in r}
    assert unconditional == {name(r) for r in project["dependencies"]}, unconditional
    extras = project["optional-dependencies"]
    only_in_extras = {name(r) for r in extras["test"] + extras["bench"]} - unconditional - {"xlserve"}
    assert {"transformers", "matplotlib", "pytest", "selenium", "schemathesis"} <= only_in_extras
    for extra in ("test", "bench"):
        gated = {name(r) for r in requirements if f'extra == "{extra}"' in r}
        assert {name(r) for r in extras[extra]} - {"xlserve"} <= gated, extra


def test_the_wheel_installs_outside_the_repository_and_serves(tmp_path):
    assert ROOT not in tmp_path.resolve().parents, "the test needs a temporary directory outside the repository"
    wheel = build_wheel(tmp_path)
    check_wheel_contents(wheel)

    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-q", "--target", site, wheel], timeout=120)

    work = tmp_path / "cwd"  # the working directory: outside the repository, empty
    work.mkdir()
    weights, state = tmp_path / "weights", tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLSERVE_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", XLSERVE_TORCH_THREADS="1",
               XLSERVE_PROMPT_THREADS="1")

    # 1. xlserve comes from the wheel, not from the editable install of this checkout
    done = run([sys.executable, "-c", "import xlserve.server, xlserve.models, xlserve.server.cli as c; "
                "print(xlserve.server.__file__); print(xlserve.models.__file__); print(c.__file__)"],
               timeout=60, cwd=work, env=env)
    for line in done.stdout.split():
        assert Path(line).resolve().is_relative_to(site.resolve()), f"xlserve imported from {line}, not {site}"

    # 2. a checkpoint, written by the wheel's own console script (the one the images run)
    script = site / "bin" / "xlserve"
    assert script.is_file()
    run([script, "new", "--arch", "transformer-xl", "--preset", "tiny", "--out", weights / "tiny"],
        timeout=120, cwd=work, env=env)
    assert (weights / "tiny" / "config.json").is_file() and (weights / "tiny" / "model.safetensors").is_file()

    # 3. serve it over loopback; every wait is bounded
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "xlserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--weights-dir", str(weights), "--state-dir", str(state), "--log-level", "warning"],
            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
        )

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, f"the server exited with {server.returncode}:\n{log_tail()}"
            assert time.monotonic() < deadline, f"the server was not ready within 90 s:\n{log_tail()}"
            try:
                if get_json(url + "/ready", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)

        status, models = get_json(url + "/v1/models")
        assert status == 200, models
        assert [(m["id"], m["architecture"]) for m in models["data"]] == [("tiny", "transformer-xl")], models

        status, result = get_json(url + "/v1/completions",
                                  {"model": "tiny", "prompt": "def main():\n", "max_tokens": 8, "temperature": 0},
                                  timeout=60)
        assert status == 200, result
        (choice,) = result["choices"]
        assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
        assert result["usage"]["prompt_tokens"] == len("def main():\n")
        assert result["usage"]["completion_tokens"] == 8

        with urllib.request.urlopen(url + "/playground", timeout=10) as response:  # package data installed
            assert response.status == 200 and b"xlserve playground" in response.read()
        with urllib.request.urlopen(url + "/playground/playground.js", timeout=10) as response:
            assert response.status == 200 and b"/v1/stream" in response.read()
        # the API reference pages, with their assets from the installed fastapi-offline package
        with urllib.request.urlopen(url + "/docs", timeout=10) as response:
            assert response.status == 200 and b"/docs/assets/swagger-ui-bundle.js" in response.read()
        with urllib.request.urlopen(url + "/docs/assets/redoc.standalone.js", timeout=10) as response:
            assert response.status == 200 and len(response.read()) > 100_000
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
    assert server.returncode == 0, f"SIGTERM should stop the server cleanly, got {server.returncode}:\n{log_tail()}"

    # the data directories came from the flags: nothing was written into the working directory
    assert state.is_dir(), "--state-dir was not used"
    assert sorted(p.name for p in work.iterdir()) == [], sorted(p.name for p in work.iterdir())
