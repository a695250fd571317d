"""Hugging Face `MambaForCausalLM` (e.g. state-spaces/mamba-130m-hf) -> our `Mamba`, with its tokenizer.json.

Config (Hugging Face -> ours)
    vocab_size, layer_norm_epsilon        -> the same names
    hidden_size                           -> d_model
    num_hidden_layers                     -> n_layer
    intermediate_size (expand · hidden)   -> d_inner
    state_size                            -> d_state
    conv_kernel                           -> d_conv
    time_step_rank ("auto": ⌈hidden/16⌉)  -> dt_rank
    use_conv_bias / use_bias              -> conv_bias / proj_bias
    tie_word_embeddings                   -> tie_embedding
Refused: hidden_act other than silu, and any architecture but MambaForCausalLM. residual_in_fp32
(true in every published checkpoint) is what xlserve always does: a model served in 16 bits
keeps its residual stream in float32 (models/mamba.py MambaBlock); use_mambapy and the
time-step initialisation fields are for training.

Tensors (per layer i; "L." = "backbone.layers.i.", "M." = "L.mixer.")
    backbone.embeddings.weight             -> embedding.weight
    L.norm.weight                          -> layers.i.norm.weight
    M.in_proj / x_proj / dt_proj / out_proj -> layers.i.mixer.<the same> (weights, biases)
    M.conv1d.weight (E, 1, K) / .bias      -> layers.i.mixer.conv_weight (E, K) / conv_bias
    M.A_log (E, N), M.D (E)                -> layers.i.mixer.A_log, D
    backbone.norm_f.weight                 -> final_norm.weight
    lm_head.weight                         -> head.weight when untied; a tied copy is ignored
Anything else is an error naming the tensor.
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import Tensor

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, skeleton
from xlserve.models.convert.tokenizer_json import check_architecture, finish_import, positive_int, real_number
from xlserve.models.mamba import Mamba, MambaConfig

ARCHITECTURE = "MambaForCausalLM"

# what transformers' MambaConfig fills in when config.json leaves a key out
HF_DEFAULTS = {
    "vocab_size": 50280, "hidden_size": 768, "state_size": 16, "num_hidden_layers": 32, "layer_norm_epsilon": 1e-5,
    "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
    "time_step_rank": "auto", "tie_word_embeddings": True,
}


def translate_config(hf: dict, where: Path) -> tuple[MambaConfig, list[str]]:
    check_architecture(hf, where, ARCHITECTURE)
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    if get("hidden_act") != "silu":
        raise ConversionError(f"{where}: hidden_act {get('hidden_act')!r} is not 'silu', the only one Mamba uses")
    d_model = positive_int(get("hidden_size"), "hidden_size", where)
    if "intermediate_size" in hf:  # it wins over expand, as transformers reads them
        d_inner = hf["intermediate_size"]
    else:
        d_inner = int(real_number(get("expand"), "expand", where) * d_model)
    rank = get("time_step_rank")
    dt_rank = math.ceil(d_model / 16) if rank == "auto" else rank
    config = MambaConfig(
        vocab_size=positive_int(get("vocab_size"), "vocab_size", where),
        n_layer=positive_int(get("num_hidden_layers"), "num_hidden_layers", where),
        d_model=d_model, d_inner=positive_int(d_inner, "intermediate_size", where),
        d_state=positive_int(get("state_size"), "state_size", where),
        d_conv=positive_int(get("conv_kernel"), "conv_kernel", where),
        dt_rank=positive_int(dt_rank, "time_step_rank", where),
        conv_bias=bool(get("use_conv_bias")), proj_bias=bool(get("use_bias")),
        layer_norm_epsilon=real_number(get("layer_norm_epsilon"), "layer_norm_epsilon", where),
        tie_embedding=bool(get("tie_word_embeddings")),
    )
    return config, []


def _place(model: Mamba, source: SourceTensors) -> dict[str, Tensor]:
    c = model.config
    d, E, N, K, R = c.d_model, c.d_inner, c.d_state, c.d_conv, c.dt_rank
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
        shapes = {"in_proj": (2 * E, d), "x_proj": (R + 2 * N, E), "dt_proj": (E, R), "out_proj": (d, E)}
        for name, shape in shapes.items():
            placed[f"{me}{name}.weight"] = source.take(f"{hf}{name}.weight", shape)
        placed[me + "dt_proj.bias"] = source.take(hf + "dt_proj.bias", (E,))
        if c.proj_bias:
            placed[me + "in_proj.bias"] = source.take(hf + "in_proj.bias", (2 * E,))
            placed[me + "out_proj.bias"] = source.take(hf + "out_proj.bias", (d,))
        placed[me + "conv_weight"] = source.take(hf + "conv1d.weight", (E, 1, K)).reshape(E, K)
        if c.conv_bias:
            placed[me + "conv_bias"] = source.take(hf + "conv1d.bias", (E,))
        placed[me + "A_log"] = source.take(hf + "A_log", (E, N))
        placed[me + "D"] = source.take(hf + "D", (E,))
    return placed


def import_checkpoint(source: SourceCheckpoint, symbols: Path | None = None) -> Imported:
    config, notes = translate_config(source.config, source.directory / "config.json")
    try:
        model = skeleton(Mamba, config)  # its random weights are all overwritten
    except ValueError as e:
        raise ConversionError(f"{source.directory / 'config.json'}: {e}") from None
    return finish_import(source, model, _place, ARCHITECTURE, symbols, notes)
