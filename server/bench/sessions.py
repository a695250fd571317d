"""`xlserve bench sessions`: what a session costs to keep and to bring back.

For each model (every checkpoint under weights/, any checkpoint path given, or with --presets
randomly initialised architectures: state sizes do not depend on the weights) and each history
length H (held-out stdlib text):

- state_bytes and bytes_per_token: the committed session (state + next-token distribution)
  after H tokens, divided by H. Transformer-XL's grows until the memory is full, the ∞-former's
  stays flat.
- restore_s[tier]: median time for `SessionCache.acquire` to hand the state back on the model's
  device when its fastest copy is in that tier (device: bookkeeping only; host: a copy; disk:
  read, checksum, decode, check; redis: one round trip for the version, one for the blob, then
  as disk). p90 next to it.
- commit_disk_s, commit_redis_s: median time of a commit, which is write-through: a safetensors
  file written, fsynced and renamed; with Redis, a compare-and-set of the blob instead.

A model that stops at its max_context (the Reformer) is measured only at the histories it can
hold; the longer ones are reported as skipped, not as failures.

Redis: --redis-url, or a temporary redis-server on a free loopback port when the binary is
installed (no persistence), or skipped with --no-redis. Results go to bench-results/sessions.json
and sessions.png. Run it alone: a second torch-heavy process on the same cores slows both and skews
the numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.server.bench.continuation import feed, held_out_text, sync
from xlserve.server.cache.codec import SessionData
from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.settings import BENCH_RESULTS_DIR, WEIGHTS_DIR, checkpoint_dir

TIERS = ("device", "host", "disk", "redis")


def models_to_run(args) -> list[tuple[str, object]]:
    """(label, model) for every checkpoint asked for, or under weights/, or every preset asked for."""
    torch.manual_seed(0)
    chosen = []
    paths = [checkpoint_dir(p) for p in args.models.split(",") if p]
    if not paths and not args.presets:
        paths = sorted(p.parent for p in WEIGHTS_DIR.glob("*/config.json"))
    for path in paths:
        chosen.append((path.name, load_checkpoint(path, device=args.device).eval()))
    for item in filter(None, args.presets.split(",")):
        from xlserve.models.registry import build_model
        from xlserve.models.training.presets import preset_config

        architecture, _, preset = item.partition(":")
        model = build_model(architecture, preset_config(architecture, preset or "small")).to(args.device).eval()
        chosen.append((f"{architecture}/{preset or 'small'} (random init)", model))
    if not chosen:
        raise SystemExit("no checkpoints under weights/; give --models PATH or --presets ARCH[:PRESET],...")
    return chosen


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(port),
                                "--save", "", "--appendonly", "no", "--dir", directory],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    import redis

    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    for _ in range(200):  # up to ~10 s
        try:
            if client.ping():
                return process, f"redis://127.0.0.1:{port}/0"
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("the temporary redis-server did not start")


def quantiles(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


@torch.inference_mode()
def measure(model, label: str, history: int, chunk: int, repeats: int, redis_url: str, device) -> dict:
    tokens = held_out_text(history)
    log_probs, state = feed(model, tokens, model.init_state(1), chunk)
    data = SessionData(state=state, tokens=history, next_log_probs=log_probs[0, -1])
    row = {"model": label, "architecture": model.architecture, "history_tokens": history,
           "state_bytes": data.nbytes(), "bytes_per_token": data.nbytes() / history}
    row["restore_s"], row["restore_p90_s"] = {}, {}
    for durable in ["disk"] + (["redis"] if redis_url else []):
        with tempfile.TemporaryDirectory(prefix="xlserve-bench-") as directory:
            cache = SessionCache(Path(directory) / "state", None, None, None, redis_url if durable == "redis" else "")
            cache.open({label: model})
            sid = cache.create(label, None, data).id
            commits = []
            for _ in range(repeats):
                lease = cache.acquire(sid, None)
                start = time.perf_counter()
                cache.commit(lease, data)
                commits.append(time.perf_counter() - start)
            row[f"commit_{durable}_s"], row[f"commit_{durable}_p90_s"] = quantiles(commits)
            for tier in ("device", "host", "disk") if durable == "disk" else ("redis",):
                times = []
                for _ in range(repeats):
                    cache.move(sid, tier)
                    sync(device)
                    start = time.perf_counter()
                    lease = cache.acquire(sid, None)
                    sync(device)
                    times.append(time.perf_counter() - start)
                    cache.release(lease)
                row["restore_s"][tier], row["restore_p90_s"][tier] = quantiles(times)
            cache.close()
    return row


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for tier in TIERS:
        points = [(r["state_bytes"], r["restore_s"][tier] * 1000) for r in results if tier in r["restore_s"]]
        if points:
            points.sort()
            left.plot(*zip(*points), marker="o", label=tier)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("state bytes")
    left.set_ylabel("ms to restore to the device (median)")
    left.set_title("Restore latency per tier")
    left.legend()
    for label in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == label]
        right.plot([r["history_tokens"] for r in rows], [r["bytes_per_token"] for r in rows], marker="o", label=label)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("history tokens")
    right.set_ylabel("state bytes per token of history")
    right.set_title("Session size")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="xlserve bench sessions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma list: names under weights/ or checkpoint paths "
                                                     "(default: every checkpoint under weights/)")
    parser.add_argument("--presets", default="", help="comma list ARCH[:PRESET] of randomly initialised models")
    parser.add_argument("--histories", default="256,1024,4096", help="comma list of history lengths in tokens")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk length")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--redis-url", default="", help="default: a temporary redis-server when installed")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--out", default=str(BENCH_RESULTS_DIR))
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    redis_process, redis_url, redis_dir = None, args.redis_url, None
    if not redis_url and not args.no_redis and shutil.which("redis-server"):
        redis_dir = tempfile.mkdtemp(prefix="xlserve-bench-redis-")
        redis_process, redis_url = start_redis(redis_dir)
    try:
        results = []
        for label, model in models_to_run(args):
            limit = model.history_limit
            for history in (int(h) for h in args.histories.split(",")):
                if limit is not None and history > limit:
                    print(f"{label:36s} H={history:>6d}  skipped: past its max_context {limit:,}, where it stops",
                          flush=True)
                    continue
                row = measure(model, label, history, args.chunk, args.repeats, "" if args.no_redis else redis_url, device)
                results.append(row)
                restore = "  ".join(f"{t} {row['restore_s'][t] * 1000:7.3f}" for t in row["restore_s"])
                print(f"{label:36s} H={history:>6d}  {row['state_bytes']:>10,} B  {row['bytes_per_token']:9.1f} B/token"
                      f"  restore ms: {restore}  commit ms: disk {row['commit_disk_s'] * 1000:7.3f}"
                      + (f" redis {row['commit_redis_s'] * 1000:7.3f}" if "commit_redis_s" in row else ""), flush=True)
    finally:
        if redis_process is not None:
            redis_process.terminate()
            redis_process.wait(10)
            shutil.rmtree(redis_dir, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "sessions", "torch": torch.__version__, "threads": torch.get_num_threads(),
               "device": args.device, "redis": bool(redis_url) and not args.no_redis, "results": results}
    (out / "sessions.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(results, out / "sessions.png")
    print(f"wrote {out / 'sessions.json'} and {out / 'sessions.png'}")
