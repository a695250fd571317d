"""Hugging Face `TransfoXLLMHeadModel` (transformers <= 4.37, e.g. transfo-xl-wt103) -> our
`TransformerXL` with adaptive input and adaptive softmax.

Config (Hugging Face -> ours)
    vocab_size, n_layer, d_model, n_head, d_head, d_inner,
    dropout, dropatt, mem_len, clamp_len, same_length,
    untie_r, layer_norm_epsilon, d_embed, cutoffs, div_val  -> the same names
    pre_lnorm               -> pre_norm, with final_norm=False (HF has no norm after the last layer)
    tie_word_embeddings     -> tie_embedding (every output cluster's vectors are the input table)
    tie_projs               -> tie_projs (derived from proj_share_all_but_first when absent)
    (always)                -> adaptive=True
Refused: attn_type != 0 and sample_softmax > 0 (the reference implements neither for
inference), and any architecture but TransfoXLLMHeadModel (a bare TransfoXLModel has no LM head).

Tensors (per layer i; "T." = "transformer.")
    T.layers.i.dec_attn.qkv_net / r_net / o_net  -> layers.i.qkv_net / r_net / o_net
    T.layers.i.dec_attn.layer_norm               -> layers.i.attn_norm
    T.layers.i.pos_ff.CoreNet.0 / CoreNet.3      -> layers.i.ff.0 / ff.3
    T.layers.i.pos_ff.layer_norm                 -> layers.i.ff_norm
    T.layers.i.dec_attn.r_w_bias / r_r_bias      -> row i of r_w_bias / r_r_bias (untie_r)
    T.r_w_bias / T.r_r_bias                      -> the single row of r_w_bias / r_r_bias
    T.word_emb.emb_layers.k / emb_projs.k        -> embedding.tables.k / embedding.projections.k
    crit.out_layers.k.bias (concatenated)        -> head.bias
    crit.out_layers.k.weight (untied only)       -> head.tables.k
    crit.out_projs.k (untied only)               -> head.projections.k
    crit.cluster_weight / cluster_bias           -> head.cluster_weight / cluster_bias
    T.pos_emb.inv_freq                           -> checked against the standard frequencies
Copies of tied tensors (which save_pretrained usually drops) are accepted and ignored, as the
reference does when it re-ties them. Anything else is an error naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, load_placed, skeleton
from xlserve.models.tokenizer import WordTokenizer
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig, cluster_bounds

ARCHITECTURE = "TransfoXLLMHeadModel"

# what transformers' TransfoXLConfig fills in when config.json leaves a key out
HF_DEFAULTS = {
    "vocab_size": 267735, "cutoffs": [20000, 40000, 200000], "d_model": 1024, "d_embed": 1024,
    "n_head": 16, "d_head": 64, "d_inner": 4096, "div_val": 4, "pre_lnorm": False, "n_layer": 18,
    "mem_len": 1600, "clamp_len": 1000, "same_length": True, "proj_share_all_but_first": True,
    "attn_type": 0, "sample_softmax": -1, "dropout": 0.1, "dropatt": 0.0, "untie_r": True,
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
}

SYMBOL_FILES = ("symbols.json", "symbols.txt")  # looked for in the source directory


def translate_config(hf: dict, where: Path) -> TransformerXLConfig:
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        raise ConversionError(f"{where} describes {architectures}; only {ARCHITECTURE} (with its LM head) converts")
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    if get("attn_type") != 0:
        raise ConversionError(f"{where}: attn_type {get('attn_type')} is not supported (only 0, relative attention)")
    if get("sample_softmax") > 0:
        raise ConversionError(f"{where}: sample_softmax {get('sample_softmax')} is not supported")
    cutoffs = list(get("cutoffs"))
    tie_projs = hf.get("tie_projs")
    if tie_projs is None:
        tie_projs = [False] + [bool(get("proj_share_all_but_first"))] * len(cutoffs)
    try:
        config = TransformerXLConfig(
            vocab_size=get("vocab_size"), n_layer=get("n_layer"), d_model=get("d_model"), n_head=get("n_head"),
            d_head=get("d_head"), d_inner=get("d_inner"), dropout=get("dropout"), dropatt=get("dropatt"),
            mem_len=get("mem_len"), tgt_len=hf.get("tgt_len", 128), clamp_len=get("clamp_len"),
            same_length=bool(get("same_length")), pre_norm=bool(get("pre_lnorm")), final_norm=False,
            untie_r=bool(get("untie_r")), tie_embedding=bool(get("tie_word_embeddings")),
            layer_norm_epsilon=get("layer_norm_epsilon"), adaptive=True, d_embed=get("d_embed"),
            cutoffs=cutoffs, div_val=get("div_val"), tie_projs=[bool(t) for t in tie_projs],
        )
        cluster_bounds(config.vocab_size, config.cutoffs)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: {e}") from None
    if len(config.tie_projs) != len(cutoffs) + 1:
        raise ConversionError(f"{where}: tie_projs has {len(config.tie_projs)} entries, expected {len(cutoffs) + 1}")
    if config.div_val < 1:
        raise ConversionError(f"{where}: div_val must be at least 1, not {config.div_val}")
    return config


def _place(model: TransformerXL, source: SourceTensors) -> dict[str, Tensor]:
    """Our parameter name -> its value from the source, for every parameter stored once."""
    c = model.config
    ours = dict(model.named_parameters())  # tied parameters appear once, under their first name
    shape = lambda name: tuple(ours[name].shape)  # noqa: E731
    placed: dict[str, Tensor] = {}

    for i in range(c.n_layer):
        hf, me = f"transformer.layers.{i}.", f"layers.{i}."
        for hf_name, name in [
            ("dec_attn.qkv_net.weight", "qkv_net.weight"),
            ("dec_attn.r_net.weight", "r_net.weight"),
            ("dec_attn.o_net.weight", "o_net.weight"),
            ("dec_attn.layer_norm.weight", "attn_norm.weight"),
            ("dec_attn.layer_norm.bias", "attn_norm.bias"),
            ("pos_ff.CoreNet.0.weight", "ff.0.weight"),
            ("pos_ff.CoreNet.0.bias", "ff.0.bias"),
            ("pos_ff.CoreNet.3.weight", "ff.3.weight"),
            ("pos_ff.CoreNet.3.bias", "ff.3.bias"),
            ("pos_ff.layer_norm.weight", "ff_norm.weight"),
            ("pos_ff.layer_norm.bias", "ff_norm.bias"),
        ]:
            placed[me + name] = source.take(hf + hf_name, shape(me + name))

    head_shape = (c.n_head, c.d_head)
    for bias in ("r_w_bias", "r_r_bias"):
        per_layer = [f"transformer.layers.{i}.dec_attn.{bias}" for i in range(c.n_layer)]
        if c.untie_r:
            placed[bias] = torch.stack([source.take(name, head_shape) for name in per_layer])
        else:  # shared: stored at the top, or (after save_pretrained dropped that copy) in a layer
            shared = f"transformer.{bias}"
            stored = [name for name in [shared, *per_layer] if name in source.tensors]
            placed[bias] = source.take(stored[0] if stored else shared, head_shape)[None]
            for name in stored[1:]:
                source.ignore(name)

    embedding = model.embedding
    for k in range(len(embedding.tables)):
        name = f"embedding.tables.{k}.weight"
        placed[name] = source.take(f"transformer.word_emb.emb_layers.{k}.weight", shape(name))
    for k in range(len(embedding.projections)):
        name = f"embedding.projections.{k}"
        placed[name] = source.take(f"transformer.word_emb.emb_projs.{k}", shape(name))

    head = model.head
    bounds = head.bounds
    if c.div_val == 1:
        placed["head.bias"] = source.take("crit.out_layers.0.bias", (c.vocab_size,))
    else:
        placed["head.bias"] = torch.cat(
            [source.take(f"crit.out_layers.{k}.bias", (bounds[k + 1] - bounds[k],)) for k in range(len(bounds) - 1)]
        )
    for k in range(len(head.tables)):
        name = f"head.tables.{k}.weight"
        if c.tie_embedding:
            source.ignore(f"crit.out_layers.{k}.weight")
        else:
            placed[name] = source.take(f"crit.out_layers.{k}.weight", shape(name))
    for k in range(len(head.projections)):
        name = f"head.projections.{k}"
        if name in ours:  # not tied to an input projection
            placed[name] = source.take(f"crit.out_projs.{k}", shape(name))
        else:
            source.ignore(f"crit.out_projs.{k}")
    if len(bounds) > 2:
        placed["head.cluster_weight"] = source.take("crit.cluster_weight", shape("head.cluster_weight"))
        placed["head.cluster_bias"] = source.take("crit.cluster_bias", shape("head.cluster_bias"))

    if "transformer.pos_emb.inv_freq" in source.tensors:
        stored = source.take("transformer.pos_emb.inv_freq", (c.d_model // 2,))
        standard = 1.0 / (10000 ** (torch.arange(0, c.d_model, 2, dtype=torch.float32) / c.d_model))
        if not torch.allclose(stored, standard, rtol=1e-3, atol=1e-7):
            raise ConversionError(
                f"{source.where}: tensor 'transformer.pos_emb.inv_freq' is not the standard sinusoid "
                "frequencies that xlserve computes"
            )
    return placed


def _symbol_file(source_dir: Path, symbols: Path | None) -> Path | None:
    if symbols is not None:
        if not symbols.is_file():
            raise ConversionError(f"symbol list {symbols} does not exist")
        return symbols
    for name in SYMBOL_FILES:
        if (source_dir / name).is_file():
            return source_dir / name
    return None


def import_checkpoint(source: SourceCheckpoint, symbols: Path | None = None) -> Imported:
    where = source.directory / "config.json"
    config = translate_config(source.config, where)

    extra = {
        "tokenizer": "words",
        "tokenizer_file": "symbols.json",
        "converted_from": {
            "format": "huggingface",
            "architecture": ARCHITECTURE,
            "transformers_version": source.config.get("transformers_version"),
            "weights_file": source.weights_file,
        },
    }
    files, notes = {}, []
    symbol_file = _symbol_file(source.directory, symbols)
    if symbol_file is not None:
        try:
            tokenizer = WordTokenizer.from_file(symbol_file)
        except (ValueError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{symbol_file}: {e}") from None
        if tokenizer.vocab_size != config.vocab_size:
            raise ConversionError(
                f"{symbol_file} lists {tokenizer.vocab_size} symbols, the model's vocab_size is {config.vocab_size}"
            )
        files["symbols.json"] = tokenizer.to_json()
    else:
        notes.append(
            "no symbol list (symbols.json / symbols.txt, or --symbols): the weights convert, but serving "
            "text needs symbols.json in the output directory; docs/convert.md shows how to export it"
        )

    model = skeleton(TransformerXL, config)  # its random weights are all overwritten below
    tensors = SourceTensors(source)
    model = load_placed(model, _place(model, tensors), tensors)
    return Imported(model=model, config_extra=extra, files=files, notes=notes)
