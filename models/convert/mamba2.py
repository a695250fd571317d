"""Hugging Face `Mamba2ForCausalLM` (e.g. state-spaces/mamba2-130m converted by transformers) -> our `Mamba2`.

Config (Hugging Face -> ours)
    vocab_size, n_groups, layer_norm_epsilon, head_dim -> the same names
    hidden_size / num_hidden_layers / num_heads        -> d_model / n_layer / n_head
    state_size / conv_kernel                           -> d_state / d_conv
    use_conv_bias / use_bias                           -> conv_bias / proj_bias
    time_step_limit (min, max)                         -> dt_min, dt_max (an infinite max -> None)
    tie_word_embeddings                                -> tie_embedding
Refused: hidden_act other than silu, expand · hidden_size other than num_heads · head_dim,
num_heads not a multiple of n_groups, and any architecture but Mamba2ForCausalLM. chunk_size is
the reference's prefill chunk (ours is our own, the result does not depend on it); rms_norm does
not change the reference's torch computation, which this follows, but for the gated RMSNorm: per
group of channels, as mamba_ssm trained it (models/mamba2.py; transformers' torch path
normalises over all channels, which differs when n_groups > 1).

Tensors (per layer i; "M." = "backbone.layers.i.mixer.")
    backbone.embeddings.weight            -> embedding.weight
    backbone.layers.i.norm.weight         -> layers.i.norm.weight
    M.in_proj / out_proj                  -> layers.i.mixer.in_proj / out_proj
    M.conv1d.weight (C, 1, K) / .bias     -> layers.i.mixer.conv_weight (C, K) / conv_bias
    M.dt_bias, M.A_log, M.D (H)           -> the same names
    M.norm.weight (E)                     -> layers.i.mixer.norm.weight
    backbone.norm_f.weight                -> final_norm.weight
    lm_head.weight                        -> head.weight when untied; a tied copy is ignored
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import Tensor

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, skeleton
from xlserve.models.convert.tokenizer_json import check_architecture, finish_import, positive_int, real_number
from xlserve.models.mamba2 import Mamba2, Mamba2Config

ARCHITECTURE = "Mamba2ForCausalLM"

HF_DEFAULTS = {
    "vocab_size": 32768, "hidden_size": 4096, "state_size": 128, "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5,
    "expand": 2, "conv_kernel": 4, "n_groups": 8, "num_heads": 128, "head_dim": 64, "use_bias": False,
    "use_conv_bias": True, "hidden_act": "silu", "time_step_limit": [0.0, math.inf], "tie_word_embeddings": False,
}


def translate_config(hf: dict, where: Path) -> tuple[Mamba2Config, list[str]]:
    check_architecture(hf, where, ARCHITECTURE)
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    if get("hidden_act") != "silu":
        raise ConversionError(f"{where}: hidden_act {get('hidden_act')!r} is not 'silu', the only one Mamba-2 uses")
    d_model = positive_int(get("hidden_size"), "hidden_size", where)
    n_head, head_dim = positive_int(get("num_heads"), "num_heads", where), positive_int(get("head_dim"), "head_dim", where)
    n_groups = positive_int(get("n_groups"), "n_groups", where)
    if int(real_number(get("expand"), "expand", where) * d_model) != n_head * head_dim:
        raise ConversionError(f"{where}: expand · hidden_size ({get('expand')} · {d_model}) is not num_heads · head_dim "
                              f"({n_head} · {head_dim})")
    if n_head % n_groups:
        raise ConversionError(f"{where}: num_heads {n_head} is not a multiple of n_groups {n_groups}")
    limit = get("time_step_limit")
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ConversionError(f"{where}: time_step_limit must be [min, max], got {limit!r}")
    dt_min, dt_max = (real_number(bound, "time_step_limit", where, infinite=True) for bound in limit)
    config = Mamba2Config(
        vocab_size=positive_int(get("vocab_size"), "vocab_size", where),
        n_layer=positive_int(get("num_hidden_layers"), "num_hidden_layers", where),
        d_model=d_model, n_head=n_head, head_dim=head_dim, n_groups=n_groups,
        d_state=positive_int(get("state_size"), "state_size", where),
        d_conv=positive_int(get("conv_kernel"), "conv_kernel", where),
        conv_bias=bool(get("use_conv_bias")), proj_bias=bool(get("use_bias")),
        layer_norm_epsilon=real_number(get("layer_norm_epsilon"), "layer_norm_epsilon", where), dt_min=dt_min,
        dt_max=None if math.isinf(dt_max) else dt_max, tie_embedding=bool(get("tie_word_embeddings")),
    )
    notes = []
    if n_groups > 1:
        notes.append(f"n_groups {n_groups}: the gated RMSNorm normalises each group of channels, as mamba_ssm, "
                     "which trained the model, does (transformers' torch path normalises over all of them)")
    return config, notes


def _place(model: Mamba2, source: SourceTensors) -> dict[str, Tensor]:
    c = model.config
    d, E, H, K, C = c.d_model, c.d_inner, c.n_head, c.d_conv, c.conv_dim
    placed = {
        # an older name transformers still reads (its model's load hook renames it)
        "embedding.weight": source.take(source.first_of("backbone.embeddings.weight", "backbone.embedding.weight"),
                                        (c.vocab_size, d)),
        "final_norm.weight": source.take("backbone.norm_f.weight", (d,)),
    }
    if c.tie_embedding:
        source.ignore("lm_head.weight")
    else:
        placed["head.weight"] = source.take("lm_head.weight", (c.vocab_size, d))
    for i in range(c.n_layer):
        hf, me = f"backbone.layers.{i}.", f"layers.{i}."
        placed[me + "norm.weight"] = source.take(hf + "norm.weight", (d,))
        hf, me = hf + "mixer.", me + "mixer."
        placed[me + "in_proj.weight"] = source.take(hf + "in_proj.weight", (E + C + H, d))
        placed[me + "out_proj.weight"] = source.take(hf + "out_proj.weight", (d, E))
        if c.proj_bias:
            placed[me + "in_proj.bias"] = source.take(hf + "in_proj.bias", (E + C + H,))
            placed[me + "out_proj.bias"] = source.take(hf + "out_proj.bias", (d,))
        placed[me + "conv_weight"] = source.take(hf + "conv1d.weight", (C, 1, K)).reshape(C, K)
        if c.conv_bias:
            placed[me + "conv_bias"] = source.take(hf + "conv1d.bias", (C,))
        for name in ("dt_bias", "A_log", "D"):
            placed[me + name] = source.take(hf + name, (H,))
        placed[me + "norm.weight"] = source.take(hf + "norm.weight", (E,))
    return placed


def import_checkpoint(source: SourceCheckpoint, symbols: Path | None = None) -> Imported:
    config, notes = translate_config(source.config, source.directory / "config.json")
    try:
        model = skeleton(Mamba2, config)
    except ValueError as e:
        raise ConversionError(f"{source.directory / 'config.json'}: {e}") from None
    return finish_import(source, model, _place, ARCHITECTURE, symbols, notes)
