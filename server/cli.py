"""`xlserve serve | train | eval | bench | convert`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _resolve_model_dir(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    shipped = Path(__file__).resolve().parent.parent / "weights" / name_or_path
    if shipped.is_dir():
        return shipped
    raise SystemExit(f"no checkpoint directory '{name_or_path}' (looked in . and {shipped.parent})")


def cmd_train(args) -> None:
    from dataclasses import replace

    from models.training.train import STANDARD_RECIPE, train

    recipe = STANDARD_RECIPE
    if args.train_bytes:
        recipe = replace(recipe, train_bytes=args.train_bytes)
    train(args.arch, args.preset, args.out, recipe, log=lambda s: print(s, flush=True))


def cmd_eval(args) -> None:
    from models.checkpoint import load_checkpoint
    from models.training.data import stdlib_corpus
    from models.training.evaluate import bits_per_byte
    from models.training.train import held_out_documents

    model = load_checkpoint(_resolve_model_dir(args.model))
    if args.mem_len is not None:
        model = model.with_mem_len(args.mem_len)
    corpus = stdlib_corpus()
    documents = held_out_documents(corpus, args.max_bytes)
    bpb = bits_per_byte(model, documents, chunk_len=args.chunk_len)
    result = {
        "model": args.model,
        "held_out_files": len(documents),
        "held_out_bytes": sum(len(d) for d in documents),
        "mem_len": getattr(model.config, "mem_len", None),
        "chunk_len": args.chunk_len,
        "bits_per_byte": round(bpb, 4),
    }
    print(json.dumps(result))


def cmd_bench(args) -> None:
    import importlib

    from server.bench import BENCHMARKS

    if args.name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark '{args.name}' (have: {', '.join(sorted(BENCHMARKS))})")
    importlib.import_module(f"server.bench.{BENCHMARKS[args.name]}").main(args.args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="xlserve")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a checkpoint on the stdlib corpus (resumable)")
    train.add_argument("--arch", required=True)
    train.add_argument("--preset", default="small")
    train.add_argument("--out", required=True)
    train.add_argument("--train-bytes", type=int, default=None, help="override the standard byte budget")
    train.set_defaults(func=cmd_train)

    evaluate = commands.add_parser("eval", help="held-out bits per byte, memory carried per document")
    evaluate.add_argument("--model", required=True, help="name under weights/ or a checkpoint directory")
    evaluate.add_argument("--mem-len", type=int, default=None, help="evaluate with another memory length")
    evaluate.add_argument("--chunk-len", type=int, default=512, help="bytes fed per forward call")
    evaluate.add_argument("--max-bytes", type=int, default=None, help="score only the first N held-out bytes")
    evaluate.set_defaults(func=cmd_eval)

    bench = commands.add_parser("bench", help="run a benchmark (JSON + plot under bench-results/)")
    bench.add_argument("name")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
