"""`xlserve bench structured`: what structured output costs (issue 38).

1. Inter-token latency at batch 1 and 16, with and without a JSON-schema constraint, on one
   engine in this process (the engine's own loop, no HTTP): `batch` requests decode together,
   every row samples at temperature 1 with its own seed; constrained rows each carry their own
   llguidance matcher and mask. The schema is an object holding a list of at least 100000
   records, so no row can finish before max_tokens and the batch stays full. ITL is the time
   between one row's consecutive tokens as its consumer receives them (p50 and p99 over every
   row). Goal: constrained p50 within 10% of unconstrained.
2. Compile time of a 50-property schema: a cold compile (a schema never seen, distinct each
   time) and a cached one (the same text again), median over several.
3. The mask's own cost per token: one row's whole mask (`allowed()`) and the step (`consume()`),
   timed alone; most steps of a row that samples without truncation need no mask
   (server/engine/constraints.py, "Drawing").

Run alone (`--quick`: batch 1 and 4, a few tokens, to check that it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from xlserve.server.bench.common import add_run_arguments, environment, figure, fill_defaults, save_results

DEFAULT_MODEL = "transformer-xl-stdlib"
FULL = {"batches": "1,16", "max_tokens": 128, "rounds": 3, "compiles": 20}
QUICK = {"batches": "1,4", "max_tokens": 16, "rounds": 1, "compiles": 3}
GOAL = 0.10  # constrained ITL p50 within 10% of unconstrained
RECORD = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "name": {"type": "string", "maxLength": 16},
                         "ok": {"type": "boolean"}},
          "required": ["id", "name", "ok"], "additionalProperties": False}
# no row can end before max_tokens: the list must hold 100000 records
LONG_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 100000}},
               "required": ["records"], "additionalProperties": False}
PROMPT = "records = "


def schema_with_50_properties(tag: int) -> dict:
    """A 50-property object of mixed types; `tag` makes each one's text distinct (a cold compile)."""
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"type": "number"}, {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "string"}}]
    properties = {f"field_{tag}_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def decode_batch(engine, tokenizer, batch: int, max_tokens: int, constrained: bool, seed: int) -> dict:
    """`batch` requests at once; the gaps between each row's consecutive tokens, and the texts."""
    from xlserve.server.engine import local
    from xlserve.server.engine.request import EngineRequest
    from xlserve.server.engine.types import SamplingParams, TokenEvent

    async def one(index: int) -> tuple[list[float], int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + index)
        if constrained:
            params.constraint_kind, params.constraint = "json_schema", json.dumps(LONG_SCHEMA)
        request = EngineRequest("generate", tokenizer.encode(PROMPT), engine.fresh_data(), params)
        arrivals = []
        async for event in local.generate(engine, request):
            if isinstance(event, TokenEvent):
                arrivals.append(time.perf_counter())
        return [b - a for a, b in zip(arrivals, arrivals[1:])], len(arrivals)

    start = time.perf_counter()
    rows = await asyncio.gather(*(one(i) for i in range(batch)))
    wall = time.perf_counter() - start
    gaps = [gap for row_gaps, _ in rows for gap in row_gaps]
    tokens = sum(count for _, count in rows)
    return {"gaps": gaps, "tokens": tokens, "wall_s": wall}


def measure_itl(engine, tokenizer, args) -> list[dict]:
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        row = {"batch": batch}
        for constrained in (False, True):
            gaps, tokens, wall = [], 0, 0.0
            for round_index in range(args.rounds):
                measured = asyncio.run(decode_batch(engine, tokenizer, batch, args.max_tokens, constrained,
                                                    args.seed + 1000 * round_index))
                gaps += measured["gaps"]
                tokens += measured["tokens"]
                wall += measured["wall_s"]
            name = "constrained" if constrained else "plain"
            row[f"{name}_itl_p50_ms"] = round(statistics.median(gaps) * 1000, 3)
            row[f"{name}_itl_p99_ms"] = round(percentile(gaps, 0.99) * 1000, 3)
            row[f"{name}_tokens_per_s"] = round(tokens / wall, 1)
            row[f"{name}_tokens"] = tokens
        row["overhead"] = round(row["constrained_itl_p50_ms"] / row["plain_itl_p50_ms"] - 1, 4)
        row["meets_goal"] = row["overhead"] <= GOAL
        rows.append(row)
    return rows


def measure_compile(compiler, compiles: int) -> dict:
    cold, warm = [], []
    for tag in range(compiles):
        text = json.dumps(schema_with_50_properties(tag))
        start = time.perf_counter()
        compiler.matcher("json_schema", text)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.matcher("json_schema", text)
        warm.append(time.perf_counter() - start)
    return {"schema_properties": 50, "compiles": compiles,
            "cold_ms_p50": round(statistics.median(cold) * 1000, 3), "cold_ms_max": round(max(cold) * 1000, 3),
            "cached_ms_p50": round(statistics.median(warm) * 1000, 4)}


def measure_mask(compiler, vocab_size: int, tokens: int) -> dict:
    """One row's mask and advance per token, alone: a record list written byte by byte."""
    from xlserve.server.engine.constraints import RowConstraint

    text = json.dumps({"records": [{"id": i, "name": f"n{i}", "ok": i % 2 == 0} for i in range(tokens)]})
    data = text.encode()[:tokens]
    row = RowConstraint(compiler.matcher("json_schema", json.dumps(LONG_SCHEMA)), vocab_size)
    start = time.perf_counter()
    for byte in data:
        allowed, _ = row.allowed()
        assert allowed[byte], "the bench's own text must fit its schema"
        row.consume(byte)
    return {"tokens": len(data), "us_per_token": round((time.perf_counter() - start) / len(data) * 1e6, 2)}


def plot(result: dict, path: Path) -> None:
    rows = result["itl"]
    with figure(path, f"ITL with and without a JSON-schema constraint ({result['setting']['model']})") as ax:
        positions = range(len(rows))
        ax.bar([p - 0.2 for p in positions], [r["plain_itl_p50_ms"] for r in rows], width=0.4, label="unconstrained")
        ax.bar([p + 0.2 for p in positions], [r["constrained_itl_p50_ms"] for r in rows], width=0.4,
               label="json_schema")
        ax.set_xticks(list(positions), [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("inter-token latency p50 (ms)")


def print_table(result: dict) -> None:
    print(f"{'batch':>5} {'plain p50 ms':>12} {'json p50 ms':>12} {'plain p99':>10} {'json p99':>10} "
          f"{'overhead':>9} {'goal':>5}")
    for row in result["itl"]:
        print(f"{row['batch']:>5} {row['plain_itl_p50_ms']:>12.3f} {row['constrained_itl_p50_ms']:>12.3f} "
              f"{row['plain_itl_p99_ms']:>10.3f} {row['constrained_itl_p99_ms']:>10.3f} "
              f"{row['overhead'] * 100:>8.1f}% {str(row['meets_goal']):>5}")
    compiled = result["compile"]
    print(f"\n50-property schema: cold compile p50 {compiled['cold_ms_p50']} ms (max {compiled['cold_ms_max']} ms), "
          f"cached {compiled['cached_ms_p50']} ms; whole mask + step {result['mask']['us_per_token']} us per token")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="xlserve bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint: a name under weights/ or a path "
                                                               "(a byte-level model)")
    parser.add_argument("--batches", default=None, help="comma list of batch sizes (1,16; --quick 1,4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per row (128; --quick 16)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per setting (3; --quick 1)")
    parser.add_argument("--compiles", type=int, default=None, help="distinct 50-property schemas compiled (20)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that the benchmark runs")
    add_run_arguments(parser, "structured")
    args = fill_defaults(parser.parse_args(argv), "structured", QUICK if "--quick" in argv else FULL)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from xlserve.models.checkpoint import load_checkpoint, read_config
    from xlserve.models.tokenizer import tokenizer_for_checkpoint
    from xlserve.server.engine import local
    from xlserve.server.engine.constraints import ConstraintCompiler
    from xlserve.server.engine.scheduler import Engine
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import checkpoint_dir

    path = checkpoint_dir(args.model)
    if not path.is_dir():
        raise SystemExit(f"no checkpoint at {path}; give --model PATH")
    model = load_checkpoint(path, device=args.device)
    tokenizer = tokenizer_for_checkpoint(read_config(path), path)
    engine = Engine("bench", model, tokenizer, Metrics(), sink=local.SubmissionDelivery(), threads=args.threads or 0)
    try:
        itl = measure_itl(engine, tokenizer, args)
    finally:
        engine.close()
    compiler = ConstraintCompiler(tokenizer, "bench", vocab_size=model.vocab_size)
    result = {
        "benchmark": "structured", "quick": args.quick,
        "setting": {"model": path.name, "architecture": model.architecture, "batches": args.batches,
                    "max_tokens": args.max_tokens, "rounds": args.rounds, "device": args.device, "goal": GOAL,
                    "schema": LONG_SCHEMA},
        "environment": environment(), "itl": itl,
        "compile": measure_compile(compiler, args.compiles),
        "mask": measure_mask(compiler, model.vocab_size, 2000 if not args.quick else 200),
        "all_meet_goal": all(row["meets_goal"] for row in itl),
    }
    save_results(result, args.out, plot, print_table)
