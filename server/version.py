"""The version of xlserve this is: what `GET /version` and `xlserve --version` say.

From the installed package's metadata (importlib.metadata) when there is one; otherwise (the
source tree used without installing it) from the `version` in the repository's pyproject.toml.
Torch-free: both processes and the CLI may use it.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # pragma: no cover - Python 3.10: the version line is read as text
    tomllib = None

DISTRIBUTION = "xlserve"
# server/ sits in the repository beside pyproject.toml (an installed wheel has metadata instead)
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return pyproject_version(PYPROJECT)


def pyproject_version(path: Path) -> str:
    """[project] version from a pyproject.toml; "unknown" when it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    if tomllib is None:
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, flags=re.MULTILINE)
        return found.group(1) if found else "unknown"
    try:
        return str(tomllib.loads(text)["project"]["version"])
    except (KeyError, TypeError, tomllib.TOMLDecodeError):
        return "unknown"
