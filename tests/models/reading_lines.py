"""How many lines a reader opens to read one architecture: its file in models/ plus every module
under models/ that it imports, directly or through another of them.

    .venv/bin/python tests/models/reading_lines.py            # a Markdown table
    .venv/bin/python tests/models/reading_lines.py --files    # and the files behind each row

Two sums per architecture: without models/interface.py, the contract every architecture shares
(a reader learns it once, not once per model), and with it. Imports are read from the source
with `ast` (nothing is imported), at any depth of the file (a function's own imports count), and
only those under `xlserve.models`; torch and the standard library are not counted.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
PACKAGE = "xlserve.models"
CONTRACT = "xlserve.models.interface"


def module_path(name: str) -> Path | None:
    """The source file of module `name` under xlserve.models, or None when it is not one."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    parts = name.split(".")[2:]
    candidate = MODELS.joinpath(*parts)
    if candidate.with_suffix(".py").is_file():
        return candidate.with_suffix(".py")
    if (candidate / "__init__.py").is_file():
        return candidate / "__init__.py"
    return None


def imported_modules(path: Path) -> set[str]:
    """Names of the xlserve.models modules that the file at `path` imports: `import a.b`,
    `from a.b import c` (c counts when it is itself a module, as in `from pkg import module`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if module_path(f"{node.module}.{alias.name}") is not None)
    return {name for name in found if module_path(name) is not None}


def reading_set(module: str) -> set[str]:
    """`module` and every xlserve.models module it imports, transitively."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imported_modules(module_path(name)))
    seen.discard(PACKAGE)  # models/__init__.py is empty: nothing to read
    return seen


def line_count(module: str) -> int:
    return len(module_path(module).read_text().splitlines())


def architecture_modules() -> dict[str, str]:
    """Registry name -> module, from models/registry.py's ARCHITECTURES (read, not imported)."""
    tree = ast.parse((MODELS / "registry.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ARCHITECTURES":
            table = ast.literal_eval(node.value)
            return {name: target.split(":")[0] for name, target in table.items()}
    raise LookupError("ARCHITECTURES not found in models/registry.py")


def reading_table() -> list[dict]:
    """Per architecture: its file's lines, the files it needs and the two sums."""
    rows = []
    for name, module in architecture_modules().items():
        needed = reading_set(module)
        without = sorted(needed - {CONTRACT})
        rows.append({
            "architecture": name,
            "own_lines": line_count(module),
            "files": len(without),
            "lines": sum(line_count(m) for m in without),
            "lines_with_interface": sum(line_count(m) for m in needed | {CONTRACT}),
            "modules": without,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", action="store_true", help="list the modules behind each row")
    args = parser.parse_args(argv)
    rows = reading_table()
    print("| architecture | its file | files to open | lines (without interface.py) | lines with interface.py |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['architecture']} | {r['own_lines']} | {r['files']} | {r['lines']} | {r['lines_with_interface']} |")
    if args.files:
        for r in rows:
            print(f"\n{r['architecture']}: " + ", ".join(m.removeprefix(PACKAGE + ".") for m in r["modules"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
