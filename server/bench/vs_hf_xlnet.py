"""`xlserve bench vs-hf-xlnet`: greedy generation speed of a converted XLNet against the Hugging
Face reference it came from (transformers 4.37.2, `XLNetLMHeadModel.generate`).

The setting (defaults): xlnet-base-cased's shape (12 layers, d_model 768, 12 heads, d_inner 3072,
vocabulary 32,000, mem_len None = the memory keeps everything), randomly initialised, saved with
save_pretrained and converted with `xlserve convert`. A random prompt of --prompt-len tokens, then
--new-tokens greedy tokens, three ways:
- xlserve: the prompt in one call, then one incremental step per token (the new token's content
  stream joins the memory as keys and values; one query-stream row predicts the next);
- the reference's `generate()` (greedy, `min_new_tokens` so it never stops early), as users call
  it. Its own decoding scheme is not left-to-right: it encodes the prompt bidirectionally and at
  every step recomputes the last two tokens plus a dummy, re-projecting the whole memory of
  hidden states into keys, values and relative keys; its tokens may therefore differ from a
  left-to-right model's, and only its speed is compared;
- the reference driven left to right by a plain loop (the new token + a masked dummy position
  to predict, memory of earlier positions passed back): the same computation as ours, so the
  tokens must be identical; it is the fastest exact way to use the reference.
Tokens/s count generated tokens over the whole call, prompt included, for `generate()` and for
xlserve ("end to end"); the per-step decode rate is reported beside it.

Results: bench-results/vs-hf-xlnet.json and .png (--quick: vs-hf-xlnet-quick.*), and a table.
Run it alone: a second torch-heavy process on the same cores slows both and skews the numbers.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from xlserve.server.bench.common import (
    add_run_arguments, comparison_result, convert_reference, figure, fill_defaults,
    generate_greedy, generate_with_state, save_comparison,
)

FULL = dict(n_layer=12, d_model=768, n_head=12, d_inner=3072, vocab_size=32000, prompt_len=256, new_tokens=256,
            batch_sizes=[1])
QUICK = dict(n_layer=2, d_model=128, n_head=4, d_inner=512, vocab_size=1000, prompt_len=32, new_tokens=16,
             batch_sizes=[1, 2])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench vs-hf-xlnet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds) instead of the full setting")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--n-head", type=int)
    parser.add_argument("--d-inner", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--mem-len", type=int, default=None, help="memory length (default: unbounded, as xlnet-base-cased)")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    add_run_arguments(parser, "vs-hf-xlnet")
    args = parser.parse_args(argv)
    return fill_defaults(args, "vs-hf-xlnet", QUICK if args.quick else FULL)


def build_reference(args):
    from transformers import XLNetConfig, XLNetLMHeadModel

    config = XLNetConfig(
        vocab_size=args.vocab_size, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
        d_inner=args.d_inner, mem_len=args.mem_len, dropout=0.0, attn_type="bi",
        # wider than the default init (0.02), so that greedy choices are not near-ties of random weights
        initializer_range=0.1,
    )
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return XLNetLMHeadModel(config).eval()


def _step_inputs(ids):
    """ids + a dummy position that nothing sees; the dummy's query stream predicts the next token."""
    B, T = ids.shape
    ids = torch.cat([ids, ids.new_zeros(B, 1)], dim=1)
    perm_mask = torch.triu(torch.ones(T + 1, T + 1), diagonal=0).expand(B, T + 1, T + 1)  # left to right
    target_mapping = torch.zeros(B, 1, T + 1)
    target_mapping[:, 0, -1] = 1.0
    return ids, perm_mask, target_mapping


def generate_reference_left_to_right(reference, prompt, new_tokens: int) -> dict:
    mems = None

    def step(ids):
        nonlocal mems
        ids, perm_mask, target_mapping = _step_inputs(ids)
        out = reference(ids, mems=mems, perm_mask=perm_mask, target_mapping=target_mapping, use_mems=True)
        mems = [m[:-1] for m in out.mems]  # the dummy never joins the memory
        return out.logits[:, -1]

    return generate_greedy(step, prompt, new_tokens)


def generate_reference(reference, prompt, new_tokens: int) -> dict:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = reference.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1,
            attention_mask=torch.ones_like(prompt), pad_token_id=reference.config.pad_token_id,
        )
    total_s = time.perf_counter() - start
    return {"tokens": out[:, prompt.shape[1] :], "total_s": total_s}


def plot(result: dict, path: Path) -> None:
    rows, s = result["results"], result["setting"]
    title = (f"XLNet greedy, prompt {s['prompt_len']} + {s['new_tokens']} tokens, {s['n_layer']} layers, "
             f"d_model {s['d_model']}, vocab {s['vocab_size']}, {result['environment']['threads']} threads")
    with figure(path, title, size=(7, 4)) as ax:
        series = [
            ("reference_generate_tokens_per_s", "transformers generate()"),
            ("reference_left_to_right_tokens_per_s", "transformers, left-to-right loop"),
            ("xlserve_tokens_per_s", "xlserve"),
        ]
        width = 0.27
        for k, (key, label) in enumerate(series):
            xs = [i + (k - 1) * width for i in range(len(rows))]
            ax.bar(xs, [r[key] for r in rows], width, label=label)
        for i, r in enumerate(rows):
            ax.annotate(f"{r['speedup_vs_generate']:.1f}x", (i + width, r["xlserve_tokens_per_s"]),
                        ha="center", va="bottom")
        ax.set_xticks(list(range(len(rows))), [f"batch {r['batch_size']}" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens / s (greedy, prompt included)")


@torch.inference_mode()
def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = build_reference(args)
    model = convert_reference(reference)

    rows = []
    for batch in args.batch_sizes:
        prompt = torch.randint(0, args.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        generate_with_state(model, prompt[:, :8], 2)  # warm up (allocations, relative-key tables)
        ours = generate_with_state(model, prompt, args.new_tokens)
        exact = generate_reference_left_to_right(reference, prompt, args.new_tokens)
        ref = generate_reference(reference, prompt, args.new_tokens)
        generated = batch * args.new_tokens
        ours_total = ours["prefill_s"] + ours["decode_s"]
        exact_total = exact["prefill_s"] + exact["decode_s"]
        row = {
            "batch_size": batch,
            "identical_to_left_to_right_reference": torch.equal(ours["tokens"], exact["tokens"]),
            "same_tokens_as_generate": torch.equal(ours["tokens"], ref["tokens"]),
            "reference_generate_tokens_per_s": generated / ref["total_s"],
            "reference_left_to_right_tokens_per_s": generated / exact_total,
            "xlserve_tokens_per_s": generated / ours_total,
            "speedup_vs_generate": ref["total_s"] / ours_total,
            "speedup_vs_left_to_right": exact_total / ours_total,
            "xlserve_decode_tokens_per_s": generated / ours["decode_s"],
            "reference_left_to_right_decode_tokens_per_s": generated / exact["decode_s"],
            "reference_generate_s": ref["total_s"],
            "reference_left_to_right_s": exact_total,
            "xlserve_prefill_s": ours["prefill_s"],
            "xlserve_decode_s": ours["decode_s"],
            "distinct_tokens_generated": len(set(ours["tokens"].flatten().tolist())),
        }
        rows.append(row)
        print(f"batch {batch}: xlserve {row['xlserve_tokens_per_s']:.1f} tok/s, generate() "
              f"{row['reference_generate_tokens_per_s']:.2f} tok/s ({row['speedup_vs_generate']:.1f}x), "
              f"left-to-right reference {row['reference_left_to_right_tokens_per_s']:.2f} tok/s, "
              f"identical={row['identical_to_left_to_right_reference']}", flush=True)

    setting = ("n_layer", "d_model", "n_head", "d_inner", "vocab_size", "mem_len", "prompt_len", "new_tokens",
               "batch_sizes", "seed")
    return comparison_result("vs-hf-xlnet", args, setting, {"attn_type": "bi", "dtype": "float32", "decoding": "greedy"},
                             model, rows, identical="identical_to_left_to_right_reference")


def print_table(result: dict) -> None:
    print()
    print(f"{'batch':>5} | {'generate() tok/s':>16} | {'left-to-right ref':>17} | {'xlserve tok/s':>13} | "
          f"{'vs generate':>11} | identical")
    print("-" * 90)
    for r in result["results"]:
        print(f"{r['batch_size']:>5} | {r['reference_generate_tokens_per_s']:>16.2f} | "
              f"{r['reference_left_to_right_tokens_per_s']:>17.2f} | {r['xlserve_tokens_per_s']:>13.1f} | "
              f"{r['speedup_vs_generate']:>10.1f}x | {r['identical_to_left_to_right_reference']}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    save_comparison(run(args), args.out, plot, print_table, reference="the left-to-right reference")
