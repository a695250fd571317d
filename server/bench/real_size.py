"""`xlserve bench real-size`: xlserve at the sizes people run (issue 36).

Three reference shapes, each built with random weights by the reference's own classes
(transformers; nothing is downloaded), saved with save_pretrained and imported with `xlserve
convert`, as a user's downloaded checkpoint would be:

- transfo-xl-wt103: transfo-xl-wt103's exact shape (18 layers, d_model 1,024, 16 heads of 64,
  d_inner 4,096, an adaptive softmax over 267,735 words with cutoffs 20k/40k/200k and div_val 4,
  mem_len 1,600, clamp_len 1,000): 285 M parameters, 236 MB of memory per session in float32;
- xlnet-large: XLNet-large's shape (24 layers, d_model 1,024, 16 heads, d_inner 4,096, the
  32,000-piece vocabulary) with mem_len 512;
- reformer-enwik8: google/reformer-enwik8's shape, as `bench vs-hf-reformer` builds it.

For each it reports:
- load: a real `xlserve serve` of the converted checkpoint, timed from the command to /ready
  with the checkpoint's pages dropped from the page cache first (a cold start), and the memory
  of its two processes then (the API process and the engine process: the sum of their resident
  sets, and of their proportional sets, which count a shared page once);
  then one greedy completion streamed from it, and as many at once as the largest batch size,
  each after its own prompt: their tokens/s together while all of them decode;
- state bytes per session at full memory (float32 and bfloat16: XLSERVE_STATE_DTYPE), and how
  many such sessions fit in each tier at the default budgets (device 1 GiB, host 4 GiB, disk
  64 GiB);
- appends: after 1k, 8k and 64k tokens of history (a history the model cannot hold, past the
  Reformer's max_context, is reported as skipped), three successive appends of 128 tokens, each
  committed through a real SessionCache: the forward alone (an append with no durable tier),
  the commit to disk, and the commit to Redis, timed apart. Bytes written per commit: to disk,
  the bytes this process passed to write() during the commit (/proc/self/io wchar), so the
  figure is what the store really wrote whatever its format; to Redis, the growth of the
  server's total_net_input_bytes. Beside them, the whole blob (what every commit wrote before
  delta commits) and the bytes of the 128 new positions alone (the goal's unit). After each
  shape's longest history, a compaction cycle: appends committed to each store until the
  session's log has been compacted once (--compact-ratio, by default the server's), its bytes
  over its commits: what a commit costs once the whole write it leads to is counted;
- decode: greedy tokens/s at batch 1 and 8 after a prompt of --decode-prompt tokens, for
  xlserve in float32, xlserve with weight-only int8 (XLSERVE_QUANTIZE) and the Hugging Face
  reference driven by the same loop with its cache, in the same run. xlserve's four runs (float32
  and int8 at each batch size) take --decode-rounds rounds of --decode-tokens steps in turn, each
  going on from where its last round ended, and report the median round's tokens/s. The ratios
  the goals name (int8 over float32, batch 8 over batch 1) are taken within each round, between
  runs a few seconds apart, and their median reported with every round's, never as a ratio of
  two medians that may come from different minutes of this machine; each row also gives the
  slowest and fastest round. The reference decodes once, amid xlserve's rounds (after the
  middle one), from the same prompt; whether xlserve's float32
  tokens equal the reference's; and the fraction of this machine's measured read bandwidth that
  the float32 decode reaches, twice: weight bytes read per step × steps/s ÷ bandwidth (the tables
  Transformer-XL and XLNet read in place of r_net counted instead of it:
  `step_bytes_beside_weights`), and with
  every row's state added to the bytes (attention reads its whole memory each step). The second
  gives the ceiling: the tokens/s of a step that only reads memory, and how much a batch can gain
  over one row at most, since a batch shares the weights' read but reads each row's state. Both
  divide by the larger of two readings, at the start and just before the decode; beside them,
  each float32 round's fraction of the bandwidth read just before and after that round (the
  larger), and their median: on a machine whose reading moves by 2x within a minute, the one
  that says what the decode itself reaches (common.BandwidthProbe).

Results: bench-results/real-size.json and real-size.png (--quick: small shapes, seconds;
`tests/server/test_bench_real_size.py` runs it). Run the full form alone: a second torch-heavy
process skews every figure. On 2 cores it takes about an hour per shape as it stands, almost all
of it feeding the 64k-token histories; `--max-fed-history 2048` (fixed-size states only, said per
row) brings the three shapes to about 12 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from xlserve.models.quantize import weight_bytes_per_step
from xlserve.server.bench.common import (BandwidthProbe, add_run_arguments, decode_ceiling, environment, fill_defaults,
                                         generate_greedy, read_bandwidth, save_results, state_bytes_per_row)
from xlserve.server.bench.sessions import start_redis

# reference shapes: the classes' own argument names, as vs-hf, vs-hf-xlnet and vs-hf-reformer take them
TRANSFO_XL_WT103 = dict(n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096, vocab_size=267735,
                        cutoffs=[20000, 40000, 200000], div_val=4, mem_len=1600, clamp_len=1000)
XLNET_LARGE = dict(n_layer=24, d_model=1024, n_head=16, d_inner=4096, vocab_size=32000, mem_len=512)
REFORMER_ENWIK8 = None  # vs_hf_reformer.FULL, read when used (it imports nothing heavy, but keep the table here)

FULL = dict(shapes=["transfo-xl-wt103", "xlnet-large", "reformer-enwik8"], histories=[1024, 8192, 65536],
            append=128, appends=3, history_chunk=512, decode_prompt=256, decode_tokens=16, decode_rounds=5,
            batch_sizes=[1, 8])
QUICK = dict(shapes=["transfo-xl-wt103", "xlnet-large", "reformer-enwik8"], histories=[64, 256], append=16,
             appends=2, history_chunk=64, decode_prompt=16, decode_tokens=4, decode_rounds=2,
             batch_sizes=[1, 2])
QUICK_SHAPES = {
    "transfo-xl-wt103": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, vocab_size=2000,
                             cutoffs=[200, 1000], div_val=4, mem_len=48, clamp_len=40),
    "xlnet-large": dict(n_layer=2, d_model=64, n_head=2, d_inner=128, vocab_size=500, mem_len=32),
    "reformer-enwik8": dict(attn_layers=["local", "lsh"], hidden_size=64, num_heads=2, head_size=32,
                            feed_forward_size=128, lsh_chunk=16, local_chunk=16, num_hashes=2, num_buckets=8,
                            axial_shape=[16, 16], axial_dims=[16, 48]),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench real-size", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds) instead of the reference shapes")
    parser.add_argument("--shapes", nargs="+", choices=FULL["shapes"])
    parser.add_argument("--histories", type=int, nargs="+", help="tokens of history before the appends")
    parser.add_argument("--append", type=int, help="tokens per append")
    parser.add_argument("--appends", type=int, help="successive appends committed after each history")
    parser.add_argument("--history-chunk", type=int, help="tokens per forward call while feeding a history")
    parser.add_argument("--max-fed-history", type=int, default=None,
                        help="feed at most this many tokens of a longer history, its last ones, and count the "
                             "session as having seen all of them; only for a state of fixed size past its memory "
                             "(Transformer-XL, XLNet with mem_len), where what an append costs cannot depend on "
                             "the tokens before; never fewer than the memory's length (mem_len), and a feed that "
                             "leaves the state short of full is refused; every row says how many were fed "
                             "(default: feed them all)")
    parser.add_argument("--decode-prompt", type=int, help="prompt tokens before the decode is timed")
    parser.add_argument("--decode-tokens", type=int, help="greedy steps timed in each round")
    parser.add_argument("--decode-rounds", type=int,
                        help="rounds of --decode-tokens steps, float32 and int8 at every batch size in turn; "
                             "tokens/s is the median round's")
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--compact-ratio", type=float, default=None,
                        help="XLSERVE_COMPACT_RATIO of the commits' caches (default: the server's)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis commits")
    parser.add_argument("--no-serve", action="store_true", help="skip the real server's load time and memory")
    parser.add_argument("--no-reference", action="store_true", help="skip the Hugging Face decode (it is the slowest part)")
    add_run_arguments(parser, "real-size")
    args = parser.parse_args(argv)
    for option in ("decode_rounds", "decode_tokens"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.compact_ratio is None:
        from xlserve.server.settings import CacheSettings

        args.compact_ratio = CacheSettings.model_fields["compact_ratio"].default
    return fill_defaults(args, "real-size", QUICK if args.quick else FULL)


# -- the shapes --------------------------------------------------------------------------------


def shape_arguments(name: str, quick: bool, seed: int) -> SimpleNamespace:
    """The namespace each vs-hf module's build_reference reads."""
    from xlserve.server.bench import vs_hf_reformer

    full = {"transfo-xl-wt103": TRANSFO_XL_WT103, "xlnet-large": XLNET_LARGE,
            "reformer-enwik8": {k: v for k, v in vs_hf_reformer.FULL.items() if k not in ("prompt_len", "new_tokens")}}
    return SimpleNamespace(**(QUICK_SHAPES if quick else full)[name], seed=seed)


def build_reference(name: str, shape: SimpleNamespace):
    if name == "transfo-xl-wt103":
        from xlserve.server.bench.vs_hf import build_reference
    elif name == "xlnet-large":
        from xlserve.server.bench.vs_hf_xlnet import build_reference
    else:
        from xlserve.server.bench.vs_hf_reformer import build_reference
    return build_reference(shape)


def reference_step(name: str, reference):
    """step(ids (B, T)) -> next-token scores (B, V) for the reference with its own cache."""
    cache = {"mems": None}

    def transfo_xl(ids):
        if cache["mems"] is None:
            cache["mems"] = [torch.zeros(0, ids.shape[0], reference.config.d_model) for _ in range(reference.config.n_layer)]
        out = reference(input_ids=ids, mems=cache["mems"])
        cache["mems"] = out.mems
        return out.prediction_scores[:, -1]

    def xlnet(ids):
        from xlserve.server.bench.vs_hf_xlnet import _step_inputs

        ids, perm_mask, target_mapping = _step_inputs(ids)
        out = reference(ids, mems=cache["mems"], perm_mask=perm_mask, target_mapping=target_mapping, use_mems=True)
        cache["mems"] = [m[:-1] for m in out.mems]  # the dummy position never joins the memory
        return out.logits[:, -1]

    def reformer(ids):
        from xlserve.server.bench.vs_hf_reformer import BYTE_SHIFT

        out = reference(input_ids=ids + BYTE_SHIFT, past_buckets_states=cache["mems"], use_cache=True)
        cache["mems"] = out.past_buckets_states
        return out.logits[:, -1, BYTE_SHIFT:]

    return {"transfo-xl-wt103": transfo_xl, "xlnet-large": xlnet, "reformer-enwik8": reformer}[name]


def state_step(model, batch: int):
    state = model.init_state(batch)

    def step(ids):
        nonlocal state
        out, state = model(ids, state)
        return out[:, -1]

    return step


# -- measurements ------------------------------------------------------------------------------


def drop_from_page_cache(directory: Path) -> None:
    """Write the files under `directory` back and ask the kernel to drop their pages from its
    cache (posix_fadvise DONTNEED, no privilege needed), so that a server started next reads
    them from the disk, as a first start after a download does."""
    for path in directory.rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)  # dirty pages are not dropped
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def process_tree_memory(pid: int) -> dict:
    """Memory of `pid` and its descendants (Linux /proc): `resident_bytes`, the sum of their
    resident sets (a page two of them map, libtorch's code for one, counts in each), and
    `proportional_bytes`, the sum of their proportional sets (a page shared by n processes counts
    1/n in each: the processes' own share, a little less than what they cost where the page is
    shared with a process outside them, as the bench's own libtorch is)."""
    totals, pending = {"resident_bytes": 0, "proportional_bytes": 0}, [pid]
    fields = {"Rss:": "resident_bytes", "Pss:": "proportional_bytes"}
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                name, *value = line.split()
                if name in fields:
                    totals[fields[name]] += int(value[0]) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                pending.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return totals


def stream_completion(port: int, model: str, prompt: list[int], new_tokens: int) -> tuple[list[float], int | None]:
    """One greedy completion of `prompt` (token ids) streamed from the server: the time
    (`time.perf_counter`) each token's chunk came, and the completion tokens its usage reports.
    It asks for log-probabilities (`logprobs: 0`) so that every token has a chunk of its own, even
    one whose text the decoder holds back; a refusal or an error chunk raises RuntimeError."""
    import json
    import urllib.error
    import urllib.request

    # ignore_eos: every run decodes its whole length, and the usage (which counts an end of text,
    # never streamed) matches the chunks
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}, "ignore_eos": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    stamps, generated = [], None
    try:
        answer = urllib.request.urlopen(request, timeout=900)
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"the served completion was refused with {error.code}: {error.read()[:2000]!r}") from None
    with answer:
        for line in answer:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:"):])
            if "error" in chunk:
                raise RuntimeError(f"the served completion failed: {chunk['error']}")
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason") is None:  # a chunk per token; the last says why it ended
                    stamps.append(time.perf_counter())
    return stamps, generated


def served_decode(port: int, model: str, vocab: int, prompt_tokens: int, new_tokens: int) -> dict:
    """One greedy completion streamed from the server, after a prompt of random token ids: the
    median time between its tokens (what a client sees, engine and HTTP together; steps after the
    first, as the in-process decode is timed); an error ends the measurement with that error."""
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    start = time.perf_counter()
    stamps, generated = stream_completion(port, model, prompt, new_tokens)
    if generated != len(stamps):
        raise RuntimeError(f"the server generated {generated} tokens but streamed {len(stamps)} token chunks")
    gaps = [after - before for before, after in zip(stamps, stamps[1:])]
    return {"served_prompt_tokens": prompt_tokens, "served_new_tokens": len(stamps),
            "served_first_token_s": stamps[0] - start if stamps else None,
            "served_decode_tokens_per_s": 1 / statistics.median(gaps) if gaps else None}


def served_batch(port: int, model: str, vocab: int, prompt_tokens: int, new_tokens: int, batch: int) -> dict:
    """`batch` greedy completions streamed from the server at once, each after its own prompt of
    random token ids, as `batch` clients would: the tokens/s of all of them together while every
    one of them is decoding (from the last first token to the first last one), which is what the
    engine's batching makes of the in-process batch decode; when one ended before another's first
    token, every token over the whole span (`served_batch_overlapped` False)."""
    import threading

    stamps: list[list[float]] = [[] for _ in range(batch)]
    errors: list[str] = []

    def stream(row: int) -> None:
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1 + row)).tolist()
        try:
            stamps[row], _ = stream_completion(port, model, prompt, new_tokens)
        except Exception as error:  # reported below, after every client has ended
            errors.append(f"completion {row}: {error}")

    clients = [threading.Thread(target=stream, args=(row,)) for row in range(batch)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    if errors:
        raise RuntimeError("a served completion of the batch failed: " + "; ".join(errors))
    if any(len(row) != new_tokens for row in stamps):
        raise RuntimeError(f"the batch's completions streamed {[len(row) for row in stamps]} tokens, not {new_tokens} each")
    first, last = max(row[0] for row in stamps), min(row[-1] for row in stamps)
    if last > first:
        together = sum(first < stamp <= last for row in stamps for stamp in row)  # the tokens made in that time
        return {"served_batch": batch, "served_batch_new_tokens": new_tokens, "served_batch_overlapped": True,
                "served_batch_tokens_per_s": together / (last - first)}
    # one client ended before another's first token (short completions of a small model on a busy
    # machine): every token over the whole span instead, and said so
    start, end = min(row[0] for row in stamps), max(row[-1] for row in stamps)
    return {"served_batch": batch, "served_batch_new_tokens": new_tokens, "served_batch_overlapped": False,
            "served_batch_tokens_per_s": (sum(len(row) for row in stamps) - batch) / (end - start) if end > start
            else None}


def served_state_move(port: int, model: str, vocab: int, fill_tokens: int) -> dict:
    """A session filled with `fill_tokens` random token ids (the memory's length: its state full)
    moved out and back in over HTTP at the server's default limits, as a client moves a session
    between servers without Redis: the export's bytes and seconds (GET state), and the import's
    (POST /v1/sessions/import, the new session checked to hold every token)."""
    import json
    import urllib.error
    import urllib.request

    def call(method: str, path: str, body: bytes | None = None, json_body: dict | None = None) -> bytes:
        headers = {}
        if json_body is not None:
            body, headers = json.dumps(json_body).encode(), {"content-type": "application/json"}
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=900) as answer:
                return answer.read()
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{method} {path} was refused with {error.code}: {error.read()[:2000]!r}") from None

    tokens = torch.randint(0, vocab, (fill_tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    session = json.loads(call("POST", "/v1/sessions", json_body={"model": model}))["id"]
    start = time.perf_counter()
    call("POST", f"/v1/sessions/{session}/append", json_body={"text": tokens})
    fill_s = time.perf_counter() - start
    start = time.perf_counter()
    state = call("GET", f"/v1/sessions/{session}/state")
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    imported = json.loads(call("POST", "/v1/sessions/import", body=state))
    import_s = time.perf_counter() - start
    if imported["tokens"] != fill_tokens:
        raise RuntimeError(f"the imported session holds {imported['tokens']} tokens, not {fill_tokens}")
    return {"served_state_fill_tokens": fill_tokens, "served_state_fill_s": fill_s,
            "served_state_export_bytes": len(state), "served_state_export_s": export_s,
            "served_state_import_s": import_s}


def served_vocabulary(checkpoint: Path) -> int:
    """The vocabulary of the converted checkpoint, which the server checks token ids against (the
    Reformer's reference has 258 ids, the converted model the 256 bytes)."""
    from xlserve.models.checkpoint import read_config

    return int(read_config(checkpoint)["config"]["vocab_size"])


def serve_and_measure(checkpoint: Path, vocab: int, prompt_tokens: int, new_tokens: int, threads: int = 0,
                      timeout_s: float = 900, batch: int = 1, batch_new_tokens: int = 0, fill_tokens: int = 0) -> dict:
    """Start `xlserve serve` on the checkpoint (on `threads` threads for every forward, as the
    in-process measurements run; 0: the server's defaults, whatever XLSERVE_ settings the caller
    has), its files first dropped from the page cache: seconds to /ready, the processes' memory
    then (`process_tree_memory`), one streamed greedy completion at batch 1 (`served_decode`), for `batch` > 1
    `batch` at once of `batch_new_tokens` each (`served_batch`), and, for `fill_tokens`, a session
    of that many tokens exported and imported again (`served_state_move`)."""
    import json
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state_dir = tempfile.mkdtemp(prefix="xlserve-bench-state-")
    # the server's defaults, whatever the caller's XLSERVE_ settings (XLSERVE_QUANTIZE or
    # XLSERVE_STATE_DTYPE would change figures reported as float32's)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLSERVE_")} | {"XLSERVE_STATE_DIR": state_dir}
    drop_from_page_cache(checkpoint)  # a cold start: convert has just written the file
    threads_arguments = ["--torch-threads", str(threads), "--prompt-threads", str(threads)] if threads else []
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "xlserve.server.cli", "serve", "--host", "127.0.0.1",
                                "--port", str(port), "--models", str(checkpoint), "--log-level", "warning",
                                *threads_arguments],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: "
                                   f"{process.stderr.read().decode(errors='replace')[-2000:]}")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        ready_s = time.perf_counter() - start
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as answer:
            models = json.load(answer)["data"]
        measured = {"ready_s": ready_s, **process_tree_memory(process.pid),
                    "served_state_bytes_per_session": models[0].get("state_bytes_per_session")}
        measured |= served_decode(port, models[0]["id"], vocab, prompt_tokens, new_tokens)
        if batch > 1:
            measured |= served_batch(port, models[0]["id"], vocab, prompt_tokens, batch_new_tokens, batch)
        if fill_tokens:
            measured |= served_state_move(port, models[0]["id"], vocab, fill_tokens)
        return measured
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(state_dir, ignore_errors=True)


def bytes_written_by_this_process() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def redis_bytes_received(url: str) -> int:
    import redis

    return int(redis.Redis.from_url(url).info("stats")["total_net_input_bytes"])


def bytes_sent(store: str, redis_url: str) -> int:
    """The counter a commit to `store` ("disk" or "redis") moves by the bytes it writes."""
    return redis_bytes_received(redis_url) if store == "redis" else bytes_written_by_this_process()


def store_cache(directory: Path, store: str, redis_url: str, compact_ratio: float):
    """A SessionCache without budgets whose last tier is `store` ("disk" or "redis")."""
    from xlserve.server.cache.session_cache import SessionCache

    return SessionCache(directory, None, None, None, redis_url if store == "redis" else "", compact_ratio=compact_ratio)


@torch.inference_mode()
def bytes_per_position(model) -> int:
    """State bytes one more position of history adds while the memory is not yet full: the
    unit of the goal "a 128-token append writes at most 2x the bytes of its 128 new positions".
    0 for a state of fixed size."""
    _, one = model(torch.zeros(1, 1, dtype=torch.long), model.init_state(1))
    _, two = model(torch.zeros(1, 1, dtype=torch.long), one)
    return two.nbytes() - one.nbytes()


@torch.inference_mode()
def feed(model, tokens: torch.Tensor, state, chunk: int):
    """Feed tokens (1, T) in calls of `chunk`, as the engine prefills (forward_scored); the
    next-token row (V,) after the last one and the state."""
    next_rows = None
    for start in range(0, tokens.shape[1], chunk):
        next_rows, _, state = model.forward_scored(tokens[:, start : start + chunk], state)
    return next_rows[0], state


@torch.inference_mode()
def measure_appends(name: str, model, history: int, args, redis_url: str, vocab: int, cycle: bool = False) -> dict:
    from xlserve.server.cache.codec import SessionData, encode

    generator = torch.Generator().manual_seed(history)
    tokens = torch.randint(0, vocab, (1, history + args.append * args.appends), generator=generator)
    fed = history
    if args.max_fed_history and history > args.max_fed_history and model.history_limit is None \
            and model.full_state_bytes() is not None:  # a state of fixed size once its memory is full
        # never fewer than fill the memory: a shorter feed left wt103's 8k row a state of 1,024
        # positions, reported as 8k tokens of history
        fed = min(history, max(args.max_fed_history, getattr(model.config, "mem_len", None) or 0))
    start = time.perf_counter()
    next_row, state = feed(model, tokens[:, history - fed : history], model.init_state(1), args.history_chunk)
    history_s = time.perf_counter() - start
    if fed < history and state.nbytes() != model.full_state_bytes():
        raise SystemExit(f"{name}: --max-fed-history {args.max_fed_history} fed {fed} tokens, which leave its state at "
                         f"{state.nbytes()} of its full {model.full_state_bytes()} bytes: its row would not be a "
                         f"history of {history} tokens; feed more")
    sessions = [SessionData(state=state, tokens=history, next_log_probs=next_row)]
    forward_s = []
    for k in range(args.appends):
        piece = tokens[:, history + k * args.append : history + (k + 1) * args.append]
        start = time.perf_counter()  # the append's forward as the engine runs it, its tokens scored
        next_rows, _, new_state = model.forward_scored(piece, sessions[-1].state)
        forward_s.append(time.perf_counter() - start)
        sessions.append(SessionData(state=new_state, tokens=sessions[-1].tokens + args.append,
                                    next_log_probs=next_rows[0]))
    row = {"shape": name, "history_tokens": history, "history_fed_tokens": fed, "append_tokens": args.append,
           "history_feed_s": history_s, "state_bytes": sessions[-1].nbytes(),
           "whole_blob_bytes": len(encode(sessions[-1], {"session_id": "sess_bench", "model": name})),
           "new_positions_bytes": bytes_per_position(model) * args.append,
           "forward_s": statistics.median(forward_s)}
    for durable in ["disk"] + (["redis"] if redis_url else []):
        with tempfile.TemporaryDirectory(prefix="xlserve-bench-") as directory:
            cache = store_cache(Path(directory) / "state", durable, redis_url, args.compact_ratio)
            cache.open({name: model})
            session_id = cache.create(name, None, sessions[0]).id
            times, written = [], []
            for data in sessions[1:]:
                lease = cache.acquire(session_id, None)
                before = bytes_sent(durable, redis_url)
                start = time.perf_counter()
                cache.commit(lease, data)
                times.append(time.perf_counter() - start)
                # a compaction this commit started runs behind its answer: awaited, untimed, and its
                # bytes counted with the commit that led to it, not with whichever comes next
                if not cache.compactions.wait_idle(timeout=600):
                    raise RuntimeError(f"{name}: a compaction to {durable} did not end within 600 s")
                written.append(bytes_sent(durable, redis_url) - before)
            if durable == "redis":  # empty the shared Redis for the next row
                import redis

                redis.Redis.from_url(redis_url).flushdb()
            cache.close()
        row[f"commit_{durable}_s"] = statistics.median(times)
        row[f"bytes_per_commit_{durable}"] = int(statistics.median(written))
        row[f"append_with_{durable}_commit_over_forward"] = (row["forward_s"] + row[f"commit_{durable}_s"]) / row["forward_s"]
        if row["new_positions_bytes"]:
            row[f"bytes_per_commit_{durable}_over_new_positions"] = row[f"bytes_per_commit_{durable}"] / row["new_positions_bytes"]
    if cycle:
        row["compaction_cycle"] = compaction_cycle(name, model, sessions, args, redis_url, vocab, seed=history + 1,
                                                   new_positions=row["new_positions_bytes"], forward_s=row["forward_s"])
    return row


MAX_CYCLE_COMMITS = 64  # a state that has not compacted by then is reported as such


def compaction_cycle(name: str, model, sessions: list, args, redis_url: str, vocab: int, seed: int,
                     new_positions: int, forward_s: float) -> dict:
    """What a commit writes amortized over a whole cycle of its session's log: the session written
    whole at `sessions[0]`, then appends of `args.append` tokens (`sessions[1:]`, then more) each
    committed, until the commit whose block takes the log past XLSERVE_COMPACT_RATIO times the
    base has been followed by its compaction, which writes the session whole again. The bytes of
    those commits and of the compaction over the number of commits: the figure a long session
    costs per append, where the median commit leaves the compactions out. Committed to disk and
    to Redis by turns, each store's bytes counted as `measure_appends` counts them, with the
    compaction awaited inside its commit's count. `new_positions`: the bytes of one append's new
    positions (`measure_appends`' row), the unit of the ratio reported. The seconds too: the
    commits' own and the compaction's (which runs behind its commit's answer, but holds the
    session meanwhile and takes the machine's time), over the commits, and an append with its
    commit amortized so over `forward_s`, the append's forward: what the median commit of
    `measure_appends` leaves out."""
    from xlserve.server.cache.codec import SessionData, encode

    generator = torch.Generator().manual_seed(seed)
    stores = ["disk"] + (["redis"] if redis_url else [])
    result = {store: {"commits": 0, "bytes": 0, "compacted": False, "commit_s": 0.0, "compaction_s": 0.0}
              for store in stores}
    with tempfile.TemporaryDirectory(prefix="xlserve-bench-") as directory:
        caches = {}
        try:
            for store in stores:
                cache = store_cache(Path(directory) / store, store, redis_url, args.compact_ratio)
                caches[store] = (cache, None)  # closed below whatever happens next
                cache.open({name: model})
                caches[store] = (cache, cache.create(name, None, sessions[0]).id)
            data = sessions[0]
            for k in range(1, MAX_CYCLE_COMMITS + 1):
                if k < len(sessions):
                    data = sessions[k]
                else:  # the next append, as measure_appends makes them
                    piece = torch.randint(0, vocab, (1, args.append), generator=generator)
                    next_rows, _, state = model.forward_scored(piece, data.state)
                    data = SessionData(state=state, tokens=data.tokens + args.append, next_log_probs=next_rows[0])
                for store, (cache, session_id) in caches.items():
                    if result[store]["compacted"]:
                        continue
                    lease = cache.acquire(session_id, None)
                    before = bytes_sent(store, redis_url)
                    start = time.perf_counter()
                    cache.commit(lease, data)
                    answered = time.perf_counter()
                    if not cache.compactions.wait_idle(timeout=600):
                        raise RuntimeError(f"{name}: a compaction to {store} did not end within 600 s")
                    result[store]["commit_s"] += answered - start
                    result[store]["compaction_s"] += time.perf_counter() - answered
                    result[store]["bytes"] += bytes_sent(store, redis_url) - before
                    result[store]["commits"] += 1
                    # behind the answer, or by a commit whose log could not wait: both count as "compaction"
                    result[store]["compacted"] = cache.durable.written.get("compaction", [0])[0] > 0
                if all(r["compacted"] for r in result.values()):
                    break
        finally:
            for cache, _ in caches.values():
                cache.close()
            if redis_url:  # empty the bench's own Redis for what follows
                import redis

                with contextlib.suppress(redis.RedisError):  # an error that stopped the cycle says more
                    redis.Redis.from_url(redis_url).flushdb()
    # the cycle's length follows from its base, the session as created: the whole state once its
    # memory was full at the history, less before
    base_bytes = len(encode(sessions[0], {"session_id": "sess_bench", "model": name}))
    for r in result.values():
        r["base_blob_bytes"] = base_bytes
        r["bytes_per_commit"] = r["bytes"] / r["commits"]
        r["seconds_per_commit"] = (r["commit_s"] + r["compaction_s"]) / r["commits"]
        r["append_with_commit_over_forward_amortized"] = (forward_s + r["seconds_per_commit"]) / forward_s
        if new_positions:
            r["bytes_per_commit_over_new_positions"] = r["bytes_per_commit"] / new_positions
    return result


class GreedyRounds:
    """Greedy decoding through `step` (`state_step`: ids -> the next token's scores) resumed in rounds: the prompt once,
    then each `decode(steps)` goes on from where the last round ended, timed on its own. Rounds of
    several runs alternate (float32, int8, batch 1, batch 8), so a ratio between two of them
    compares steps taken under the same load of this machine, not minutes apart."""

    def __init__(self, step, prompt: torch.Tensor):
        self.step = step
        self.scores = step(prompt)  # (B, V): the next token's scores after the prompt
        self.tokens: list[torch.Tensor] = []  # (B, steps) per round
        self.seconds: list[float] = []

    def decode(self, steps: int) -> None:
        tokens = []
        start = time.perf_counter()
        for _ in range(steps):
            token = self.scores.max(-1, keepdim=True).indices  # (B, 1): argmax, as the engine takes it
            tokens.append(token)
            self.scores = self.step(token)
        self.seconds.append(time.perf_counter() - start)
        self.tokens.append(torch.cat(tokens, 1))

    def tokens_per_s(self, batch: int, steps: int) -> float:
        """At the median round's speed."""
        return batch * steps / statistics.median(self.seconds)

    def by_round(self, batch: int, steps: int) -> list[float]:
        """Each round's tokens/s."""
        return [batch * steps / seconds for seconds in self.seconds]

    def spread(self, batch: int, steps: int) -> list[float]:
        """The slowest and fastest round's tokens/s."""
        return [min(self.by_round(batch, steps)), max(self.by_round(batch, steps))]


@torch.inference_mode()
def measure_decode(name: str, model, reference, args, vocab: int, bandwidth: float) -> list[dict]:
    from xlserve.models.huge_pages import weights_on_huge_pages
    from xlserve.models.quantize import quantize_model

    import copy

    quantized = copy.deepcopy(model)
    for tensor in (*quantized.parameters(), *quantized.buffers()):  # each its own storage, as loaded
        tensor.data = tensor.data.clone()  # (a deepcopy makes the moved weights views of one storage)
    quantized = weights_on_huge_pages(quantize_model(quantized, "int8"))  # as the engine loads it
    steps, rounds = args.decode_tokens, args.decode_rounds
    # a row's state halfway through the timed steps: what each step reads beside the weights
    halfway = args.decode_prompt + rounds * steps // 2
    state_bytes = state_bytes_per_row(model, halfway, vocab)
    # and what it reads that every row shares: the weights, and the tables some architectures
    # read in place of a weight (Transformer-XL's relative keys instead of r_net)
    float32_read = weight_bytes_per_step(model) + model.step_bytes_beside_weights(halfway)
    int8_read = weight_bytes_per_step(quantized) + quantized.step_bytes_beside_weights(halfway)
    runs, prompts = {}, {}
    for batch in args.batch_sizes:
        prompts[batch] = torch.randint(0, vocab, (batch, args.decode_prompt), generator=torch.Generator().manual_seed(batch))
        for kind, weights in (("float32", model), ("int8", quantized)):
            generate_greedy(state_step(weights, batch), prompts[batch][:, :4], 1)  # warm up
            runs[batch, kind] = GreedyRounds(state_step(weights, batch), prompts[batch])
    references = {}
    # the bandwidth read just before and just after each float32 round, the larger of the two: this
    # machine's reading can move by 2x within a minute (BandwidthProbe), so a fraction against a
    # reading taken minutes before says more about that minute than about the decode
    probe = BandwidthProbe(0.25 if args.quick else 1.0)
    beside = {key: [] for key in runs if key[1] == "float32"}
    for round_index in range(rounds):
        # every other round the other way round: no run always comes first, or after the same one
        order = list(runs.items())
        for key, run in order if round_index % 2 == 0 else reversed(order):
            if key in beside:
                before = probe.read(3)
                run.decode(steps)
                beside[key].append(max(before, probe.read(3)))
            else:
                run.decode(steps)
        if reference is not None and round_index == rounds // 2:
            # the reference once (it is the slowest part by far), amid xlserve's rounds rather than
            # minutes after them: its ratio compares steps taken under the same load of this machine
            for batch in args.batch_sizes:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    generate_greedy(reference_step(name, reference), prompts[batch][:, :4], 1)
                    references[batch] = generate_greedy(reference_step(name, reference), prompts[batch], steps)
    rows = []
    for batch in args.batch_sizes:
        ours, int8 = runs[batch, "float32"], runs[batch, "int8"]
        row = {"shape": name, "batch_size": batch, "prompt_tokens": args.decode_prompt, "new_tokens": steps,
               "rounds": rounds,
               "xlserve_float32_tokens_per_s": ours.tokens_per_s(batch, steps),
               "xlserve_int8_tokens_per_s": int8.tokens_per_s(batch, steps),
               "xlserve_float32_tokens_per_s_spread": ours.spread(batch, steps),
               "xlserve_int8_tokens_per_s_spread": int8.spread(batch, steps),
               "xlserve_float32_tokens_per_s_by_round": ours.by_round(batch, steps),
               "xlserve_int8_tokens_per_s_by_round": int8.by_round(batch, steps),
               "int8_tokens_equal_float32": float((int8.tokens[0] == ours.tokens[0]).float().mean()),
               "weight_bytes_per_step_float32": float32_read, "weight_bytes_per_step_int8": int8_read}
        row["read_bandwidth_bytes_per_s"] = bandwidth  # what the fractions divide by
        row["float32_bandwidth_fraction"] = (row["weight_bytes_per_step_float32"]
                                             * row["xlserve_float32_tokens_per_s"] / batch / bandwidth)
        # each round's against the bandwidth read beside it, and their median
        row["read_bandwidth_beside_rounds_bytes_per_s"] = beside[batch, "float32"]
        row["float32_bandwidth_fraction_by_round"] = [
            row["weight_bytes_per_step_float32"] * tokens_per_s / batch / read
            for tokens_per_s, read in zip(row["xlserve_float32_tokens_per_s_by_round"], beside[batch, "float32"])]
        row["float32_bandwidth_fraction_beside"] = statistics.median(row["float32_bandwidth_fraction_by_round"])
        ceiling = decode_ceiling(row["weight_bytes_per_step_float32"], state_bytes, batch, bandwidth)
        row["state_bytes_per_row"] = state_bytes
        row["bytes_read_per_step_float32"] = ceiling["bytes_read_per_step"]
        row["float32_ceiling_tokens_per_s"] = ceiling["ceiling_tokens_per_s"]
        # the same fraction counting every byte a step reads: its tokens/s over the ceiling's
        row["float32_read_fraction"] = row["xlserve_float32_tokens_per_s"] / ceiling["ceiling_tokens_per_s"]
        # the ratio within each round (the two runs one after the other), and its median: the median
        # rounds of the two runs may come from different minutes of this machine
        row["int8_over_float32_by_round"] = [f / i for f, i in zip(ours.seconds, int8.seconds)]
        row["int8_over_float32"] = statistics.median(row["int8_over_float32_by_round"])
        if batch in references:
            ref = references[batch]
            row["reference_tokens_per_s"] = batch * steps / ref["decode_s"]
            row["reference_after_round"] = rounds // 2 + 1
            row["identical_tokens"] = torch.equal(ours.tokens[0], ref["tokens"])
            row["float32_over_reference"] = row["xlserve_float32_tokens_per_s"] / row["reference_tokens_per_s"]
        rows.append(row)
        print(f"  decode batch {batch}: float32 {row['xlserve_float32_tokens_per_s']:.2f} tok/s, int8 "
              f"{row['xlserve_int8_tokens_per_s']:.2f}, reference {row.get('reference_tokens_per_s', float('nan')):.2f}",
              flush=True)
    one = next((r for r in rows if r["batch_size"] == 1), None)
    for row in rows:
        if one is not None:
            # a batch's gain within each round (batch 1 and this batch in the same round), and its median
            for kind in ("float32", "int8"):
                alone, batched = runs[1, kind].seconds, runs[row["batch_size"], kind].seconds
                row[f"{kind}_over_batch_1_by_round"] = [row["batch_size"] * a / b for a, b in zip(alone, batched)]
                row[f"{kind}_over_batch_1"] = statistics.median(row[f"{kind}_over_batch_1_by_round"])
            # the most a batch can gain over one row when reading memory is all a step does
            row["ceiling_over_batch_1"] = row["float32_ceiling_tokens_per_s"] / one["float32_ceiling_tokens_per_s"]
    return rows


def tiers(state_bytes: int | None) -> dict:
    """Sessions at full memory that fit each tier at its default budget."""
    from xlserve.server.settings import CacheSettings

    budgets = {tier: CacheSettings.model_fields[f"{tier}_state_bytes"].default for tier in ("device", "host", "disk")}
    return {tier: (None if not state_bytes else budget // state_bytes) for tier, budget in budgets.items()} | {
        "budgets": budgets}


def sentencepiece_model(vocab_size: int) -> bytes:
    """A sentencepiece model of exactly `vocab_size` pieces, trained here in a fraction of a second:
    a few hundred pieces learnt from two stdlib sources, the rest made-up words (the bench
    measures speed and bytes; what the pieces are does not matter, only that there are as many as
    the model's vocabulary)."""
    import inspect
    import io
    import json

    import sentencepiece

    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    learnt = min(300, vocab_size // 2)
    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]), model_writer=buffer,
        vocab_size=vocab_size, model_type="unigram", character_coverage=1.0, minloglevel=2, hard_vocab_limit=False,
        control_symbols=["<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"],
        user_defined_symbols=[f"\u2581w{i}" for i in range(vocab_size - learnt)])
    pieces = sentencepiece.SentencePieceProcessor(model_proto=buffer.getvalue()).get_piece_size()
    if pieces != vocab_size:
        raise RuntimeError(f"the made-up sentencepiece model has {pieces} pieces, not {vocab_size}")
    return buffer.getvalue()


def measure_shape(name: str, args, redis_url: str, bandwidth: float) -> dict:
    from xlserve.models.checkpoint import load_checkpoint
    from xlserve.models.convert import convert
    from xlserve.models.huge_pages import weights_on_huge_pages
    from xlserve.server.engine.process import session_bytes_when_full

    print(f"{name}: building the reference", flush=True)
    shape = shape_arguments(name, args.quick, args.seed)
    reference = build_reference(name, shape)
    with tempfile.TemporaryDirectory(prefix="xlserve-real-size-") as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference.save_pretrained(Path(tmp) / "hf")
        symbols = None
        if name == "transfo-xl-wt103":  # a word-level model serves with its symbol list: a made-up one
            symbols = Path(tmp) / "vocab.txt"
            words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(shape.vocab_size - 2)]
            symbols.write_text("\n".join(words) + "\n")
        if name == "xlnet-large":  # and a sentencepiece model serves with its spiece.model: a made-up one
            (Path(tmp) / "hf" / "spiece.model").write_bytes(sentencepiece_model(shape.vocab_size))
        start = time.perf_counter()
        convert(Path(tmp) / "hf", Path(tmp) / "xlserve", symbols)
        convert_s = time.perf_counter() - start
        # the batch streams as many tokens as the in-process decode times (its rounds together)
        served = None if args.no_serve else serve_and_measure(
            Path(tmp) / "xlserve", served_vocabulary(Path(tmp) / "xlserve"), args.decode_prompt, args.decode_tokens,
            args.threads, batch=max(args.batch_sizes), batch_new_tokens=args.decode_tokens * args.decode_rounds,
            # the memory's length (the state full); the Reformer's grows: the shortest history's
            fill_tokens=getattr(shape, "mem_len", None) or min(args.histories))
        start = time.perf_counter()
        model = load_checkpoint(Path(tmp) / "xlserve").eval()
        load_s = time.perf_counter() - start
        weights_on_huge_pages(model)  # as the engine loads it (not counted in load_s)
    vocab = model.vocab_size
    result = {"shape": name, "setting": {k: v for k, v in vars(shape).items() if k != "seed"},
              "parameters": sum(p.numel() for p in model.parameters()),
              "convert_s": convert_s, "load_checkpoint_s": load_s, "served": served,
              # what a session counts against the tiers once its memory is full: the state and its
              # float32 next-token row, as /v1/models reports it
              "state_bytes_per_session": {"float32": session_bytes_when_full(model, torch.float32),
                                          "bfloat16": session_bytes_when_full(model, torch.bfloat16)}}
    result["sessions_per_tier"] = {dtype: tiers(b) for dtype, b in result["state_bytes_per_session"].items()}
    limit = model.history_limit
    result["appends"] = []
    # a cycle long enough to compact fits the model's context (the Reformer's grows)
    fits = [h for h in args.histories if limit is None or h + args.append * MAX_CYCLE_COMMITS <= limit]
    for history in args.histories:
        if limit is not None and history + args.append * args.appends > limit:
            result["appends"].append({"shape": name, "history_tokens": history, "skipped": f"past max_context {limit}"})
            continue
        print(f"  history {history}", flush=True)
        # the compaction cycle after the longest history: the memory full, as a long session's
        cycle = bool(fits) and history == max(fits)
        result["appends"].append(measure_appends(name, model, history, args, redis_url, vocab, cycle))
    reference = None if args.no_reference else reference
    # the bandwidth again, minutes later, just before the decode it divides: this machine's speed
    # moves by a quarter within an hour; the larger reading makes the fraction the harder goal
    result["read_bandwidth_before_decode_bytes_per_s"] = read_bandwidth(0.25 if args.quick else 1.0)
    bandwidth = max(bandwidth, result["read_bandwidth_before_decode_bytes_per_s"])
    print(f"  read bandwidth before the decode: {result['read_bandwidth_before_decode_bytes_per_s'] / 1e9:.1f} GB/s",
          flush=True)
    result["decode"] = measure_decode(name, model, reference, args, vocab, bandwidth)
    return result


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(0.25 if args.quick else 1.0)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    redis_process, redis_url, redis_dir = None, "", None
    if not args.no_redis and shutil.which("redis-server"):
        redis_dir = tempfile.mkdtemp(prefix="xlserve-bench-redis-")
        redis_process, redis_url = start_redis(redis_dir)
    try:
        shapes = [measure_shape(name, args, redis_url, bandwidth) for name in args.shapes]
    finally:
        if redis_process is not None:
            redis_process.kill()
            redis_process.wait()
            shutil.rmtree(redis_dir, ignore_errors=True)
    return {"benchmark": "real-size", "quick": args.quick, "read_bandwidth_bytes_per_s": bandwidth,
            "setting": {k: getattr(args, k) for k in ("histories", "max_fed_history", "append", "appends", "history_chunk",
                                                      "compact_ratio", "decode_prompt", "decode_tokens", "decode_rounds",
                                                      "batch_sizes", "seed")},
            "environment": environment(with_transformers=True), "shapes": shapes}


# -- output ------------------------------------------------------------------------------------


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def print_table(result: dict) -> None:
    print(f"\nread bandwidth at the start {result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    for shape in result["shapes"]:
        served = shape["served"] or {}
        print(f"\n{shape['shape']}: {shape['parameters'] / 1e6:.0f} M parameters; served ready in "
              f"{served.get('ready_s', float('nan')):.1f} s, resident {_mb(served.get('resident_bytes'))} "
              f"({_mb(served.get('proportional_bytes'))} proportional), "
              f"decode over HTTP {served.get('served_decode_tokens_per_s') or float('nan'):.2f} tokens/s, "
              f"{served.get('served_batch_tokens_per_s') or float('nan'):.2f} with {served.get('served_batch', '-')} "
              "clients at once; "
              f"state per session {_mb(shape['state_bytes_per_session']['float32'])} float32, "
              f"{_mb(shape['state_bytes_per_session']['bfloat16'])} bfloat16")
        fits = shape["sessions_per_tier"]["float32"]
        print(f"  sessions at default budgets (float32): device {fits['device']}, host {fits['host']}, disk {fits['disk']}")
        if served.get("served_state_export_bytes"):
            print(f"  a session of {served['served_state_fill_tokens']} tokens over HTTP: export "
                  f"{_mb(served['served_state_export_bytes'])} in {served['served_state_export_s']:.2f} s, import "
                  f"{served['served_state_import_s']:.2f} s (at the default body limits)")
        print("  history | forward | disk commit | redis commit | whole blob | new positions | bytes/commit disk | redis")
        for row in shape["appends"]:
            if "skipped" in row:
                print(f"  {row['history_tokens']:>7} | skipped: {row['skipped']}")
                continue
            print(f"  {row['history_tokens']:>7} | {row['forward_s'] * 1000:7.0f} ms | "
                  f"{row['commit_disk_s'] * 1000:8.0f} ms | {row.get('commit_redis_s', float('nan')) * 1000:9.0f} ms | "
                  f"{_mb(row['whole_blob_bytes'])} | {_mb(row['new_positions_bytes'])} | "
                  f"{_mb(row['bytes_per_commit_disk'])} | {_mb(row.get('bytes_per_commit_redis'))}")
        for row in shape["appends"]:
            for store, cycle in row.get("compaction_cycle", {}).items():
                print(f"  compaction cycle after {row['history_tokens']} tokens (a base of "
                      f"{_mb(cycle['base_blob_bytes'])}), {store}: {cycle['commits']} commits "
                      f"{'and their compaction' if cycle['compacted'] else '(no compaction)'} wrote "
                      f"{_mb(cycle['bytes'])}, {_mb(cycle['bytes_per_commit'])} a commit amortized "
                      f"({cycle.get('bytes_per_commit_over_new_positions', float('nan')):.2f}x its new positions); "
                      f"{cycle['commit_s'] + cycle['compaction_s']:.2f} s of commits and compaction "
                      f"({cycle['compaction_s']:.2f} s of it the compaction), "
                      f"{cycle['seconds_per_commit'] * 1000:.0f} ms a commit amortized: append + commit "
                      f"{cycle['append_with_commit_over_forward_amortized']:.2f}x the forward")
        print(f"  read bandwidth before the decode {shape['read_bandwidth_before_decode_bytes_per_s'] / 1e9:.1f} GB/s; "
              f"the fractions divide by the larger reading, {shape['decode'][0]['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
        for row in shape["decode"]:
            readings = [f"{b / 1e9:.1f}" for b in row["read_bandwidth_beside_rounds_bytes_per_s"]]
            fractions = [f"{f:.2f}" for f in row["float32_bandwidth_fraction_by_round"]]
            print(f"  batch {row['batch_size']}, float32 rounds: bandwidth read beside each {', '.join(readings)} GB/s; "
                  f"fraction of it (weights) {', '.join(fractions)}, median {row['float32_bandwidth_fraction_beside']:.2f}")
        print("  batch | float32 tok/s | int8 tok/s | int8 ÷ float32 (rounds) | reference tok/s | identical "
              "| fraction: weights | weights + state | ceiling tok/s | over batch 1: float32, int8 (ceiling)")
        for row in shape["decode"]:
            by_round = row["int8_over_float32_by_round"]
            print(f"  {row['batch_size']:>5} | {row['xlserve_float32_tokens_per_s']:13.2f} | "
                  f"{row['xlserve_int8_tokens_per_s']:10.2f} | "
                  f"{row['int8_over_float32']:4.2f} ({min(by_round):.2f}-{max(by_round):.2f}){'':>9} | "
                  f"{row.get('reference_tokens_per_s', float('nan')):15.2f} | "
                  f"{row.get('identical_tokens', '-')!s:>9} | {row['float32_bandwidth_fraction']:17.2f} | "
                  f"{row['float32_read_fraction']:15.2f} | {row['float32_ceiling_tokens_per_s']:13.2f} | "
                  f"{row.get('float32_over_batch_1', float('nan')):.2f}, {row.get('int8_over_batch_1', float('nan')):.2f} "
                  f"({row.get('ceiling_over_batch_1', float('nan')):.2f})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["shapes"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    left, right = axes
    labels, whole, disk, redis_bytes, new = [], [], [], [], []
    for shape in shapes:
        for row in shape["appends"]:
            if "skipped" in row:
                continue
            labels.append(f"{shape['shape']}\n{row['history_tokens']} tok")
            whole.append(row["whole_blob_bytes"])
            disk.append(row["bytes_per_commit_disk"])
            redis_bytes.append(row.get("bytes_per_commit_redis", 0))
            new.append(row["new_positions_bytes"])
    width = 0.2
    xs = range(len(labels))
    series = [(whole, "whole state (before delta commits)"), (disk, "written to disk"), (redis_bytes, "sent to Redis"),
              (new, "the new positions")]
    series = [(values, label) for values, label in series if any(values)]  # no Redis bars in a run without Redis
    for k, (values, label) in enumerate(series):
        left.bar([x + (k - (len(series) - 1) / 2) * width for x in xs], [max(v, 1) for v in values], width, label=label)
    left.set_xticks(list(xs), labels, fontsize=6)
    left.set_yscale("log")
    left.set_ylabel(f"bytes per commit of a {result['setting']['append']}-token append")
    left.set_title("What a commit writes", fontsize=9)
    left.legend(fontsize=7)
    rows = [(shape["shape"], row) for shape in shapes for row in shape["decode"]]
    xs = range(len(rows))
    series = [("xlserve_float32_tokens_per_s", "xlserve float32"), ("xlserve_int8_tokens_per_s", "xlserve int8"),
              ("reference_tokens_per_s", "transformers")]
    for k, (key, label) in enumerate(series):
        right.bar([x + (k - 1) * 0.27 for x in xs], [row.get(key, 0) or 0 for _, row in rows], 0.27, label=label)
    right.set_xticks(list(xs), [f"{name}\nbatch {row['batch_size']}" for name, row in rows], fontsize=6)
    right.set_yscale("log")
    right.set_ylabel("greedy decode tokens / s")
    used = sorted({row["read_bandwidth_bytes_per_s"] / 1e9 for _, row in rows})  # each shape's, read before its decode
    span = f"{used[0]:.1f}" if used[-1] - used[0] < 0.05 else f"{used[0]:.1f}-{used[-1]:.1f}"
    right.set_title(f"Decode ({result['environment']['threads']} threads, read bandwidth {span} GB/s)", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    save_results(run(args), args.out, plot, print_table)
