"""The model card (card.md) of a shipped checkpoint: what it was trained on, how, and how
well it does on the held-out files, with a sample of what it writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from models.interface import LanguageModel
from models.training.data import stdlib_corpus
from models.training.evaluate import bits_per_byte
from models.training.train import held_out_documents, machine_summary


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


def evaluate_for_card(model: LanguageModel, segment_len: int) -> list[dict]:
    """Held-out bits per byte with the trained memory and with none (mem_len 0)."""
    corpus = stdlib_corpus()
    documents = held_out_documents(corpus)
    rows = []
    variants = [("trained", model, 512)]
    if hasattr(model, "with_mem_len"):
        variants.append(("none", model.with_mem_len(0), segment_len))
    for label, variant, chunk in variants:
        started = time.time()
        bpb = bits_per_byte(variant, documents, chunk_len=chunk)
        rows.append({"memory": label, "mem_len": getattr(variant.config, "mem_len", None), "chunk_len": chunk,
                     "bits_per_byte": round(bpb, 4), "seconds": round(time.time() - started, 1)})
    return rows


def write_card(directory: Path, model: LanguageModel, evaluations: list[dict], text_sample: str) -> None:
    training = json.loads((directory / "training.json").read_text())
    recipe = training["recipe"]
    corpus = stdlib_corpus()
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"# {directory.name}",
        "",
        f"A byte-level `{model.architecture}` language model ({params:,} parameters) trained by xlserve's standard "
        "recipe on the Python standard library source, shipped so that `make serve` has a real model to serve.",
        "",
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
        f"{recipe['final_lr_fraction']:.0%}, gradient clipping {recipe['grad_clip']}; memory carried across "
        "consecutive segments of each lane.",
        f"- Preset `{training['preset']}`: `{json.dumps(training['config'])}`",
        f"- Wall time: {training['elapsed_s'] / 60:.1f} minutes on {machine_summary()}.",
        "",
        "## Held-out bits per byte",
        "",
        "Each held-out file is scored on its own from an empty memory, carried across the whole file "
        "(the first byte of a file has no context and is not scored).",
        "",
        "| memory | mem_len | bits per byte |",
        "|---|---|---|",
    ]
    lines += [f"| {e['memory']} | {e['mem_len']} | {e['bits_per_byte']:.4f} |" for e in evaluations]
    lines += [
        "",
        "For scale: `gzip -9` compresses the same files to about 1.7 bits per byte and `xz -9` to about 1.6.",
        "",
        "Quick held-out evaluations during training (first 200,000 held-out bytes):",
        "",
        "| step | bits per byte |",
        "|---|---|",
    ]
    lines += [f"| {e['step']} | {e['held_out_bits_per_byte_quick']:.4f} |" for e in training["evaluations"]]
    lines += [
        "",
        "## Sample",
        "",
        "Temperature 0.7, seed 0:",
        "",
        "```python",
        text_sample,
        "```",
        "",
        "Reproduce: `xlserve train --arch {arch} --preset {preset} --out weights/{name}` (resumable), then "
        "`xlserve eval --model {name} --write-card`.".format(arch=model.architecture, preset=training["preset"],
                                                               name=directory.name),
        "",
    ]
    (directory / "card.md").write_text("\n".join(lines))
    (directory / "evaluation.json").write_text(json.dumps(evaluations, indent=2) + "\n")
