"""`xlserve bench vs-hf-mamba`: greedy decoding and prefill of a converted Mamba against the
Hugging Face reference it came from (transformers' MambaForCausalLM, its torch path, with its cache).

The setting (defaults): state-spaces/mamba-130m-hf's shape (24 layers, d_model 768, streams of
1,536 with 16 states, vocabulary 50,280), random weights at a trained model's spread (so greedy
decoding neither repeats one token nor meets near-ties), saved with save_pretrained and
converted with `xlserve convert`:
- decode: a random prompt of --prompt-len tokens per row, then --new-tokens greedy tokens, at
  each of --batch-sizes: the reference's generate() with its cache, as users call it, and
  xlserve's prompt in one call plus one incremental call per token. The tokens must be
  identical. Decode rates: xlserve's steps, and generate()'s time after its first token (a
  second generate() of one token measures the prompt's forward and first step, subtracted);
- prefill: one batch-1 forward over --prefill-len tokens that leaves a state (the reference:
  use_cache=True), timed on each side;
- the ceiling: this machine's measured read bandwidth over the bytes a step must read (every
  weight once, the tied embedding whole since the head scores every token with it, and each
  row's state): the fastest any float32 decode of these weights can go on this machine, and what
  that is in multiples of the reference.

The reference runs in a process of its own (server/bench/mamba_reference.py): the test extra's
transformers (4.37.2, kept for TransfoXL) has no Mamba, so --reference-path names a directory to
put first on that process's PYTHONPATH (default .venv/hf-reference, where `make test` and `make
bench` install transformers 4.57.1; without one, this environment's transformers).

Results: bench-results/vs-hf-mamba.json and .png (--quick: vs-hf-mamba-quick.*), and a table.
Run it alone: a second torch-heavy process on the same cores slows both and skews the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from xlserve.models.quantize import weight_bytes_per_step
from xlserve.server.bench.common import (add_run_arguments, decode_ceiling, environment, figure, fill_defaults,
                                         generate_with_state, read_bandwidth, save_results, state_bytes_per_row)

FULL = dict(n_layer=24, d_model=768, vocab_size=50280, prefill_len=2048, prompt_len=64, new_tokens=64,
            batch_sizes=[1, 8])
QUICK = dict(n_layer=2, d_model=64, vocab_size=256, prefill_len=128, prompt_len=16, new_tokens=8, batch_sizes=[1, 2])
REFERENCE_SCRIPT = Path(__file__).with_name("mamba_reference.py")
DEFAULT_REFERENCE_PATHS = (Path.cwd() / ".venv" / "hf-reference", Path(__file__).resolve().parents[2] / ".venv" / "hf-reference")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench vs-hf-mamba", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds) instead of the full setting")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--prefill-len", type=int, help="tokens of the timed batch-1 prefill")
    parser.add_argument("--prompt-len", type=int, help="tokens of each row's prompt before decoding")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--reference-path", default=None,
                        help="a directory with a transformers that has Mamba (default .venv/hf-reference when it exists)")
    add_run_arguments(parser, "vs-hf-mamba")
    args = parser.parse_args(argv)
    return fill_defaults(args, "vs-hf-mamba", QUICK if args.quick else FULL)


def reference_path(args) -> Path | None:
    if args.reference_path:
        path = Path(args.reference_path)
        if not path.is_dir():
            raise SystemExit(f"xlserve bench vs-hf-mamba: --reference-path {path} is not a directory")
        return path
    return next((p for p in DEFAULT_REFERENCE_PATHS if (p / "transformers").is_dir()), None)


def run_reference(args, directory: Path, threads: int) -> dict:
    """The reference side, in its own process; its results (reference.json)."""
    spec = {
        "config": dict(vocab_size=args.vocab_size, hidden_size=args.d_model, num_hidden_layers=args.n_layer,
                       tie_word_embeddings=True),
        "seed": args.seed, "dir": str(directory), "threads": threads, "prefill_len": args.prefill_len,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch_sizes": args.batch_sizes,
    }
    path = reference_path(args)
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(REFERENCE_SCRIPT), json.dumps(spec)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"xlserve bench vs-hf-mamba: the reference failed ({last[0]}); it needs a transformers with "
                         "MambaForCausalLM (4.39+): make bench installs one, or .venv/bin/pip install --no-deps "
                         "--target .venv/hf-reference transformers==4.57.1 tokenizers==0.22.1, or --reference-path")
    return json.loads((directory / "reference.json").read_text())


@torch.inference_mode()
def run(args) -> dict:
    from xlserve.models.checkpoint import load_checkpoint
    from xlserve.models.convert import convert
    from xlserve.server.bench.mamba_reference import prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        reference = run_reference(args, Path(tmp), threads)
        convert(Path(tmp) / "hf", Path(tmp) / "xl")
        model = load_checkpoint(Path(tmp) / "xl")
    long, batches = prompts(args.seed, args.vocab_size, args.prefill_len, args.prompt_len, args.batch_sizes)
    bandwidth = read_bandwidth(0.25 if args.quick else 1.0)
    weight_bytes, state_bytes = weight_bytes_per_step(model), state_bytes_per_row(model, 1, args.vocab_size)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; a step reads {weight_bytes / 1e6:.0f} MB of weights and "
          f"{state_bytes / 1e3:.0f} kB of state per row", flush=True)

    model(long[:, :8], model.init_state(1))  # warm up
    start = time.perf_counter()
    model(long, model.init_state(1))
    prefill_s = time.perf_counter() - start
    prefill = {"prefill_len": args.prefill_len, "xlserve_s": prefill_s, "reference_s": reference["prefill_s"],
               "speedup": reference["prefill_s"] / prefill_s}
    print(f"prefill of {args.prefill_len} tokens: xlserve {prefill_s:.3f}s, reference {reference['prefill_s']:.3f}s "
          f"({prefill['speedup']:.2f}x)", flush=True)

    rows = []
    for batch, prompt in batches.items():
        generate_with_state(model, prompt[:, :4], 2)  # warm up
        ours = generate_with_state(model, prompt, args.new_tokens)
        ref = reference["generate"][str(batch)]
        ref_tokens = torch.tensor(ref["tokens"])
        ref_decode_s = max(ref["total_s"] - ref["prompt_and_first_s"], 1e-9)  # the steps after the first token
        ours_per_step = ours["decode_s"] / args.new_tokens
        ref_per_step = ref_decode_s / max(args.new_tokens - 1, 1)
        row = {
            "batch_size": batch,
            "identical_tokens": torch.equal(ours["tokens"], ref_tokens),
            "xlserve_decode_tokens_per_s": batch / ours_per_step,
            "reference_decode_tokens_per_s": batch / ref_per_step,
            "decode_speedup": ref_per_step / ours_per_step,
            "xlserve_tokens_per_s": batch * args.new_tokens / (ours["prefill_s"] + ours["decode_s"]),
            "reference_generate_tokens_per_s": batch * args.new_tokens / ref["total_s"],
            "speedup_vs_generate": ref["total_s"] / (ours["prefill_s"] + ours["decode_s"]),
            "xlserve_prefill_s": ours["prefill_s"],
            "xlserve_decode_s": ours["decode_s"],
            "reference_generate_s": ref["total_s"],
            "reference_prompt_and_first_token_s": ref["prompt_and_first_s"],
            "distinct_tokens_generated": len(set(ours["tokens"].flatten().tolist())),
        }
        # the fastest any float32 decode of these weights can be here, ours or the reference's: a
        # step that only reads its weights and states at the measured bandwidth
        ceiling = decode_ceiling(weight_bytes, state_bytes, batch, bandwidth)["ceiling_tokens_per_s"]
        row.update(ceiling_tokens_per_s=ceiling, xlserve_of_ceiling=row["xlserve_decode_tokens_per_s"] / ceiling,
                   reference_of_ceiling=row["reference_decode_tokens_per_s"] / ceiling,
                   ceiling_over_reference=ceiling / row["reference_decode_tokens_per_s"])
        rows.append(row)
        print(f"batch {batch}: decode xlserve {row['xlserve_decode_tokens_per_s']:.1f} tok/s, generate() "
              f"{row['reference_decode_tokens_per_s']:.1f} tok/s ({row['decode_speedup']:.1f}x), "
              f"identical={row['identical_tokens']}; ceiling {ceiling:.1f} tok/s "
              f"({row['ceiling_over_reference']:.1f}x the reference)", flush=True)

    setting = {name: getattr(args, name) for name in
               ("n_layer", "d_model", "vocab_size", "prefill_len", "prompt_len", "new_tokens", "batch_sizes", "seed")}
    return {
        "benchmark": "vs-hf-mamba",
        "quick": args.quick,
        "setting": {**setting, "d_inner": 2 * args.d_model, "d_state": 16, "dtype": "float32", "decoding": "greedy",
                    "reference_path": str(reference_path(args))},
        "parameters": sum(p.numel() for p in model.parameters()),
        "read_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_step": weight_bytes, "state_bytes_per_row": state_bytes,
        "environment": {**environment(), "transformers": reference["transformers"]},
        "prefill": prefill,
        "results": rows,
        "all_identical": all(row["identical_tokens"] for row in rows),
    }


def plot(result: dict, path: Path) -> None:
    rows, s = result["results"], result["setting"]
    title = (f"Mamba {s['n_layer']} x {s['d_model']}, greedy decode after {s['prompt_len']} tokens, "
             f"transformers {result['environment']['transformers']}, {result['environment']['threads']} threads")
    with figure(path, title, size=(7, 4)) as ax:
        width = 0.38
        xs = list(range(len(rows)))
        ax.bar([x - width / 2 for x in xs], [r["reference_decode_tokens_per_s"] for r in rows], width,
               label="transformers generate()")
        ax.bar([x + width / 2 for x in xs], [r["xlserve_decode_tokens_per_s"] for r in rows], width, label="xlserve")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['decode_speedup']:.1f}x", (x + width / 2, r["xlserve_decode_tokens_per_s"]),
                        ha="center", va="bottom")
        p = result["prefill"]
        ax.set_xticks(xs, [f"batch {r['batch_size']}" for r in rows])
        ax.set_ylabel("decoded tokens / s")
        ax.set_xlabel(f"prefill of {p['prefill_len']} tokens: xlserve {p['xlserve_s']:.2f}s, "
                      f"reference {p['reference_s']:.2f}s ({p['speedup']:.1f}x)")


def print_table(result: dict) -> None:
    p = result["prefill"]
    print()
    print(f"prefill {p['prefill_len']} tokens (batch 1): xlserve {p['xlserve_s']:.3f}s | reference {p['reference_s']:.3f}s | "
          f"{p['speedup']:.2f}x")
    print(f"read bandwidth {result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; a step reads "
          f"{result['weight_bytes_per_step'] / 1e6:.0f} MB of weights + {result['state_bytes_per_row'] / 1e3:.0f} kB per row")
    print(f"{'batch':>5} | {'generate() decode tok/s':>23} | {'xlserve decode tok/s':>20} | {'speedup':>7} | identical | "
          f"ceiling tok/s (x reference)")
    print("-" * 106)
    for r in result["results"]:
        print(f"{r['batch_size']:>5} | {r['reference_decode_tokens_per_s']:>23.1f} | {r['xlserve_decode_tokens_per_s']:>20.1f} | "
              f"{r['decode_speedup']:>6.1f}x | {r['identical_tokens']!s:>9} | {r['ceiling_tokens_per_s']:.1f} "
              f"({r['ceiling_over_reference']:.1f}x)")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    result = run(args)
    save_results(result, args.out, plot, print_table)
    if not result["all_identical"]:
        raise SystemExit("generated tokens differ between xlserve and transformers' generate()")
