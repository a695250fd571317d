"""The `# Copied from` checker (tests/models/check_copies.py) on the tree, and on altered copies."""

import shutil
import textwrap
from pathlib import Path

from tests.models.check_copies import ROOT, check_tree, main

SOURCE = '''
class Memory:
    def init_state(self, batch_size: int):
        """A state that has seen nothing."""
        c = self.config
        return empty(batch_size, c.n_layer, like=self.r_w_bias)  # the dtype and device of the weights
'''

COPY = '''
class Other:
    # Copied from xlserve.models.source.Memory.init_state with r_w_bias->mask_emb
    def init_state(self, batch_size: int):
        """A state that has seen nothing."""
        c = self.config
        return empty(batch_size, c.n_layer, like=self.mask_emb)  # the dtype and device of the weights
'''


def write_tree(root: Path, copy: str, source: str = SOURCE) -> Path:
    """A models/ folder under `root` with source.py and copy.py; returns copy.py's path."""
    (root / "models").mkdir(exist_ok=True)
    (root / "models" / "source.py").write_text(textwrap.dedent(source))
    (root / "models" / "copy.py").write_text(textwrap.dedent(copy))
    return root / "models" / "copy.py"


def test_every_copy_in_the_tree_matches_its_source(capsys):
    copies, problems = check_tree(ROOT)
    assert problems == []
    assert copies, "no `# Copied from` markers found under models/"
    assert {c.path.name for c in copies} >= {"xlnet.py", "lite_transformer.py"}
    assert main([]) == 0
    assert f"{len(copies)} copies checked, 0 problems" in capsys.readouterr().out


def test_a_faithful_copy_with_renames_passes(tmp_path):
    write_tree(tmp_path, COPY)
    copies, problems = check_tree(tmp_path)
    assert len(copies) == 1 and copies[0].renames == [("r_w_bias", "mask_emb")]
    assert problems == []


def test_line_breaks_and_indentation_do_not_count(tmp_path):
    rewrapped = COPY.replace("return empty(batch_size, c.n_layer, like=self.mask_emb)",
                             "return empty(batch_size,\n                     c.n_layer, like=self.mask_emb)")
    write_tree(tmp_path, rewrapped)
    assert check_tree(tmp_path)[1] == []


def test_an_altered_copy_is_caught_with_a_diff(tmp_path):
    write_tree(tmp_path, COPY.replace("c.n_layer, like", "c.n_layer + 1, like"))
    _, problems = check_tree(tmp_path)
    assert len(problems) == 1
    assert "copy.py:3: differs from xlserve.models.source.Memory.init_state" in problems[0]
    assert "+    return empty(batch_size, c.n_layer + 1, like=self.mask_emb)" in problems[0]


def test_a_changed_source_docstring_or_comment_is_caught(tmp_path):
    write_tree(tmp_path, COPY, SOURCE.replace("has seen nothing", "has seen no token"))
    assert "differs from" in check_tree(tmp_path)[1][0]
    write_tree(tmp_path, COPY, SOURCE.replace("# the dtype and device", "# dtype and device"))
    assert "differs from" in check_tree(tmp_path)[1][0]


def test_stale_and_malformed_markers_are_reported(tmp_path):
    write_tree(tmp_path, COPY.replace("with r_w_bias->mask_emb", "with r_w_bias->mask_emb, u->v"))
    assert check_tree(tmp_path)[1] == [
        f"{tmp_path}/models/copy.py:3: rename u->v: 'u' does not occur in xlserve.models.source.Memory.init_state"]
    write_tree(tmp_path, COPY.replace("Memory.init_state", "Memory.empty_state"))
    source = tmp_path / "models" / "source.py"
    assert check_tree(tmp_path)[1] == [f"{tmp_path}/models/copy.py:3: {source} has no Memory.empty_state"]
    write_tree(tmp_path, COPY.replace("xlserve.models.source", "xlserve.models.nowhere"))
    assert "no module under xlserve.models holds xlserve.models.nowhere" in check_tree(tmp_path)[1][0]
    write_tree(tmp_path, COPY.replace("    def init_state", "    size = 1\n    def init_state"))
    assert check_tree(tmp_path)[1] == [f"{tmp_path}/models/copy.py:3: the marker is not right above a def or class"]
    write_tree(tmp_path, COPY.replace("Copied from xlserve.models.source.Memory.init_state", "Copied from source.py"))
    assert "not a marker" in check_tree(tmp_path)[1][0]


def test_drift_in_a_real_copy_is_caught(tmp_path):
    """XLNet's state methods are Transformer-XL's: a copy of models/ where XLNet's init_state
    takes another tensor's dtype fails, naming the file and the line."""
    shutil.copytree(ROOT / "models", tmp_path / "models", ignore=shutil.ignore_patterns("__pycache__"))
    xlnet = tmp_path / "models" / "xlnet.py"
    text = xlnet.read_text()
    original = "c.n_head, c.d_head, like=self.mask_emb)"
    assert text.count(original) == 1
    xlnet.write_text(text.replace(original, "c.n_head, c.d_head, like=self.embedding.weight)"))
    _, problems = check_tree(tmp_path)
    assert len(problems) == 1
    marker = next(i for i, line in enumerate(text.splitlines(), 1) if "TransformerXL.init_state" in line)
    source = "xlserve.models.transformer_xl.TransformerXL.init_state"
    assert problems[0].startswith(f"{xlnet}:{marker}: differs from {source}")
    assert main([str(tmp_path)]) == 1
