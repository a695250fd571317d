"""Every checkpoint shipped under weights/ is a real trained model, loadable and documented."""

import json
from pathlib import Path

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.training.data import stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"
SHIPPED = sorted(p for p in WEIGHTS.glob("*-stdlib") if (p / "model.safetensors").is_file())


@pytest.mark.parametrize("directory", SHIPPED, ids=lambda p: p.name)
def test_checkpoint_is_small_documented_and_loads(directory):
    assert (directory / "model.safetensors").stat().st_size <= 8_000_000
    card = (directory / "card.md").read_text()
    assert "bits per byte" in card and "sha256" in card
    evaluations = json.loads((directory / "evaluation.json").read_text())
    by_variant = {e["memory"]: e["bits_per_byte"] for e in evaluations}
    if "trained, permutation order" in by_variant:
        # XLNet: its training objective (context on both sides) must be learned; served left to
        # right it must at least beat the held-out byte frequencies (4.69 bits per byte)
        assert by_variant["trained, permutation order"] <= 2.2 and by_variant["trained"] < 4.0
    else:
        assert by_variant["trained"] <= 2.2
    load_checkpoint(directory)


@pytest.mark.parametrize("directory", [p for p in SHIPPED if p.name.startswith("transformer-xl")], ids=lambda p: p.name)
def test_transformer_xl_memory_helps_and_it_writes_python(directory):
    model = load_checkpoint(directory)
    evaluations = {e["memory"]: e["bits_per_byte"] for e in json.loads((directory / "evaluation.json").read_text())}
    assert evaluations["trained"] < evaluations["none"]
    # a quick recheck on one held-out file: the shipped weights give the card's kind of number
    corpus = stdlib_corpus()
    document = corpus.read(corpus.held_out[1])[:6000]
    with_memory = bits_per_byte(model, [document])
    without = bits_per_byte(model.with_mem_len(0), [document], chunk_len=model.config.tgt_len)
    assert with_memory < 2.6 and with_memory < without
    # greedy continuation of a function header looks like Python: an indented body follows
    prompt = b"def read_config(path):\n"
    with torch.no_grad():
        log_probs, state = model(torch.tensor([list(prompt)]), model.init_state(1))
        generated = []
        for _ in range(40):
            token = int(log_probs[0, -1].argmax())
            generated.append(token)
            log_probs, state = model(torch.tensor([[token]]), state)
    text = bytes(generated).decode("utf-8", errors="replace")
    assert text.startswith("    "), text


@pytest.mark.parametrize("directory", [p for p in SHIPPED if p.name.startswith("infinity-former")], ids=lambda p: p.name)
def test_infinity_former_long_term_memory_helps(directory):
    evaluations = {e["memory"]: e["bits_per_byte"] for e in json.loads((directory / "evaluation.json").read_text())}
    assert evaluations["trained"] < evaluations["short-term only"]
    # a recheck on the first 12 kB of a long held-out file, past several memory updates
    model = load_checkpoint(directory)
    corpus = stdlib_corpus()
    document = next(data for data in map(corpus.read, corpus.held_out) if len(data) > 20_000)[:12_000]
    with_memory = bits_per_byte(model, [document])
    without = bits_per_byte(model.with_long_term_memory(False), [document])
    assert with_memory < 2.6 and with_memory < without


@pytest.mark.parametrize("directory", [p for p in SHIPPED if p.name.startswith("vanilla")], ids=lambda p: p.name)
def test_vanilla_card_shows_the_stride_it_was_scored_with(directory):
    evaluations = {e["memory"]: e for e in json.loads((directory / "evaluation.json").read_text())}
    strided, stride_one = evaluations["trained, first bytes"], evaluations["trained, first bytes, stride 1"]
    assert stride_one["window_stride"] == 1 and strided["window_stride"] > 1
    assert strided["scored_bytes"] == stride_one["scored_bytes"]
    # stride 1 gives every byte the full window, so it can only do as well or better (to noise)
    assert stride_one["bits_per_byte"] <= strided["bits_per_byte"] + 0.01
