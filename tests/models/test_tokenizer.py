from xlserve.models.tokenizer import ByteTokenizer


def test_round_trip_of_any_text():
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓ 😀'\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_incremental_detokenizer_never_emits_a_broken_character():
    tokenizer = ByteTokenizer()
    text = "a😀b✓é"
    detokenizer = tokenizer.detokenizer()
    pieces = [detokenizer.push(t) for t in tokenizer.encode(text)]
    assert "".join(pieces) + detokenizer.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)
    # the four bytes of the emoji produce nothing until the last one arrives
    assert pieces[1:4] == ["", "", ""] and pieces[4] == "😀"


def test_incomplete_tail_is_flushed_as_replacement():
    detokenizer = ByteTokenizer().detokenizer()
    assert detokenizer.push(0xF0) == ""
    assert detokenizer.flush() == "\ufffd"
