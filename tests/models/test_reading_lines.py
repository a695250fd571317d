"""An architecture reads as its own file plus the shared models/layers/ (tests/models/reading_lines.py
counts the lines; these tests keep the shape that makes the count small)."""

from tests.models.reading_lines import MODELS, PACKAGE, architecture_modules, reading_set, reading_table


def test_no_architecture_file_needs_another():
    modules = set(architecture_modules().values())
    for name, module in architecture_modules().items():
        others = reading_set(module) & (modules - {module})
        assert not others, f"{name} reads {sorted(others)}: a piece two architectures share belongs in models/layers/"


def test_every_layers_module_serves_at_least_two_architectures():
    """A piece only one architecture uses lives in that architecture's file (issue 34, item 5)."""
    users: dict[str, list[str]] = {}
    for name, module in architecture_modules().items():
        for needed in reading_set(module):
            users.setdefault(needed, []).append(name)
    layers = sorted(p.stem for p in (MODELS / "layers").glob("*.py") if p.stem != "__init__")
    assert layers
    for layer in layers:
        readers = users.get(f"{PACKAGE}.layers.{layer}", [])
        assert len(readers) >= 2, f"models/layers/{layer}.py is read by {readers or 'no architecture'} only"


def test_the_table_counts_each_architecture_file_and_what_it_imports():
    rows = {row["architecture"]: row for row in reading_table()}
    assert set(rows) == set(architecture_modules())
    reformer = rows["reformer"]
    assert f"{PACKAGE}.reformer" in reformer["modules"] and f"{PACKAGE}.interface" not in reformer["modules"]

    def lines(module: str) -> int:
        return len((MODELS / (module.split(".", 2)[2].replace(".", "/") + ".py")).read_text().splitlines())

    assert reformer["files"] == len(reformer["modules"])
    assert reformer["lines"] == sum(lines(m) for m in reformer["modules"])
    assert reformer["lines_with_interface"] == reformer["lines"] + lines(f"{PACKAGE}.interface")
