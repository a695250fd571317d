"""Deliberate copies stay copies: every `# Copied from` marker under models/ is checked against
the code it names (Hugging Face's utils/check_copies.py convention).

A model file reads alone, so a few small pieces of one architecture stand again, on purpose, in
another. Each such copy carries a marker on the line right above its `def` or `class`:

    # Copied from xlserve.models.transformer_xl.TransformerXL.init_state
    # Copied from xlserve.models.transformer_xl.TransformerXL.init_state with r_w_bias->mask_emb

The dotted name is a module under xlserve.models followed by the object's path in it (a class,
a function, a method). `with A->B, C->D` lists renames: each A in the source is replaced by B
before comparing, in the order given, wherever A stands as a whole word (`r_w_bias` but not
`r_w_bias_scale`), and each A must occur in the source. The copy and the renamed source are
compared as token streams, comments included: line breaks and indentation do not count,
anything else does (code, docstrings, comments).

    .venv/bin/python tests/models/check_copies.py        # exit 1 and a diff per copy that drifted

Nothing is imported: the files are read with `ast` and `tokenize`, so the check needs no torch.
"""

from __future__ import annotations

import ast
import difflib
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"xlserve.models": "models"}  # dotted package -> its folder under the root
MARKER = re.compile(r"^(?P<indent>\s*)# Copied from (?P<target>xlserve\.[\w.]+)(?: with (?P<renames>.+))?\s*$")
RENAME = re.compile(r"^\s*(?P<old>\S+)\s*->\s*(?P<new>\S+)\s*$")
IGNORED_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


@dataclass
class Copy:
    """One marker and what it points at."""

    path: Path  # the file holding the copy
    line: int  # the marker's line (1-based)
    target: str  # the dotted name of the source
    renames: list[tuple[str, str]]


def markers(path: Path) -> tuple[list[Copy], list[str]]:
    """The `# Copied from` markers of a file, and a problem for each line that mentions
    "Copied from" in a comment without being a well-formed marker."""
    copies, problems = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if "# Copied from" not in line:
            continue
        match = MARKER.match(line)
        if match is None:
            problems.append(f"{path}:{number}: not a marker: '# Copied from <xlserve.models.name> [with A->B, ...]'")
            continue
        renames = []
        for part in (match["renames"] or "").split(",") if match["renames"] else []:
            rename = RENAME.match(part)
            if rename is None:
                problems.append(f"{path}:{number}: rename '{part.strip()}' is not of the form A->B")
                continue
            renames.append((rename["old"], rename["new"]))
        copies.append(Copy(path, number, match["target"], renames))
    return copies, problems


def definition_after(tree: ast.Module, line: int) -> ast.AST | None:
    """The def or class (at any depth) whose first line, decorators included, is the first
    line after `line` that starts a statement."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = first_line(node)
            if start > line and (best is None or start < first_line(best)):
                best = node
    statements = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno > line]
    if best is None or (statements and min(statements) < best.lineno and min(statements) < first_line(best)):
        return None
    return best


def first_line(node: ast.AST) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def source_of(node: ast.AST, text: str) -> str:
    """The code of `node`, decorators included, dedented."""
    lines = text.splitlines(keepends=True)
    return textwrap.dedent("".join(lines[first_line(node) - 1 : node.end_lineno]))


def locate(target: str, root: Path) -> tuple[Path, list[str]] | None:
    """The file of the longest module prefix of `target` under `root`, and the rest of the name."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        for package, folder in PACKAGES.items():
            if module == package or module.startswith(package + "."):
                relative = module[len(package) :].lstrip(".").replace(".", "/")
                path = root / folder / relative
                for candidate in (path.with_suffix(".py"), path / "__init__.py"):
                    if relative and candidate.is_file():
                        return candidate, parts[cut:]
    return None


def find_object(tree: ast.Module, names: list[str]) -> ast.AST | None:
    """The class or function at the path `names` (class, then method, ...) in a module."""
    body, node = tree.body, None
    for name in names:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


def tokens(code: str) -> list[tuple[int, str]]:
    """The code's tokens without layout (line breaks, indentation), comments kept."""
    stream = tokenize.generate_tokens(io.StringIO(code).readline)
    return [(t.type, t.string) for t in stream if t.type not in IGNORED_TOKENS]


def check(copy: Copy, root: Path) -> list[str]:
    """Problems with one copy: its source cannot be found, a rename does not apply, or the copy
    differs from the renamed source (with a unified diff)."""
    where = f"{copy.path}:{copy.line}"
    text = copy.path.read_text()
    node = definition_after(ast.parse(text), copy.line)
    if node is None:
        return [f"{where}: the marker is not right above a def or class"]
    located = locate(copy.target, root)
    if located is None:
        return [f"{where}: no module under {', '.join(PACKAGES)} holds {copy.target}"]
    source_path, names = located
    source_text = source_path.read_text()
    source_node = find_object(ast.parse(source_text), names)
    if source_node is None:
        return [f"{where}: {source_path} has no {'.'.join(names)}"]
    expected = source_of(source_node, source_text)
    problems = []
    for old, new in copy.renames:
        word = re.compile(rf"(?<!\w){re.escape(old)}(?!\w)")
        if not word.search(expected):
            problems.append(f"{where}: rename {old}->{new}: '{old}' does not occur in {copy.target}")
        expected = word.sub(new, expected)
    actual = source_of(node, text)
    if tokens(actual) != tokens(expected):
        diff = difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"{copy.target} (renamed)",
                                    f"{copy.path}:{first_line(node)}", lineterm="")
        problems.append(f"{where}: differs from {copy.target}:\n" + "\n".join(diff))
    return problems


def check_tree(root: Path = ROOT) -> tuple[list[Copy], list[str]]:
    """Every marker in the Python files of the packages' folders under `root`, and every problem."""
    copies, problems = [], []
    for folder in PACKAGES.values():
        for path in sorted((root / folder).rglob("*.py")):
            found, malformed = markers(path)
            copies += found
            problems += malformed
    for copy in copies:
        problems += check(copy, root)
    return copies, problems


def main(argv: list[str] | None = None) -> int:
    root = Path(argv[0]) if argv else ROOT
    copies, problems = check_tree(root)
    for problem in problems:
        print(problem)
    print(f"{len(copies)} copies checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
