"""Hugging Face `RwkvForCausalLM` (e.g. RWKV/rwkv-4-169m-pile) -> our `Rwkv` (RWKV-4), with its tokenizer.json.

Config (Hugging Face -> ours)
    vocab_size, layer_norm_epsilon, rescale_every -> the same names
    hidden_size / num_hidden_layers               -> d_model / n_layer
    attention_hidden_size (None: hidden_size)     -> d_attention
    intermediate_size (None: 4 · hidden_size)     -> d_ffn
    tie_word_embeddings                           -> tie_embedding
Refused: any architecture but RwkvForCausalLM. context_length only sizes the reference's CUDA
kernel; our state has no length limit.

Tensors (per layer i; "B." = "rwkv.blocks.i.")
    rwkv.embeddings.weight                 -> embedding.weight
    rwkv.blocks.0.pre_ln                   -> pre_norm
    B.ln1 / B.ln2                          -> layers.i.ln1 / ln2
    B.attention.time_decay / time_first    -> layers.i.attention.time_decay / time_first
    B.attention.time_mix_* (1, 1, d)       -> layers.i.attention.time_mix_* (d)
    B.attention.key / value / receptance / output -> the same names
    B.feed_forward.time_mix_* (1, 1, d)    -> layers.i.feed_forward.time_mix_* (d)
    B.feed_forward.key / receptance / value -> the same names
    rwkv.ln_out                            -> final_norm
    head.weight                            -> head.weight when untied; a tied copy is ignored
The weights must be as trained (transformers divides some in place while it runs in eval mode
and would save those: a directory saved from such a model is not the checkpoint it loaded).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, skeleton
from xlserve.models.convert.tokenizer_json import check_architecture, finish_import, positive_int, real_number
from xlserve.models.rwkv import Rwkv, RwkvConfig

ARCHITECTURE = "RwkvForCausalLM"

HF_DEFAULTS = {
    "vocab_size": 50277, "hidden_size": 4096, "num_hidden_layers": 32, "attention_hidden_size": None,
    "intermediate_size": None, "layer_norm_epsilon": 1e-5, "rescale_every": 6, "tie_word_embeddings": False,
}


# the World models' vocabulary (RWKV/rwkv-4-world-*), whose tokenizer is no tokenizer.json
WORLD_VOCAB_SIZE = 65536


def translate_config(hf: dict, where: Path) -> tuple[RwkvConfig, list[str]]:
    check_architecture(hf, where, ARCHITECTURE)
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    d_model = positive_int(get("hidden_size"), "hidden_size", where)
    rescale = get("rescale_every") or 0
    if isinstance(rescale, bool) or not isinstance(rescale, int) or rescale < 0:
        raise ConversionError(f"{where}: rescale_every must be a non-negative integer, got {rescale!r}")
    config = RwkvConfig(
        vocab_size=positive_int(get("vocab_size"), "vocab_size", where),
        n_layer=positive_int(get("num_hidden_layers"), "num_hidden_layers", where), d_model=d_model,
        d_attention=positive_int(get("attention_hidden_size") or d_model, "attention_hidden_size", where),
        d_ffn=positive_int(get("intermediate_size") or 4 * d_model, "intermediate_size", where),
        layer_norm_epsilon=real_number(get("layer_norm_epsilon"), "layer_norm_epsilon", where),
        rescale_every=rescale,
        tie_embedding=bool(get("tie_word_embeddings")),
    )
    notes = []
    if config.vocab_size == WORLD_VOCAB_SIZE and not (where.parent / "tokenizer.json").is_file():
        notes.append(f"a vocabulary of {WORLD_VOCAB_SIZE:,} tokens and no tokenizer.json: an RWKV World model, whose "
                     "tokenizer (rwkv_vocab_v20230424, read by the repository's own code) xlserve does not read; "
                     "the weights convert and take token ids, but text needs a tokenizer.json")
    return config, notes


def _place(model: Rwkv, source: SourceTensors) -> dict[str, Tensor]:
    c = model.config
    d, A, F = c.d_model, c.d_attention, c.d_ffn
    placed = {"embedding.weight": source.take("rwkv.embeddings.weight", (c.vocab_size, d))}
    for hf, me in (("rwkv.blocks.0.pre_ln", "pre_norm"), ("rwkv.ln_out", "final_norm")):
        placed[me + ".weight"] = source.take(hf + ".weight", (d,))
        placed[me + ".bias"] = source.take(hf + ".bias", (d,))
    if c.tie_embedding:
        source.ignore("head.weight")
    else:
        placed["head.weight"] = source.take("head.weight", (c.vocab_size, d))
    for i in range(c.n_layer):
        hf, me = f"rwkv.blocks.{i}.", f"layers.{i}."
        for norm in ("ln1", "ln2"):
            placed[f"{me}{norm}.weight"] = source.take(f"{hf}{norm}.weight", (d,))
            placed[f"{me}{norm}.bias"] = source.take(f"{hf}{norm}.bias", (d,))
        for name in ("time_decay", "time_first"):
            placed[f"{me}attention.{name}"] = source.take(f"{hf}attention.{name}", (A,))
        for part, mixes in (("attention", ("key", "value", "receptance")), ("feed_forward", ("key", "receptance"))):
            for mix in mixes:
                name = f"{part}.time_mix_{mix}"
                placed[me + name] = source.take(hf + name, (1, 1, d)).reshape(d)
        shapes = {"attention.key": (A, d), "attention.value": (A, d), "attention.receptance": (A, d),
                  "attention.output": (d, A), "feed_forward.key": (F, d), "feed_forward.receptance": (d, d),
                  "feed_forward.value": (d, F)}
        for name, shape in shapes.items():
            placed[f"{me}{name}.weight"] = source.take(f"{hf}{name}.weight", shape)
    return placed


def import_checkpoint(source: SourceCheckpoint, symbols: Path | None = None) -> Imported:
    config, notes = translate_config(source.config, source.directory / "config.json")
    try:
        model = skeleton(Rwkv, config)
    except ValueError as e:
        raise ConversionError(f"{source.directory / 'config.json'}: {e}") from None
    return finish_import(source, model, _place, ARCHITECTURE, symbols, notes)
