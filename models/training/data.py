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


LANE_LAYOUTS = ("files", "concatenated")


class SegmentStream:
    """The training files, shuffled once with a fixed seed, dealt into `batch_size` lanes and
    read as segments: step s reads segment s of every lane, so lane b's memory after step s is
    exactly the context of its segment s + 1 (the paper's recurrence).

    `segment(step)` also says which lanes start a file at that step: the caller gives those
    lanes an empty state, so the memory a model learns to use is the memory a served document
    has, the bytes of that document since its first byte and nothing older. Two layouts:

    - "files" (the standard recipe): each file begins at a segment boundary of its lane, and
      segments of one file overlap by the one byte that is a target of one and the first input of
      the next. A file's last (length - 1) % segment_len bytes are not read; files shorter than
      segment_len + 1 bytes are not read at all. Each file goes to the lane with the fewest
      segments so far, and every lane is cut to the shortest one.
    - "concatenated": the files joined end to end and cut into equal lanes; the lanes start a
      file only at step 0 of an epoch, so one state runs on across hundreds of files. The
      checkpoints trained before "files" used it; models whose state never forgets (Performer's
      running sums, Longformer's global positions) learn there to rely on a state no served
      document has (docs/design.md section 5).
    """

    def __init__(self, corpus: Corpus, batch_size: int, segment_len: int, seed: int = 0, layout: str = "files"):
        if layout not in LANE_LAYOUTS:
            raise ValueError(f"lane layout '{layout}' is not one of {LANE_LAYOUTS}")
        order = list(corpus.train)
        random.Random(seed).shuffle(order)
        self.segment_len = segment_len
        if layout == "concatenated":
            data = b"".join(corpus.read(p) for p in order)
            lane_len = len(data) // batch_size
            lanes = torch.frombuffer(bytearray(data[: lane_len * batch_size]), dtype=torch.uint8)
            lanes = lanes.view(batch_size, lane_len)
            steps = (lane_len - 1) // segment_len
            # (B, S, T + 1): segment s of lane b is lanes[b, s*T : (s+1)*T + 1]
            self.windows = lanes.unfold(1, segment_len + 1, segment_len)[:, :steps]
            self.starts = torch.zeros(batch_size, steps, dtype=torch.bool)
            self.starts[:, 0] = True
            self.total_bytes = len(data)
            self.read_bytes = batch_size * steps * segment_len
            return
        windows: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
        counts = [0] * batch_size
        total = 0
        for path in order:
            data = corpus.read(path)
            total += len(data)
            count = (len(data) - 1) // segment_len
            if count <= 0:
                continue
            lane = min(range(batch_size), key=lambda b: (counts[b], b))
            file_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            windows[lane].append(file_bytes.unfold(0, segment_len + 1, segment_len)[:count])  # (count, T + 1)
            counts[lane] += count
        steps = min(counts)
        self.windows = torch.stack([torch.cat(lane)[:steps] for lane in windows])  # (B, S, T + 1)
        self.starts = torch.zeros(batch_size, steps, dtype=torch.bool)
        for b, lane in enumerate(windows):
            first = torch.tensor([0] + [len(w) for w in lane[:-1]]).cumsum(0)
            self.starts[b, first[first < steps]] = True
        self.total_bytes = total
        self.read_bytes = batch_size * steps * segment_len

    @property
    def steps_per_epoch(self) -> int:
        return self.windows.shape[1]

    def segment(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (B, T) for `step`, and a (B,) bool: the lanes whose
        segment is the first of a file (every lane at the first step of an epoch), whose memory
        the caller empties before this segment."""
        index = step % self.steps_per_epoch
        window = self.windows[:, index].long()  # (B, T + 1)
        return window[:, :-1], window[:, 1:], self.starts[:, index].clone()
