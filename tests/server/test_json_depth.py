"""server/api/protocol.py json_depth_exceeded: the nesting of a JSON text found without parsing
it, strings (whole, escaped quotes and all, or unterminated) left out of the count."""

from __future__ import annotations

import json

import pytest

from xlserve.server.api.protocol import MAX_JSON_DEPTH, json_depth_exceeded


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("as_bytes", [False, True])
def test_depth_counts_the_brackets_outside_strings_only(as_bytes):
    cases = {
        nested(MAX_JSON_DEPTH): False,
        nested(MAX_JSON_DEPTH + 1): True,
        json.dumps({"prompt": nested(10_000)}): False,  # brackets inside a string
        json.dumps({"prompt": '"' + nested(1_000) + '\\'}): False,  # escaped quotes and backslashes
        json.dumps([[], [], {}] * 1_000): False,  # many brackets, shallow
        json.dumps({"a": [nested(1)] * 40, "b": "]" * 100}) + nested(MAX_JSON_DEPTH + 1): True,
        '{"prompt": "' + "\\\"[" * 1_000: False,  # a string that never ends holds the rest
        nested(MAX_JSON_DEPTH + 1)[: MAX_JSON_DEPTH + 1] + '"unterminated': True,  # deep before it
        '["\\\\"' + nested(MAX_JSON_DEPTH + 1) + "]": True,  # an escaped backslash ends no string early
        '["ü' + "[" * 40 + '"]': False,  # text outside ASCII
    }
    for document, deep in cases.items():
        given = document.encode() if as_bytes else document
        assert json_depth_exceeded(given) is deep, document[:80]


def test_the_depth_check_agrees_with_the_parser_on_what_it_accepts():
    for depth in (1, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1):
        value = json.loads(nested(depth))
        for _ in range(3):
            value = {"x": value, "s": "[{\"]}", "t": ["\\", "\""]}
        text = json.dumps(value)
        assert json_depth_exceeded(text) is (depth + 6 > MAX_JSON_DEPTH), depth


def test_an_escape_outside_any_string_starts_no_string():
    assert json_depth_exceeded('\\"' + "[" * (MAX_JSON_DEPTH + 1))
