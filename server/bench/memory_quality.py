"""`xlserve bench memory-quality`: what a session's state buys in bits per byte, per byte of state.

On the held-out stdlib files longer than `--min-file-bytes` (20 KB), each scored on its own from
an empty state carried across the whole file, this reports held-out bits per byte and the
session state bytes (`State.nbytes()`, what the cache manager stores per session) of:
- the ∞-former as trained (short-term memory + continuous long-term memory);
- the same ∞-former with its long-term memory switched off (short-term memory only): the
  long-term memory must help;
- the Transformer-XL checkpoint with mem_len chosen so that its state takes as many bytes as
  the ∞-former's (its state grows by a fixed number of bytes per remembered position, so the
  equal-bytes mem_len is solved from two measurements), and as trained (mem_len 128);
- Mamba (`--mamba`, mamba-stdlib when it is shipped), whose state is a fixed summary of the whole
  history, beside Transformer-XL with mem_len chosen so that its state takes as many bytes as
  Mamba's: the same state budget spent on a window of exact positions.
The ∞-former's state is the same size after any history; Transformer-XL's stops growing at
mem_len. Results: bench-results/memory-quality.json and .png. Run it alone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.training.data import stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte
from xlserve.server.bench.common import environment, figure, save_results
from xlserve.server.settings import BENCH_RESULTS_DIR, checkpoint_dir


def long_held_out_files(min_bytes: int, max_files: int | None) -> list[tuple[str, bytes]]:
    corpus = stdlib_corpus()
    files = [(str(path), corpus.read(path)) for path in corpus.held_out]
    files = [(name, data) for name, data in files if len(data) > min_bytes]
    return files[:max_files] if max_files else files


def state_bytes(model) -> int:
    """Bytes of a session's state once its memory is full, as the server counts them (from the
    state's shapes: models/interface.py `full_state_bytes`; the same bytes as a state after 2,048
    bytes of history, which the bench used to run a forward over for each row and each mem_len)."""
    nbytes = model.full_state_bytes()
    if nbytes is None:
        raise ValueError(f"{type(model).__name__}'s state grows without bound: no state bytes to compare at")
    return nbytes


def equal_bytes_mem_len(transformer_xl, target_bytes: int) -> int:
    """The mem_len whose full Transformer-XL state is closest to `target_bytes`."""
    low, high = 128, 256
    per_position = (state_bytes(transformer_xl.with_mem_len(high)) - state_bytes(transformer_xl.with_mem_len(low))) / (high - low)
    fixed = state_bytes(transformer_xl.with_mem_len(low)) - per_position * low
    return max(1, round((target_bytes - fixed) / per_position))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="xlserve bench memory-quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--infinity-former", default="infinity-former-stdlib", help="name under weights/ or a path")
    parser.add_argument("--transformer-xl", default="transformer-xl-stdlib", help="name under weights/ or a path")
    parser.add_argument("--mamba", default="mamba-stdlib",
                        help="name under weights/ or a path; 'none' leaves the Mamba rows out (so does a name not found)")
    parser.add_argument("--min-file-bytes", type=int, default=20_000)
    parser.add_argument("--max-files", type=int, default=None, help="only the first N long files (a quick look)")
    parser.add_argument("--max-file-bytes", type=int, default=None,
                        help="score only each file's first N bytes (a quick look; the files are still chosen by --min-file-bytes)")
    parser.add_argument("--chunk", type=int, default=512, help="bytes fed per forward call")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(BENCH_RESULTS_DIR / "memory-quality.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    infinity_former = load_checkpoint(checkpoint_dir(args.infinity_former))
    transformer_xl = load_checkpoint(checkpoint_dir(args.transformer_xl))
    files = long_held_out_files(args.min_file_bytes, args.max_files)
    documents = [data[:args.max_file_bytes] if args.max_file_bytes else data for _, data in files]
    target = state_bytes(infinity_former)
    matched = equal_bytes_mem_len(transformer_xl, target)
    trained_mem_len = transformer_xl.config.mem_len
    variants = [
        ("∞-former", "long-term + short-term memory", infinity_former),
        ("∞-former, long-term memory off", "short-term memory only", infinity_former.with_long_term_memory(False)),
        ("Transformer-XL, equal state bytes", f"mem_len {matched}", transformer_xl.with_mem_len(matched)),
        ("Transformer-XL, as trained", f"mem_len {trained_mem_len}", transformer_xl),
    ]
    mamba, mamba_matched = None, None
    if args.mamba != "none":
        mamba_dir = checkpoint_dir(args.mamba)
        if (mamba_dir / "config.json").is_file():
            mamba = load_checkpoint(mamba_dir)
            mamba_matched = equal_bytes_mem_len(transformer_xl, state_bytes(mamba))
            variants += [
                ("Mamba", "fixed summary of the whole history", mamba),
                ("Transformer-XL, Mamba's state bytes", f"mem_len {mamba_matched}", transformer_xl.with_mem_len(mamba_matched)),
            ]
        else:
            print(f"no checkpoint {mamba_dir}: the Mamba rows are left out", flush=True)
    rows = []
    for label, memory, model in variants:
        started = time.perf_counter()
        bpb = bits_per_byte(model, documents, chunk_len=args.chunk)
        rows.append({"model": label, "memory": memory, "state_bytes": state_bytes(model), "bits_per_byte": round(bpb, 4),
                     "seconds": round(time.perf_counter() - started, 1)})
        print(f"{label:36s} {memory:32s} state {rows[-1]['state_bytes']:>10,} B  {bpb:.4f} bits/byte", flush=True)
    with_ltm, without_ltm = rows[0]["bits_per_byte"], rows[1]["bits_per_byte"]
    result = {
        "benchmark": "memory-quality", **environment(),
        "files": [name for name, _ in files], "scored_bytes": sum(len(d) - 1 for d in documents),
        "min_file_bytes": args.min_file_bytes, "max_file_bytes": args.max_file_bytes, "chunk": args.chunk,
        "infinity_former": args.infinity_former, "transformer_xl": args.transformer_xl,
        "equal_bytes_mem_len": matched, "mamba": args.mamba if mamba is not None else None,
        "mamba_equal_bytes_mem_len": mamba_matched, "results": rows,
        "long_term_memory_gain_bits_per_byte": round(without_ltm - with_ltm, 4),
    }
    save_results(result, args.out, plot, print_table)


def plot(result: dict, path: Path) -> None:
    rows = result["results"]
    with figure(path, f"Held-out files > {result['min_file_bytes'] // 1000} KB: bits per byte by session state",
                size=(7, 4)) as ax:
        for row in rows:
            ax.scatter(row["state_bytes"] / 1e6, row["bits_per_byte"], s=40, label=f"{row['model']} ({row['memory']})")
        ax.set_xlabel("session state (MB)")
        ax.set_ylabel("bits per byte (lower is better)")


def print_table(result: dict) -> None:
    print(f"\n{len(result['files'])} held-out files > {result['min_file_bytes']:,} bytes, {result['scored_bytes']:,} bytes scored")
    print("| model | memory | state bytes | bits per byte |")
    print("|---|---|---|---|")
    for row in result["results"]:
        print(f"| {row['model']} | {row['memory']} | {row['state_bytes']:,} | {row['bits_per_byte']:.4f} |")
    print(f"long-term memory gain: {result['long_term_memory_gain_bits_per_byte']:+.4f} bits per byte")
