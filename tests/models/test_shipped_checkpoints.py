"""Every checkpoint shipped under weights/ is a real trained model, loadable, and its card
(card.md, written by models/training/card.py with evaluation.json beside it, and training.json
from training) says what the checkpoint really is:

- the card's parameter count, architecture, preset config, step count and storage dtype are
  those of the loaded checkpoint (config.json, model.safetensors);
- the card's text sample (temperature 0.7, seed 0) is regenerated exactly from the shipped
  weights: the card was written with these very weights;
- the card's held-out bits per byte are recomputed on the first 20,000 held-out bytes (a few
  seconds per model on one core). The vanilla card scores exactly that prefix, so its number is
  reproduced to rounding; the other cards only state the full held-out set (minutes per model),
  which the prefix approximates (the first held-out files are easier: 0.13-0.19 bits below the
  full set for these checkpoints), so those are checked within PREFIX_TOLERANCE.

The held-out split is the stdlib of the running interpreter; where it differs from the one the
cards were measured on (the card states its file and byte counts), the recomputations skip.
"""

import json
import re
import struct
from pathlib import Path

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.training.card import STRIDE_ONE_BYTES, sample
from xlserve.models.training.data import stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte, scored_part
from xlserve.models.training.train import held_out_documents

from tests.models.helpers import one_thread  # noqa: F401 (a fixture)

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"
SHIPPED = sorted(p for p in WEIGHTS.glob("*-stdlib") if (p / "model.safetensors").is_file())
SAMPLE_PROMPT = "import os\n\n\ndef "  # what `xlserve eval --write-card` samples (server/cli.py)
SAMPLE_LENGTH = 400
PREFIX_TOLERANCE = 0.25  # bits per byte between the first 20 kB and the whole held-out set
SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", None: "F32"}


def ids(directory: Path) -> str:
    return directory.name


def shipped(prefix: str) -> list[Path]:
    return [p for p in SHIPPED if p.name.startswith(prefix)]


def read_json(directory: Path, name: str):
    return json.loads((directory / name).read_text())


def card_text(directory: Path) -> str:
    return (directory / "card.md").read_text()


def card_table(card: str, heading: str) -> list[list[str]]:
    """The body rows (cells) of the first markdown table after the line containing `heading`."""
    lines = card[card.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def stated_corpus(card: str) -> tuple[int, int, int, int]:
    m = re.search(r"\((\d+) training files, ([\d,]+) bytes; (\d+) held-out files, ([\d,]+) bytes\)", card)
    assert m, "the card states its corpus"
    return tuple(int(g.replace(",", "")) for g in m.groups())


def safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


def test_there_are_shipped_checkpoints():
    assert {p.name for p in SHIPPED} >= {"transformer-xl-stdlib", "vanilla-stdlib", "xlnet-stdlib",
                                         "infinity-former-stdlib"}


@pytest.mark.parametrize("directory", SHIPPED, ids=ids)
def test_the_card_describes_the_checkpoint(directory):
    assert (directory / "model.safetensors").stat().st_size <= 8_000_000  # the budget for shipped weights
    model = load_checkpoint(directory)
    config, training, card = read_json(directory, "config.json"), read_json(directory, "training.json"), card_text(directory)

    # parameters: counted on the loaded model, stated by the card, training.json and config.json
    parameters = sum(p.numel() for p in model.parameters())
    stated = re.search(r"A byte-level `([a-z-]+)` language model \(([\d,]+) parameters\)", card)
    assert stated, "the card states the architecture and parameter count"
    assert (stated.group(1), int(stated.group(2).replace(",", ""))) == (model.architecture, parameters)
    assert training["parameters"] == config["training"]["parameters"] == parameters
    assert training["architecture"] == config["architecture"] == model.architecture

    # the preset: the card's JSON is training.json's config, and every value of it is the checkpoint's
    preset = re.search(r"^- Preset `([^`]+)`: `(\{.*\})`$", card, re.MULTILINE)
    assert preset, "the card states the preset"
    assert preset.group(1) == training["preset"] == config["training"]["preset"]
    card_config = json.loads(preset.group(2))
    assert card_config == training["config"]
    checkpoint_config = model.config.to_dict()
    assert checkpoint_config == config["config"]
    assert {k: checkpoint_config[k] for k in card_config} == card_config

    # the run: steps and recipe as trained, the last quick evaluation at the last step
    recipe = training["recipe"]
    assert training["step"] == config["training"]["step"]
    assert f"({training['step']:,} steps)" in card
    assert f"{recipe['train_bytes']:,} training bytes, {recipe['batch_size']} lanes x {recipe['segment_len']} bytes" in card
    assert training["evaluations"][-1]["step"] == training["step"]
    if "Recipe:" in card and "independent windows" not in card:  # a model with memory: how its lanes were laid out
        layout = recipe.get("lane_layout", "concatenated")
        assert ("emptied where a lane starts a file" in card) == (layout == "files")
        assert ("files joined end to end" in card) == (layout == "concatenated")
    quick = card_table(card, "Quick held-out evaluations")
    assert quick == [[str(e["step"]), f"{e['held_out_bits_per_byte_quick']:.4f}"] for e in training["evaluations"]]

    # the held-out table is evaluation.json's
    evaluations = read_json(directory, "evaluation.json")
    table = card_table(card, "## Held-out bits per byte")
    assert [(row[0], row[-1]) for row in table] == [(e["memory"], f"{e['bits_per_byte']:.4f}") for e in evaluations]

    # storage: the dtype the file really holds, and the size the card gives
    storage = config.get("storage_dtype")
    assert safetensors_dtypes(directory / "model.safetensors") == {SAFETENSORS_DTYPES[storage]}
    if storage:
        size = (directory / "model.safetensors").stat().st_size
        assert f"Weights are stored as {storage} ({size:,} bytes" in card
    else:
        assert "Weights are stored as" not in card


@pytest.mark.parametrize("directory", SHIPPED, ids=ids)
def test_the_card_sample_is_regenerated_from_the_weights(directory, one_thread):
    """The card's sample is temperature 0.7, seed 0, from the same prompt: the shipped weights
    write it again, character for character."""
    card = card_text(directory)
    assert "Temperature 0.7, seed 0:" in card
    stated = card.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
    assert stated.startswith(SAMPLE_PROMPT)
    assert sample(load_checkpoint(directory), SAMPLE_PROMPT, SAMPLE_LENGTH) == stated


@pytest.mark.parametrize("directory", SHIPPED, ids=ids)
def test_the_card_bits_per_byte_are_reproduced(directory, corpus, one_thread):
    card = card_text(directory)
    here = (len(corpus.train), corpus.size(corpus.train), len(corpus.held_out), corpus.size(corpus.held_out))
    if stated_corpus(card) != here:
        pytest.skip(f"this interpreter's stdlib split {here} is not the card's {stated_corpus(card)}")
    evaluations = {e["memory"]: e for e in read_json(directory, "evaluation.json")}
    trained = evaluations["trained"]
    documents = held_out_documents(corpus)
    model = load_checkpoint(directory)
    if "scored_bytes" in trained:  # each file's first byte is not scored; a model that stops, past where it stops
        assert trained["scored_bytes"] == sum(len(scored_part(model, d)) - 1 for d in documents)

    prefix = held_out_documents(corpus, STRIDE_ONE_BYTES)
    if model.history_limit is not None:
        # a model that stops is scored on each file's beginning: as many files' beginnings as
        # make up the prefix, rather than the first file's beginning alone
        prefix = [scored_part(model, d) for d in documents][: max(1, STRIDE_ONE_BYTES // model.history_limit)]
    bpb = bits_per_byte(model, prefix, chunk_len=trained["chunk_len"], window_stride=trained.get("window_stride"))
    first_bytes = evaluations.get("trained, first bytes")
    if first_bytes is not None:
        # the card scored exactly this prefix, this way: reproduced to its rounding
        assert first_bytes["scored_bytes"] == sum(len(d) - 1 for d in prefix)
        assert first_bytes["window_stride"] == trained["window_stride"]
        assert bpb == pytest.approx(first_bytes["bits_per_byte"], abs=2e-3)
    else:
        assert bpb == pytest.approx(trained["bits_per_byte"], abs=PREFIX_TOLERANCE)


@pytest.mark.parametrize("directory", shipped("transformer-xl"), ids=ids)
def test_transformer_xl_memory_helps_and_it_writes_python(directory, corpus, one_thread):
    model = load_checkpoint(directory)
    evaluations = {e["memory"]: e["bits_per_byte"] for e in read_json(directory, "evaluation.json")}
    assert evaluations["trained"] < evaluations["none"]
    # the same on one held-out file, recomputed: memory carried beats segments on their own
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


@pytest.mark.parametrize("directory", shipped("infinity-former"), ids=ids)
def test_infinity_former_long_term_memory_helps(directory, corpus, one_thread):
    evaluations = {e["memory"]: e["bits_per_byte"] for e in read_json(directory, "evaluation.json")}
    assert evaluations["trained"] < evaluations["short-term only"]
    # recomputed on the first 12 kB of a long held-out file, past several memory updates
    model = load_checkpoint(directory)
    document = next(data for data in map(corpus.read, corpus.held_out) if len(data) > 20_000)[:12_000]
    with_memory = bits_per_byte(model, [document])
    without = bits_per_byte(model.with_long_term_memory(False), [document])
    assert with_memory < 2.6 and with_memory < without


@pytest.mark.parametrize("directory", shipped("adaptive-span"), ids=ids)
def test_adaptive_span_keeps_what_its_learned_spans_predict(directory, corpus, one_thread):
    """Issue 17: a served state is smaller than the maximum span would need, by the ratio the
    learned spans predict, and the card's span table is the checkpoint's."""
    model = load_checkpoint(directory)
    c = model.config
    kept = [n for row in model.kept_positions() for n in row]
    full = c.n_layer * c.n_head * (c.max_span + c.ramp - 1)
    document = next(data for data in map(corpus.read, corpus.held_out) if len(data) > 8_192)
    sizes = []
    # fed in the server's prefill chunks (XLSERVE_PREFILL_CHUNK_TOKENS' default), as a served
    # session is: one 8,192-token forward attends over all of it at once and took 10x as long
    state, fed = model.init_state(1), 0
    for length in (4_096, 8_192):
        with torch.no_grad():
            for start in range(fed, length, 512):
                _, state = model(torch.tensor([list(document[start:start + 512])]), state)
        fed = length
        assert [k.shape[1] for k in state.keys] == kept
        sizes.append(state.nbytes())
    assert sizes[0] == sizes[1] == model.state_bytes_when_full()
    state_of_full_span = 2 * 4 * c.d_head * full + 8
    assert (sizes[0] - 8) / (state_of_full_span - 8) == pytest.approx(sum(kept) / full, rel=1e-12)
    assert sizes[0] < state_of_full_span
    card = card_text(directory)
    assert f"{sum(kept):,} positions in all, {sum(kept) / full:.1%} of the {full:,}" in card
    table = card_table(card, "## Learned spans")
    assert [[f"{z:.1f}, {n}" for z, n in zip(r["spans"], r["kept_positions"])] for r in model.spans_report()] \
        == [row[1:] for row in table]


@pytest.mark.parametrize("directory", shipped("xlnet"), ids=ids)
def test_xlnet_card_gives_both_orders(directory):
    # served left to right it must at least beat the held-out byte frequencies (4.69 bits per
    # byte); on its training objective (context on both sides) it must have learned; the
    # left-to-right number is reproduced by test_the_card_bits_per_byte_are_reproduced
    by_variant = {e["memory"]: e for e in read_json(directory, "evaluation.json")}
    assert by_variant["trained"]["bits_per_byte"] < 4.0
    permutation = by_variant["trained, permutation order"]
    assert permutation["bits_per_byte"] <= 2.2
    model = load_checkpoint(directory)
    assert permutation["chunk_len"] == model.config.seg_len and permutation["mem_len"] == model.config.mem_len


@pytest.mark.parametrize("directory", shipped("vanilla"), ids=ids)
def test_vanilla_card_shows_the_stride_it_was_scored_with(directory):
    model = load_checkpoint(directory)
    evaluations = {e["memory"]: e for e in read_json(directory, "evaluation.json")}
    strided, stride_one = evaluations["trained, first bytes"], evaluations["trained, first bytes, stride 1"]
    assert stride_one["window_stride"] == 1 and 1 < strided["window_stride"] <= model.max_context
    assert evaluations["trained"]["window_stride"] == strided["window_stride"]
    assert strided["scored_bytes"] == stride_one["scored_bytes"]
    assert f"the full held-out set is scored with windows {strided['window_stride']} bytes apart" in card_text(directory)
    # stride 1 gives every byte the full window, so it can only do as well or better (to noise);
    # the strided number is reproduced by test_the_card_bits_per_byte_are_reproduced
    assert stride_one["bits_per_byte"] <= strided["bits_per_byte"] + 0.01
