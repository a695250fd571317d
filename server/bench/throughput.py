"""`xlserve bench throughput`: what continuous batching buys, and what HTTP costs.

For 1, 4, 16 and 64 concurrent streams (each stream sends its requests one after another),
greedy generation of --max-tokens tokens after a short code prompt, measured three ways:

- http: a real server (`xlserve serve`, in a subprocess: its API process and its engine
  process) over real HTTP + SSE, driven by a minimal HTTP/1.1 client on uvloop in this process
  (which never imports torch, so the client costs as little CPU as possible beside the server
  on a small machine);
- engine: the same load on an in-process `Engine` (in another subprocess), no HTTP, consumed
  through its asyncio front (server/engine/local.py) as code embedding the engine would, so
  http / engine is what serving over HTTP costs;
- engine ceiling: the same again, its events taken by a sink in the engine's own worker thread:
  no event loop, no consumer, the most the step loop gives.

The three alternate in --rounds rounds (default 5; a shared machine's speed drifts between
single runs) and each level reports its median round. Each level sends at least --min-requests requests (16),
so that one stream is timed for seconds, not for under one. The engine runs with the server's
default threads (the cores less one; --threads to change it) in all three. Reported per level:
aggregate generated tokens/s (and every round's), p50/p99 time to first token (request sent ->
first token received), p50/p99 inter-token latency (gap between consecutive tokens of one
stream, as received) and, over HTTP, the CPU (in cores) that the API process, the engine
process and the load generator used.
Results go to bench-results/throughput.json and throughput.png, and a table is printed. The goals
it reports (2 CPU cores, the shipped transformer-xl-stdlib): 16 streams >= 6x the tokens/s of
one stream; http >= 90% of engine throughput. docs/benchmarks.md has the method and the latest
numbers.

Run it alone: on a small machine a second torch-heavy process (a training run, a test suite)
slows both and the numbers mean nothing. Speed does not depend on the weights, so before
the shipped checkpoint exists, `--random-small` benchmarks a random one of the same shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from xlserve.server.engine.types import Finished, SamplingParams, TokenEvent  # torch-free
from xlserve.server.settings import BENCH_RESULTS_DIR, WEIGHTS_DIR, checkpoint_dir

DEFAULT_MODEL = WEIGHTS_DIR / "transformer-xl-stdlib"
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Config:\n    def __init__(self, path):\n        self.",
    "    for index, line in enumerate(lines):\n        if ",
    "def read_file(name):\n    with open(name) as f:\n        ",
    "# Copyright (c) Python Software Foundation.\n\"\"\"",
    "        except KeyError:\n            raise ValueError(",
    "if __name__ == \"__main__\":\n    ",
    "    @property\n    def name(self):\n        return self.",
]
USAGE = re.compile(rb'"completion_tokens": (\d+)')
TOKEN_CHUNK = b'"finish_reason": null'


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarise(concurrency: int, wall: float, tokens: int, ttft: list[float], itl: list[float]) -> dict:
    return {
        "concurrency": concurrency, "requests": len(ttft), "generated_tokens": tokens, "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
    }


def stamp(now: float, sent: float, last: float | None, ttft: list, itl: list) -> float:
    """Record a token received at `now`: its time to first token (from `sent`) if it is the
    stream's first, else the gap since the `last` one. Returns `now`, the stream's new last."""
    if last is None:
        ttft.append(now - sent)
    else:
        itl.append(now - last)
    return now


# -- the HTTP side (no torch in this process) -------------------------------------------------


class _StreamedCompletion(asyncio.Protocol):
    """One streamed completion as seen by the load generator: stamps every token chunk as it
    arrives. A bare protocol on the event loop (no stream reader, no HTTP library), so that
    reading costs the server's machine as little CPU as it can."""

    def __init__(self, request: bytes, ttft: list, itl: list):
        self.request, self.ttft, self.itl = request, ttft, itl
        self.received: list[bytes] = []
        self.tail = b""
        self.last: float | None = None
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.sent = time.perf_counter()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        # a token's chunk says "finish_reason": null; the finish, usage and [DONE] chunks do not
        window = self.tail + data
        tokens = window.count(TOKEN_CHUNK) - self.tail.count(TOKEN_CHUNK)
        self.tail = window[-(len(TOKEN_CHUNK) - 1):]
        self.received.append(data)
        for _ in range(tokens):  # chunks that arrived together: gaps of 0 after the first
            self.last = stamp(now, self.sent, self.last, self.ttft, self.itl)

    def connection_lost(self, error) -> None:
        if not self.done.done():
            self.done.set_result(b"".join(self.received))


async def http_request(host: str, port: int, body: dict, ttft: list, itl: list) -> int:
    """One streamed completion over a fresh HTTP/1.1 connection; returns generated tokens."""
    payload = json.dumps(body).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(payload), payload))
    transport, protocol = await asyncio.get_running_loop().create_connection(
        lambda: _StreamedCompletion(request, ttft, itl), host, port)
    try:
        received = await protocol.done
    finally:
        transport.close()
    if b" 200 " not in received.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"request failed: {received[:300]!r}")
    match = USAGE.findall(received)
    return int(match[-1]) if match else 0


def run_loop(coroutine):
    """Run `coroutine` on uvloop where it is installed, the loop the server itself runs on: for
    the load generator (it takes about a quarter less CPU than asyncio's, CPU it shares with the
    server on a small machine) and, to compare like with like, for the in-process engine's
    consumers."""
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)  # Python 3.11+
    except (ImportError, AttributeError):
        return asyncio.run(coroutine)
    with runner:
        return runner.run(coroutine)


async def http_level(host: str, port: int, model: str, concurrency: int, per_stream: int, max_tokens: int,
                     server_pid: int | None = None) -> dict:
    ttft, itl = [], []

    async def stream(index: int) -> int:
        total = 0
        for r in range(per_stream):
            body = {"model": model, "prompt": PROMPTS[(index + r) % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            total += await http_request(host, port, body, ttft, itl)
        return total

    engine_pid = next(iter(child_processes(server_pid)), None) if server_pid else None
    start, client_cpu = time.perf_counter(), time.process_time()
    server_cpu, engine_cpu = process_cpu_seconds(server_pid), process_cpu_seconds(engine_pid)
    tokens = sum(await asyncio.gather(*(stream(i) for i in range(concurrency))))
    wall = time.perf_counter() - start
    result = summarise(concurrency, wall, tokens, ttft, itl)
    # the load generator shares the machine's cores with the server: say how much each took
    result["client_cpu_share"] = round((time.process_time() - client_cpu) / wall, 3)
    if server_cpu is not None:  # the API process (HTTP, SSE)
        result["server_cpu_share"] = round((process_cpu_seconds(server_pid) - server_cpu) / wall, 3)
    if engine_cpu is not None:  # the engine process (server/engine/process.py)
        result["engine_process_cpu_share"] = round((process_cpu_seconds(engine_pid) - engine_cpu) / wall, 3)
    return result


def stat_fields(process: Path) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces): the
    state is [0], the parent [1], user and system CPU ticks [11] and [12]."""
    return (process / "stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) of process `pid` so far, from /proc (None where there is none)."""
    try:
        fields = stat_fields(Path(f"/proc/{pid}"))
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def child_processes(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc; none where there is no /proc)."""
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(stat_fields(entry)[1]) == pid:
                children.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def start_server(model_dir: Path, env: dict, timeout: float = 180) -> tuple[subprocess.Popen, int]:
    """`xlserve serve` on a free loopback port; returns once /ready answers 200."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "xlserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--models", str(model_dir), "--log-level", "warning"], env={**os.environ, **env},
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as response:
                if response.status == 200:
                    return process, port
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server was not ready within {timeout}s")


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Per level, the round with the median tokens/s (a real measured row, latencies included),
    with every round's tokens/s beside it."""
    rows = []
    for measured in zip(*rounds):
        ordered = sorted(measured, key=lambda r: r["tokens_per_s"] or 0)
        rows.append({**ordered[len(ordered) // 2], "tokens_per_s_rounds": [r["tokens_per_s"] for r in measured]})
    return rows


def requests_per_stream(levels: list[int], per_stream: int, min_requests: int) -> dict[int, int]:
    """Requests each stream sends at each level: at least `per_stream`, and enough that the level
    as a whole sends `min_requests` (one stream alone would otherwise be timed for under a second,
    where this machine's drift decides the result)."""
    return {c: max(per_stream, -(-min_requests // c)) for c in levels}


def measure(model_dir: Path, levels: list[int], per_stream: dict[int, int], max_tokens: int, threads: int, device: str,
            rounds: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(engine rows, engine ceiling rows, http rows): the in-process engine driven through its
    asyncio API, the same with a sink in its worker thread, and the server over HTTP, measured
    in alternating rounds (all three, `rounds` times), so that the machine's drift between
    single runs falls on all alike; each level reports its median round."""
    env = {"XLSERVE_TORCH_THREADS": str(threads), "XLSERVE_DEVICE": device,
           "XLSERVE_MAX_BATCH_SIZE": str(max(levels)), "XLSERVE_MAX_TOKENS_LIMIT": str(max(4096, max_tokens))}
    process, port = start_server(model_dir, env)  # idle while the engine runs
    engine_rounds, ceiling_rounds, http_rounds = [], [], []
    try:
        run_loop(http_level("127.0.0.1", port, model_dir.name, 1, 1, 8))  # warm-up
        for round_index in range(rounds):
            engine_rounds.append(run_engine(model_dir, levels, per_stream, max_tokens, threads, device, "asyncio"))
            ceiling_rounds.append(run_engine(model_dir, levels, per_stream, max_tokens, threads, device, "sink"))
            results = []
            for concurrency in levels:
                results.append(run_loop(http_level("127.0.0.1", port, model_dir.name, concurrency,
                                                      per_stream[concurrency], max_tokens, process.pid)))
                print(f"  http   {concurrency:>3} streams: {results[-1]['tokens_per_s']} tokens/s "
                      f"(round {round_index + 1} of {rounds})", flush=True)
            http_rounds.append(results)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    return median_rows(engine_rounds), median_rows(ceiling_rounds), median_rows(http_rounds)


# -- the in-process engine (a subprocess, with torch) ----------------------------------------


def engine_worker(args: dict) -> list[dict]:
    """The same load on an `Engine` in this process, with no HTTP, consumed one of two ways:

    - "asyncio": through its asyncio front (server/engine/local.py), as code that embeds the
      engine would drive it; the consumers run on an event loop that shares this interpreter's
      lock with the engine's worker thread (`engine_level_asyncio`);
    - "sink": its events go to a sink in the worker thread itself, which stamps each token and
      queues a stream's next request when one finishes. No event loop, no consumer: the most the
      step loop gives, the ceiling (`engine_level_sink`).
    """
    from xlserve.server.engine.process import load_models
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import EngineSettings

    # threads as in the server: load_models gives the engine's worker thread its own
    settings = EngineSettings(models=args["model_dir"], device=args["device"], max_batch_size=max(args["levels"]),
                              torch_threads=args["threads"])
    from xlserve.server.engine.local import SubmissionDelivery

    relay = SinkRelay() if args["consumer"] == "sink" else None
    sink = relay if relay is not None else SubmissionDelivery()  # "asyncio": to the consumers' event loop
    loaded = next(iter(load_models(settings, Metrics(), sink=sink).values()))
    load = EngineLoad(loaded.engine, loaded.tokenizer)

    def level(concurrency: int, per_stream: int, max_tokens: int) -> dict:
        if relay is not None:
            return engine_level_sink(load, relay, concurrency, per_stream, max_tokens)
        return run_loop(engine_level_asyncio(load, concurrency, per_stream, max_tokens))

    try:
        level(1, 1, 8)  # warm-up
        results = []
        for concurrency in args["levels"]:
            results.append(level(concurrency, args["per_stream"][str(concurrency)], args["max_tokens"]))
            print(f"  engine ({args['consumer']}) {concurrency:>3} streams: {results[-1]['tokens_per_s']} tokens/s",
                  file=sys.stderr, flush=True)
        return results
    finally:
        loaded.engine.close()


class SinkRelay:
    """The engine's sink, passing each step's events to the level being measured."""

    def __init__(self):
        self.target = None

    def __call__(self, items: list) -> None:
        self.target(items)


class EngineLoad:
    """The requests the in-process engine is given: stream `index`'s request number `request`
    is greedy generation after one of PROMPTS, from a fresh session."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer

    def request(self, index: int, request: int, max_tokens: int, handle: object = None):
        from xlserve.server.engine.request import EngineRequest  # torch: only in the engine's subprocess

        prompt = self.tokenizer.encode(PROMPTS[(index + request) % len(PROMPTS)])
        return EngineRequest("generate", prompt, self.engine.fresh_data(),
                             SamplingParams(max_tokens=max_tokens, temperature=0), handle=handle)


async def engine_level_asyncio(load: EngineLoad, concurrency: int, per_stream: int, max_tokens: int) -> dict:
    from xlserve.server.engine import local

    ttft, itl = [], []

    async def stream(index: int) -> int:
        total = 0
        for request in range(per_stream):
            sent, last = time.perf_counter(), None
            async for event in local.generate(load.engine, load.request(index, request, max_tokens)):
                if isinstance(event, TokenEvent):
                    last = stamp(time.perf_counter(), sent, last, ttft, itl)
                    total += 1
        return total

    begin = time.perf_counter()
    tokens = sum(await asyncio.gather(*(stream(i) for i in range(concurrency))))
    return summarise(concurrency, time.perf_counter() - begin, tokens, ttft, itl)


def engine_level_sink(load: EngineLoad, relay: SinkRelay, concurrency: int, per_stream: int, max_tokens: int) -> dict:
    ttft, itl, done, failures = [], [], threading.Event(), []
    left = {index: per_stream for index in range(concurrency)}
    sent, last, total = {}, {}, [0]

    def start(index: int) -> None:
        sent[index], last[index] = time.perf_counter(), None
        load.engine.enqueue(load.request(index, per_stream - left[index], max_tokens, handle=index))

    def take(items: list) -> None:  # the engine's worker thread
        now = time.perf_counter()
        for index, event in items:
            if isinstance(event, TokenEvent):
                last[index] = stamp(now, sent[index], last[index], ttft, itl)
                total[0] += 1
            elif isinstance(event, Finished):
                left[index] -= 1
                if left[index]:
                    start(index)
                elif not any(left.values()):
                    done.set()
            elif isinstance(event, BaseException):
                failures.append(event)
                done.set()

    relay.target = take
    begin = time.perf_counter()
    for index in range(concurrency):
        start(index)
    if not done.wait(timeout=600) or failures:
        raise RuntimeError(f"engine level {concurrency} failed: {failures[:1] or 'timed out'}")
    return summarise(concurrency, time.perf_counter() - begin, total[0], ttft, itl)


def run_engine(model_dir: Path, levels: list[int], per_stream: dict[int, int], max_tokens: int, threads: int,
               device: str, consumer: str) -> list[dict]:
    args = {"model_dir": str(model_dir), "levels": levels, "per_stream": per_stream, "max_tokens": max_tokens,
            "threads": threads, "device": device, "consumer": consumer}
    done = subprocess.run([sys.executable, "-m", "xlserve.server.bench.throughput", "--engine-worker", json.dumps(args)], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- report --------------------------------------------------------------------------------------


def fmt(value, scale: float = 1000.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(http: list[dict], engine: list[dict], ceiling: list[dict]) -> str:
    lines = [f"{'streams':>7} | {'http tok/s':>10} {'engine':>8} {'ceiling':>8} {'http/eng':>8} {'http/ceil':>9} | "
             f"{'TTFT p50/p99 ms':>16} | {'ITL p50/p99 ms':>15} | {'ceiling TTFT p50/p99':>20} | {'ceiling ITL p50/p99':>19}"]
    for h, e, c in zip(http, engine, ceiling):
        lines.append(
            f"{h['concurrency']:>7} | {h['tokens_per_s']:>10.1f} {e['tokens_per_s']:>8.1f} {c['tokens_per_s']:>8.1f} "
            f"{fmt(share(h, e), 100, 0) + '%':>8} {fmt(share(h, c), 100, 0) + '%':>9} | "
            f"{fmt(h['ttft_p50_s']) + ' / ' + fmt(h['ttft_p99_s']):>16} | "
            f"{fmt(h['itl_p50_s']) + ' / ' + fmt(h['itl_p99_s']):>15} | "
            f"{fmt(c['ttft_p50_s']) + ' / ' + fmt(c['ttft_p99_s']):>20} | "
            f"{fmt(c['itl_p50_s']) + ' / ' + fmt(c['itl_p99_s']):>19}")
    return "\n".join(lines)


def share(row: dict, base: dict) -> float | None:
    return row["tokens_per_s"] / base["tokens_per_s"] if row["tokens_per_s"] and base["tokens_per_s"] else None


def goals(http: list[dict], engine: list[dict], ceiling: list[dict]) -> dict:
    """The throughput goals: 16 streams >= 6x one stream over HTTP, HTTP >= 90% of the in-process
    engine; the share of the ceiling is reported beside it."""
    by = {r["concurrency"]: r for r in http}
    eng = {r["concurrency"]: r for r in engine}
    top = {r["concurrency"]: r for r in ceiling}
    result = {}
    if 1 in by and 16 in by:
        result["speedup_16_vs_1_http"] = round(by[16]["tokens_per_s"] / by[1]["tokens_per_s"], 2)
        result["speedup_16_vs_1_engine"] = round(eng[16]["tokens_per_s"] / eng[1]["tokens_per_s"], 2)
        result["speedup_16_vs_1_ceiling"] = round(top[16]["tokens_per_s"] / top[1]["tokens_per_s"], 2)
        result["speedup_goal_met"] = result["speedup_16_vs_1_http"] >= 6
    shares = {c: round(share(by[c], eng[c]), 3) for c in by if c in eng}
    result["http_share_of_engine"] = shares
    result["http_share_of_ceiling"] = {c: round(share(by[c], top[c]), 3) for c in by if c in top}
    result["http_overhead_goal_met"] = all(s >= 0.9 for s in shares.values())
    return result


def plot(http: list[dict], engine: list[dict], ceiling: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    levels = [r["concurrency"] for r in http]
    left.plot(levels, [r["tokens_per_s"] for r in http], "o-", label="HTTP + SSE")
    left.plot(levels, [r["tokens_per_s"] for r in engine], "s--", label="engine in process (asyncio)")
    left.plot(levels, [r["tokens_per_s"] for r in ceiling], "^:", label="engine ceiling (sink in its thread)")
    left.set(xscale="log", xlabel="concurrent streams", ylabel="generated tokens / s", title="throughput")
    left.set_xticks(levels, [str(c) for c in levels])
    left.legend()
    for key, style, label in (("ttft_p50_s", "o-", "TTFT p50"), ("ttft_p99_s", "o:", "TTFT p99"),
                              ("itl_p50_s", "s-", "ITL p50"), ("itl_p99_s", "s:", "ITL p99")):
        right.plot(levels, [1000 * (r[key] or 0) for r in http], style, label=label)
    right.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="latency over HTTP")
    right.set_xticks(levels, [str(c) for c in levels])
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def random_checkpoint(out: Path) -> Path:
    directory = out / "transformer-xl-small-random"
    if not (directory / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "xlserve.server.cli", "new", "--arch", "transformer-xl", "--preset", "small",
                        "--out", str(directory), "--force"], check=True, capture_output=True)  # over a run cut short
    return directory


def main(argv: list[str]) -> None:
    if argv[:1] == ["--engine-worker"]:
        print(json.dumps(engine_worker(json.loads(argv[1]))))
        return
    parser = argparse.ArgumentParser(prog="xlserve bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory or name under weights/")
    parser.add_argument("--random-small", action="store_true",
                        help="benchmark a random transformer-xl/small checkpoint (same shape as the shipped one)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma list of concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=16,
                        help="requests per level at least (low levels send more per stream, so that each is timed "
                             "for seconds)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating engine/HTTP rounds; each level reports its median round")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op torch threads of the engine, over HTTP and in process (XLSERVE_TORCH_THREADS); "
                             "default 0: the server's default, the cores less one")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(BENCH_RESULTS_DIR))
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint_dir(args.model)
    if args.random_small:
        model_dir = random_checkpoint(out)
    if not (model_dir / "model.safetensors").is_file():
        raise SystemExit(f"no checkpoint at {model_dir}; pass --model DIR, or --random-small for a random "
                         "checkpoint of the shipped shape (speed does not depend on the weights)")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    per_stream = requests_per_stream(levels, args.requests_per_stream, args.min_requests)
    threads = args.threads or "all"
    print(f"throughput of {model_dir.name}: streams x requests {per_stream}, {args.max_tokens} tokens each, "
          f"{threads} torch threads", flush=True)
    engine, ceiling, http = measure(model_dir, levels, per_stream, args.max_tokens, args.threads, args.device,
                                    args.rounds)

    payload = {
        "benchmark": "throughput", "model": str(model_dir), "random_weights": args.random_small,
        "max_tokens": args.max_tokens, "requests_per_stream": {str(c): n for c, n in per_stream.items()},
        "rounds": args.rounds, "threads": args.threads,
        "device": args.device, "cpu_count": os.cpu_count(), "http": http, "engine": engine,
        "engine_ceiling": ceiling, "goals": goals(http, engine, ceiling),
    }
    (out / "throughput.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(http, engine, ceiling, out / "throughput.png", f"{model_dir.name}, {threads} threads, {args.max_tokens} tokens/request")
    print(table(http, engine, ceiling))
    print(json.dumps(payload["goals"]))
    print(f"wrote {out / 'throughput.json'} and {out / 'throughput.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
