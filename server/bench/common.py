"""What the model benchmarks (vs-hf, vs-hf-xlnet, vs-hf-reformer, eval-speed) share: the
arguments every run takes, the environment it ran in, a converted copy of a Hugging Face
reference, greedy generation timed in two parts (prefill, decode), a plot figure, writing the
results (JSON + PNG) before printing the table, and a comparison's result and verdict.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch


def add_run_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """--threads, --seed and --out (default bench-results/NAME[-quick].json)."""
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=f"results JSON (default bench-results/{name}[-quick].json)")


def fill_defaults(args: argparse.Namespace, name: str, defaults: dict | None = None) -> argparse.Namespace:
    """Every argument left unset takes its value from `defaults`; --out its default path."""
    for key, value in (defaults or {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = f"bench-results/{name}{'-quick' if args.quick else ''}.json"
    return args


def environment(with_transformers: bool = False) -> dict:
    env = {"torch": torch.__version__}
    if with_transformers:
        import transformers

        env["transformers"] = transformers.__version__
    return {**env, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version()}


def convert_reference(reference):
    """Our model converted from `reference`: saved with save_pretrained, run through `xlserve
    convert` and loaded back, in a temporary directory."""
    from xlserve.models.checkpoint import load_checkpoint
    from xlserve.models.convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference.save_pretrained(Path(tmp) / "hf")
        convert(Path(tmp) / "hf", Path(tmp) / "xl")
        return load_checkpoint(Path(tmp) / "xl")


def generate_greedy(step: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, new_tokens: int,
                    chunk: int | None = None) -> dict:
    """Greedy generation through `step(ids (B, T)) -> scores of the next token (B, V)`, which
    carries its own state: the prompt in calls of `chunk` tokens (None: one call), then
    `new_tokens` steps of argmax + one call of the chosen token. Returns the tokens (B, new_tokens),
    the chosen tokens' scores (B, new_tokens), prefill_s and decode_s."""
    chunk = chunk or prompt.shape[1]
    start = time.perf_counter()
    for s in range(0, prompt.shape[1], chunk):
        scores = step(prompt[:, s : s + chunk])
    prefill_s = time.perf_counter() - start

    tokens, chosen = [], []
    start = time.perf_counter()
    for _ in range(new_tokens):
        value, token = scores.max(-1, keepdim=True)  # (B, 1) each: argmax, faster (sampling.most_likely)
        tokens.append(token)
        chosen.append(value)
        scores = step(token)
    decode_s = time.perf_counter() - start
    return {"tokens": torch.cat(tokens, 1), "chosen": torch.cat(chosen, 1), "prefill_s": prefill_s,
            "decode_s": decode_s}


def generate_with_state(model, prompt: torch.Tensor, new_tokens: int, chunk: int | None = None) -> dict:
    """`generate_greedy` through an xlserve model's own state: the prompt in calls of `chunk`
    tokens (None: one call), then one incremental call per token."""
    state = model.init_state(prompt.shape[0])

    def step(ids):
        nonlocal state
        out, state = model(ids, state)
        return out[:, -1]

    return generate_greedy(step, prompt, new_tokens, chunk)


@contextmanager
def figure(path: Path, title: str, size: tuple[float, float] = (6, 4)) -> Iterator:
    """The axes of a new figure; on leaving, the title and legend are added and it is saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def save_results(result: dict, out: str | Path, plot: Callable[[dict, Path], None],
                 print_table: Callable[[dict], None]) -> None:
    """`result` as JSON at `out`, `plot(result, path)` beside it as .png, then the table."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def comparison_result(benchmark: str, args: argparse.Namespace, setting_names: tuple[str, ...], fixed: dict,
                      model: torch.nn.Module, rows: list[dict], identical: str) -> dict:
    """The result of comparing xlserve with a reference: the run's setting (the arguments named
    and the `fixed` facts), the model's size, where it ran, the rows, and whether every row's
    `identical` field holds."""
    return {
        "benchmark": benchmark,
        "quick": args.quick,
        "setting": {**{name: getattr(args, name) for name in setting_names}, **fixed},
        "parameters": sum(p.numel() for p in model.parameters()),
        "environment": environment(with_transformers=True),
        "results": rows,
        "all_identical": all(row[identical] for row in rows),
    }


def save_comparison(result: dict, out: str | Path, plot: Callable[[dict, Path], None],
                    print_table: Callable[[dict], None], reference: str) -> None:
    """`save_results`, then fail the command when any row's tokens differ from the `reference`'s."""
    save_results(result, out, plot, print_table)
    if not result["all_identical"]:
        raise SystemExit(f"generated tokens differ between xlserve and {reference}")


# -- what a decode step must read, and the fastest it can then be ----------------------------------

GIB = 1 << 30


class BandwidthProbe:
    """This machine's read bandwidth in bytes/s, as torch reads memory: the best of `repeats`
    passes over `gib` GiB of float32 (1 GiB is 3.4 times this VM's 300 MB last-level cache, which
    it shares with its neighbours; the 0.25 GiB of --quick forms is not), on torch's threads, by the faster
    of two kernels that read every byte once: a sum, and a matrix-vector product (what a decode
    step's linear layers do). The larger figure makes the decode's fraction of it the harder goal.
    The buffer lies on huge pages where the weights do (models/huge_pages.py): on 4 kB pages it
    read 20.7 GB/s in a run whose float32 decode then read its weights at 24.6.

    One probe keeps its buffer, so `read()` can be called beside each round of a decode: on the
    AMD EPYC VM of 2026-12-06 two threads' reading moved between two levels, 33-37 and 60-67 GB/s,
    for seconds to minutes at a time, in every buffer of a process at once (one thread's stayed at
    30-35), while a decode step changed by about 10% between them (docs/benchmarks.md)."""

    def __init__(self, gib: float = 1.0):
        from xlserve.models.huge_pages import weights_on_huge_pages

        holder = torch.nn.Module()
        holder.register_buffer("data", torch.ones(int(gib * GIB) // 4))
        self.data = weights_on_huge_pages(holder).data
        self.matrix, self.vector = self.data.view(-1, 1024), torch.ones(1, 1024)
        self.data.sum()  # touch every page first

    def read(self, repeats: int = 5) -> float:
        best = float("inf")
        for _ in range(repeats):
            for read in (self.data.sum, lambda: torch.nn.functional.linear(self.vector, self.matrix)):
                start = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - start)
        return self.data.numel() * 4 / best


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """One reading of a `BandwidthProbe` of `gib` GiB, its buffer freed after."""
    return BandwidthProbe(gib).read(repeats)


@torch.inference_mode()
def state_bytes_per_row(model, tokens: int, vocab: int) -> int:
    """Bytes of one row's state after `tokens` tokens: what each decode step of that row reads
    besides the weights (attention reads every position of its memory; a recurrent model its
    whole state)."""
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    return model(ids, model.init_state(1))[1].nbytes()


def decode_ceiling(weight_bytes: int, state_bytes: int, batch: int, bandwidth: float) -> dict:
    """The fastest a decode step of `batch` rows can be when reading memory is all it does: it
    reads the weights once for every row and each row's own state, at `bandwidth` bytes/s. A batch
    shares the weights' read, never the states': its gain over one row is bounded by
    batch · (weights + state) / (weights + batch · state), below `batch` once the states weigh."""
    read = weight_bytes + batch * state_bytes
    return {"bytes_read_per_step": read, "ceiling_tokens_per_s": batch * bandwidth / read}
