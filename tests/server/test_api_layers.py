"""The API's layers stay apart: a router (server/api/routers/) parses a request and hands it to
serving, so from this project it imports only the protocol models and serving: never another
router, the engine or the cache. Read from the source with `ast`, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTERS = Path(__file__).resolve().parents[2] / "server" / "api" / "routers"
PACKAGE = "xlserve.server.api.routers"
ALLOWED = ("xlserve.server.api.protocol", "xlserve.server.api.serving")


def project_imports(path: Path) -> set[str]:
    """What `path` imports from this project, as dotted names: `from a.b import c` gives "a.b.c"
    (c may be a module or a name in a.b), relative imports resolved against the routers package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = PACKAGE.rsplit(".", node.level - 1)[0] if node.level > 1 else PACKAGE
                module = f"{base}.{module}" if module else base
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] in ("xlserve", "server", "models"))
    return found


def allowed(name: str) -> bool:
    return any(name == module or name.startswith(module + ".") for module in ALLOWED)


def router_files() -> list[Path]:
    return sorted(ROUTERS.glob("*.py"))


def test_every_router_is_checked():
    assert {"completions", "sessions", "ws", "models", "health"} <= {path.stem for path in router_files()}


@pytest.mark.parametrize("path", router_files(), ids=lambda path: path.name)
def test_router_imports_only_protocol_and_serving(path):
    forbidden = sorted(name for name in project_imports(path) if not allowed(name))
    assert not forbidden, f"{path.name} imports {forbidden}; a router goes through protocol and serving only"


def test_the_check_sees_what_it_forbids(tmp_path):
    source = tmp_path / "router.py"
    source.write_text("from xlserve.server.engine.types import Cancelled\n"
                      "import xlserve.server.cache\n"
                      "from xlserve.server.api.routers import sessions\n"
                      "from xlserve.server.api import errors, serving\n"
                      "from . import ws\n"
                      "from ..protocol import CompletionRequest\n")
    imports = project_imports(source)
    assert sorted(name for name in imports if not allowed(name)) == [
        "xlserve.server.api.errors", "xlserve.server.api.routers.sessions", "xlserve.server.api.routers.ws",
        "xlserve.server.cache", "xlserve.server.engine.types.Cancelled",
    ]
    assert {"xlserve.server.api.serving", "xlserve.server.api.protocol.CompletionRequest"} <= imports
