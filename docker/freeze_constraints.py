"""Write constraints.txt: the exact version of every package `pip install .` brings in, read
from the environment this runs in (the one `make serve` made), so that `make serve`, `make
test` and both images install the same versions.

    .venv/bin/python docker/freeze_constraints.py > constraints.txt

Only the runtime closure of pyproject.toml's `dependencies` is written (the test extra floats:
tests run against whatever versions it resolves, CI shows when one breaks). Run it on the oldest
Python pyproject's `requires-python` allows, or check that what it wrote still resolves there:
tests/test_dependencies.py resolves every pin for that floor (a dry run of pip).
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def applies(requirement: str) -> bool:
    """Whether a requirement applies here, ignoring extras-only ones (`; extra == ...`)."""
    if ";" not in requirement:
        return True
    marker = requirement.split(";", 1)[1]
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker
    except ModuleNotFoundError:  # pip vendors packaging; fall back to keeping it
        return True
    return Marker(marker).evaluate()


def closure(requirements: list[str]) -> dict[str, str]:
    pinned: dict[str, str] = {}
    todo = [r for r in requirements if applies(r)]
    while todo:
        name = canonical(REQUIREMENT_NAME.match(todo.pop()).group(1))
        if name in pinned:
            continue
        distribution = metadata.distribution(name)
        pinned[name] = distribution.version
        todo.extend(r for r in (distribution.requires or []) if applies(r))
    return pinned


TORCH_BLOCK = "# torch and what only torch needs"  # the Makefile drops this block when torch is the user's own


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = closure(project["dependencies"])
    others = closure([r for r in project["dependencies"] if canonical(REQUIREMENT_NAME.match(r).group(1)) != "torch"])
    # torch is pinned without a local label (+cpu, +cu124): the CPU image's index and a CUDA
    # index both satisfy `torch==X` with their own build
    pinned["torch"] = pinned["torch"].split("+")[0]
    sys.stdout.write(
        "# Exact versions of everything `pip install .` installs: make serve, make test and both\n"
        "# images install with `-c constraints.txt`. Regenerate: docker/freeze_constraints.py.\n"
    )
    for name in sorted(others):
        sys.stdout.write(f"{name}=={pinned[name]}\n")
    sys.stdout.write(f"{TORCH_BLOCK} (a GPU user's own torch brings its own):\n")
    for name in sorted(set(pinned) - set(others)):
        sys.stdout.write(f"{name}=={pinned[name]}\n")


if __name__ == "__main__":
    main()
