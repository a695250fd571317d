"""The model card (card.md) of a shipped checkpoint: what it was trained on, how, and how
well it does on the held-out files, with a sample of what it writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from xlserve.models.interface import LanguageModel
from xlserve.models.training.data import stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte, permutation_bits_per_byte, scored_part
from xlserve.models.training.train import held_out_documents, machine_summary


@torch.no_grad()
def sample(model: LanguageModel, prompt: str, length: int, temperature: float = 0.7, seed: int = 0) -> str:
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt.encode("utf-8"))
    log_probs, state = model(torch.tensor([tokens], device=model.device), model.init_state(1))
    out = []
    for _ in range(length):
        probs = torch.softmax(log_probs[0, -1].float().cpu() / temperature, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        log_probs, state = model(torch.tensor([[token]], device=model.device), state)
    return prompt + bytes(out).decode("utf-8", errors="replace")


# fixed-context models: windows this far apart over the whole held-out set (each byte predicted
# from at least L - 64 bytes); a window per byte costs a full forward per byte (evaluate.py)
CARD_WINDOW_STRIDE = 64
PERMUTATION_BYTES = 300_000  # held-out bytes XLNet is also scored on with its training objective
STRIDE_ONE_BYTES = 20_000  # held-out bytes a fixed-context model is also scored on at stride 1


def card_variants(model: LanguageModel, segment_len: int) -> list[dict]:
    """What the card evaluates: the model as trained, and the same weights with their memory
    taken away, so the card shows what the memory is worth.

    - Transformer-XL: mem_len 0 (each segment of `segment_len` bytes on its own).
    - ∞-former: the continuous long-term memory off (short-term attention only).
    - vanilla: no memory to remove; the whole held-out set is scored with windows
      CARD_WINDOW_STRIDE apart (see evaluate.py), and the first STRIDE_ONE_BYTES bytes both
      ways, so the card shows what the cheaper stride costs against the paper's stride 1.
    - XLNet: served left to right (each byte predicted from the bytes before it), and on its
      training objective (random factorisation orders, the last 1/K of each predicted from
      context on both sides), which is what it was trained to do.
    """
    trained = {"memory": "trained", "model": model, "chunk_len": 512}
    if model.sliding_window is not None:
        stride = min(CARD_WINDOW_STRIDE, model.sliding_window)
        return [
            {**trained, "window_stride": stride},
            {**trained, "memory": "trained, first bytes", "window_stride": stride, "limit_bytes": STRIDE_ONE_BYTES},
            {**trained, "memory": "trained, first bytes, stride 1", "window_stride": 1, "limit_bytes": STRIDE_ONE_BYTES},
        ]
    variants = [trained]
    if model.architecture == "transformer-xl":
        variants.append({"memory": "none", "model": model.with_mem_len(0), "chunk_len": segment_len})
    if hasattr(model, "permuted"):
        variants.append({"memory": "trained, permutation order", "model": model, "chunk_len": model.config.seg_len,
                         "permutation": 1 / model.config.partial_prediction_k, "limit_bytes": PERMUTATION_BYTES})
    if hasattr(model, "with_long_term_memory"):
        variants.append({"memory": "short-term only", "model": model.with_long_term_memory(False), "chunk_len": 512})
    return variants


def describe(model: LanguageModel, permutation: float | None = None) -> str:
    """The state each variant keeps, in words, for the card's table. The four first
    architectures have their own words (their cards' text); every other one gets
    `describe_state`, which needs nothing of its config."""
    config = model.config
    if permutation is not None:
        return f"{config.mem_len} positions; last {permutation:.0%} of a random order predicted"
    if model.sliding_window is not None:
        return f"the last {model.max_context} bytes"
    if getattr(config, "long_term_memory", None) is not None:
        if config.long_term_memory:
            return f"previous segment + continuous memory of {config.n_basis} basis functions"
        return "previous segment only"
    if model.architecture in ("transformer-xl", "xlnet"):  # a memory of keys and values only
        return f"{config.mem_len} positions"
    # every other architecture, with or without a mem_len: a convolution buffer beside a window
    # of mem_len positions is more than "mem_len positions"
    return describe_state(model)


# what each `state_kind` keeps, in words (models/interface.py)
STATE_KIND_WORDS = {
    "segment-recurrence": "keys and values of the latest positions",
    "continuous": "a continuous memory",
    "window": "a bounded window of keys and values",
    "linear": "fixed-size sums over the whole history",
    "none": "nothing",
}
# the history lengths (bytes) after which a card gives a session's state bytes: 4 KB and 64 KB
STATE_HISTORIES = (4096, 65536)


def _history_words(tokens: int) -> str:
    return f"{tokens // 1024} KB" if tokens % 1024 == 0 else f"{tokens:,} bytes"


@torch.no_grad()
def state_bytes_after(model: LanguageModel, histories: tuple[int, ...] = STATE_HISTORIES, chunk: int = 512,
                      seed: int = 0) -> dict[int, int]:
    """`State.nbytes()` of one session (what the session cache counts) after each of `histories`
    bytes: seeded random bytes fed in chunks of `chunk`, the model in eval mode (a model may keep
    more while training; adaptive span keeps its maximum span)."""
    longest = max(histories)
    tokens = torch.randint(0, model.vocab_size, (1, longest), generator=torch.Generator().manual_seed(seed))
    marks = sorted(set(histories))
    was_training = model.training
    model.eval()
    try:
        state, done, found = model.init_state(1), 0, {}
        for mark in marks:
            for start in range(done, mark, chunk):
                piece = tokens[:, start:min(start + chunk, mark)].to(model.device)
                _, state = model(piece, state)
            done = mark
            found[mark] = state.nbytes()
    finally:
        model.train(was_training)
    return {h: found[h] for h in histories}


def describe_state(model: LanguageModel, histories: tuple[int, ...] | None = None) -> str:
    """Any architecture's state in words, from what every model has: its `state_kind` and the
    bytes of a session after each of `histories` bytes (default STATE_HISTORIES), measured by
    `state_bytes_after`."""
    histories = histories or STATE_HISTORIES
    stops_at = model.history_limit
    if stops_at is not None and max(histories) > stops_at:
        # a longer history is refused, so the longest a session can hold is measured instead
        histories = tuple(dict.fromkeys(min(h, stops_at) for h in histories))
    measured = state_bytes_after(model, histories)
    kind = STATE_KIND_WORDS.get(model.state_kind, model.state_kind)
    sizes = [f"{n:,} bytes after {_history_words(h)}" for h, n in measured.items()]
    if len(set(measured.values())) == 1 and len(measured) > 1:
        sizes = [f"{next(iter(measured.values())):,} bytes after {' and '.join(map(_history_words, measured))}"]
    text = f"{kind} ({model.state_kind}): " + ", ".join(sizes)
    if model.state_grows_with_context:  # the Reformer: every position's keys and values, up to where it stops
        text += f"; it grows with the history, up to the model's maximum of {model.max_context:,} bytes"
    if stops_at is not None and stops_at in measured:
        text += f" (a longer history is refused, so no session holds more than the {_history_words(stops_at)} measured)"
    if hasattr(model, "spans_report"):
        text += "; each head keeps its learned span + ramp (see Learned spans)"
    return text


def evaluate_for_card(model: LanguageModel, segment_len: int) -> list[dict]:
    """Held-out bits per byte of every variant in `card_variants`."""
    corpus = stdlib_corpus()
    rows = []
    for variant in card_variants(model, segment_len):
        documents = held_out_documents(corpus, variant.get("limit_bytes"))
        started = time.time()
        if "permutation" in variant:
            bpb = permutation_bits_per_byte(variant["model"], documents, variant["chunk_len"], variant["permutation"])
        else:
            bpb = bits_per_byte(variant["model"], documents, chunk_len=variant["chunk_len"],
                                window_stride=variant.get("window_stride"))
        rows.append({"memory": variant["memory"], "state": describe(variant["model"], variant.get("permutation")),
                     "mem_len": getattr(variant["model"].config, "mem_len", None), "chunk_len": variant["chunk_len"],
                     "window_stride": variant.get("window_stride"), "scored_bytes": sum(len(scored_part(variant["model"], d)) - 1 for d in documents),
                     "bits_per_byte": round(bpb, 4), "seconds": round(time.time() - started, 1)})
    return rows


def _storage_lines(directory: Path, storage: str | None) -> list[str]:
    """A line on how the weights are stored, when narrower than the float32 they were trained in."""
    if not storage:
        return []
    size = (directory / "model.safetensors").stat().st_size
    return [f"Weights are stored as {storage} ({size:,} bytes, to fit the 8 MB budget for shipped weights) and "
            "widened to float32 on load; every number below was measured with the stored weights.", ""]


def write_card(directory: Path, model: LanguageModel, evaluations: list[dict], text_sample: str) -> None:
    """card.md and evaluation.json of the checkpoint in `directory` (its training.json and
    config.json must be there): what was trained on what, held-out bits per byte, a sample."""
    training = json.loads((directory / "training.json").read_text())
    storage = json.loads((directory / "config.json").read_text()).get("storage_dtype")
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"# {directory.name}",
        "",
        f"A byte-level `{model.architecture}` language model ({params:,} parameters) trained by xlserve's standard "
        "recipe on the Python standard library source, shipped so that `make serve` has a real model to serve.",
        "",
        *_storage_lines(directory, storage),
        *_training_lines(model, training),
        *_departure_lines(model),
        *_held_out_lines(model, training, evaluations),
        *_span_lines(model),
        *_sample_lines(directory, model, training, storage, text_sample),
    ]
    (directory / "card.md").write_text("\n".join(lines))
    (directory / "evaluation.json").write_text(json.dumps(evaluations, indent=2) + "\n")


def _training_lines(model: LanguageModel, training: dict) -> list[str]:
    recipe = training["recipe"]
    corpus = stdlib_corpus()
    return [
        "## Training",
        "",
        f"- Corpus: every `.py` file under the stdlib root of the training interpreter, outside `site-packages` "
        f"({len(corpus.train)} training files, {corpus.size(corpus.train):,} bytes; "
        f"{len(corpus.held_out)} held-out files, {corpus.size(corpus.held_out):,} bytes).",
        "- Split: a file is held out when `int(sha256(relative_path).hexdigest(), 16) % 20 == 0`, relative_path "
        "being its POSIX path relative to the stdlib root.",
        f"- Recipe: {recipe['train_bytes']:,} training bytes, {recipe['batch_size']} lanes x {recipe['segment_len']} "
        f"bytes per step ({training['step']:,} steps), AdamW (betas 0.9/0.98, weight decay {recipe['weight_decay']}), "
        f"peak learning rate {recipe['learning_rate']}, {recipe['warmup_steps']} warm-up steps, cosine decay to "
        f"{recipe['final_lr_fraction']:.0%}, gradient clipping {recipe['grad_clip']}; "
        + ("independent windows (no memory between them)." if model.sliding_window is not None
           else "memory carried across consecutive segments of each lane, "
           + ("emptied where a lane starts a file (each file begins at a segment boundary)."
              if recipe.get("lane_layout", "concatenated") == "files"
              else "files joined end to end in each lane and the memory emptied only at the first step.")),
        *([f"- Resumed at step{'s' if len(emptied) > 1 else ''} {', '.join(f'{s:,}' for s in emptied)} from progress "
           "kept without the lanes' memory: every lane's memory was emptied there, as at the start of a file."]
          if (emptied := training.get("lane_memory_emptied_at_steps")) else []),
        # what changed in a run after it started (a migrated progress file records it in `notes`)
        *[f"- {note[0].upper()}{note[1:].rstrip('.')}." for note in training.get("notes", [])],
        f"- Preset `{training['preset']}`: `{json.dumps(training['config'])}`",
        f"- Wall time: {training['elapsed_s'] / 60:.1f} minutes on {machine_summary()}.",
        "",
    ]


def _departure_lines(model: LanguageModel) -> list[str]:
    if model.departures_from_the_paper is None:
        return []
    return ["## Departures from the paper", "", model.departures_from_the_paper, ""]


def _held_out_lines(model: LanguageModel, training: dict, evaluations: list[dict]) -> list[str]:
    recipe = training["recipe"]
    lines = [
        "## Held-out bits per byte",
        "",
        "Each held-out file is scored on its own from an empty state, carried across the whole file "
        "(the first byte of a file has no context and is not scored).",
    ]
    if model.history_limit is not None:
        lines += [
            "",
            f"This model takes at most {model.max_context:,} bytes of history (a longer one is refused), so each "
            f"held-out file is scored on its first {model.max_context:,} bytes.",
        ]
    if model.sliding_window is not None:
        lines += [
            "",
            f"This model sees only the last {model.max_context} bytes. Scored byte by byte it recomputes a whole "
            "window per byte (stride 1, the paper's evaluation), so the full held-out set is scored with windows "
            f"{evaluations[0]['window_stride']} bytes apart, each byte predicted from at least "
            f"{model.max_context - evaluations[0]['window_stride']} bytes of context; the first "
            f"{STRIDE_ONE_BYTES:,} held-out bytes are scored both ways to show the difference.",
        ]
    if hasattr(model, "permuted"):
        lines += [
            "",
            "XLNet is trained by permutation language modeling: each training byte it predicts sees the memory "
            "and most of its segment, on both sides of it. Served, it generates left to right, one of the orders "
            "it was trained on, where every byte sees only the bytes before it, which its training rarely asked "
            "of it. The card gives both: `trained` is the left-to-right number (comparable with the other "
            "architectures), `trained, permutation order` is its training objective on the first "
            f"{PERMUTATION_BYTES:,} held-out bytes (random orders, seed 0).",
        ]
    lines += [
        "",
        "| variant | state kept | window stride | scored bytes | bits per byte |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {e['memory']} | {e.get('state', e['mem_len'])} | {e.get('window_stride') or '-'} | "
              f"{e['scored_bytes']:,} | {e['bits_per_byte']:.4f} |" if "scored_bytes" in e else
              f"| {e['memory']} | {e['mem_len']} | - | all | {e['bits_per_byte']:.4f} |" for e in evaluations]
    lines += [
        "",
        "For scale: `gzip -9` compresses the same files to about 1.7 bits per byte and `xz -9` to about 1.6.",
        "",
        f"Quick held-out evaluations during training (first {recipe['quick_eval_bytes']:,} held-out bytes"
        + (f", windows {recipe.get('eval_window_stride')} bytes apart" if model.sliding_window is not None else "") + "):",
        "",
        "| step | bits per byte |",
        "|---|---|",
    ]
    lines += [f"| {e['step']} | {e['held_out_bits_per_byte_quick']:.4f} |" for e in training["evaluations"]]
    return lines


def _span_lines(model: LanguageModel) -> list[str]:
    """Adaptive span only: every head's learned span z and the positions a served session keeps
    for it (`spans_report`), since these decide the state's bytes."""
    if not hasattr(model, "spans_report"):
        return []
    c = model.config
    report = model.spans_report()
    heads = len(report[0]["spans"]) if report else 0
    kept = sum(sum(row["kept_positions"]) for row in report)
    full = (c.max_span + c.ramp - 1) * heads * len(report)
    lines = [
        "",
        "## Learned spans",
        "",
        f"Each head attends over its learned span z (at most S = {c.max_span}) plus a ramp of R = {c.ramp} positions; "
        f"a served session keeps, per head, the keys and values of its last ceil(z) + R - 1 positions (`kept` below): "
        f"{kept:,} positions in all, {kept / full:.1%} of the {full:,} the maximum span would need "
        f"({model.state_bytes_when_full():,} bytes of state once full).",
        "",
        "| layer | " + " | ".join(f"head {h}: z, kept" for h in range(heads)) + " |",
        "|---|" + "---|" * heads,
    ]
    lines += [f"| {row['layer']} | " + " | ".join(f"{z:.1f}, {n}" for z, n in zip(row["spans"], row["kept_positions"]))
              + " |" for row in report]
    return lines


def _sample_lines(directory: Path, model: LanguageModel, training: dict, storage: str | None,
                  text_sample: str) -> list[str]:
    return [
        "",
        "## Sample",
        "",
        "Temperature 0.7, seed 0:",
        "",
        "```python",
        text_sample,
        "```",
        "",
        "Reproduce: `xlserve train --arch {arch} --preset {preset} --out weights/{name}` (resumable), {store}then "
        "`xlserve eval --model {name} --write-card`.".format(
            arch=model.architecture, preset=training["preset"], name=directory.name,
            store=f"`xlserve store --model {directory.name} --dtype {storage}`, " if storage else ""),
        "",
    ]
