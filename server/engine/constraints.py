"""Structured output: what a row may generate, as a mask over the vocabulary before sampling
(engine process; any process that runs an `Engine`).

A request may carry one constraint (`SamplingParams.constraint_kind` and `constraint`, as the
API built them from `response_format`, vLLM's `guided_*` fields or chat's `tools`):

- "json_schema": a JSON schema (the text of one JSON object); "json_object" is any JSON object;
- "regex": a regular expression the whole output matches (Rust's regex syntax);
- "choice": a JSON list of strings, the output is one of them;
- "grammar": a Lark grammar in llguidance's dialect (which can embed JSON schemas, `%json {...}`).

The constraint engine is llguidance (a kept library: Earley parsing over a lazily built lexer,
JSON schema to grammar, masks over token byte strings). A compiled constraint is an `LLMatcher`
over the model's tokens; each row decodes with its own copy (`RowConstraint`), so n > 1 choices
and the prompts of a batched request never share parser state.

Tokens as bytes: llguidance needs each token's byte string, such that the decoded text is those
strings joined (`model_tokenizer`). A byte-level vocabulary (token i is byte i) has exactly that,
and so has a tokenizer.json whose decoder is ByteLevel (GPT-2's and GPT-NeoX's byte-level BPE,
which converted Mamba, Mamba-2 and RWKV-4 checkpoints carry): each token's name spells its bytes
(models/tokenizer.py `TokenizersTokenizer.token_bytes`). llguidance's vocabulary is the MODEL's
(the logits' width, which may pass the tokenizer's: mamba-130m-hf has 50,280 rows for 50,277
tokens, a byte checkpoint may have 260) plus one token, past it, that stands for "the output may
end here" (llguidance's EOS). Every id without bytes of its own is a special token, which no
JSON schema, regex, choice or tool grammar allows: a row past the tokenizer's (padding), a byte
model's id past 255, and every added token of a tokenizer.json (<|endoftext|>, the model's end of
text; a chat template's markers). Word-level, SentencePiece and other tokenizer.json vocabularies
are refused (400 `constraint_not_supported`): their decoded text is not the concatenation of
per-token bytes (words are joined by spaces, pieces lose their leading space at the start), so a
mask over them would allow text the constraint does not.

Drawing (server/engine/scheduler.py `_draw_constrained`). Where the sampler does not truncate
the row (no top-k, top-p or min-p; greedy counts as untruncated), the row is perturbed once with
Gumbel noise from the choice's generator (`Sampler.perturbed`): the argmax of the perturbed row
over any set of tokens is a draw from the row restricted to that set (the Gumbel-max trick). The
argmax over all tokens is offered to the matcher (one parser step); only when the constraint
forbids it is the mask computed, and the argmax over the allowed tokens taken: exactly a draw
from the masked row, with no second draw, and most steps never compute a mask. With truncation
the mask comes first and the sampler draws as usual (`Sampler.choose`), as in vLLM's order.

Ending. Our byte models have no end-of-text token, so a row cannot stop by itself; a converted
model's end of text (<|endoftext|>) is a special token no constraint allows, and a constrained
row does not end at it as an unconstrained row does. Where the constraint is complete but could
go on (a number's digits, text after a tool call), the output ends when the model's draw is a
token the constraint forbids (the end of text among them): the model "wanted" something the
output may not contain. So "end here" has the probability the model gives to every forbidden
token (the perturbed row's argmax is forbidden; with truncation "end here" is drawn as one more
choice beside the allowed tokens with that mass, server/engine/sampling.py `Sampler.choose`;
greedy ends when the most likely token is forbidden).
Where the constraint can only end (a JSON object's closing brace), the row ends after that token.
Both end with finish_reason "stop". A row whose constraint allows no token and cannot end ends
with finish_reason "no_allowed_token", and so does one whose model gives every allowed token no
chance (log-probability -inf) where it cannot end; the rest of the batch goes on. A matcher that stopped with
an error of its own (one of llguidance's limits, `parser_limits`, reached mid-output) is no such
end: its request fails alone with 400 `grammar_too_large` carrying llguidance's reason, which the
engine logs too (`RowConstraint.failure`).

Cost. Every row's parser runs on the engine's one worker thread, between the model's steps, so a
constraint that is slow to follow holds every other request of the model. An ambiguous grammar
(`start: x "b"`, `x: x x | x x x | "a"`) costs a step time that grows with the square of the
output (0.3 ms at token 25, 6-10 ms at 100, 30-170 ms past 175), and no llguidance limit trips. A
row therefore measures the parser's CPU time (its thread's, so neither the GIL nor a loaded
machine counts) for each token it draws, the step and the mask together; past
`structured_token_milliseconds` for `SLOW_TOKENS_IN_A_ROW` tokens in a row (one alone may be a
spike: a garbage collection, lexer states built the first time), or past that limit on average
with more than `SLOW_TOKENS_SPARE` tokens' worth to spare (slow tokens between fast ones), its
request ends alone with 400 `constraint_too_slow`, naming the setting (`RowConstraint.too_slow`). The JSON schemas,
regexes, choice lists and tool grammars clients send take 0.01-0.5 ms at their worst token (128
tools: 1.2 ms at the first); a schema of 600 optional properties up to 20 ms where a key starts,
but one token at a time, so it passes.

Compiling happens once per distinct constraint text: compiled matchers are kept in a bounded
LRU cache (`structured_cache_size`), and so are refusals, so a repeated bad schema costs nothing.
A compile runs on a worker thread and is given `structured_compile_seconds`: one that takes
longer is refused (400 `grammar_too_large`), and so is a constraint text over
`structured_max_bytes` (checked by the API before it gets here) or a grammar llguidance finds
too large (its own limits). A schema or grammar llguidance rejects is 400
`invalid_response_format`, with llguidance's message (a keyword or format it does not implement
in plain words, `plain_reason`). The API asks for lenient compiles, which ignore such keywords,
unless the request says `strict: true` (server/api/structured.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from xlserve.models.tokenizer import ByteTokenizer, TokenizersTokenizer
from xlserve.server.engine.errors import InvalidInput, QueueFull

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
NO_ALLOWED_TOKEN = "no_allowed_token"  # the finish_reason of a row its constraint leaves nothing to draw
# how JSON is laid out: compact separators with one space, as json.dumps writes, and no other
# whitespace. A free-whitespace JSON grammar lets a small model pad an object with newlines until
# max_tokens; this way every token goes to content, and the output is still any parser's JSON
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILE_THREADS = 2  # compiles of distinct constraints at once (a timed-out one finishes in the background)
# Earley items one row of llguidance's parser may hold. Its default (2,000) ended a schema of 600
# optional properties (four items each where a key may start) at its first key, though the
# schema is a third of XLSERVE_STRUCTURED_MAX_BYTES: 32,768 covers the optional properties a 64 KiB
# schema can list (`"p1": {}, ` is 10 bytes). What such rows cost to follow is bounded by time,
# per token (`RowConstraint.too_slow`), not by this count.
MAX_ITEMS_IN_ROW = 32_768
# tokens in a row over the parser's time limit that end a row: one alone is a spike (a garbage
# collection, the lexer building states it meets for the first time), where a grammar that grows
# slower with every token is over the limit at every token from some point on
SLOW_TOKENS_IN_A_ROW = 3
# and over any stretch of tokens, the parser may take the limit per token on average, with this
# many tokens' worth of time to spare (1 s at the default 5 ms): a constraint whose slow tokens
# alternate with fast ones (a schema of thousands of properties: 300 ms at each ", ", then a few
# fast tokens) never has three slow ones in a row, and held every other request of the model
# for minutes. A spike (a garbage collection) fits in the spare time, and so does a schema of 600
# optional properties (20 ms where a key starts, every ten tokens or so: 2 ms a token)
SLOW_TOKENS_SPARE = 200


class ParserDebt:
    """The parser time a request's rows took past the limit and have not paid back by faster
    tokens, shared by all of its rows (its n choices; each prompt of a list is an engine request
    of its own, bounded by the queue's limits): every row's parser
    runs in turn on the engine's one worker thread, so n rows of one request may spare what one
    row may, not n times that, or a request of 64 rows with a schema whose first token costs
    140 ms would take 9 s of every step from every other request without any row going over."""

    def __init__(self):
        self.seconds = 0.0


def llguidance_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint of `kind` with `text`; ValueError when `text` is
    not even the right shape (not a JSON object, not a list of strings)."""
    import llguidance  # the engine process's dependency only: the API process never compiles

    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = json.loads(text)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object")
        if isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict):
            # the schema's own options stay, but for the layout, which is the server's: a client's
            # separators ("item_separator": ";") would make the output no JSON
            schema = {**schema, "x-guidance": {**schema["x-guidance"], **JSON_OPTIONS}}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("a choice is a non-empty list of strings")
        # one lexeme whose alternatives are the choices: the lexer follows them all at once (10,000
        # compile in 50 ms), where alternatives of a rule are a parser item each, past the row's
        # bound. json.dumps writes each as a Lark string: quotes, backslashes, control and non-ASCII
        # characters escaped (\uXXXX, surrogate pairs included), which llguidance reads back
        return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: "
                                                      + " | ".join(json.dumps(choice) for choice in choices))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise ValueError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")


def parser_limits():
    """llguidance's limits for every matcher: its defaults, but `MAX_ITEMS_IN_ROW`, and terse
    errors (a verbose one lists the parser's state: the output so far, for the log and the client)."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


# llguidance's words for JSON schema keywords and formats it does not implement
_UNIMPLEMENTED_KEYS = re.compile(r"Unimplemented keys: \[([^\]\n]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def plain_reason(message: str) -> str:
    """llguidance's reason for refusing a JSON schema, its words for keywords or a format it does
    not implement (which a lenient compile ignores) put plainly; the rest as it is."""

    def keywords(found: re.Match) -> str:
        names = [name.strip().strip('"') for name in found.group(1).split(",") if name.strip()]
        listed = ", ".join(f'"{name}"' for name in names)
        them = "them" if len(names) > 1 else "it"
        return (f"the schema uses {listed}, which structured output does not enforce: a schema marked "
                f'"strict": true may not use {them} (without "strict": true it is accepted, and {them} ignored)')

    def unknown_format(found: re.Match) -> str:
        return (f'the schema uses "format": "{found.group(1)}", a format structured output does not know: a schema '
                'marked "strict": true may not use it (without "strict": true it is accepted, and the format '
                "ignored)")

    return _UNKNOWN_FORMAT.sub(unknown_format, _UNIMPLEMENTED_KEYS.sub(keywords, message))


END = b"\xff[end]"  # the name of llguidance's end-of-output token; \xff: llguidance's special-token mark


def byte_level_tokenizer(vocab_size: int):
    """llguidance's tokenizer for a byte-level vocabulary of `vocab_size` ids: token i < 256 is
    byte i, an id past 255 (a byte checkpoint with more rows than bytes) is special, and token
    `vocab_size` is the end of the output (a special token, never fed to the model)."""
    import llguidance

    class Tokens:
        eos_token_id = vocab_size
        bos_token_id = None
        tokens = [bytes([i]) if i < 256 else b"\xff[id %d]" % i for i in range(vocab_size)] + [END]
        special_token_ids = [*range(256, vocab_size), vocab_size]

        def __call__(self, text):
            return list(text if isinstance(text, bytes) else text.encode("utf-8"))

    # slices=[]: with 256 tokens a mask is computed by walking them all, faster than slicing
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), slices=[])


def byte_level_bpe_tokenizer(tokenizer: TokenizersTokenizer, vocab_size: int):
    """llguidance's tokenizer for a byte-level BPE (a tokenizer.json whose decoder is ByteLevel)
    under a model of `vocab_size` ids: token i is the bytes its name spells
    (`TokenizersTokenizer.token_bytes`); an added token (<|endoftext|>, a chat template's marker)
    and an id past the tokenizer's (a padded embedding row) are special, so no constraint
    allows them; token `vocab_size` is the end of the output (special, never fed to the model).
    llguidance's own LLTokenizer(tokenizer.json) cannot be used: it refuses an end token past
    the tokenizer's own ids."""
    import llguidance

    tokens: list[bytes] = []
    special: list[int] = []
    known = tokenizer.vocab_size  # the library counts them anew at each call (3 ms at 50,277 tokens)
    for token in range(vocab_size):
        spelled = tokenizer.token_bytes(token)
        if spelled is None:
            name = tokenizer.tokenizer.id_to_token(token) if token < known else None
            tokens.append(b"\xff" + (name.encode("utf-8") if name else b"[id %d]" % token))
            special.append(token)
        else:
            tokens.append(spelled)
    specials = set(special)
    single = {spelled[0]: token for token, spelled in enumerate(tokens) if len(spelled) == 1 and token not in specials}

    class Tokens:
        eos_token_id = vocab_size
        bos_token_id = None
        special_token_ids = [*special, vocab_size]

        def __call__(self, text):
            """Token ids whose bytes join to `text`: the tokenizer's, unless they hold a special
            token (an added token written in the text) or spell something else; then one
            byte token per byte."""
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            try:
                ids = tokenizer.encode(data.decode("utf-8"))
            except UnicodeDecodeError:
                ids = None
            if ids is not None and all(0 <= i < vocab_size and i not in specials for i in ids) \
                    and b"".join(tokens[i] for i in ids) == data:
                return ids
            return [single[byte] for byte in data if byte in single]

    Tokens.tokens = tokens + [END]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()))


def vocabulary_refusal(tokenizer, model_name: str) -> str | None:
    """Why structured output cannot be enforced over the model's tokens (the message of 400
    `constraint_not_supported`); None where it can: a byte-level vocabulary, or a tokenizer.json
    whose decoder is ByteLevel."""
    if isinstance(tokenizer, ByteTokenizer):
        return None
    if isinstance(tokenizer, TokenizersTokenizer):
        if tokenizer.byte_level:
            return None
        decoder = tokenizer.tokenizer.decoder
        return (f"model '{model_name}' has a tokenizer.json whose decoder is "
                f"{type(decoder).__name__ if decoder is not None else 'none'}, not ByteLevel, so its tokens are not "
                "known to be byte strings that join to the decoded text, and structured output cannot be enforced on "
                "it; it can on byte-level models and on byte-level BPE tokenizers (GPT-2's and GPT-NeoX's "
                "tokenizer.json)")
    return (f"model '{model_name}' has a {type(tokenizer).__name__}, whose tokens are not byte strings that join "
            "to the decoded text (words are joined by spaces, pieces lose a leading space), so structured output "
            "cannot be enforced on it; it can on byte-level models and on byte-level BPE tokenizers (GPT-2's and "
            "GPT-NeoX's tokenizer.json)")


def model_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for a model of `vocab_size` ids (its logits' width) whose text
    `tokenizer` makes, one token past them standing for the end of the output
    (`vocabulary_refusal` says which tokenizers it takes)."""
    if isinstance(tokenizer, ByteTokenizer):
        return byte_level_tokenizer(vocab_size)
    return byte_level_bpe_tokenizer(tokenizer, vocab_size)


class ConstraintCompiler:
    """One model's constraints: compiles them (once per distinct text, on a worker thread, within
    a time limit) and keeps the results in a bounded LRU cache. Any thread."""

    def __init__(self, tokenizer, model_name: str, cache_size: int = 256, compile_seconds: float = 5.0,
                 vocab_size: int | None = None):
        self.model_name = model_name
        # the MODEL's vocabulary (its logits' width; the tokenizer's when not given), which may
        # pass the tokenizer's: llguidance's vocabulary is that and one end token
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        self.unsupported = vocabulary_refusal(tokenizer, model_name)
        self._model_tokenizer = tokenizer
        self._tokenizer = None  # llguidance's, built at the first constraint
        # held while llguidance's tokenizer is built (0.25 s for a vocabulary of 50,000 tokens), not
        # `_lock`, which the engine process's reader thread takes to look in the cache
        self._build_lock = threading.Lock()
        self.cache_size = max(0, cache_size)
        self.compile_seconds = compile_seconds
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # -> LLMatcher, or the InvalidInput it got
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.compiles = 0  # how many compiles ran (tests and the benchmark read it)

    def __len__(self) -> int:
        return len(self._cache)

    def cached_matcher(self, kind: str, text: str, param: str | None = None):
        """`matcher`'s answer when the constraint was compiled before (its error raised, as there),
        None when it would have to be compiled: a caller that must not wait for a compile (the
        engine process's reader thread) asks this, in one step, rather than `cached` and then
        `matcher`, between which another compile may push it out of the cache."""
        if self.unsupported is not None:
            raise InvalidInput(self.unsupported, param=param, code="constraint_not_supported")
        key = (kind, text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        return None if compiled is None else self._answer(compiled, param)

    def matcher(self, kind: str, text: str, param: str | None = None):
        """A fresh matcher for the constraint (a copy of the compiled one, for one request);
        raises InvalidInput naming `param` when it cannot be compiled or is too large."""
        compiled = self.cached_matcher(kind, text, param)
        if compiled is not None:
            return compiled
        compiled = self._compile(kind, text, param)  # raises QueueFull, kept for nothing, when no thread frees
        self._keep((kind, text), compiled)
        return self._answer(compiled, param)

    @staticmethod
    def _answer(compiled, param: str | None):
        """The compiled matcher, or its compile's error raised naming `param`."""
        if isinstance(compiled, InvalidInput):
            raise type(compiled)(compiled.message, param=param, code=compiled.code)
        return compiled

    def _keep(self, key: tuple[str, str], compiled) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _compile(self, kind: str, text: str, param: str | None):
        import llguidance

        with self._build_lock:
            if self._tokenizer is None:
                self._tokenizer = model_tokenizer(self._model_tokenizer, self.vocab_size)
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="constraint-compile")
            tokenizer, pool = self._tokenizer, self._pool
        what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
                "choice": "choice list", "grammar": "Lark grammar"}.get(kind, kind)
        try:
            grammar = llguidance_grammar(kind, text)
        except ValueError as error:
            return InvalidInput(f"the {what} is not valid: {error}", code="invalid_response_format")

        started = threading.Event()

        def build():
            started.set()
            # the constructor never raises for a bad grammar: the matcher is left in an error state
            return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())

        # The time limit is the compile's own, from when a thread takes it: time spent waiting
        # behind other clients' compiles must not turn this one into grammar_too_large, cached
        # for everyone who sends it. With every thread taken for the whole limit (compiles that
        # passed theirs run on: a thread cannot be stopped), the request is refused as busy
        # (429 constraint_compiler_busy) and nothing is kept for the constraint.
        future = pool.submit(build)
        if not started.wait(timeout=max(self.compile_seconds, 1.0)) and future.cancel():
            raise QueueFull(f"every structured-output compile thread of model '{self.model_name}' has been busy "
                             f"for {self.compile_seconds:g} s (XLSERVE_STRUCTURED_COMPILE_SECONDS); retry later",
                             code="constraint_compiler_busy")
        self.compiles += 1
        try:
            matcher = future.result(timeout=self.compile_seconds)
        except FutureTimeout:
            return InvalidInput(f"the {what} took more than {self.compile_seconds:g} s to compile "
                                "(XLSERVE_STRUCTURED_COMPILE_SECONDS); simplify it", code="grammar_too_large")
        if matcher.is_error():
            message = matcher.get_error().strip()
            code = "grammar_too_large" if "limit" in message.lower() else "invalid_response_format"
            return InvalidInput(f"the {what} is not valid: {plain_reason(message)}", code=code)
        return matcher


class RowConstraint:
    """One row's matcher: which tokens it may draw next, and what it has drawn; and what the parser
    costs per token (`start_token`, `too_slow`)."""

    def __init__(self, matcher, vocab_size: int, debt: ParserDebt | None = None):
        self.matcher = matcher.deep_copy()
        self.vocab_size = vocab_size
        self.token_seconds = 0.0  # the parser's CPU time since `start_token`
        self.slow_tokens = 0  # tokens in a row, up to the last, over the time limit
        # parser time past the limit, not yet paid back by faster tokens (`too_slow`): its request's
        self.debt = debt if debt is not None else ParserDebt()

    def start_token(self) -> None:
        """The parser's time from here on is the next token's."""
        self.token_seconds = 0.0

    def too_slow(self, limit_seconds: float, param: str | None) -> InvalidInput | None:
        """The refusal of a row whose parser took longer than `limit_seconds` (0: no limit) for
        each of its last `SLOW_TOKENS_IN_A_ROW` tokens, the last since `start_token`; else None."""
        if limit_seconds <= 0:
            return None
        self.slow_tokens = self.slow_tokens + 1 if self.token_seconds > limit_seconds else 0
        # the time taken past the limit, paid back by every token under it (a leaky bucket), over
        # all of the request's rows
        debt = self.debt
        debt.seconds = max(0.0, debt.seconds + self.token_seconds - limit_seconds)
        if debt.seconds > SLOW_TOKENS_SPARE * limit_seconds:
            return InvalidInput(
                f"the constraint took {debt.seconds * 1e3:.0f} ms of parser time more than the limit of "
                f"{limit_seconds * 1e3:g} ms a token (XLSERVE_STRUCTURED_TOKEN_MILLISECONDS) allows over its recent "
                f"tokens, over all of the request's choices, past the "
                f"{SLOW_TOKENS_SPARE * limit_seconds * 1e3:.0f} ms it may spare, so that one request cannot hold the "
                "others. Schemas of thousands of properties cost that at every one; simplify the constraint, or ask "
                "for fewer choices", param=param, code="constraint_too_slow")
        if self.slow_tokens < SLOW_TOKENS_IN_A_ROW:
            return None
        return InvalidInput(
            f"the constraint took {self.token_seconds * 1e3:.1f} ms of parser time for its last token, over the "
            f"limit of {limit_seconds * 1e3:g} ms (XLSERVE_STRUCTURED_TOKEN_MILLISECONDS) for {self.slow_tokens} "
            "tokens in a row, so that one request cannot hold the others. An ambiguous grammar (a rule such as "
            '`x: x x | "a"`) grows slower with every token, and so do schemas with hundreds of optional '
            "properties; simplify the constraint", param=param, code="constraint_too_slow")

    def _timed(self, call, *args):
        started = time.thread_time()  # this thread's CPU time: waits for the GIL or a core do not count
        try:
            return call(*args)
        finally:
            self.token_seconds += time.thread_time() - started

    def allowed(self) -> tuple[torch.Tensor, bool]:
        """((V,) bool: the tokens that keep the output valid, whether it may end here)."""
        words = np.frombuffer(self._timed(self.matcher.compute_bitmask), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")  # bit i of the little-endian words is token i
        may_end = bool(bits[self.vocab_size]) and self.matcher.is_accepting()
        return torch.from_numpy(bits[: self.vocab_size].astype(bool)), may_end

    def allowed_bits(self) -> np.ndarray:
        """(V,) bool, NumPy: the tokens that keep the output valid."""
        words = np.frombuffer(self._timed(self.matcher.compute_bitmask), dtype=np.uint8)
        return np.unpackbits(words, bitorder="little")[: self.vocab_size].astype(bool)

    def may_end(self) -> bool:
        return self.matcher.is_accepting() and not self.matcher.is_error()

    def accept(self, token: int) -> bool:
        """Take `token` if the constraint allows it (True), else change nothing (False): one
        step of the parser, far cheaper than a whole mask."""
        return self._timed(self.matcher.try_consume_tokens, [token]) == 1

    def consume(self, token: int) -> None:
        """Take a token drawn from the mask."""
        self._timed(self.matcher.consume_token, token)

    def failure(self, param: str | None, taken: int) -> InvalidInput | None:
        """Why the matcher stopped, when it stopped with an error of its own rather than at the end
        of its language: one of llguidance's limits (`parser_limits`) reached at this point of the
        output, after `taken` tokens of it. None while it has no error."""
        if not self.matcher.is_error():
            return None
        reason = (self.matcher.get_error().strip().splitlines() or ["no reason given"])[0]
        return InvalidInput(f"the constraint's parser stopped after {taken} tokens of output: {reason}",
                            param=param, code="grammar_too_large")

    @property
    def complete(self) -> bool:
        """Nothing may follow what it has taken."""
        return self.matcher.is_stopped() and not self.matcher.is_error()
