"""`xlserve bench soak`: does the server give its memory back after many rounds of session work?

A real server (`xlserve serve` in a subprocess: its API process and its engine process) is
driven over HTTP on loopback for --rounds rounds (default 50). Each round:

- creates --sessions new sessions (default 8) and, for each of them at once, appends --chunks
  document chunks of --chunk-bytes bytes (slices of a standard-library source file), then
  continues it with a streamed completion that commits;
- continues as many older, still living sessions with a streamed completion each;
- lets a share (--disconnect-share, default 0.25) of all those completions' clients close the
  socket mid-stream, after a few tokens (the request is cancelled, nothing is committed);
- deletes half of the round's new sessions (the other half lives on until the end).

With --mode stateless, each round instead sends --sessions streamed completions about no session,
each on a prompt of --chunks x --chunk-bytes not sent before (a share of them dropped mid-stream
alike): what stateless traffic does, which fills the prefix cache (server/cache/prefix_cache.py)
up to its caps rather than any session.

After every round it records the prefix cache's bytes per tier (xlserve_prefix_cache_bytes from
/metrics) and the resident memory (VmRSS and RssAnon from /proc/PID/status) of
the API process and of the engine process; after the last round it deletes every session, waits
--settle-seconds while the server is idle and records it again. The engine process's memory
after that, against its memory after start-up, is what the soak is for: docs/design.md
(section 8) states the bound that server/engine/memory.py keeps and docs/benchmarks.md has the
latest curve. Results go to bench-results/soak.json and soak.png.

The load generator is this process, which never imports torch: plain asyncio streams, a minimal
HTTP/1.1 client, everything on 127.0.0.1. Every request has a time limit and every retry a count,
so a run always ends. The server keeps its sessions in a temporary state directory (removed at
the end) unless --state-dir is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xlserve.server.bench.throughput import DEFAULT_MODEL, child_processes, run_loop, start_server  # torch-free
from xlserve.server.engine.memory import IDLE_GROWTH_BOUND_MB  # torch-free
from xlserve.server.settings import BENCH_RESULTS_DIR, checkpoint_dir

HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 120  # any one HTTP exchange; a healthy server answers in well under a second
BUSY_RETRIES = 200  # a session just left by a disconnected client may be busy for a moment (409)
BUSY_WAIT_S = 0.05
TOKEN_CHUNK = b'"finish_reason": null'  # an SSE chunk that carries a token


# -- resident memory ------------------------------------------------------------------------------


def memory_of(pid: int | None) -> dict | None:
    """VmRSS (everything resident) and RssAnon (what the allocator holds: heap, arenas, anonymous
    mappings) of process `pid`, in MB, from /proc/PID/status; None where there is none."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)  # kB -> MB
    return {"rss_mb": fields.get("VmRSS"), "anon_mb": fields.get("RssAnon")}


# -- a minimal HTTP/1.1 client (no torch, no HTTP library) -----------------------------------------


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status, self.body = status, body


def request_bytes(method: str, path: str, body: dict | None) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    return status, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)  # the CRLF after each chunk
    return await reader.read()  # until the server closes


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def exchange(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body), the body de-chunked."""

    async def talk():
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            writer.write(request_bytes(method, path, body))
            status, headers = await read_head(reader)
            return status, await read_body(reader, headers)
        finally:
            await close(writer)

    return await asyncio.wait_for(talk(), REQUEST_TIMEOUT_S)


class Load:
    """What the load generator did, counted (and how often it had to wait for a busy session)."""

    def __init__(self, port: int):
        self.port = port
        self.counts = {"created": 0, "appended": 0, "committed": 0, "completed": 0, "disconnected": 0, "deleted": 0,
                       "busy_retries": 0}

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        """A JSON call that must succeed; a 409 (the session is held by a request that is still
        ending: a client that disconnected a moment ago) is retried a bounded number of times."""
        for _ in range(BUSY_RETRIES):
            status, data = await exchange(self.port, method, path, body)
            if status != 409:
                break
            self.counts["busy_retries"] += 1
            await asyncio.sleep(BUSY_WAIT_S)
        if status != 200:
            raise HttpError(status, data)
        return json.loads(data)

    async def create(self, model: str) -> str:
        session = await self.call("POST", "/v1/sessions", {"model": model})
        self.counts["created"] += 1
        return session["id"]

    async def append(self, session_id: str, text: str) -> None:
        await self.call("POST", f"/v1/sessions/{session_id}/append", {"text": text})
        self.counts["appended"] += 1

    async def delete(self, session_id: str) -> None:
        await self.call("DELETE", f"/v1/sessions/{session_id}")
        self.counts["deleted"] += 1

    async def complete(self, model: str, session_id: str | None, max_tokens: int, seed: int,
                       disconnect_after: int | None, prompt: str | None = None) -> None:
        """A streamed completion that continues `session_id` (or, with None, completes `prompt`
        about no session): read to the end (the server then commits), or, with
        `disconnect_after`, close the socket once that many tokens came."""
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed, "stream": True}
        body.update({"session_id": session_id} if session_id is not None else {"prompt": prompt})
        for _ in range(BUSY_RETRIES):
            if await asyncio.wait_for(self._stream(body, disconnect_after), REQUEST_TIMEOUT_S):
                return
            self.counts["busy_retries"] += 1
            await asyncio.sleep(BUSY_WAIT_S)
        raise RuntimeError(f"session {session_id} stayed busy")

    async def _stream(self, body: dict, disconnect_after: int | None) -> bool:
        """False when the session was busy (409), True when the stream was read or dropped."""
        reader, writer = await asyncio.open_connection(HOST, self.port)
        try:
            writer.write(request_bytes("POST", "/v1/completions", body))
            status, headers = await read_head(reader)
            if status == 409:
                await read_body(reader, headers)
                return False
            if status != 200:
                raise HttpError(status, await read_body(reader, headers))
            if disconnect_after is None:
                data = await read_body(reader, headers)
                if b"data: [DONE]" not in data or b'"error"' in data:
                    raise RuntimeError(f"the stream did not end well: {data[-300:]!r}")
                self.counts["committed" if "session_id" in body else "completed"] += 1  # completed: no session
                return True
            seen = b""
            while seen.count(TOKEN_CHUNK) < disconnect_after and b"[DONE]" not in seen:
                data = await reader.read(65536)
                if not data:
                    break
                seen += data
            self.counts["disconnected"] += 1
            return True  # the socket closes below, mid-stream
        finally:
            await close(writer)


# -- the soak -----------------------------------------------------------------------------------


def document() -> str:
    """A long, real text the load generator has without torch or a download: the source of a
    standard-library module (argparse's: about 100 kB of code and prose)."""
    return Path(argparse.__file__).read_text(encoding="utf-8")


async def soak_round(load: Load, model: str, round_index: int, living: list[str], args, text: str,
                     chooser: random.Random) -> list[str]:
    """One round of session work; returns the sessions that live on after it."""
    new = [await load.create(model) for _ in range(args.sessions)]
    older = chooser.sample(living, min(len(living), args.sessions))

    def stream_for(session_id: str, index: int):
        disconnect = chooser.random() < args.disconnect_share
        return load.complete(model, session_id, args.max_tokens * (4 if disconnect else 1),
                             seed=round_index * 1000 + index,
                             disconnect_after=chooser.randint(1, 8) if disconnect else None)

    async def feed_and_continue(session_id: str, index: int, completion) -> None:
        for chunk in range(args.chunks):
            start = ((round_index * args.sessions + index) * args.chunks + chunk) * args.chunk_bytes % max(
                1, len(text) - args.chunk_bytes)
            await load.append(session_id, text[start:start + args.chunk_bytes])
        await completion

    work = [feed_and_continue(s, i, stream_for(s, i)) for i, s in enumerate(new)]
    work += [stream_for(s, args.sessions + i) for i, s in enumerate(older)]
    await asyncio.gather(*work)
    leaving = new[: len(new) // 2]
    for session_id in leaving:
        await load.delete(session_id)
    return living + new[len(new) // 2:]


async def stateless_round(load: Load, model: str, round_index: int, args, text: str,
                          chooser: random.Random) -> None:
    """One round of completions about no session, each on a prompt not sent before (the round and
    its index pick the document's slice, shifted by a round-specific prefix so that none repeats)."""
    size = args.chunks * args.chunk_bytes

    def completion(index: int):
        start = (round_index * args.sessions + index) * size % max(1, len(text) - size)
        disconnect = chooser.random() < args.disconnect_share
        return load.complete(model, None, args.max_tokens * (4 if disconnect else 1),
                             seed=round_index * 1000 + index,
                             disconnect_after=chooser.randint(1, 8) if disconnect else None,
                             prompt=f"# round {round_index}, request {index}\n" + text[start:start + size])

    await asyncio.gather(*(completion(i) for i in range(args.sessions)))


PREFIX_CACHE_BYTES = "xlserve_prefix_cache_bytes{"


async def prefix_cache_mb(load: Load) -> dict[str, float]:
    """The prefix cache's bytes per tier, summed over the models, in MB, from /metrics."""
    status, data = await exchange(load.port, "GET", "/metrics")
    if status != 200:
        raise HttpError(status, data)
    tiers: dict[str, float] = {}
    for line in data.decode().splitlines():
        if line.startswith(PREFIX_CACHE_BYTES):
            labels, _, value = line.rpartition(" ")
            tier = labels.split('tier="', 1)[1].split('"', 1)[0] if 'tier="' in labels else "all"
            tiers[tier] = tiers.get(tier, 0.0) + float(value) / 2**20
    return {tier: round(mb, 3) for tier, mb in sorted(tiers.items())}


def sample(label: str, round_index: int | None, api_pid: int, engine_pid: int, living: int) -> dict:
    """Both processes' memory now. A server that restarted its engine process would mix two
    processes' numbers: the soak stops instead."""
    api, engine = memory_of(api_pid), memory_of(engine_pid)
    if api is None or engine is None:
        raise RuntimeError(f"the {'API' if api is None else 'engine'} process is gone; the soak stops")
    return {"label": label, "round": round_index, "sessions": living, "api": api, "engine": engine,
            "time_s": round(time.monotonic(), 2)}


async def drive(port: int, api_pid: int, engine_pid: int, model: str, args) -> tuple[list[dict], dict]:
    load = Load(port)
    text = document()
    chooser = random.Random(args.seed)
    samples = [sample("start", None, api_pid, engine_pid, 0)]
    living: list[str] = []
    for round_index in range(args.rounds):
        if args.mode == "stateless":
            await stateless_round(load, model, round_index, args, text, chooser)
        else:
            living = await soak_round(load, model, round_index, living, args, text, chooser)
        samples.append(sample("round", round_index + 1, api_pid, engine_pid, len(living)))
        row = samples[-1]
        row["prefix_cache_mb"] = await prefix_cache_mb(load)
        # what the living sessions' states take, as the cache counts it (every one has seen more
        # than its memory holds after its appends, so one stands for all)
        info = await load.call("GET", f"/v1/sessions/{living[-1]}") if living else {"state_bytes": 0}
        row["session_states_mb"] = round(len(living) * info["state_bytes"] / 2**20, 3)
        print(f"  round {round_index + 1:>3}: {len(living):>4} sessions, engine {row['engine']['rss_mb']} MB, "
              f"API {row['api']['rss_mb']} MB, prefix cache {sum(row['prefix_cache_mb'].values()):.1f} MB "
              f"{row['prefix_cache_mb']}", flush=True)
    for session_id in living:
        await load.delete(session_id)
    # the server is idle now: give it the time to hand back what it holds (server/engine/memory.py)
    deadline = time.monotonic() + args.settle_seconds
    while True:
        samples.append(sample("settle", None, api_pid, engine_pid, 0))
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    samples[-1]["label"] = "after_delete"
    samples[-1]["prefix_cache_mb"] = await prefix_cache_mb(load)
    return samples, load.counts


def summary(samples: list[dict], process: str) -> dict:
    """start, max (over the rounds), end (after the last round) and after_delete, in MB."""
    rounds = [s[process]["rss_mb"] for s in samples if s["label"] == "round"]
    return {"start_mb": samples[0][process]["rss_mb"], "max_mb": max(rounds, default=None),
            "end_mb": rounds[-1] if rounds else None, "after_delete_mb": samples[-1][process]["rss_mb"],
            "after_delete_anon_mb": samples[-1][process]["anon_mb"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        rounds = [s for s in samples if s["label"] == "round"]
        xs = [0] + [s["round"] for s in rounds] + [result["rounds"] + 1]
        for process, style in (("engine", "o-"), ("api", "s-")):
            ys = [samples[0][process]["rss_mb"]] + [s[process]["rss_mb"] for s in rounds] + \
                 [samples[-1][process]["rss_mb"]]
            ax.plot(xs, ys, style, markersize=3, label=f"{process} process RSS")
        engine = result["engine"]
        ax.plot(xs, [engine["start_mb"]] + [engine["start_mb"] + s["session_states_mb"] for s in rounds]
                + [engine["start_mb"]], ":", color="C0", label="engine start-up + living session states")
        ax.axhline(engine["start_mb"], color="grey", linestyle=":", label="engine RSS after start-up")
        ax.axhline(engine["start_mb"] + result["bound_mb"], color="red", linestyle="--",
                   label=f"bound once every session is deleted: start-up + {result['bound_mb']} MB")
        ax.set(xlabel=f"round (0: start, {result['rounds'] + 1}: every session deleted)", ylabel="MB resident")
        ax.set_title(f"soak: {Path(result['model']).name}, {result['rounds']} rounds, "
                     f"{result['sessions_per_round']} sessions per round", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def prefix_cache_summary(samples: list[dict]) -> dict:
    """The prefix cache's total MB: max over the rounds, at the end of the last, after delete."""
    totals = [sum(s["prefix_cache_mb"].values()) for s in samples if s["label"] == "round"]
    return {"max_mb": round(max(totals, default=0.0), 3), "end_mb": round(totals[-1], 3) if totals else None,
            "after_delete_mb": round(sum(samples[-1]["prefix_cache_mb"].values()), 3)}


def print_table(result: dict) -> None:
    print(f"{'process':>12} | {'start MB':>9} {'max MB':>9} {'end MB':>9} {'after delete':>12}")
    for process in ("engine", "api"):
        row = result[process]
        print(f"{process:>12} | {row['start_mb']:>9} {row['max_mb']:>9} {row['end_mb']:>9} "
              f"{row['after_delete_mb']:>12}")
    cache = result["prefix_cache"]
    print(f"{'prefix cache':>12} | {'':>9} {cache['max_mb']:>9} {cache['end_mb']:>9} {cache['after_delete_mb']:>12}")
    print(json.dumps(result["counts"]))
    print(f"engine after delete within start + {result['bound_mb']} MB: {result['within_bound']}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="xlserve bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory or name under weights/")
    parser.add_argument("--mode", choices=("sessions", "stateless"), default="sessions",
                        help="session work, or completions about no session (which fill the prefix cache)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=8,
                        help="new sessions per round (and older ones continued); stateless: completions per round")
    parser.add_argument("--chunks", type=int, default=2,
                        help="document chunks appended to each new session (stateless: in each prompt)")
    parser.add_argument("--chunk-bytes", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (4x for a disconnecting one)")
    parser.add_argument("--disconnect-share", type=float, default=0.25,
                        help="share of completions whose client closes the socket mid-stream")
    parser.add_argument("--settle-seconds", type=float, default=5.0,
                        help="how long the idle server is watched after every session is deleted")
    parser.add_argument("--threads", type=int, default=0, help="XLSERVE_TORCH_THREADS (0: the server's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", default=None, help="the server's XLSERVE_STATE_DIR (default: a temporary one)")
    parser.add_argument("--out", default=str(BENCH_RESULTS_DIR), help="directory for soak.json and soak.png")
    args = parser.parse_args(argv)

    model_dir = checkpoint_dir(args.model)
    if not (model_dir / "model.safetensors").is_file():
        raise SystemExit(f"no checkpoint at {model_dir}; pass --model DIR")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_dir = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="xlserve-soak-state-"))
    env = {"XLSERVE_STATE_DIR": str(state_dir), "XLSERVE_TORCH_THREADS": str(args.threads)}
    what = "sessions" if args.mode == "sessions" else "completions about no session"
    print(f"soak of {model_dir.name}: {args.rounds} rounds of {args.sessions} {what}", flush=True)
    began = time.monotonic()
    process, port = start_server(model_dir, env)
    try:
        engine_pid = next(iter(child_processes(process.pid)), None)
        if engine_pid is None:
            raise RuntimeError("the server has no engine process")
        samples, counts = run_loop(drive(port, process.pid, engine_pid, model_dir.name, args))
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        if not args.state_dir:
            shutil.rmtree(state_dir, ignore_errors=True)

    bound = IDLE_GROWTH_BOUND_MB
    result = {
        "benchmark": "soak", "mode": args.mode, "model": str(model_dir), "rounds": args.rounds,
        "sessions_per_round": args.sessions,
        "chunks": args.chunks, "chunk_bytes": args.chunk_bytes, "max_tokens": args.max_tokens,
        "disconnect_share": args.disconnect_share, "settle_seconds": args.settle_seconds, "seed": args.seed,
        "threads": args.threads, "cpu_count": os.cpu_count(), "wall_s": round(time.monotonic() - began, 1),
        "environment": {key: os.environ[key] for key in ("MALLOC_ARENA_MAX", "XLSERVE_RETURN_MEMORY")
                        if key in os.environ},
        "counts": counts, "engine": summary(samples, "engine"), "api": summary(samples, "api"),
        "prefix_cache": prefix_cache_summary(samples),
        "bound_mb": bound, "samples": samples,
    }
    engine = result["engine"]
    result["within_bound"] = engine["after_delete_mb"] <= engine["start_mb"] + bound
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "soak.png")
    print_table(result)
    print(f"\nwrote {out / 'soak.json'} and {out / 'soak.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
