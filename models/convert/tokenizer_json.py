"""The tokenizer files of a Hugging Face directory whose tokenizer is a `tokenizer.json` (Mamba,
Mamba-2 and RWKV-4 checkpoints: GPT-NeoX's byte-level BPE), and what their importers share.

tokenizer.json is read by the `tokenizers` library (never by hand-written BPE) to check it
before it is copied beside the weights; models.tokenizer.TokenizersTokenizer serves it.
tokenizer_config.json and chat_template.jinja are copied when the directory has them: the
server's chat completions take the checkpoint's chat template (and bos/eos tokens) from them
(server/api/chat.py). The end-of-text tokens, where a generation ends, are recorded in our
config.json as `stop_token_ids` (models/tokenizer.py `stop_tokens_of`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, load_placed

TOKENIZER_FILE = "tokenizer.json"
COPIED_IF_PRESENT = ("tokenizer_config.json", "chat_template.jinja")


def tokenizer_files(directory: Path, vocab_size: int, hf_config: dict) -> tuple[dict[str, bytes], list[int] | None, list[str]]:
    """The files that go beside the converted weights, the end-of-text tokens at which a
    generation ends (None without a tokenizer.json: found at load from the files put there
    later), and notes for the user."""
    from xlserve.models.tokenizer import TokenizersTokenizer, stop_tokens_of

    files: dict[str, bytes] = {}
    path = directory / TOKENIZER_FILE
    tokenizer = None
    if path.is_file():
        content = path.read_bytes()
        try:
            tokenizer = TokenizersTokenizer.from_bytes(content)
        except Exception as e:  # the library raises its own Exception subclass on a bad file
            raise ConversionError(f"{path} is not a tokenizer the tokenizers library reads: {e}") from None
        if tokenizer.vocab_size > vocab_size:
            raise ConversionError(f"{path} has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                                  f"{vocab_size}")
        files[TOKENIZER_FILE] = content
    # without a tokenizer.json these still go: the end of text is read from them at conversion
    # (generation_config.json, config.json) or at load (tokenizer_config.json), once the user
    # has put the tokenizer.json beside the converted weights
    for name in COPIED_IF_PRESENT:
        extra = directory / name
        if not extra.is_file():
            continue
        if name.endswith(".json"):
            try:
                parsed = json.loads(extra.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConversionError(f"{extra} is not valid JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise ConversionError(f"{extra} does not hold a JSON object")
        files[name] = extra.read_bytes()
    stops = stop_tokens_of(tokenizer, directory, hf_config, vocab_size)
    if tokenizer is None:
        notes = [f"no {TOKENIZER_FILE} in {directory}: the weights convert, but serving text needs the "
                 f"checkpoint's {TOKENIZER_FILE}: put it in the output directory"]
        if stops:
            notes.append(f"a generation ends at token {', '.join(map(str, stops))} (the source's eos_token_id), as "
                         "transformers' generate() ends it, unless a request sets ignore_eos")
        # none found: left unrecorded, so that the load reads tokenizer_config.json's eos_token
        return files, stops or None, notes
    if stops:
        names = ", ".join(f"{tokenizer.token_text(token)} ({token})" for token in stops)
        notes = [f"a generation ends at {names}, as transformers' generate() ends it, unless a request sets ignore_eos"]
    else:
        notes = ["no end-of-text token (eos_token_id) found: generations end at a stop string or max_tokens"]
    return files, stops, notes


def finish_import(source: SourceCheckpoint, model, place, architecture: str, symbols: Path | None,
                  notes: list[str]) -> Imported:
    """`model` (built from the translated config) with the tensors `place(model, tensors)` maps
    onto it, its tokenizer files and our config.json's extra fields."""
    if symbols is not None:
        raise ConversionError(f"--symbols is for word-level models; {architecture}'s tokenizer is its {TOKENIZER_FILE}")
    files, stops, tokenizer_notes = tokenizer_files(source.directory, model.config.vocab_size, source.config)
    extra = {
        "tokenizer": "tokenizers",
        "tokenizer_file": TOKENIZER_FILE,
        **({"stop_token_ids": stops} if stops is not None else {}),
        "converted_from": {
            "format": "huggingface",
            "architecture": architecture,
            "transformers_version": source.config.get("transformers_version"),
            "weights_file": source.weights_file,
        },
    }
    tensors = SourceTensors(source)
    model = load_placed(model, place(model, tensors), tensors)
    return Imported(model=model, config_extra=extra, files=files, notes=notes + tokenizer_notes)


def check_architecture(hf: dict, where: Path, architecture: str) -> None:
    architectures = hf.get("architectures") or [architecture]
    if architecture not in architectures:
        raise ConversionError(f"{where} describes {architectures}; only {architecture} (with its LM head) converts")


def positive_int(value, name: str, where: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConversionError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def real_number(value, name: str, where: Path, infinite: bool = False) -> float:
    """A config value that must be a finite number (an epsilon, a ratio), or with `infinite` a
    bound that may be ±inf (Mamba-2's time_step_limit is [0, inf] by default): a null, a string
    or NaN is refused naming the field, where float() raised a TypeError naming none."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
            or (not infinite and math.isinf(value))):
        kind = "a number" if infinite else "a finite number"
        raise ConversionError(f"{where}: {name} must be {kind}, got {value!r}")
    return float(value)
