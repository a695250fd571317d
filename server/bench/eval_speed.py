"""`xlserve bench eval-speed`: time per evaluated byte, vanilla vs Transformer-XL (the comparison of
Dai et al. 2019, table 9: up to 1,874x at attention length 3,800).

Both models have the widths of the shipped small presets (4 layers, d_model 192, 4 heads of 48,
d_inner 768) and random weights (timing does not depend on them); the attention length A is
what each prediction conditions on:
- vanilla (Al-Rfou et al.): context_len A. As in its paper's evaluation, every byte is predicted
  from the window of the A bytes before it, and since every position moves when the window
  slides, that is one full forward pass over A positions per evaluated byte (its per-layer
  positional tables grow with A, the only parameters that differ);
- Transformer-XL: mem_len A with same_length, so every query attends to exactly A positions;
  the document is fed in segments of --segment bytes and the memory carries the rest.
Both are timed in the steady state over a long held-out document: after A bytes of warm-up (the
window full, the memory full), --vanilla-bytes (default: about 64k positions' worth) and
--txl-bytes are evaluated through each model's `forward`, exactly as `xlserve eval` and the
server run them.

Results: bench-results/eval-speed.json and .png (--quick: eval-speed-quick.*), and a table.
Run it alone: a second torch-heavy process on the same cores slows both and skews the numbers.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from xlserve.server.bench.common import add_run_arguments, environment, figure, fill_defaults, save_results

WIDTHS = dict(n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768)
QUICK_WIDTHS = dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench eval-speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small widths and lengths (seconds)")
    parser.add_argument("--lengths", type=int, nargs="+", help="attention lengths (default 512 1024 3800)")
    parser.add_argument("--segment", type=int, default=128, help="Transformer-XL: bytes per forward call")
    parser.add_argument("--vanilla-bytes", type=int, default=None,
                        help="vanilla bytes timed per length (default: max(8, 65536 // A))")
    parser.add_argument("--txl-bytes", type=int, default=None, help="Transformer-XL bytes timed (default 8192)")
    add_run_arguments(parser, "eval-speed")
    args = parser.parse_args(argv)
    if args.lengths is None:
        args.lengths = [64, 128] if args.quick else [512, 1024, 3800]
    if args.txl_bytes is None:
        args.txl_bytes = 512 if args.quick else 8192
    return fill_defaults(args, "eval-speed")


def held_out_document(length: int) -> tuple[torch.Tensor, str]:
    """The longest held-out file (continued by the next longest ones if it is too short)."""
    from xlserve.models.training.data import stdlib_corpus

    corpus = stdlib_corpus()
    by_size = sorted(corpus.held_out, key=lambda p: -(corpus.root / p).stat().st_size)
    data, names = b"", []
    for path in by_size:
        data += corpus.read(path)
        names.append(path)
        if len(data) >= length:
            break
    if len(data) < length:
        raise SystemExit(f"the held-out files hold {len(data)} bytes, fewer than the {length} this run needs")
    return torch.tensor(list(data[:length]), dtype=torch.long)[None], " + ".join(names)


def time_forward(model, document: torch.Tensor, warm: int, timed: int, chunk: int) -> float:
    """Seconds per byte for bytes warm .. warm+timed-1 of `document`, fed in `chunk`-byte calls
    after the first `warm` bytes filled the state."""
    state = model.init_state(1)
    for start in range(0, warm, chunk):
        _, state = model(document[:, start : min(start + chunk, warm)], state)
    started = time.perf_counter()
    for start in range(warm, warm + timed, chunk):
        _, state = model(document[:, start : min(start + chunk, warm + timed)], state)
    return (time.perf_counter() - started) / timed


@torch.inference_mode()
def run(args) -> dict:
    from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
    from xlserve.models.vanilla import VanillaConfig, VanillaTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    rows = []
    for A in args.lengths:
        vanilla_bytes = args.vanilla_bytes or max(8, 65536 // A)
        document, source = held_out_document(A + max(vanilla_bytes, args.txl_bytes))
        torch.manual_seed(args.seed)
        vanilla = VanillaTransformer(VanillaConfig(context_len=A, **widths)).eval()
        txl = TransformerXL(TransformerXLConfig(mem_len=A, tgt_len=args.segment, same_length=True, **widths)).eval()
        time_forward(vanilla, document, A, min(vanilla_bytes, 2), args.segment)  # warm up
        vanilla_s = time_forward(vanilla, document, A, vanilla_bytes, args.segment)
        time_forward(txl, document, A, min(args.segment, args.txl_bytes), args.segment)  # warm up
        txl_s = time_forward(txl, document, A, args.txl_bytes, args.segment)
        row = {
            "attention_length": A,
            "vanilla_s_per_byte": vanilla_s,
            "transformer_xl_s_per_byte": txl_s,
            "speedup": vanilla_s / txl_s,
            "vanilla_bytes_timed": vanilla_bytes,
            "transformer_xl_bytes_timed": args.txl_bytes,
            "vanilla_parameters": sum(p.numel() for p in vanilla.parameters()),
            "transformer_xl_parameters": sum(p.numel() for p in txl.parameters()),
            "document": source,
        }
        rows.append(row)
        print(f"A={A}: vanilla {vanilla_s * 1e3:.2f} ms/byte, Transformer-XL {txl_s * 1e3:.3f} ms/byte, "
              f"{row['speedup']:.0f}x", flush=True)
    return {
        "benchmark": "eval-speed",
        "quick": args.quick,
        "setting": {**widths, "segment": args.segment, "lengths": args.lengths, "dtype": "float32",
                    "transformer_xl": "mem_len = A, same_length (each query sees A positions)",
                    "vanilla": "context_len = A, one full forward over the A-byte window per evaluated byte"},
        "environment": environment(),
        "paper": {"source": "Dai et al. 2019, Transformer-XL, table 9", "speedup_at_3800": 1874},
        "results": rows,
    }


def plot(result: dict, path: Path) -> None:
    from matplotlib.ticker import NullFormatter

    rows, s = result["results"], result["setting"]
    title = f"{s['n_layer']} layers, d_model {s['d_model']}, {result['environment']['threads']} threads, float32"
    with figure(path, title) as ax:
        lengths = [r["attention_length"] for r in rows]
        ax.plot(lengths, [r["vanilla_s_per_byte"] * 1e3 for r in rows], "o-", label="vanilla (window recomputed)")
        ax.plot(lengths, [r["transformer_xl_s_per_byte"] * 1e3 for r in rows], "s-", label="Transformer-XL (memory)")
        for r in rows:
            ax.annotate(f"{r['speedup']:.0f}x", (r["attention_length"], r["vanilla_s_per_byte"] * 1e3),
                        textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(a) for a in lengths])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("attention length (bytes)")
        ax.set_ylabel("evaluation time per byte (ms)")


def print_table(result: dict) -> None:
    print()
    print(f"{'attention length':>16} | {'vanilla ms/byte':>15} | {'Transformer-XL ms/byte':>22} | {'speedup':>8}")
    print("-" * 72)
    for r in result["results"]:
        print(f"{r['attention_length']:>16} | {r['vanilla_s_per_byte'] * 1e3:>15.3f} | "
              f"{r['transformer_xl_s_per_byte'] * 1e3:>22.4f} | {r['speedup']:>7.0f}x")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    result = run(args)
    save_results(result, args.out, plot, print_table)
