import random

import pytest

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


def counting(tokenizer):
    """`tokenizer` with its decode wrapped to record how many ids each call decodes."""
    lengths = []
    decode = tokenizer.decode

    def counted(tokens):
        tokens = list(tokens)
        lengths.append(len(tokens))
        return decode(tokens)

    tokenizer.decode = counted
    return tokenizer, lengths


def streamed(tokenizer, ids) -> tuple[list[str], str]:
    detokenizer = tokenizer.detokenizer()
    pieces = [detokenizer.push(t) for t in ids]
    return pieces, "".join(pieces) + detokenizer.flush()


@pytest.fixture(scope="module")
def subword_tokenizers():
    """A byte-level BPE read by the tokenizers library (Mamba's and RWKV's kind) and a
    sentencepiece model (XLNet's kind), both trained here in a fraction of a second."""
    from tests.models.test_convert_recurrent import byte_level_tokenizer_json
    from xlserve.models.tokenizer import SentencePieceTokenizer, TokenizersTokenizer
    from xlserve.server.bench.real_size import sentencepiece_model

    return {"tokenizers": lambda: TokenizersTokenizer.from_bytes(byte_level_tokenizer_json(400).encode()),
            "sentencepiece": lambda: SentencePieceTokenizer(sentencepiece_model(600))}


@pytest.mark.parametrize("kind", ["tokenizers", "sentencepiece"])
def test_a_subword_stream_is_the_whole_decode_in_constant_work_per_token(subword_tokenizers, kind):
    """Streamed text equals one decode of all the tokens, for real text and for random ids
    (byte-level pieces that split characters, control pieces, unknown pieces), and no push
    decodes more than a short window, however long the stream: n tokens cost O(n), not O(n²)."""
    pytest.importorskip("tokenizers" if kind == "tokenizers" else "sentencepiece")
    tokenizer, lengths = counting(subword_tokenizers[kind]())
    text = 'def decode(self, s):\n    """Return ``s``, 1990, ünïcode ✓ 😀."""\n' * 40
    rng = random.Random(0)
    streams = [tokenizer.encode(text)] + [[rng.randrange(tokenizer.vocab_size) for _ in range(300)] for _ in range(20)]
    for ids in streams:
        whole = tokenizer.decode(ids)
        lengths.clear()
        pieces, joined = streamed(tokenizer, ids)
        assert joined == whole
        if "\ufffd" not in whole:  # real text: no piece ever hands out half a character
            assert not any("\ufffd" in piece for piece in pieces)
    # the longest stream (about 2,000 tokens of real text) decoded windows of a few tokens only
    lengths.clear()
    streamed(tokenizer, streams[0])
    assert len(streams[0]) > 1000 and max(lengths) <= 16, max(lengths)


@pytest.mark.parametrize("kind", ["tokenizers", "sentencepiece"])
def test_runs_without_text_or_of_broken_characters_neither_stall_nor_grow_the_window(subword_tokenizers, kind):
    """Pieces that decode to nothing (sentencepiece's control pieces) and bytes that never make a
    character (lone continuation bytes), a thousand in a row: the stream still equals one decode,
    no push decodes more than a bounded window, and text that can no longer change is handed out
    while the run goes on instead of at its end."""
    pytest.importorskip("tokenizers" if kind == "tokenizers" else "sentencepiece")
    from xlserve.models.tokenizer import SentencePieceDetokenizer

    tokenizer, lengths = counting(subword_tokenizers[kind]())
    word = tokenizer.encode(" word")
    if kind == "sentencepiece":
        runs = {"control": [tokenizer.processor.PieceToId("<cls>")]}
    else:  # a byte that is no character on its own, however many follow: U+FFFD each
        broken = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i] * 3) == "\ufffd" * 3)
        runs = {"broken": [broken], "replacement characters": tokenizer.encode("\ufffd")}
    bound = SentencePieceDetokenizer.REACH + SentencePieceDetokenizer.HOLD + 8
    for name, unit in runs.items():
        ids = word + unit * 1000 + word
        whole = tokenizer.decode(ids)
        lengths.clear()
        pieces, joined = streamed(tokenizer, ids)
        assert joined == whole, name
        assert max(lengths) <= bound, (name, max(lengths))
        if whole != tokenizer.decode(word * 2):  # the run has text: most of it leaves before the run ends
            assert len("".join(pieces[: len(word) + 1000 * len(unit) - 20])) > len(whole) // 2, name


def test_a_tokenizer_json_saved_with_truncation_or_padding_encodes_the_whole_text_unpadded():
    """transformers saves a tokenizer.json with the truncation and padding its last call left
    ("truncation": {"max_length": 2048, ...}); read as they are, every longer prompt would be cut
    and every shorter one padded, without a word. Both are off for a served model's tokenizer."""
    from tokenizers import Tokenizer

    from tests.models.test_convert_recurrent import byte_level_tokenizer_json
    from xlserve.models.tokenizer import TokenizersTokenizer

    saved = Tokenizer.from_str(byte_level_tokenizer_json(300))
    plain = [list(saved.encode(text, add_special_tokens=False).ids) for text in ("x", "def f(x):\n" * 20)]
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=8, pad_id=0)
    tokenizer = TokenizersTokenizer.from_bytes(saved.to_str().encode())
    assert [tokenizer.encode(text) for text in ("x", "def f(x):\n" * 20)] == plain
    assert len(plain[1]) > 8 and len(plain[0]) < 4


# -- tokenizer.json written by a newer tokenizers ------------------------------------------------

# run by the reference environment's tokenizers (0.22): trains the tokenizers today's checkpoints
# ship (byte-level BPE, GPT-NeoX's kind; a Metaspace BPE, Llama's and Mistral's kind, with each
# prepend scheme and inside a Sequence), saves each in its own form, and writes the ids and the
# decoded text that release gives for every text
NEWER_TOKENIZERS = r'''
import json, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out, texts = sys.argv[1], json.loads(sys.argv[2])
corpus = [t * 3 for t in texts] * 20
made = {}
byte_level = Tokenizer(models.BPE())
byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
byte_level.decoder = decoders.ByteLevel()
byte_level.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
made["byte_level"] = byte_level
for scheme in ("always", "first", "never"):
    meta = Tokenizer(models.BPE(unk_token="<unk>"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    meta.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    meta.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    made["metaspace_" + scheme] = meta
sequence = Tokenizer(models.BPE(unk_token="<unk>"))
sequence.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  pre_tokenizers.Metaspace(prepend_scheme="first")])
sequence.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first")])
sequence.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
made["sequence"] = sequence
results = {}
for name, tokenizer in made.items():
    ids = [tokenizer.encode(text).ids for text in texts]
    results[name] = {"json": tokenizer.to_str(), "ids": ids, "decoded": [tokenizer.decode(i) for i in ids]}
open(out, "w").write(json.dumps(results))
'''


def test_tokenizer_json_of_a_newer_tokenizers_reads_with_the_same_tokens(tmp_path):
    """tokenizers 0.19 and 0.20 changed how tokenizer.json is written (merges as pairs, Metaspace's
    prepend_scheme and split); the release this install keeps (0.15) could not read such files,
    which are what checkpoints saved today ship. Rewritten for it (`readable_by_library`), each
    gives the newer release's ids and decoded text for every text."""
    import json
    import os
    import subprocess
    import sys

    from tests.models.hf_reference import REFERENCE_DIR, reference_available
    from xlserve.models.tokenizer import TokenizersTokenizer

    if not reference_available():
        pytest.skip(f"the reference environment {REFERENCE_DIR} (tokenizers 0.22) is missing; make test installs it")
    texts = ["hello world, the quick brown fox", " leading space and  two spaces", "numbers 12345 and 2026-12-06",
             "ünïcödé ✓ and emoji 😀", "tab\tnew\nline", "the lazy dog jumps over the quick brown fox again"]
    out = tmp_path / "newer.json"
    done = subprocess.run([sys.executable, "-c", NEWER_TOKENIZERS, str(out), json.dumps(texts)],
                          env={**os.environ, "PYTHONPATH": str(REFERENCE_DIR)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, made in json.loads(out.read_text()).items():
        tokenizer = TokenizersTokenizer.from_bytes(made["json"].encode())
        assert [tokenizer.encode(text) for text in texts] == made["ids"], name
        assert [tokenizer.decode(ids) for ids in made["ids"]] == made["decoded"], name


@pytest.mark.parametrize("change, refused", [
    (lambda c: c["model"].__setitem__("ignore_merges", True), "ignore_merges"),
    (lambda c: c["pre_tokenizer"].__setitem__("split", False), "split false"),
    (lambda c: c["model"]["merges"].append(["a b", "c"]), "token with a space"),
])
def test_a_newer_tokenizer_json_an_older_tokenizers_cannot_express_is_refused_naming_why(change, refused):
    from xlserve.models.tokenizer import readable_by_library

    content = {"model": {"type": "BPE", "merges": [["a", "b"]], "vocab": {"a": 0, "b": 1, "ab": 2}},
               "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}}
    assert readable_by_library(content, (0, 15))["model"]["merges"] == ["a b"]
    change(content)
    with pytest.raises(ValueError, match=refused) as error:
        readable_by_library(content, (0, 15))
    assert "tokenizers>=0.20" in str(error.value)


# -- a generation's text continues its prompt's ----------------------------------------------------


def metaspace_tokenizer():
    """A Metaspace BPE (Llama's and Mistral's kind) trained here with the installed tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from xlserve.models.tokenizer import TokenizersTokenizer

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", add_prefix_space=True)
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", add_prefix_space=True)
    corpus = ["Hello world, the cat sat on the mat. 1990, 2024 and ünïcode words again."] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    return TokenizersTokenizer(tokenizer)


@pytest.mark.parametrize("kind", ["tokenizers", "sentencepiece", "metaspace", "words"])
def test_a_generation_streams_the_text_that_follows_its_prompt(subword_tokenizers, kind):
    """What a choice streams after a prompt is what one decode of prompt + completion adds to the
    prompt's text: sentencepiece and Metaspace decoders drop a text's first word-start space, and
    word-level text puts no space before a line's first word, so a detokenizer that started from
    nothing streamed "Hello" + "world". After a session's text whose tokens are not at hand
    (`continues`), the first word takes its space too."""
    pytest.importorskip("sentencepiece" if kind == "sentencepiece" else "tokenizers")
    from xlserve.models.tokenizer import WordTokenizer

    text = "Hello world, the cat sat on the mat. 1990, and words again."
    if kind == "metaspace":
        tokenizer = metaspace_tokenizer()
    elif kind == "words":
        text = "Hello world , the cat\nsat on the mat . 1990 , and\nwords again ."
        tokenizer = WordTokenizer(sorted(set(text.split())) + ["<eos>"])
    else:
        tokenizer = subword_tokenizers[kind]()
    ids = tokenizer.encode(text)
    checked = 0
    for cut in range(1, len(ids)):
        prompt, completion = ids[:cut], ids[cut:]
        before, whole = tokenizer.decode(prompt), tokenizer.decode(ids)
        if not whole.startswith(before):  # a cut inside a character: no text of the prompt's own to follow
            continue
        detokenizer = tokenizer.detokenizer(prompt[-8:])
        streamed = "".join(detokenizer.push(token) for token in completion) + detokenizer.flush()
        assert before + streamed == whole, (cut, before, streamed)
        checked += 1
    assert checked > len(ids) // 2
    # a word's tokens as they follow other text: byte-level BPE carries the space in the token
    word = tokenizer.encode(" world" if kind == "tokenizers" else "world")
    detokenizer = tokenizer.detokenizer(continues=True)
    assert "".join(detokenizer.push(token) for token in word) + detokenizer.flush() == " world"
    if kind == "words":  # after a line's end, a line's first word
        detokenizer = tokenizer.detokenizer(tokenizer.encode("cat\n"))
        assert detokenizer.push(word[0]) == "world"


def test_a_missing_tokenizer_file_is_named_without_reading_it(tmp_path):
    """What a start checks before its port opens: the file a converted checkpoint's config names,
    without loading it; a value of another kind is left to the load, which says what is wrong."""
    from xlserve.models.tokenizer import missing_tokenizer_file

    assert missing_tokenizer_file({"tokenizer": "bytes"}, tmp_path) is None
    assert "symbols.json does not exist" in missing_tokenizer_file({"tokenizer": "words"}, tmp_path)
    assert "mine.json does not exist" in missing_tokenizer_file({"tokenizer": "tokenizers",
                                                                  "tokenizer_file": "mine.json"}, tmp_path)
    (tmp_path / "spiece.model").write_bytes(b"")
    assert missing_tokenizer_file({"tokenizer": "sentencepiece"}, tmp_path) is None
    for odd in ({"tokenizer": ["words"]}, {"tokenizer": "words", "tokenizer_file": 7}, {"tokenizer": None}):
        assert missing_tokenizer_file(odd, tmp_path) is None
