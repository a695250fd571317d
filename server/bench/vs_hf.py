"""`xlserve bench vs-hf`: greedy generation speed of a converted Transformer-XL against the
Hugging Face reference it came from (transformers 4.37.2, `TransfoXLLMHeadModel`).

The setting (defaults): 12 layers, d_model 512, 8 heads of 64, d_inner 2048, the WikiText-103
vocabulary layout (267,735 words, cutoffs 20000/40000/200000, div_val 4, tied), mem_len 1600,
clamp_len 1000, same_length: the WikiText-103 evaluation setting at a smaller width. One
randomly initialised reference model is saved with save_pretrained, converted with
`xlserve convert`, and both generate greedily, at each batch size:
- prefill: a random prompt of --prompt-len tokens (default mem_len, so the memory is full),
  fed in chunks of --chunk tokens, both starting from EMPTY memories (the reference's default
  `init_mems` would add mem_len zero vectors; see docs/design.md section 3);
- decode: --new-tokens steps of argmax + one forward call of the chosen token.
The reference is driven by the same plain loop (its forward with `mems`), which is the work its
`generate()` does per step minus generate's own overhead: each step re-projects every layer's
memory of hidden states into keys and values, where xlserve keeps them projected.
The generated tokens must be identical; the log-probabilities of the chosen tokens are compared.

Results: bench-results/vs-hf.json and vs-hf.png (--quick: vs-hf-quick.*), and a printed table.
Run it alone: a second torch-heavy process on the same cores slows both and skews the ratio.
The full setting spends almost all of its time in the reference at batch 8 (how long it takes:
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from xlserve.server.bench.common import (
    add_run_arguments, comparison_result, convert_reference, figure, fill_defaults,
    generate_greedy, generate_with_state, save_comparison,
)

FULL = dict(
    n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, vocab_size=267735,
    cutoffs=[20000, 40000, 200000], div_val=4, mem_len=1600, clamp_len=1000,
    prompt_len=None, new_tokens=256, batch_sizes=[1, 8], chunk=128,
)
QUICK = dict(
    n_layer=2, d_model=128, n_head=4, d_head=32, d_inner=512, vocab_size=10000,
    cutoffs=[1000, 5000], div_val=4, mem_len=128, clamp_len=100,
    prompt_len=None, new_tokens=32, batch_sizes=[1, 2], chunk=64,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench vs-hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds) instead of the full setting")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--n-head", type=int)
    parser.add_argument("--d-head", type=int)
    parser.add_argument("--d-inner", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--cutoffs", type=int, nargs="*")
    parser.add_argument("--div-val", type=int)
    parser.add_argument("--mem-len", type=int)
    parser.add_argument("--clamp-len", type=int)
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default: mem_len, a full memory)")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--chunk", type=int, help="prompt tokens per forward call")
    add_run_arguments(parser, "vs-hf")
    args = parser.parse_args(argv)
    fill_defaults(args, "vs-hf", QUICK if args.quick else FULL)
    if args.prompt_len is None:
        args.prompt_len = args.mem_len
    return args


def build_reference(args):
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    config = TransfoXLConfig(
        vocab_size=args.vocab_size, cutoffs=list(args.cutoffs), div_val=args.div_val, d_model=args.d_model,
        d_embed=args.d_model, n_head=args.n_head, d_head=args.d_head, d_inner=args.d_inner, n_layer=args.n_layer,
        mem_len=args.mem_len, clamp_len=args.clamp_len, same_length=True, pre_lnorm=False, untie_r=True,
        # wider than the default init (0.02) so that greedy choices are not near-ties of random weights
        init_std=0.1, proj_init_std=0.1,
    )
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransfoXLLMHeadModel(config).eval()


def generate_reference(reference, prompt, new_tokens: int, chunk: int) -> dict:
    batch = prompt.shape[0]
    mems = [torch.zeros(0, batch, reference.config.d_model) for _ in range(reference.config.n_layer)]

    def step(ids):
        nonlocal mems
        out = reference(input_ids=ids, mems=mems)
        mems = out.mems
        return out.prediction_scores[:, -1]  # (B, V)

    return generate_greedy(step, prompt, new_tokens, chunk)


def plot(result: dict, path: Path) -> None:
    rows, s = result["results"], result["setting"]
    title = (f"greedy {s['new_tokens']} tokens, {s['n_layer']} layers, d_model {s['d_model']}, "
             f"mem_len {s['mem_len']}, vocab {s['vocab_size']}, {result['environment']['threads']} threads")
    with figure(path, title) as ax:
        x = range(len(rows))
        width = 0.38
        ref = [r["reference_tokens_per_s"] for r in rows]
        ours = [r["xlserve_tokens_per_s"] for r in rows]
        ax.bar([i - width / 2 for i in x], ref, width, label="transformers 4.37.2 TransfoXL")
        ax.bar([i + width / 2 for i in x], ours, width, label="xlserve")
        for i, r in enumerate(rows):
            ax.annotate(f"{r['speedup']:.1f}x", (i + width / 2, ours[i]), ha="center", va="bottom")
        ax.set_xticks(list(x), [f"batch {r['batch_size']}" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens / s (greedy)")


@torch.inference_mode()
def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = build_reference(args)
    model = convert_reference(reference)

    rows = []
    for batch in args.batch_sizes:
        prompt = torch.randint(0, args.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        ours = generate_with_state(model, prompt, args.new_tokens, args.chunk)
        ref = generate_reference(reference, prompt, args.new_tokens, args.chunk)
        identical = torch.equal(ours["tokens"], ref["tokens"])
        generated = batch * args.new_tokens
        row = {
            "batch_size": batch,
            "identical_tokens": identical,
            "chosen_log_prob_max_abs_diff": (ours["chosen"] - ref["chosen"]).abs().max().item(),
            "reference_tokens_per_s": generated / ref["decode_s"],
            "xlserve_tokens_per_s": generated / ours["decode_s"],
            "speedup": ref["decode_s"] / ours["decode_s"],
            "reference_decode_s": ref["decode_s"],
            "xlserve_decode_s": ours["decode_s"],
            "reference_prefill_s": ref["prefill_s"],
            "xlserve_prefill_s": ours["prefill_s"],
            "distinct_tokens_generated": len(set(ours["tokens"].flatten().tolist())),
        }
        rows.append(row)
        print(f"batch {batch}: xlserve {row['xlserve_tokens_per_s']:.1f} tok/s, reference "
              f"{row['reference_tokens_per_s']:.2f} tok/s, {row['speedup']:.1f}x, identical={identical}", flush=True)

    setting = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "vocab_size", "cutoffs", "div_val", "mem_len",
               "clamp_len", "prompt_len", "new_tokens", "batch_sizes", "chunk", "seed")
    return comparison_result("vs-hf", args, setting, {"same_length": True, "dtype": "float32", "decoding": "greedy"},
                             model, rows, identical="identical_tokens")


def print_table(result: dict) -> None:
    print()
    print(f"{'batch':>5} | {'reference tok/s':>15} | {'xlserve tok/s':>13} | {'speedup':>7} | identical")
    print("-" * 62)
    for r in result["results"]:
        print(f"{r['batch_size']:>5} | {r['reference_tokens_per_s']:>15.2f} | {r['xlserve_tokens_per_s']:>13.1f} | "
              f"{r['speedup']:>6.1f}x | {r['identical_tokens']}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    save_comparison(run(args), args.out, plot, print_table, reference="the reference")
