"""Git holds servable checkpoints, never training state.

About 230 MB of resume progress was once committed under weights/ and deleted later, and every
clone still downloads it. These tests read what git tracks (a fresh clone in CI is a checkout)
and fail when anything under weights/ is not part of a servable checkpoint, when a checkpoint
file passes the 8 MB that the repository allows, or when training state could be added by a
plain `git add`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_CHECKPOINT_FILE_BYTES = 8 << 20
# what a servable checkpoint directory holds: the files the loader reads (config.json,
# model.safetensors, a tokenizer's own files for imported checkpoints) and the record of how it was
# made and measured (card.md, evaluation.json, training.json: the recipe and its evaluations, a
# few kB of JSON, never weights or optimiser moments), and the chat template the server reads
CHECKPOINT_FILES = frozenset({
    "config.json", "model.safetensors", "chat_template.jinja",
    "card.md", "evaluation.json", "training.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model", "vocab.json",
    "merges.txt", "vocab.txt",
})


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def tracked_weights() -> list[PurePosixPath]:
    listed = git("ls-files", "-z", "weights")
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    return [PurePosixPath(path) for path in listed.stdout.split("\0") if path]


def test_only_servable_checkpoint_files_are_tracked_under_weights(tracked_weights):
    assert tracked_weights, "no checkpoint is tracked under weights/"
    strays = [str(path) for path in tracked_weights
              if len(path.parts) != 3 or path.name not in CHECKPOINT_FILES or path.parts[1].startswith(".")]
    assert not strays, f"tracked under weights/ but not part of a servable checkpoint (training state?): {strays}"


def test_every_tracked_checkpoint_is_servable_and_small(tracked_weights):
    directories = {path.parent for path in tracked_weights}
    for directory in directories:
        names = {path.name for path in tracked_weights if path.parent == directory}
        assert {"config.json", "model.safetensors", "card.md"} <= names, f"{directory} is not a servable checkpoint: {sorted(names)}"
    for path in tracked_weights:
        size = (ROOT / path).stat().st_size
        assert size <= MAX_CHECKPOINT_FILE_BYTES, f"{path} is {size:,} bytes; checkpoints in git are at most 8 MB a file"


@pytest.mark.parametrize("path", [
    "weights/.progress/reformer-stdlib/progress.safetensors",
    "weights/transformer-xl-stdlib/.resume/progress.json",
    ".progress/run/progress.safetensors",
])
def test_training_state_is_ignored_by_git(path):
    checked = git("check-ignore", "--no-index", "-q", path)
    if checked.returncode == 128:
        pytest.skip(f"not a git checkout: {checked.stderr.strip()}")
    assert checked.returncode == 0, f"{path} would be added by `git add`: .gitignore must ignore training state"
