"""The model card works for every registered architecture, not only the four first ones: the
"state kept" text of an architecture without `mem_len` is measured (state kind + a session's
bytes after two histories), and an adaptive-span card gives every head's learned span."""

from dataclasses import replace

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.registry import ARCHITECTURES, build_model
from xlserve.models.training import card
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train

HISTORIES = (256, 1024)  # instead of the card's 4 KB and 64 KB: the same path, in a fraction of a second


@pytest.fixture
def short_histories(monkeypatch):
    monkeypatch.setattr(card, "STATE_HISTORIES", HISTORIES)


def table_after(text: str, heading: str) -> list[list[str]]:
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_every_architecture_has_a_state_description(architecture, short_histories):
    torch.manual_seed(0)
    model = build_model(architecture, preset_config(architecture, "tiny")).eval()
    for variant in card.card_variants(model, segment_len=32):
        text = card.describe(variant["model"], variant.get("permutation"))
        assert text and "|" not in text  # a cell of the card's markdown table


@pytest.mark.parametrize("architecture", ["performer", "longformer", "logsparse", "conformer", "lite-transformer"])
def test_a_bounded_state_is_described_by_its_bytes(architecture, short_histories):
    torch.manual_seed(0)
    model = build_model(architecture, preset_config(architecture, "tiny")).eval()
    # conformer and lite-transformer have a mem_len, but keep convolution buffers beside it:
    # their words are their measured bytes too, never "mem_len positions"
    measured = card.state_bytes_after(model, HISTORIES)
    assert measured[256] == measured[1024] > 0  # bounded: full long before 256 tokens
    assert card.describe(model) == (f"{card.STATE_KIND_WORDS[model.state_kind]} ({model.state_kind}): "
                                    f"{measured[256]:,} bytes after 256 bytes and 1 KB")
    assert model.training is False  # measuring left the mode as it was


def test_adaptive_span_card_gives_its_state_and_learned_spans(tmp_path, short_histories):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=1000, quick_eval_bytes=2000, warmup_steps=2)
    trained = train("adaptive-span", "tiny", tmp_path / "span", recipe, log=lambda s: None).train()
    card.state_bytes_after(trained, (64,))  # measured in eval mode (training keeps the maximum span)...
    assert trained.training  # ...and the model is left in the mode it was in

    model = load_checkpoint(tmp_path / "span")
    assert [v["memory"] for v in card.card_variants(model, segment_len=32)] == ["trained"]
    state = card.describe(model)
    evaluations = [{"memory": "trained", "state": state, "mem_len": None, "chunk_len": 512, "window_stride": None,
                    "scored_bytes": 1_000, "bits_per_byte": 6.25, "seconds": 0.1}]
    card.write_card(tmp_path / "span", model, evaluations, card.sample(model, "import os\n", 16))
    text = (tmp_path / "span" / "card.md").read_text()

    # the held-out table's "state kept" cell: its kind and its bytes, which are what the spans keep
    measured = card.state_bytes_after(model, HISTORIES)
    assert measured[256] == measured[1024] == model.state_bytes_when_full()
    assert table_after(text, "## Held-out bits per byte") == [["trained", state, "-", "1,000", "6.2500"]]
    assert f"{measured[256]:,} bytes after 256 bytes and 1 KB" in state and "learned span" in state

    # every layer's and head's learned span z and the positions a session keeps for it
    report = model.spans_report()
    spans = table_after(text, "## Learned spans")
    assert spans == [[str(row["layer"])] + [f"{z:.1f}, {n}" for z, n in zip(row["spans"], row["kept_positions"])]
                     for row in report]
    kept = sum(map(sum, model.kept_positions()))
    c = model.config
    full = (c.max_span + c.ramp - 1) * c.n_layer * c.n_head
    assert f"{kept:,} positions in all, {kept / full:.1%} of the {full:,}" in text
    assert f"({model.state_bytes_when_full():,} bytes of state once full)" in text
    # the sections around it are where the shipped-checkpoint tests look for them
    assert text.index("## Held-out bits per byte") < text.index("## Learned spans") < text.index("## Sample")


@pytest.mark.parametrize("architecture", ["linformer", "conformer", "lite-transformer", "reformer", "transformer-xl"])
def test_a_card_says_where_the_model_departs_from_its_paper(architecture, tmp_path, short_histories):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 2, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=1000, quick_eval_bytes=2000, warmup_steps=2)
    train(architecture, "tiny", tmp_path / "run", recipe, log=lambda s: None)
    model = load_checkpoint(tmp_path / "run")
    evaluations = [{"memory": "trained", "state": card.describe(model), "mem_len": None, "chunk_len": 512,
                    "window_stride": None, "scored_bytes": 1_000, "bits_per_byte": 6.25, "seconds": 0.1}]
    card.write_card(tmp_path / "run", model, evaluations, "sample")
    text = (tmp_path / "run" / "card.md").read_text()
    if architecture == "transformer-xl":  # follows its paper: no such section
        assert model.departures_from_the_paper is None and "## Departures from the paper" not in text
        return
    section = text[text.index("## Departures from the paper"):text.index("## Held-out bits per byte")]
    assert model.departures_from_the_paper in section
    assert f"models/{architecture.replace('-', '_')}.py" in section  # where the whole story is told
