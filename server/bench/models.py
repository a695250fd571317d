"""`xlserve bench models`: every shipped checkpoint side by side, whatever its architecture.

One row per checkpoint (by default every directory under --weights-dir with a config.json and a
card.md; or those named by --models), measured in process through the model's `forward` and its
`State` (no server):
- parameters, and held-out bits per byte: the "trained" row of the checkpoint's evaluation.json
  (`xlserve eval --write-card`: every held-out file scored left to right from an empty state
  carried across the file); missing (null) when the checkpoint has no evaluation;
- state bytes of one session (`State.nbytes()`, what the session cache keeps and counts) after
  4 KB and 64 KB of history (--state-histories);
- time to append 128 tokens (one forward) to a session holding 1k / 10k / 64k tokens of
  history (--histories): each timed append starts from a clone of the same state, the histories
  are timed round-robin (drift falls on each alike), median of --repeats rounds after a warm-up;
- decode tokens/s at batch 1 and 16 (--batch-sizes): greedy, one token per step, from the state
  after the first state history, the batch made of copies of that session joined by
  `State.concat` (as the engine batches rows); generated tokens (all rows) per second, median of
  a few runs.
- with --state-dtype bfloat16 (or float16): the session state in that dtype against float32
  (XLSERVE_STATE_DTYPE), in `state_dtype`: the state bytes after each state history in both, and
  held-out bits per byte of the first --state-dtype-tokens held-out tokens scored as a session of
  turns of --turn tokens, once with the state kept in float32 and once with it rounded to the
  state dtype after every turn (as the session cache stores it at each commit); their difference
  (the issue's bound is 0.01). The model computes in float32 in both; the next turn's first token
  is scored from the float32 next-token row, which the cache keeps as it is.
- with --quantize int8: every checkpoint quantized at load as XLSERVE_QUANTIZE=int8 does
  (models/quantize.py), so the appends and decode rates are the int8 model's; the row's
  `quantize` gives the weight bytes in float32 and in int8. Its bits_per_byte stay the card's
  (float32): tests/models/test_quantize.py holds int8 within 0.02 of them. Compare with a run
  without the flag (results go to models-int8[-quick].json).
Histories are held-out stdlib text, fed in chunks of --chunk tokens, one pass that keeps the
state at each length. A model with a fixed context of L bytes (`max_context`, the vanilla
transformer) keeps nothing older than its last L bytes, so it is fed only those, when
`check_state` accepts the result as the state of a session of the full length (feeding it 64k
bytes would cost 64k forwards over its window); `history_fed_tokens` says so in the JSON.

A model that stops at its `max_context` (the Reformer: longer histories are refused, it does not
slide) is measured only where the history, and the history plus the append, fit: null in the
JSON, `-` in the table, past that. When a requested history passes the limit, its state is also
measured at the limit (`state_bytes_at_history_limit`; null when every history fits, as in
--quick), and it decodes from the longest measured history that leaves room for the decoded
tokens when the first state history does not (`decode_after_tokens`).

Results: bench-results/models.json (--quick: models-quick.json) and a plot beside it (bits per
byte against state bytes after the longest state history, log x, one point per checkpoint), and a
table. Run it alone: a second torch-heavy process on the same cores slows both.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.quantize import QUANTIZE_MODES, parameter_count, quantize_model, weight_bytes
from xlserve.models.training.card import STATE_HISTORIES
from xlserve.server.cache.codec import STATE_DTYPES, SessionData, floating_dtypes
from xlserve.server.bench.common import environment, figure, save_results
from xlserve.server.bench.continuation import held_out_text, sync
from xlserve.server.settings import BENCH_RESULTS_DIR, WEIGHTS_DIR, checkpoint_dir

DEFAULTS = dict(histories="1024,10240,65536", state_histories=",".join(map(str, STATE_HISTORIES)),
                decode=64, repeats=5, state_dtype_tokens=16384)
QUICK = dict(histories="128,512", state_histories="256,1024", decode=8, repeats=2, state_dtype_tokens=1024)
# the bound on the held-out bits per byte lost by keeping the state in 16 bits
STATE_DTYPE_BOUND = 0.01


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xlserve bench models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help="comma list of names under --weights-dir or paths "
                             "(default: every checkpoint there with a card.md)")
    parser.add_argument("--weights-dir", default=str(WEIGHTS_DIR))
    parser.add_argument("--histories", default=None,
                        help=f"history lengths (tokens) the append is timed after (default {DEFAULTS['histories']})")
    parser.add_argument("--state-histories", default=None,
                        help="history lengths (tokens) the state bytes are given after "
                             f"(default {DEFAULTS['state_histories']})")
    parser.add_argument("--append", type=int, default=128, help="tokens appended per timed append")
    parser.add_argument("--decode", type=int, default=None,
                        help=f"greedy steps timed per decode run (default {DEFAULTS['decode']})")
    parser.add_argument("--batch-sizes", default="1,16", help="decode batch sizes")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed rounds of appends (default {DEFAULTS['repeats']}); decode: half as many runs")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per forward call while feeding a history")
    parser.add_argument("--state-dtype", choices=[d for d in STATE_DTYPES if d != "float32"], default=None,
                        help="also measure the session state kept in this dtype against float32: its bytes, and "
                             "held-out bits per byte with the state rounded to it after every turn")
    parser.add_argument("--state-dtype-tokens", type=int, default=None,
                        help="held-out tokens scored for --state-dtype "
                             f"(default {DEFAULTS['state_dtype_tokens']}; --quick {QUICK['state_dtype_tokens']})")
    parser.add_argument("--turn", type=int, default=128,
                        help="tokens per turn for --state-dtype: the state is stored after each")
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, default="none",
                        help="int8: measure every checkpoint with weight-only int8 linear layers (XLSERVE_QUANTIZE)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small settings for tests ({QUICK}); the numbers say nothing about the full ones")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="results JSON (default bench-results/models[-quick].json)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.histories = _lengths(args.histories)
    args.state_histories = _lengths(args.state_histories)
    args.batch_sizes = _lengths(args.batch_sizes)
    if args.out is None:
        quantized = "" if args.quantize == "none" else f"-{args.quantize}"
        args.out = str(BENCH_RESULTS_DIR / f"models{quantized}{'-quick' if args.quick else ''}.json")
    return args


def _lengths(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"expected a comma list of positive integers, got '{text}'")
    return values


def checkpoints(models: str | None, weights_dir: Path) -> list[Path]:
    """The checkpoints to measure: those named, or every shipped one under `weights_dir` (a
    directory with a config.json and a card.md)."""
    if models:
        paths = [checkpoint_dir(name.strip(), weights_dir) for name in models.split(",") if name.strip()]
        missing = [str(p) for p in paths if not (p / "config.json").is_file()]
        if missing:
            raise SystemExit(f"no checkpoint at {', '.join(missing)}")
        return paths
    paths = sorted(p for p in weights_dir.iterdir() if (p / "config.json").is_file() and (p / "card.md").is_file()) \
        if weights_dir.is_dir() else []
    if not paths:
        raise SystemExit(f"no checkpoint with a card.md under {weights_dir}")
    return paths


def held_out_bits_per_byte(directory: Path) -> dict | None:
    """The "trained" row of the checkpoint's evaluation.json (models/training/card.py), or None."""
    path = directory / "evaluation.json"
    if not path.is_file():
        return None
    return next((row for row in json.loads(path.read_text()) if row.get("memory") == "trained"), None)


def feed(model, tokens: list[int], state, chunk: int):
    """`tokens` through the model in calls of `chunk`: the last call's next-token row and the state."""
    log_probs = None
    for start in range(0, len(tokens), chunk):
        piece = torch.tensor([tokens[start:start + chunk]], device=model.device)
        log_probs, state = model(piece, state)
    return log_probs[0, -1], state


def history_states(model, tokens: list[int], marks: list[int], chunk: int) -> dict[int, dict]:
    """For each history length in `marks`: the session's state, its next-token row, and how many
    tokens were fed to get it. One pass over the longest history, keeping a copy at each mark;
    a fixed-context model (see the module docstring) is fed only the last max_context tokens
    before each mark when its check accepts that as the state after the whole history. A model
    that stops at max_context (the Reformer) gets only the marks it can hold."""
    if model.sliding_window is not None:
        found = {}
        for mark in marks:
            start = max(0, mark - model.max_context)
            row, state = feed(model, tokens[start:mark], model.init_state(1), chunk)
            try:
                model.check_state(state, mark)
            except ValueError:
                break
            found[mark] = {"state": state, "next": row, "fed": mark - start}
        else:
            return found
    found, state, done, limit = {}, model.init_state(1), 0, model.history_limit
    for mark in sorted(set(marks)):
        if limit is not None and mark > limit:
            break
        row = None
        for start in range(done, mark, chunk):
            piece = torch.tensor([tokens[start:min(start + chunk, mark)]], device=model.device)
            log_probs, state = model(piece, state)
            row = log_probs[0, -1]
        done = mark
        found[mark] = {"state": state.clone(), "next": row.clone(), "fed": mark}
    return found


def time_appends(model, sessions: dict[int, dict], appended: dict[int, list[int]],
                 repeats: int) -> dict[int, list[float]]:
    """Seconds to append `appended[h]` (one forward) to the session of each history h, `repeats`
    rounds round-robin over the histories after a warm-up round; every append starts from a
    fresh clone of the session's state (the clone is not timed)."""
    device = model.device
    pieces = {h: torch.tensor([new], device=device) for h, new in appended.items()}
    times = {h: [] for h in appended}
    for round_index in range(repeats + 1):  # round 0 warms up
        for history, piece in pieces.items():
            state = sessions[history]["state"].clone()
            sync(device)
            start = time.perf_counter()
            model(piece, state)
            sync(device)
            if round_index:
                times[history].append(time.perf_counter() - start)
    return times


def decode_rate(model, session: dict, batch: int, steps: int, runs: int) -> tuple[float, list[float]]:
    """Greedy decoding tokens/s (all rows) at `batch` rows that share one history, joined by
    State.concat; the median of `runs` runs of `steps` steps, each after two untimed steps."""
    device = model.device
    rates = []
    for _ in range(runs):
        state = session["state"]
        state = type(state).concat([state.clone() for _ in range(batch)]) if batch > 1 else state.clone()
        token = session["next"].argmax().view(1, 1).expand(batch, 1).contiguous()
        for _ in range(2):  # warm-up: the first steps may allocate
            log_probs, state = model(token, state)
            token = log_probs[:, -1].argmax(-1, keepdim=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            log_probs, state = model(token, state)
            token = log_probs[:, -1].argmax(-1, keepdim=True)  # (batch, 1)
        sync(device)
        rates.append(batch * steps / (time.perf_counter() - start))
    return statistics.median(rates), rates


def turn_bits_per_byte(model, tokens: list[int], turn: int, state_dtype: torch.dtype | None) -> float:
    """Held-out bits per byte of `tokens` (byte tokens: one token a byte) scored left to right from
    an empty state as a session of `turn`-token turns, each token from the log-probs the model
    gave after the one before it; with `state_dtype`, the state goes through that dtype after every
    turn and comes back in the model's own dtypes for the next, as a session kept in the cache at
    XLSERVE_STATE_DTYPE does. The next-token row stays float32, as the cache keeps it."""
    computed = floating_dtypes(model.init_state(1))
    state, previous_row, nats, scored = model.init_state(1), None, 0.0, 0
    for start in range(0, len(tokens), turn):
        piece = tokens[start:start + turn]
        log_probs, state = model(torch.tensor([piece], device=model.device), state)
        targets = torch.tensor(piece[1:], device=model.device)
        nats -= float(log_probs[0, :-1].gather(1, targets[:, None]).sum())
        if previous_row is not None:  # the first token of a turn, from the turn before
            nats -= float(previous_row[piece[0]])
        scored += len(piece) - 1 + (previous_row is not None)
        previous_row = log_probs[0, -1]
        if state_dtype is not None:
            stored = SessionData(state, 0, None).cast_state(state_dtype)
            state = stored.cast_state(computed).state
    return nats / math.log(2) / max(scored, 1)


def state_dtype_comparison(model, sessions: dict[int, dict], tokens: list[int], args: argparse.Namespace) -> dict:
    """The `state_dtype` field of a row (module docstring): bytes and held-out bits per byte with
    the state in float32 and in args.state_dtype."""
    dtype = STATE_DTYPES[args.state_dtype]
    limit = model.history_limit
    scored = tokens[:args.state_dtype_tokens] if limit is None else tokens[:min(args.state_dtype_tokens, limit)]
    bits = {"float32": turn_bits_per_byte(model, scored, args.turn, None),
            args.state_dtype: turn_bits_per_byte(model, scored, args.turn, dtype)}
    difference = bits[args.state_dtype] - bits["float32"]
    return {
        "dtype": args.state_dtype,
        "state_bytes": {name: {str(h): SessionData(sessions[h]["state"], h, None).cast_state(STATE_DTYPES[name])
                               .state.nbytes() if h in sessions else None for h in args.state_histories}
                        for name in ("float32", args.state_dtype)},
        "bits_per_byte": bits,
        "difference": difference,
        "within_bound": abs(difference) <= STATE_DTYPE_BOUND,
        "scored_tokens": len(scored),
        "turn_tokens": args.turn,
    }


@torch.inference_mode()
def measure(directory: Path, args: argparse.Namespace, tokens: list[int]) -> dict:
    started = time.perf_counter()
    model = load_checkpoint(directory, device=args.device).eval()
    float_weight_bytes = weight_bytes(model)
    model = quantize_model(model, args.quantize)
    evaluation = held_out_bits_per_byte(directory)
    limit = model.history_limit
    requested = set(args.histories) | set(args.state_histories)
    # the state at the limit is measured only when a requested history passes it (it stands in for
    # those): the text read reaches the longest requested history, not necessarily the limit
    # (--quick reads about 1,152 tokens; the Reformer stops at 2,048)
    passes_limit = limit is not None and limit < max(requested)
    marks = sorted(requested | ({limit} if passes_limit else set()))
    sessions = history_states(model, tokens, marks, args.chunk)
    # each history is continued by the text that follows it, where the model can take that
    # much (a model that stops at max_context has no append past it: null in the JSON)
    timed = [h for h in args.histories if limit is None or h + args.append <= limit]
    times = time_appends(model, sessions, {h: tokens[h:h + args.append] for h in timed}, args.repeats)
    append_s = {h: statistics.median(t) for h, t in times.items()}
    decode_after = args.state_histories[0]
    if limit is not None and decode_after + args.decode > limit:  # the longest history with room to decode
        decode_after = max((h for h in sessions if h + args.decode <= limit), default=None)
    decode = {b: decode_rate(model, sessions[decode_after], b, args.decode, max(1, args.repeats // 2))
              for b in args.batch_sizes} if decode_after is not None else {}
    row = {
        "model": directory.name,
        "architecture": model.architecture,
        "state_kind": model.state_kind,
        "parameters": parameter_count(model),
        "bits_per_byte": evaluation["bits_per_byte"] if evaluation else None,
        "bits_per_byte_scored_bytes": evaluation.get("scored_bytes") if evaluation else None,
        "state_bytes": {str(h): sessions[h]["state"].nbytes() if h in sessions else None for h in args.state_histories},
        "state_bytes_at_history_limit": sessions[limit]["state"].nbytes() if limit in sessions else None,
        "append_s": {str(h): append_s.get(h) for h in args.histories},
        "append_s_rounds": {str(h): times.get(h) for h in args.histories},
        "append_time_spread": round(max(append_s.values()) / min(append_s.values()) - 1, 4) if append_s else None,
        "history_limit": limit,
        "decode_tokens_per_s": {str(b): rate for b, (rate, _) in decode.items()},
        "decode_tokens_per_s_runs": {str(b): runs for b, (_, runs) in decode.items()},
        "decode_after_tokens": decode_after,
        "history_fed_tokens": {str(h): sessions[h]["fed"] for h in marks if h in sessions},
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.quantize != "none":
        row["quantize"] = {"mode": args.quantize, "weight_bytes": weight_bytes(model),
                           "float32_weight_bytes": float_weight_bytes}
    if args.state_dtype is not None:
        row["state_dtype"] = state_dtype_comparison(model, sessions, tokens, args)
        row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = checkpoints(args.models, Path(args.weights_dir))
    longest = max(args.histories + args.state_histories)
    tokens = held_out_text(max(longest + args.append, args.state_dtype_tokens if args.state_dtype else 0))
    started = time.perf_counter()
    rows = []
    for path in paths:
        row = measure(path, args, tokens)
        rows.append(row)
        print(f"{row['model']}: {row['seconds']:.0f} s", flush=True)
    result = {
        "benchmark": "models", **environment(), "device": args.device, "quick": args.quick,
        "weights_dir": args.weights_dir, "history_text": "held-out stdlib files, concatenated",
        "histories": args.histories, "state_histories": args.state_histories, "append_tokens": args.append,
        "decode_tokens": args.decode, "batch_sizes": args.batch_sizes, "repeats": args.repeats, "chunk": args.chunk,
        "quantize": args.quantize,
        "state_dtype": args.state_dtype, "state_dtype_bound": STATE_DTYPE_BOUND if args.state_dtype else None,
        "results": rows, "seconds": round(time.perf_counter() - started, 1),
    }
    save_results(result, args.out, plot, print_table)


def _tokens(n: int) -> str:
    """1024 -> 1k, 10240 -> 10k, 65536 -> 64k; other lengths as they are."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _missing_or(value, show) -> str:
    """A table cell: `-` where the model cannot hold that much history (past its max_context)."""
    return "-" if value is None else show(value)


def _labels(rows: list[dict]) -> list[str]:
    """The architecture names, or the checkpoint names where an architecture appears twice."""
    architectures = [r["architecture"] for r in rows]
    return [r["architecture"] if architectures.count(r["architecture"]) == 1 else r["model"] for r in rows]


def plot(result: dict, path: Path) -> None:
    last = str(result["state_histories"][-1])
    rows = result["results"]
    with figure(path, f"Shipped checkpoints: held-out bits per byte against session state after "
                      f"{_tokens(int(last))} tokens", size=(7, 4.5)) as ax:
        shown = 0
        for row, label in zip(rows, _labels(rows)):
            # a model that stops before the last history is placed at the state it stops with
            x = row["state_bytes"][last]
            x = row.get("state_bytes_at_history_limit") if x is None else x
            if row["bits_per_byte"] is None or x is None:
                continue
            y = row["bits_per_byte"]
            at = "" if row["state_bytes"][last] is not None else f" at its {_tokens(row['history_limit'])} limit"
            ax.scatter([x], [y], s=45, label=f"{label} ({_bytes(x)}{at})")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
            shown += 1
        if not shown:
            ax.plot([], [], " ", label="no checkpoint has a held-out evaluation (evaluation.json)")
        ax.set_xscale("log")
        ax.set_xlabel(f"session state bytes after {_tokens(int(last))} tokens (log scale)")
        ax.set_ylabel("held-out bits per byte (lower is better)")


def print_table(result: dict) -> None:
    histories, states, batches = result["histories"], result["state_histories"], result["batch_sizes"]
    header = (["model", "parameters", "bits/byte"] + [f"state @{_tokens(h)}" for h in states]
              + [f"append {result['append_tokens']} @{_tokens(h)}" for h in histories]
              + [f"decode b{b} tok/s" for b in batches])
    lines = []
    for row in result["results"]:
        bpb = row["bits_per_byte"]
        lines.append([row["model"], f"{row['parameters']:,}", "-" if bpb is None else f"{bpb:.4f}"]
                     + [_missing_or(row["state_bytes"][str(h)], _bytes) for h in states]
                     + [_missing_or(row["append_s"][str(h)], lambda s: f"{s * 1000:.1f} ms") for h in histories]
                     + [_missing_or(row["decode_tokens_per_s"].get(str(b)), lambda r: f"{r:,.0f}") for b in batches])
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    print(f"\nthreads {result['threads']}, {result['device']}; append: median of {result['repeats']} rounds; "
          f"decode: greedy after {_tokens(states[0])} tokens, rows of one history batched with State.concat")
    print(fmt(header))
    print("|" + "|".join("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths)) + "|")
    for line in lines:
        print(fmt(line))
    missing = [r["model"] for r in result["results"] if r["bits_per_byte"] is None]
    if missing:
        print(f"bits/byte -: no held-out evaluation (evaluation.json) for {', '.join(missing)}")
    shortcut = [r["model"] for r in result["results"]
                if any(int(fed) < int(h) for h, fed in r["history_fed_tokens"].items())]
    if shortcut:
        print(f"fed only their last max_context tokens of each history (fixed context): {', '.join(shortcut)}")
    stopping = [f"{r['model']} ({r['history_limit']:,}"
                + (f"; state there {_bytes(r['state_bytes_at_history_limit'])}" if r.get("state_bytes_at_history_limit") else "")
                + (f"; decoded after {_tokens(r['decode_after_tokens'])} tokens"
                   if r["decode_after_tokens"] not in (None, states[0]) else "") + ")"
                for r in result["results"] if r.get("history_limit")]
    if stopping:
        print(f"-: past max_context, where these models stop (a longer history is refused): {', '.join(stopping)}")
    if result.get("state_dtype"):
        print_state_dtype_table(result)


def print_state_dtype_table(result: dict) -> None:
    """Bytes and held-out bits per byte with the state in float32 and in the 16-bit dtype."""
    dtype, last = result["state_dtype"], str(result["state_histories"][-1])
    rows = [r for r in result["results"] if "state_dtype" in r]
    header = ["model", f"state @{_tokens(int(last))} float32", f"state @{_tokens(int(last))} {dtype}",
              "scored tokens", "bits/byte float32", f"bits/byte {dtype}", "difference",
              f"within {result['state_dtype_bound']}"]
    lines = []
    for row in rows:
        compared = row["state_dtype"]
        lines.append([row["model"], _missing_or(compared["state_bytes"]["float32"][last], _bytes),
                      _missing_or(compared["state_bytes"][dtype][last], _bytes), f"{compared['scored_tokens']:,}",
                      f"{compared['bits_per_byte']['float32']:.4f}", f"{compared['bits_per_byte'][dtype]:.4f}",
                      f"{compared['difference']:+.4f}", "yes" if compared["within_bound"] else "NO"])
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) for i in range(len(header))]
    print(f"\nsession state in {dtype} against float32: held-out bits per byte scored in turns of "
          f"{rows[0]['state_dtype']['turn_tokens'] if rows else 0} tokens, the state stored in {dtype} after each")
    print("| " + " | ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths)) + "|")
    for line in lines:
        print("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) + " |")
