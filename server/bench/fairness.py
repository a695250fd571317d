"""`xlserve bench fairness`: a short request's time to first token beside a long prompt's prefill.

One model in an in-process engine (the scheduler is what is measured: no HTTP, no session
cache). Each step's prefill budget (--prefill-chunk tokens, the server's
XLSERVE_PREFILL_CHUNK_TOKENS) is shared round robin among the prompts being prefilled
(docs/design.md section 7), so a short prompt's first token should not wait for a long one's
whole prefill. Measured, each a greedy request for one token:

- alone: --small-requests requests of a --small-bytes prompt (10 bytes), one after another on
  an idle engine: their TTFT (enqueue -> first token);
- alone, per --long-sizes (100 KB and 300 KB of text): the long prompt's own TTFT (its prefill);
- beside, per long size: the long prompt is queued, and once its prefill has begun the small
  requests are sent one after another while it runs; their TTFT, how many arrived while the long
  prompt was still prefilling, and the long prompt's TTFT beside them.

The goal (issue 35): beside a long prompt, a small request's first token within 2x its TTFT
alone plus one prefill chunk's time (the long prompt's prefill alone over its chunks); the long
prompt's own time grows by no more than the share it gives up. JSON and a plot of the small
requests' TTFT alone and beside each long prompt under bench-results/fairness[-quick].json / .png.
--quick runs small sizes (2 KB and 6 KB, chunks of 64 tokens) to check that the benchmark works;
its numbers mean little. Run it alone: a second torch-heavy process on the same cores makes the
numbers meaningless.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import time

import torch

from xlserve.server.bench.common import add_run_arguments, environment, figure, fill_defaults, save_results
from xlserve.server.settings import WEIGHTS_DIR, checkpoint_dir

DEFAULT_MODEL = WEIGHTS_DIR / "transformer-xl-stdlib"
FULL = {"long_sizes": "100000,300000", "small_requests": 5, "prefill_chunk": 512}
QUICK = {"long_sizes": "2000,6000", "small_requests": 3, "prefill_chunk": 64}
# how long a measured request may take before the run gives up on it (a 300 KB prefill on a
# slow CPU takes minutes)
REQUEST_TIMEOUT_S = 3600


def text_of(length: int, rng: random.Random) -> list[int]:
    """`length` byte tokens of printable text (the model's answer is not what is measured)."""
    return list("".join(rng.choice(string.ascii_letters + string.digits + " \n") for _ in range(length)).encode())


class Timed:
    """One greedy request for one token, and when its first token came (monotonic seconds)."""

    def __init__(self, engine, prompt: list[int]):
        from xlserve.server.engine import local
        from xlserve.server.engine.request import EngineRequest
        from xlserve.server.engine.types import SamplingParams

        self.request = EngineRequest("generate", prompt, engine.fresh_data(), SamplingParams(max_tokens=1, temperature=0))
        self.sent = time.monotonic()
        self.events = local.submit(engine, self.request).events()
        self.first_token_at: float | None = None

    async def finish(self) -> float:
        """Wait for its end; its TTFT in seconds."""
        from xlserve.server.engine.types import TokenEvent

        async def drain():
            async for event in self.events:
                if isinstance(event, TokenEvent) and self.first_token_at is None:
                    self.first_token_at = time.monotonic()

        await asyncio.wait_for(drain(), REQUEST_TIMEOUT_S)
        return self.first_token_at - self.sent


async def small_alone(engine, prompt: list[int], count: int) -> list[float]:
    return [await Timed(engine, prompt).finish() for _ in range(count)]


async def beside_long(engine, long_prompt: list[int], small_prompt: list[int], count: int) -> dict:
    """The long prompt, and `count` small requests one after another once its prefill began."""
    long_request = Timed(engine, long_prompt)
    for _ in range(REQUEST_TIMEOUT_S * 1000):  # until the worker has fed it its first chunk
        if long_request.request.fed > 0:
            break
        await asyncio.sleep(0.001)
    small_ttft, during_prefill = [], 0
    for _ in range(count):
        small = Timed(engine, small_prompt)
        small_ttft.append(await small.finish())
        # read after its first token: the long prompt was still prefilling when it came
        during_prefill += long_request.request.fed < len(long_prompt)
    return {"small_ttft_s": small_ttft, "small_during_prefill": during_prefill, "long_ttft_s": await long_request.finish()}


def median(values: list[float]) -> float:
    return statistics.median(values)


async def measure(engine, args) -> dict:
    rng = random.Random(args.seed)
    small_prompt = text_of(args.small_bytes, rng)
    alone = await small_alone(engine, small_prompt, args.small_requests)
    rows = []
    for size in (int(s) for s in args.long_sizes.split(",")):
        long_prompt = text_of(size, rng)
        long_alone = await Timed(engine, long_prompt).finish()
        together = await beside_long(engine, long_prompt, small_prompt, args.small_requests)
        chunks = -(-size // args.prefill_chunk)
        chunk_s = long_alone / chunks
        goal_s = 2 * median(alone) + chunk_s
        # what the long prompt gives up: the small prompts' tokens, at its own rate per token
        given_up_s = args.small_requests * args.small_bytes / args.prefill_chunk * chunk_s
        rows.append({
            "long_bytes": size, "long_chunks": chunks, "long_ttft_alone_s": long_alone,
            "long_ttft_beside_s": together["long_ttft_s"], "chunk_s": chunk_s,
            "small_ttft_beside_p50_s": median(together["small_ttft_s"]),
            "small_ttft_beside_max_s": max(together["small_ttft_s"]), "small_ttft_beside_s": together["small_ttft_s"],
            "small_during_prefill": together["small_during_prefill"], "goal_s": goal_s,
            "meets_goal": max(together["small_ttft_s"]) <= goal_s,
            "long_slowdown_s": together["long_ttft_s"] - long_alone, "long_share_given_up_s": given_up_s,
        })
    return {"small_ttft_alone_s": alone, "small_ttft_alone_p50_s": median(alone), "rows": rows}


def plot(result: dict, path) -> None:
    rows = result["results"]["rows"]
    labels = ["alone"] + [f"beside {row['long_bytes'] / 1000:g} KB" for row in rows]
    p50 = [result["results"]["small_ttft_alone_p50_s"]] + [row["small_ttft_beside_p50_s"] for row in rows]
    worst = [max(result["results"]["small_ttft_alone_s"])] + [row["small_ttft_beside_max_s"] for row in rows]
    with figure(path, f"{result['setting']['small_bytes']}-byte request: time to first token "
                      f"(prefill chunk {result['setting']['prefill_chunk']})") as ax:
        positions = range(len(labels))
        ax.bar([p - 0.2 for p in positions], p50, width=0.4, label="p50")
        ax.bar([p + 0.2 for p in positions], worst, width=0.4, label="max")
        ax.scatter([p + 1 for p in range(len(rows))], [row["goal_s"] for row in rows], marker="_", s=400,
                   color="black", label="goal: 2x alone + one chunk")
        ax.set_xticks(list(positions), labels)
        ax.set_yscale("log")
        ax.set_ylabel("seconds")


def print_table(result: dict) -> None:
    results = result["results"]
    print(f"small request alone: TTFT p50 {results['small_ttft_alone_p50_s'] * 1000:.1f} ms")
    print(f"{'long prompt':>12s} {'long alone s':>13s} {'long beside s':>14s} {'small p50 ms':>13s} "
          f"{'small max ms':>13s} {'goal ms':>9s} {'during':>7s} {'meets':>6s}")
    for row in results["rows"]:
        print(f"{row['long_bytes']:>10,} B {row['long_ttft_alone_s']:>13.2f} {row['long_ttft_beside_s']:>14.2f} "
              f"{row['small_ttft_beside_p50_s'] * 1000:>13.1f} {row['small_ttft_beside_max_s'] * 1000:>13.1f} "
              f"{row['goal_s'] * 1000:>9.1f} {row['small_during_prefill']:>7d} {str(row['meets_goal']):>6s}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="xlserve bench fairness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint: a name under weights/ or a path")
    parser.add_argument("--long-sizes", default=None, help="comma list of long prompt lengths in bytes "
                                                           "(default 100000,300000; --quick 2000,6000)")
    parser.add_argument("--small-bytes", type=int, default=10, help="the small requests' prompt length")
    parser.add_argument("--small-requests", type=int, default=None, help="small requests per setting (5; --quick 3)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prefill budget per step (512; --quick 64)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that the benchmark runs")
    add_run_arguments(parser, "fairness")
    args = parser.parse_args(argv)
    args = fill_defaults(args, "fairness", QUICK if args.quick else FULL)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from xlserve.models.checkpoint import load_checkpoint
    from xlserve.models.tokenizer import ByteTokenizer
    from xlserve.server.engine import local
    from xlserve.server.engine.scheduler import Engine
    from xlserve.server.metrics import Metrics

    path = checkpoint_dir(args.model)
    if not path.is_dir():
        raise SystemExit(f"no checkpoint at {path}; give --model PATH")
    model = load_checkpoint(path, device=args.device)
    engine = Engine("bench", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery(),
                    prefill_chunk=args.prefill_chunk, threads=args.threads or 0)
    try:
        results = asyncio.run(measure(engine, args))
    finally:
        engine.close()
    result = {
        "benchmark": "fairness", "quick": args.quick,
        "setting": {"model": path.name, "architecture": model.architecture, "long_sizes": args.long_sizes,
                    "small_bytes": args.small_bytes, "small_requests": args.small_requests,
                    "prefill_chunk": args.prefill_chunk, "device": args.device},
        "environment": environment(), "results": results,
        "all_meet_goal": all(row["meets_goal"] for row in results["rows"]),
    }
    save_results(result, args.out, plot, print_table)
