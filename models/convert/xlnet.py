"""Hugging Face `XLNetLMHeadModel` (e.g. xlnet-base-cased) -> our `XLNet`, with its spiece.model.

Config (Hugging Face -> ours)
    vocab_size, n_layer, d_model, n_head, d_inner, ff_activation, clamp_len -> the same names
    d_head                    -> d_model // n_head (the reference derives it the same way)
    layer_norm_eps            -> layer_norm_epsilon
    dropout                   -> dropout and dropatt (the reference uses one rate for both)
    mem_len                   -> mem_len (None or 0 = keep everything -> None)
    tie_word_embeddings       -> tie_embedding
    (always)                  -> same_length=False: the reference's "bi" attention ignores
                                 same_length, and its "uni" attention without it is the same
                                 computation under a left-to-right permutation mask
Refused: attn_type "uni" with same_length (a sliding window we do not reproduce), bi_data (the
reference then gives half of every batch backward positions, at inference too), activations we
do not have, and any architecture but XLNetLMHeadModel. reuse_len only changes what the
reference caches while pretraining; it is noted and otherwise ignored.

Tensors (per layer i; "T." = "transformer.", "A." = "T.layer.i.rel_attn.")
    T.word_embedding.weight             -> embedding.weight
    T.mask_emb (1, 1, d)                -> mask_emb (d)
    A.q / A.k / A.v / A.r (d, H, D)     -> layers.i.q_net / k_net / v_net / r_net .weight (H*D, d)
    A.o (d, H, D)                       -> layers.i.o_net.weight (d, H*D)
    A.r_w_bias / r_r_bias / r_s_bias    -> layers.i.r_w_bias / r_r_bias / r_s_bias
    A.seg_embed                         -> layers.i.seg_embed
    A.layer_norm                        -> layers.i.attn_norm
    T.layer.i.ff.layer_1 / layer_2      -> layers.i.ff_in / ff_out
    T.layer.i.ff.layer_norm             -> layers.i.ff_norm
    lm_loss.bias                        -> head.bias
    lm_loss.weight                      -> head.weight when untied; a tied copy is ignored
Anything else is an error naming the tensor.

Tokenizer: spiece.model is copied beside the weights and served by
models.tokenizer.SentencePieceTokenizer, with do_lower_case / remove_space / keep_accents from
tokenizer_config.json when the directory has one (the reference's defaults otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, load_placed, skeleton
from xlserve.models.layers.feedforward import ACTIVATIONS
from xlserve.models.xlnet import XLNet, XLNetConfig

ARCHITECTURE = "XLNetLMHeadModel"

# what transformers' XLNetConfig fills in when config.json leaves a key out
HF_DEFAULTS = {
    "vocab_size": 32000, "d_model": 1024, "n_layer": 24, "n_head": 16, "d_inner": 4096,
    "ff_activation": "gelu", "attn_type": "bi", "layer_norm_eps": 1e-12, "dropout": 0.1, "mem_len": 512,
    "reuse_len": None, "bi_data": False, "clamp_len": -1, "same_length": False, "tie_word_embeddings": True,
}
TOKENIZER_FILE = "spiece.model"
TOKENIZER_OPTIONS = {"do_lower_case": False, "remove_space": True, "keep_accents": False}


def translate_config(hf: dict, where: Path) -> tuple[XLNetConfig, list[str]]:
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        raise ConversionError(f"{where} describes {architectures}; only {ARCHITECTURE} (with its LM head) converts")
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    notes = []
    if get("attn_type") not in ("bi", "uni"):
        raise ConversionError(f"{where}: attn_type {get('attn_type')!r} is not 'bi' or 'uni'")
    if get("attn_type") == "uni" and get("same_length"):
        raise ConversionError(f"{where}: attn_type 'uni' with same_length is not supported")
    if get("bi_data"):
        raise ConversionError(
            f"{where}: bi_data is true, which makes the reference run half of every batch with backward "
            "positions; it is a pretraining setting (the weights do not depend on it): set it to false to convert"
        )
    if get("ff_activation") not in ACTIVATIONS:
        raise ConversionError(f"{where}: ff_activation {get('ff_activation')!r} is not one of {sorted(ACTIVATIONS)}")
    if get("attn_type") == "uni":
        notes.append("attn_type 'uni': left-to-right serving is the same computation; XLNet.permuted with other "
                     "orders does not add the reference's causal mask")
    if get("reuse_len"):
        notes.append(f"reuse_len {get('reuse_len')} is a pretraining setting; xlserve's memory keeps every "
                     "position (up to mem_len)")
    d_model, n_head = get("d_model"), get("n_head")
    if not isinstance(d_model, int) or not isinstance(n_head, int) or n_head < 1 or d_model % n_head:
        raise ConversionError(f"{where}: d_model {d_model} is not a multiple of n_head {n_head}")
    if hf.get("d_head", d_model // n_head) != d_model // n_head:
        raise ConversionError(f"{where}: d_head {hf['d_head']} is not d_model // n_head = {d_model // n_head}")
    mem_len = get("mem_len") or None
    try:
        config = XLNetConfig(
            vocab_size=get("vocab_size"), n_layer=get("n_layer"), d_model=d_model, n_head=n_head,
            d_head=d_model // n_head, d_inner=get("d_inner"), ff_activation=get("ff_activation"),
            dropout=get("dropout"), dropatt=get("dropout"), mem_len=mem_len, same_length=False,
            clamp_len=get("clamp_len") if get("clamp_len") is not None else -1,
            layer_norm_epsilon=get("layer_norm_eps"), tie_embedding=bool(get("tie_word_embeddings")),
        )
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: {e}") from None
    return config, notes


def _place(model: XLNet, source: SourceTensors) -> dict[str, Tensor]:
    c = model.config
    d, H, D = c.d_model, c.n_head, c.d_head
    placed = {
        "embedding.weight": source.take("transformer.word_embedding.weight", (c.vocab_size, d)),
        "mask_emb": source.take("transformer.mask_emb", (1, 1, d)).reshape(d),
        "head.bias": source.take("lm_loss.bias", (c.vocab_size,)),
    }
    if c.tie_embedding:
        source.ignore("lm_loss.weight")
    else:
        placed["head.weight"] = source.take("lm_loss.weight", (c.vocab_size, d))
    for i in range(c.n_layer):
        attn, ff, me = f"transformer.layer.{i}.rel_attn.", f"transformer.layer.{i}.ff.", f"layers.{i}."
        for hf, ours in [("q", "q_net"), ("k", "k_net"), ("v", "v_net"), ("r", "r_net")]:
            placed[me + ours + ".weight"] = source.take(attn + hf, (d, H, D)).reshape(d, H * D).T.contiguous()
        placed[me + "o_net.weight"] = source.take(attn + "o", (d, H, D)).reshape(d, H * D)
        for name in ("r_w_bias", "r_r_bias", "r_s_bias"):
            placed[me + name] = source.take(attn + name, (H, D))
        placed[me + "seg_embed"] = source.take(attn + "seg_embed", (2, H, D))
        for hf, ours, shape in [
            (attn + "layer_norm", "attn_norm", (d,)), (ff + "layer_norm", "ff_norm", (d,)),
            (ff + "layer_1", "ff_in", None), (ff + "layer_2", "ff_out", None),
        ]:
            w_shape = shape or ((c.d_inner, d) if ours == "ff_in" else (d, c.d_inner))
            b_shape = shape or ((c.d_inner,) if ours == "ff_in" else (d,))
            placed[f"{me}{ours}.weight"] = source.take(f"{hf}.weight", w_shape)
            placed[f"{me}{ours}.bias"] = source.take(f"{hf}.bias", b_shape)
    return placed


def _tokenizer_files(directory: Path, vocab_size: int) -> tuple[dict[str, bytes], dict, list[str]]:
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        note = (f"no {TOKENIZER_FILE} in {directory}: the weights convert, but serving text needs the "
                f"sentencepiece model as {TOKENIZER_FILE} in the output directory")
        return {}, {}, [note]
    options = dict(TOKENIZER_OPTIONS)
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            saved = json.loads(tokenizer_config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ConversionError(f"{tokenizer_config} is not valid JSON: {e}") from None
        if not isinstance(saved, dict):
            raise ConversionError(f"{tokenizer_config} does not hold a JSON object")
        options.update({k: bool(saved[k]) for k in TOKENIZER_OPTIONS if k in saved})
    from xlserve.models.tokenizer import SentencePieceTokenizer

    content = path.read_bytes()
    try:
        tokenizer = SentencePieceTokenizer(content, **options)
    except Exception as e:  # sentencepiece raises RuntimeError / OSError on a bad model file
        raise ConversionError(f"{path} is not a readable sentencepiece model: {e}") from None
    if tokenizer.vocab_size != vocab_size:
        raise ConversionError(f"{path} has {tokenizer.vocab_size} pieces, the model's vocab_size is {vocab_size}")
    return {TOKENIZER_FILE: content}, options, []


def import_checkpoint(source: SourceCheckpoint, symbols: Path | None = None) -> Imported:
    if symbols is not None:
        raise ConversionError("--symbols is for word-level models; XLNet's tokenizer is its spiece.model")
    config, notes = translate_config(source.config, source.directory / "config.json")
    files, options, tokenizer_notes = _tokenizer_files(source.directory, config.vocab_size)
    extra = {
        "tokenizer": "sentencepiece",
        "tokenizer_file": TOKENIZER_FILE,
        "tokenizer_options": options or dict(TOKENIZER_OPTIONS),
        "converted_from": {
            "format": "huggingface",
            "architecture": ARCHITECTURE,
            "transformers_version": source.config.get("transformers_version"),
            "weights_file": source.weights_file,
        },
    }
    try:
        model = skeleton(XLNet, config)  # its random weights are all overwritten below
    except ValueError as e:
        raise ConversionError(f"{source.directory / 'config.json'}: {e}") from None
    tensors = SourceTensors(source)
    model = load_placed(model, _place(model, tensors), tensors)
    return Imported(model=model, config_extra=extra, files=files, notes=notes + tokenizer_notes)
