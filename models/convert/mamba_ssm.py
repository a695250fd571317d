"""state-spaces' own format -> the Hugging Face form the mamba and mamba2 importers read.

The original Mamba and Mamba-2 checkpoints (state-spaces/mamba-130m … 2.8b, mamba2-130m … 2.7b,
mamba-2.8b-slimpj) are saved by mamba_ssm's `MambaLMHeadModel`, not by transformers: a
config.json with `d_model`, `n_layer`, `vocab_size` and `ssm_cfg` (no `model_type`), and a
pytorch_model.bin (read as data, never unpickled: torch_file.py). Only transformers' copies
(`…-hf`) are in transformers' form, and for Mamba-2 those come from third parties. This module
translates the config and the tensor names; the computation is the same, so the importers for
`MambaForCausalLM` and `Mamba2ForCausalLM` (models/convert/mamba.py, mamba2.py) do the rest.

Config (mamba_ssm -> Hugging Face)
    d_model / n_layer                     -> hidden_size / num_hidden_layers
    vocab_size, pad_vocab_size_multiple   -> vocab_size rounded up to the multiple (the embedding's rows)
    tie_embeddings                        -> tie_word_embeddings
    ssm_cfg "layer": "Mamba1" (default)   -> model_type mamba: d_state, d_conv, expand, dt_rank, bias, conv_bias
    ssm_cfg "layer": "Mamba2"             -> model_type mamba2: headdim, ngroups, d_state, d_conv, expand,
                                             bias, conv_bias, dt_limit, chunk_size
Refused, naming the field: a hybrid with attention layers (attn_layer_idx), an MLP after each
mixer (d_intermediate), LayerNorm instead of RMSNorm (rms_norm false), and the Mamba-2 options
that change its computation (d_ssm other than the whole width, D_has_hdim, norm_before_gate,
rmsnorm false, an activation other than silu). residual_in_fp32 and fused_add_norm change only
the rounding of a half-precision model: xlserve keeps the residual stream in float32 always.

Tensors: `backbone.embedding.weight` -> `backbone.embeddings.weight`; every other name is the
same in both forms.

The tokenizer: state-spaces' directories carry none (their models use EleutherAI/gpt-neox-20b's):
copy that repository's tokenizer.json and tokenizer_config.json into the directory before
converting (docs/convert.md).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from xlserve.models.convert import ConversionError

# MambaConfig and the mixers' defaults in mamba_ssm, for keys a config.json leaves out
MAMBA1_DEFAULTS = {"d_state": 16, "d_conv": 4, "expand": 2, "dt_rank": "auto", "bias": False, "conv_bias": True}
MAMBA2_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "bias": False,
                   "conv_bias": True, "dt_limit": [0.0, float("inf")], "chunk_size": 256}
NORM_EPSILON = 1e-5  # mamba_ssm's MixerModel default; its config.json does not record it


def describes(config: dict) -> bool:
    """Whether a config.json is mamba_ssm's (no model_type; d_model, n_layer and ssm_cfg)."""
    return "model_type" not in config and {"d_model", "n_layer", "ssm_cfg"} <= config.keys()


def as_hugging_face(config: dict, where: Path) -> dict:
    """The transformers config.json that describes the same model (model_type mamba or mamba2)."""
    ssm = config.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise ConversionError(f"{where}: ssm_cfg must be an object, got {ssm!r}")
    if config.get("attn_layer_idx"):
        raise ConversionError(f"{where}: attn_layer_idx {config['attn_layer_idx']}: a hybrid of Mamba and attention "
                              "layers does not convert (only pure Mamba and Mamba-2 models do)")
    if config.get("d_intermediate", 0):
        raise ConversionError(f"{where}: d_intermediate {config['d_intermediate']}: an MLP after each mixer does "
                              "not convert (the published Mamba and Mamba-2 models have none)")
    if config.get("rms_norm", True) is not True:
        raise ConversionError(f"{where}: rms_norm false (LayerNorm blocks) does not convert; Mamba's are RMSNorm")
    vocab_size, multiple = config.get("vocab_size"), config.get("pad_vocab_size_multiple", 8)
    if isinstance(vocab_size, int) and isinstance(multiple, int) and multiple > 0 and vocab_size % multiple:
        vocab_size += multiple - vocab_size % multiple  # as MambaLMHeadModel pads its embedding
    hf = {"vocab_size": vocab_size, "hidden_size": config["d_model"], "num_hidden_layers": config["n_layer"],
          "layer_norm_epsilon": NORM_EPSILON, "tie_word_embeddings": bool(config.get("tie_embeddings", True)),
          "hidden_act": "silu"}
    layer = ssm.get("layer", "Mamba1")
    if layer == "Mamba1":
        get = lambda key: ssm.get(key, MAMBA1_DEFAULTS[key])  # noqa: E731
        return {**hf, "model_type": "mamba", "architectures": ["MambaForCausalLM"], "state_size": get("d_state"),
                "conv_kernel": get("d_conv"), "expand": get("expand"), "time_step_rank": get("dt_rank"),
                "use_bias": get("bias"), "use_conv_bias": get("conv_bias")}
    if layer != "Mamba2":
        raise ConversionError(f"{where}: ssm_cfg layer {layer!r}: only Mamba1 and Mamba2 convert")
    refused = {"D_has_hdim": False, "norm_before_gate": False, "rmsnorm": True}
    for key, meant in refused.items():
        if key in ssm and ssm[key] != meant:
            raise ConversionError(f"{where}: ssm_cfg {key} {ssm[key]!r} changes Mamba-2's computation; only "
                                  f"{meant!r} (the published models') converts")
    if ssm.get("activation", "silu") not in ("silu", "swish"):
        raise ConversionError(f"{where}: ssm_cfg activation {ssm['activation']!r} is not silu, the only one Mamba-2 uses")
    get = lambda key: ssm.get(key, MAMBA2_DEFAULTS[key])  # noqa: E731
    expand, headdim = get("expand"), get("headdim")
    width = expand * config["d_model"] if isinstance(expand, int) and isinstance(config["d_model"], int) else None
    if ssm.get("d_ssm") not in (None, width):
        raise ConversionError(f"{where}: ssm_cfg d_ssm {ssm['d_ssm']} is not the whole width {width}: a Mamba-2 "
                              "layer part state space, part gated MLP does not convert")
    if not isinstance(width, int) or not isinstance(headdim, int) or headdim < 1 or width % headdim:
        raise ConversionError(f"{where}: expand · d_model ({expand} · {config['d_model']}) is not a multiple of "
                              f"ssm_cfg headdim {headdim!r}")
    dt_limit = get("dt_limit")
    if not isinstance(dt_limit, (list, tuple)) or len(dt_limit) != 2:
        raise ConversionError(f"{where}: ssm_cfg dt_limit must be [min, max], got {dt_limit!r}")
    return {**hf, "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "state_size": get("d_state"),
            "conv_kernel": get("d_conv"), "expand": expand, "num_heads": width // headdim, "head_dim": headdim,
            "n_groups": get("ngroups"), "use_bias": get("bias"), "use_conv_bias": get("conv_bias"),
            "time_step_limit": list(dt_limit), "chunk_size": get("chunk_size")}


def renamed(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors under transformers' names (only the embedding's differs)."""
    return {("backbone.embeddings.weight" if name == "backbone.embedding.weight" else name): tensor
            for name, tensor in tensors.items()}
