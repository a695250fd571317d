"""The training corpus: the Python standard library source of the running interpreter.

Every machine has it, it is offline, and its files are long documents. A `.py` file outside
site-packages is held out when int(sha256(relative_path).hexdigest(), 16) % 20 == 0, where
relative_path is its POSIX path relative to the stdlib root; every other file trains.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest(), 16) % 20 == 0


@dataclass
class Corpus:
    root: Path
    train: list[str]  # relative POSIX paths, sorted
    held_out: list[str]

    def read(self, relative_path: str) -> bytes:
        return (self.root / relative_path).read_bytes()

    def size(self, paths: list[str]) -> int:
        return sum((self.root / p).stat().st_size for p in paths)


def stdlib_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.relative_to(root).parts and p.is_file()
    )
    return Corpus(
        root=root,
        train=[p for p in paths if not is_held_out(p)],
        held_out=[p for p in paths if is_held_out(p)],
    )


class SegmentStream:
    """The training files, shuffled once with a fixed seed and concatenated, cut into
    `batch_size` contiguous lanes. Step s reads segment s of every lane, so lane b's memory
    after step s is exactly the context of its segment s + 1 (the paper's recurrence)."""

    def __init__(self, corpus: Corpus, batch_size: int, segment_len: int, seed: int = 0):
        order = list(corpus.train)
        random.Random(seed).shuffle(order)
        data = b"".join(corpus.read(p) for p in order)
        lane_len = len(data) // batch_size
        self.lanes = torch.frombuffer(bytearray(data[: lane_len * batch_size]), dtype=torch.uint8)
        self.lanes = self.lanes.view(batch_size, lane_len)
        self.segment_len = segment_len
        self.total_bytes = len(data)

    @property
    def steps_per_epoch(self) -> int:
        return (self.lanes.shape[1] - 1) // self.segment_len

    def segment(self, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(inputs, targets) of shape (B, T) for `step`, and whether the lanes restarted
        (a new epoch), in which case the caller resets the memory."""
        index = step % self.steps_per_epoch
        start = index * self.segment_len
        window = self.lanes[:, start : start + self.segment_len + 1].long()
        return window[:, :-1], window[:, 1:], index == 0
