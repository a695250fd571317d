"""`xlserve bench continuation`: what a session's memory saves.

For each model and each history length H, on held-out stdlib text:
- append_reused_s: time to feed 128 new tokens to a session that already holds H tokens
  (the memory is reused: only the 128 tokens are computed);
- append_recompute_s: time to get the same result without a memory, by running all H + 128
  tokens from an empty state (what a stateless server does);
- decode_tokens_per_s: greedy decoding one token at a time at batch 1 after the history;
- append_time_spread per model: slowest append over fastest across the histories, minus 1 (a
  constant-state model such as the ∞-former should stay within 0.2 from 1k to 100k tokens).
Medians over repeats; the reused appends of all history lengths are timed round-robin. Results go to bench-results/continuation.json and continuation.png.
Run it alone: a second torch-heavy process on the same cores slows both and skews the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.training.data import stdlib_corpus
from xlserve.server.settings import BENCH_RESULTS_DIR, checkpoint_dir


def held_out_text(length: int) -> list[int]:
    corpus = stdlib_corpus()
    data = b""
    for path in corpus.held_out:
        data += corpus.read(path)
        if len(data) >= length:
            break
    while len(data) < length:
        data += data
    return list(data[:length])


def feed(model, tokens: list[int], state, chunk: int):
    log_probs = None
    for start in range(0, len(tokens), chunk):
        piece = torch.tensor([tokens[start : start + chunk]], device=model.device)
        log_probs, state = model(piece, state)
    return log_probs, state


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure(model, histories: list[int], append_len: int, decode_len: int, chunk: int, repeats: int) -> list[dict]:
    """One row per history length. The reused appends of all the history lengths are timed
    round-robin (one of each, `repeats` times over), so that drift in the machine (another
    process, the allocator after a 100k-token recomputation) falls on every length alike."""
    device = model.device
    tokens = held_out_text(max(histories) + append_len)
    sessions = {}
    for history_len in histories:
        _, state = feed(model, tokens[:history_len], model.init_state(1), chunk)
        sessions[history_len] = (state, tokens[history_len : history_len + append_len])

    reused_times = {h: [] for h in histories}
    for round_index in range(repeats + 1):  # round 0 warms up
        for history_len, (state, new) in sessions.items():
            sync(device)
            start = time.perf_counter()
            feed(model, new, state, chunk)
            sync(device)
            if round_index:
                reused_times[history_len].append(time.perf_counter() - start)

    rows = []
    for history_len, (state, new) in sessions.items():
        reused = statistics.median(reused_times[history_len])
        whole = tokens[: history_len + append_len]
        recompute = timed(lambda: feed(model, whole, model.init_state(1), chunk), max(1, repeats // 4), device)
        # the two paths must agree where the architecture's memory covers the history
        reused_lp, _ = feed(model, new, state, chunk)
        full_lp, _ = feed(model, whole, model.init_state(1), chunk)
        max_diff = (reused_lp[0, -1] - full_lp[0, -1]).abs().max().item()

        def decode():
            log_probs, current = feed(model, new, state, chunk)
            for _ in range(decode_len):
                token = log_probs[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                log_probs, current = model(token, current)

        decode_total = timed(decode, max(1, repeats // 2), device) - reused
        rows.append({
            "history_tokens": history_len,
            "append_tokens": append_len,
            "append_reused_s": reused,
            "append_recompute_s": recompute,
            "speedup": recompute / reused,
            "decode_tokens": decode_len,
            "decode_tokens_per_s": decode_len / decode_total,
            "state_bytes": state.nbytes(),
            "reused_vs_recomputed_max_abs_diff": max_diff,
        })
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\nH={r['history_tokens']}" for r in results]
    reused = [r["append_reused_s"] * 1000 for r in results]
    recompute = [r["append_recompute_s"] * 1000 for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(max(5, 2 * len(results)), 4))
    ax.bar([i - 0.2 for i in x], reused, width=0.4, label="memory reused")
    ax.bar([i + 0.2 for i in x], recompute, width=0.4, label="recomputed from scratch")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms to append 128 tokens")
    ax.set_yscale("log")
    ax.set_title("Continuing a session: memory reuse vs recomputation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="xlserve bench continuation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="transformer-xl-stdlib", help="comma list: names under weights/ or paths")
    parser.add_argument("--histories", default="4096", help="comma list of history lengths in tokens")
    parser.add_argument("--append", type=int, default=128)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk length")
    parser.add_argument("--repeats", type=int, default=9, help="rounds of reused appends (recomputation: a quarter)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(BENCH_RESULTS_DIR))
    args = parser.parse_args(argv)

    results = []
    for name in args.models.split(","):
        path = checkpoint_dir(name)
        model = load_checkpoint(path, device=args.device)
        histories = [int(h) for h in args.histories.split(",")]
        for measured in measure(model, histories, args.append, args.decode, args.chunk, args.repeats):
            row = {"model": path.name, "device": args.device, **measured}
            results.append(row)
            print(f"{row['model']:28s} H={row['history_tokens']:>7d}  append {args.append}: reused "
                  f"{row['append_reused_s'] * 1000:8.1f} ms  recomputed {row['append_recompute_s'] * 1000:9.1f} ms "
                  f"({row['speedup']:6.1f}x)  decode {row['decode_tokens_per_s']:7.1f} tok/s  state {row['state_bytes']:,} B",
                  flush=True)
    # how flat the append time stays as the history grows: slowest over fastest, per model
    flatness = {}
    for name in dict.fromkeys(r["model"] for r in results):
        times = [r["append_reused_s"] for r in results if r["model"] == name]
        flatness[name] = round(max(times) / min(times) - 1, 4)
        print(f"{name}: append time spread over histories {flatness[name]:.1%} (slowest over fastest, minus 1)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "continuation", "torch": torch.__version__, "threads": torch.get_num_threads(),
               "append_time_spread": flatness, "results": results}
    (out / "continuation.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(results, out / "continuation.png")
    print(f"wrote {out / 'continuation.json'} and {out / 'continuation.png'}")
