"""`xlserve bench multi-turn`: the workload of a chat or document client, with and without reuse.

C concurrent conversations (--conversations, 16) of T turns (--turns, 8). Each turn appends a
user message (a piece of held-out stdlib text of --min-message..--max-message bytes, cut at a
line end) to the conversation and asks for a streamed reply of R tokens (--reply-tokens, 64),
which is appended too. Three modes, interleaved turn by turn in one run (turn t of every mode
runs before turn t + 1 of any, so a machine's drift hits all three alike):

- prefix-cache: a stateless client, resending the whole history each turn; the server's prefix
  cache finds the previous turn's prompt + reply (README, "Reuse without sessions");
- no-cache: the same client with "prefix_cache": false, so every turn recomputes its history;
- sessions: a client that names a session and sends only the new message.

Reported per mode and turn: time to first token p50/p99 (request sent -> first token chunk
received), time per output token p50 (the rest of the reply over its tokens after the first),
end-to-end latency p50, the share of prompt tokens the server reused
(`usage.prompt_tokens_details.cached_tokens`; for sessions, the session's own history), and
goodput: the share of requests meeting TTFT <= --ttft-goal (1 s) and TPOT <= --tpot-goal (50 ms).
Per mode: output tokens/s over its requests' wall time. JSON and a plot of TTFT p50 against turn
for the three modes under bench-results/multi-turn.json / .png.

The server is a real `xlserve serve` subprocess; the client is plain HTTP/1.1 + SSE on the event
loop, with no torch work in this process (it reads the held-out text with the stdlib corpus
helper once, before the server starts). Run it alone: a second torch-heavy process on the same
cores makes the numbers meaningless.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from xlserve.server.bench.throughput import percentile, run_loop, start_server
from xlserve.server.settings import BENCH_RESULTS_DIR, WEIGHTS_DIR, checkpoint_dir

MODES = ("prefix-cache", "no-cache", "sessions")
DEFAULT_MODEL = WEIGHTS_DIR / "transformer-xl-stdlib"


def user_messages(count: int, shortest: int, longest: int, seed: int) -> list[str]:
    """`count` pieces of held-out stdlib text, each shortest..longest bytes, cut after a newline."""
    from xlserve.models.training.data import stdlib_corpus

    corpus = stdlib_corpus()
    text = b"".join(corpus.read(path) for path in corpus.held_out).decode("utf-8", errors="ignore")
    rng = random.Random(seed)
    messages, position = [], 0
    while len(messages) < count:
        length = rng.randint(shortest, longest)
        piece = text[position : position + length]
        cut = piece.rfind("\n")
        piece = piece[: cut + 1] if cut > shortest // 2 else piece
        messages.append(piece)
        position = (position + len(piece)) % max(1, len(text) - longest)
    return messages


# -- one streamed request over HTTP/1.1 -------------------------------------------------------------


async def post(host: str, port: int, path: str, body: dict, stream: bool) -> dict:
    """POST `body`; for a streamed completion, the time of the first token chunk, the text and
    the usage of the final chunk; else the JSON answer. Times in seconds from sending."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    sent = time.perf_counter()
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (path.encode(), host.encode(), len(payload), payload))
    await writer.drain()
    try:
        status = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if b" 200 " not in status:
            raise RuntimeError(f"{path} answered {status.decode().strip()}: {(await reader.read())[:300]!r}")
        if not stream:
            return json.loads(await reader.read())
        first, text, usage, buffer = None, [], None, b""
        async for piece in _chunks(reader, headers.get("transfer-encoding") == "chunked"):
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.partition(b"data: ")[2]
                if not data or data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        if first is None:
                            first = time.perf_counter() - sent
                        text.append(choice["text"])
        return {"ttft": first, "e2e": time.perf_counter() - sent, "text": "".join(text), "usage": usage}
    finally:
        writer.close()


async def _chunks(reader: asyncio.StreamReader, chunked: bool):
    """The body as it arrives, de-chunked."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


# -- the conversations ------------------------------------------------------------------------------


class Conversation:
    def __init__(self, mode: str, model: str, messages: list[str], reply_tokens: int):
        self.mode, self.model, self.messages, self.reply_tokens = mode, model, messages, reply_tokens
        self.history = ""
        self.session_id: str | None = None

    async def turn(self, host: str, port: int, index: int) -> dict:
        message = self.messages[index]
        body = {"model": self.model, "max_tokens": self.reply_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.mode == "sessions":
            if self.session_id is None:
                self.session_id = (await post(host, port, "/v1/sessions", {"model": self.model}, False))["id"]
            body.update(prompt=message, session_id=self.session_id)
        else:
            body["prompt"] = self.history + message
            if self.mode == "no-cache":
                body["prefix_cache"] = False
        result = await post(host, port, "/v1/completions", body, True)
        self.history += message + result["text"]
        usage = result["usage"] or {}
        completion = usage.get("completion_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        prompt = usage.get("prompt_tokens", 0)
        ttft = result["ttft"] if result["ttft"] is not None else result["e2e"]
        return {"ttft": ttft, "e2e": result["e2e"], "completion_tokens": completion,
                "tpot": (result["e2e"] - ttft) / (completion - 1) if completion > 1 else None,
                # sessions: the context is the session's history plus the new message
                "cached_share": cached / (cached + prompt if self.mode == "sessions" else max(prompt, 1)) if prompt else 0.0}


def summarise(results: list[dict], ttft_goal: float, tpot_goal: float) -> dict:
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    good = [r for r in results if r["ttft"] <= ttft_goal and (r["tpot"] is None or r["tpot"] <= tpot_goal)]
    return {"requests": len(results), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "e2e_p50_s": percentile([r["e2e"] for r in results], 50),
            "cached_share": round(sum(r["cached_share"] for r in results) / len(results), 4),
            "goodput": round(len(good) / len(results), 4)}


async def run(host: str, port: int, args, messages: list[str]) -> dict:
    conversations = {mode: [Conversation(mode, args.model_name, messages[c * args.turns : (c + 1) * args.turns],
                                         args.reply_tokens) for c in range(args.conversations)]
                     for mode in MODES}
    per_turn = {mode: [] for mode in MODES}
    wall = {mode: 0.0 for mode in MODES}
    tokens = {mode: 0 for mode in MODES}
    for turn in range(args.turns):
        for mode in MODES[turn % 3:] + MODES[: turn % 3]:  # which mode goes first rotates
            started = time.perf_counter()
            results = await asyncio.gather(*(c.turn(host, port, turn) for c in conversations[mode]))
            wall[mode] += time.perf_counter() - started
            tokens[mode] += sum(r["completion_tokens"] for r in results)
            per_turn[mode].append({"turn": turn + 1, **summarise(results, args.ttft_goal, args.tpot_goal)})
            print(f"turn {turn + 1} {mode:>12}: ttft p50 {per_turn[mode][-1]['ttft_p50_s'] * 1000:8.1f} ms, "
                  f"reused {per_turn[mode][-1]['cached_share']:.0%}", flush=True)
    return {mode: {"turns": per_turn[mode], "output_tokens_per_s": round(tokens[mode] / wall[mode], 2)}
            for mode in MODES}


def goals(modes: dict) -> dict:
    """The issue's goals: with the cache, turn T's TTFT p50 within 2x of turn 1's; at turn T the
    cache cuts TTFT p50 by >= 5x against no cache; the cache within 20% of sessions' TTFT."""
    cache, off, sessions = (modes[m]["turns"] for m in MODES)
    last = len(cache) - 1
    return {
        "cache_last_over_first_ttft": round(cache[last]["ttft_p50_s"] / cache[0]["ttft_p50_s"], 3),
        "no_cache_over_cache_ttft_last_turn": round(off[last]["ttft_p50_s"] / cache[last]["ttft_p50_s"], 3),
        "cache_over_sessions_ttft_last_turn": round(cache[last]["ttft_p50_s"] / sessions[last]["ttft_p50_s"], 3),
    }


def plot(result: dict, path: Path) -> None:
    from xlserve.server.bench.common import figure

    with figure(path, f"{result['model']}: time to first token by turn "
                      f"({result['conversations']} conversations)") as ax:
        for mode in MODES:
            turns = result["modes"][mode]["turns"]
            ax.plot([t["turn"] for t in turns], [t["ttft_p50_s"] * 1000 for t in turns], marker="o", label=mode)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")


def print_table(result: dict) -> None:
    print(f"\n{'mode':>12} {'turn':>4} {'TTFT p50':>10} {'p99':>10} {'TPOT p50':>9} {'e2e p50':>9} {'reused':>7} "
          f"{'goodput':>7}")
    for mode in MODES:
        for t in result["modes"][mode]["turns"]:
            tpot = f"{t['tpot_p50_s'] * 1000:7.1f}ms" if t["tpot_p50_s"] is not None else "-"
            print(f"{mode:>12} {t['turn']:>4} {t['ttft_p50_s'] * 1000:8.1f}ms {t['ttft_p99_s'] * 1000:8.1f}ms "
                  f"{tpot:>9} {t['e2e_p50_s'] * 1000:7.0f}ms {t['cached_share']:>7.0%} {t['goodput']:>7.0%}")
        print(f"{mode:>12} output tokens/s: {result['modes'][mode]['output_tokens_per_s']}")
    print("goals:", json.dumps(result["goals"]))


def main(argv: list[str]) -> None:
    from xlserve.server.bench.common import save_results

    parser = argparse.ArgumentParser(prog="xlserve bench multi-turn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint name under weights/ or path")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--min-message", type=int, default=512)
    parser.add_argument("--max-message", type=int, default=2048)
    parser.add_argument("--ttft-goal", type=float, default=1.0, help="goodput: TTFT at most this (s)")
    parser.add_argument("--tpot-goal", type=float, default=0.05, help="goodput: time per output token at most this (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(BENCH_RESULTS_DIR / "multi-turn.json"))
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.reply_tokens) < 1 or args.min_message > args.max_message:
        parser.error("conversations, turns and reply tokens must be positive, min-message <= max-message")
    model_dir = checkpoint_dir(args.model)
    args.model_name = model_dir.name
    messages = user_messages(args.conversations * args.turns, args.min_message, args.max_message, args.seed)
    process, port = start_server(model_dir, {})
    try:
        modes = run_loop(run("127.0.0.1", port, args, messages))
    finally:
        process.terminate()
        process.wait(60)
    result = {"model": args.model_name, "conversations": args.conversations, "turns": args.turns,
              "reply_tokens": args.reply_tokens, "message_bytes": [args.min_message, args.max_message],
              "ttft_goal_s": args.ttft_goal, "tpot_goal_s": args.tpot_goal, "modes": modes, "goals": goals(modes)}
    save_results(result, args.out, plot, print_table)
