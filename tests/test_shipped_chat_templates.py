"""Every checkpoint under weights/ carries a chat template, as the README says ("Chat, tokenize,
detokenize"): `/v1/chat/completions` works on each shipped checkpoint without
`XLSERVE_CHAT_TEMPLATE`. The shipped models are byte-level and know no roles or special tokens, so
each carries the same minimal template: a line `role: content` per message, the answer after
`assistant: `."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xlserve.server.api.chat import load_chat_template

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
CHECKPOINTS = sorted(p for p in WEIGHTS.iterdir() if (p / "config.json").is_file())


def test_there_are_shipped_checkpoints():
    assert CHECKPOINTS, f"no checkpoint (a directory with config.json) under {WEIGHTS}"


@pytest.mark.parametrize("directory", CHECKPOINTS, ids=lambda p: p.name)
def test_every_checkpoint_carries_a_chat_template_that_renders(directory):
    config = json.loads((directory / "config.json").read_text())
    template = load_chat_template(config, directory)
    assert template is not None, f"{directory.name} has no chat template (chat_template.jinja)"
    assert template.error is None, template.error
    if config.get("tokenizer", "bytes") == "bytes":  # the minimal template of the byte-level models
        rendered = template.render([{"role": "user", "content": "hi"}])
        assert rendered == "user: hi\nassistant: ", repr(rendered)
