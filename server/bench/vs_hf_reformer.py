"""`xlserve bench vs-hf-reformer`: greedy generation speed of a converted Reformer against the
Hugging Face reference it came from (transformers 4.37.2, `ReformerModelWithLMHead.generate`).

The setting (defaults): google/reformer-enwik8's shape (12 layers, 3 of them LSH: local, local,
lsh, local, local, local, lsh, local, local, local, lsh, local; hidden size 1024, 8 heads of 128,
feed-forward 4096; LSH chunks of 256 with 4 hash rounds over 512 buckets, local chunks of 128,
each looking one chunk back; axial positions 128 x 512; the byte vocabulary of 258 ids),
randomly initialised with a fixed hash_seed, saved with save_pretrained and converted with
`xlserve convert`. A random prompt of --prompt-len bytes, then --new-tokens greedy bytes, two
ways:
- xlserve: the prompt in one call (the reference's one pass), then one incremental step per
  token: the new token is hashed, sorted among the stored buckets and attends to the stored keys
  and values of its windows;
- the reference's `generate()` (greedy, ids 0 and 1 suppressed so both choose among bytes, no
  end-of-text id), as users call it: its cache (`past_buckets_states`) holds hidden states and
  buckets, and every step re-projects the hidden states of each LSH window (4 rounds x 512
  positions per LSH layer) and of each local window into keys and values.
Both are the same computation (tests/models/test_convert_reformer.py), so the tokens must be
identical. Tokens/s count generated tokens over the whole call, prompt included; the per-step
decode rate of xlserve is reported beside it. Batch 1 only: the reference's cached LSH decoding
mixes the rows of a larger batch (docs/convert.md).

Results: bench-results/vs-hf-reformer.json and .png (--quick: vs-hf-reformer-quick.*), and a
table. Run it alone: a second torch-heavy process on the same cores slows both and skews the
numbers.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from xlserve.server.bench.common import (
    add_run_arguments, comparison_result, convert_reference, figure, fill_defaults,
    generate_with_state, save_comparison,
)

ENWIK8_LAYERS = ["local", "local", "lsh", "local", "local", "local", "lsh", "local", "local", "local", "lsh", "local"]
FULL = dict(attn_layers=ENWIK8_LAYERS, hidden_size=1024, num_heads=8, head_size=128, feed_forward_size=4096,
            lsh_chunk=256, local_chunk=128, num_hashes=4, num_buckets=512, axial_shape=[128, 512],
            axial_dims=[256, 768], prompt_len=1024, new_tokens=128)
QUICK = dict(attn_layers=["local", "lsh"], hidden_size=64, num_heads=2, head_size=32, feed_forward_size=128,
             lsh_chunk=16, local_chunk=16, num_hashes=2, num_buckets=8, axial_shape=[16, 16], axial_dims=[16, 48],
             prompt_len=40, new_tokens=16)
BYTE_SHIFT = 2  # the enwik8 vocabulary: id = byte + 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench vs-hf-reformer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds) instead of the full setting")
    parser.add_argument("--attn-layers", nargs="+", choices=["lsh", "local"])
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--head-size", type=int)
    parser.add_argument("--feed-forward-size", type=int)
    parser.add_argument("--lsh-chunk", type=int)
    parser.add_argument("--local-chunk", type=int)
    parser.add_argument("--num-hashes", type=int)
    parser.add_argument("--num-buckets", type=int)
    parser.add_argument("--axial-shape", type=int, nargs=2)
    parser.add_argument("--axial-dims", type=int, nargs=2)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    add_run_arguments(parser, "vs-hf-reformer")
    args = parser.parse_args(argv)
    args = fill_defaults(args, "vs-hf-reformer", QUICK if args.quick else FULL)
    if args.prompt_len + args.new_tokens > args.axial_shape[0] * args.axial_shape[1]:
        parser.error("prompt + new tokens must fit the axial positions")
    return args


def build_reference(args):
    from transformers import ReformerConfig, ReformerModelWithLMHead

    config = ReformerConfig(
        vocab_size=256 + BYTE_SHIFT, attn_layers=list(args.attn_layers), hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads, attention_head_size=args.head_size,
        feed_forward_size=args.feed_forward_size, lsh_attn_chunk_length=args.lsh_chunk,
        local_attn_chunk_length=args.local_chunk, lsh_num_chunks_before=1, local_num_chunks_before=1,
        num_hashes=args.num_hashes, num_buckets=args.num_buckets, axial_pos_shape=list(args.axial_shape),
        axial_pos_embds_dim=list(args.axial_dims), max_position_embeddings=args.axial_shape[0] * args.axial_shape[1],
        is_decoder=True, hash_seed=args.seed, hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        # wider than the default init (0.02), so that greedy choices are not near-ties of random weights
        initializer_range=0.1,
    )
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ReformerModelWithLMHead(config).eval()


def generate_reference(reference, prompt, new_tokens: int) -> dict:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = reference.generate(
            prompt + BYTE_SHIFT, max_new_tokens=new_tokens, do_sample=False, num_beams=1, eos_token_id=None,
            pad_token_id=0, suppress_tokens=list(range(BYTE_SHIFT)),
        )
    total_s = time.perf_counter() - start
    return {"tokens": out[:, prompt.shape[1] :] - BYTE_SHIFT, "total_s": total_s}


def plot(result: dict, path: Path) -> None:
    (row,) = result["results"]
    s = result["setting"]
    title = (f"Reformer greedy, prompt {s['prompt_len']} + {s['new_tokens']} bytes, {len(s['attn_layers'])} layers "
             f"({s['attn_layers'].count('lsh')} LSH), hidden {s['hidden_size']}, {result['environment']['threads']} threads")
    with figure(path, title, size=(6, 4)) as ax:
        bars = [("transformers generate()", row["reference_generate_tokens_per_s"]),
                ("xlserve", row["xlserve_tokens_per_s"])]
        for i, (label, value) in enumerate(bars):
            ax.bar([i], [value], 0.6, label=label)
        ax.annotate(f"{row['speedup_vs_generate']:.1f}x", (1, row["xlserve_tokens_per_s"]), ha="center", va="bottom")
        ax.set_xticks([0, 1], [label for label, _ in bars])
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens / s (greedy, prompt included)")


@torch.inference_mode()
def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = build_reference(args)
    model = convert_reference(reference)
    prompt = torch.randint(0, 256, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    generate_with_state(model, prompt[:, :8], 2)  # warm up both (allocations, generate()'s first-call set-up)
    generate_reference(reference, prompt[:, :8], 2)
    ours = generate_with_state(model, prompt, args.new_tokens)
    ref = generate_reference(reference, prompt, args.new_tokens)
    generated = args.new_tokens
    ours_total = ours["prefill_s"] + ours["decode_s"]
    row = {
        "batch_size": 1,
        "identical_tokens": torch.equal(ours["tokens"], ref["tokens"]),
        "reference_generate_tokens_per_s": generated / ref["total_s"],
        "xlserve_tokens_per_s": generated / ours_total,
        "speedup_vs_generate": ref["total_s"] / ours_total,
        "xlserve_decode_tokens_per_s": generated / ours["decode_s"],
        "reference_generate_s": ref["total_s"],
        "xlserve_prefill_s": ours["prefill_s"],
        "xlserve_decode_s": ours["decode_s"],
        "distinct_tokens_generated": len(set(ours["tokens"].flatten().tolist())),
    }
    print(f"xlserve {row['xlserve_tokens_per_s']:.1f} tok/s, generate() {row['reference_generate_tokens_per_s']:.2f} "
          f"tok/s ({row['speedup_vs_generate']:.1f}x), identical={row['identical_tokens']}", flush=True)
    setting = ("attn_layers", "hidden_size", "num_heads", "head_size", "feed_forward_size", "lsh_chunk", "local_chunk",
               "num_hashes", "num_buckets", "axial_shape", "axial_dims", "prompt_len", "new_tokens", "seed")
    return comparison_result("vs-hf-reformer", args, setting,
                             {"vocab_size": 256 + BYTE_SHIFT, "dtype": "float32", "decoding": "greedy"},
                             model, [row], identical="identical_tokens")


def print_table(result: dict) -> None:
    print()
    print(f"{'batch':>5} | {'generate() tok/s':>16} | {'xlserve tok/s':>13} | {'xlserve decode tok/s':>20} | "
          f"{'vs generate':>11} | identical")
    print("-" * 92)
    for r in result["results"]:
        print(f"{r['batch_size']:>5} | {r['reference_generate_tokens_per_s']:>16.2f} | {r['xlserve_tokens_per_s']:>13.1f} | "
              f"{r['xlserve_decode_tokens_per_s']:>20.1f} | {r['speedup_vs_generate']:>10.1f}x | {r['identical_tokens']}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    save_comparison(run(args), args.out, plot, print_table, reference="the reference's generate()")
