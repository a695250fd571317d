"""Hugging Face `ReformerModelWithLMHead` (e.g. google/reformer-enwik8) -> our `Reformer`.

Config (Hugging Face -> ours)
    attn_layers                         -> attn_layers ("lsh" / "local")
    hidden_size, num_attention_heads,
    attention_head_size, feed_forward_size, hidden_act
                                        -> d_model, n_head, d_head, d_inner, activation
    lsh_attn_chunk_length, lsh_num_chunks_before, num_hashes, num_buckets
                                        -> lsh_chunk, lsh_chunks_before, n_hashes, n_buckets
    local_attn_chunk_length, local_num_chunks_before
                                        -> local_chunk, local_chunks_before
    axial_pos_embds, axial_pos_shape, axial_pos_embds_dim
                                        -> axial_pos_shape, axial_pos_dims (None: learned table of
                                           max_position_embeddings)
    layer_norm_eps, hidden_dropout_prob, lsh_attention_probs_dropout_prob, chunk_size_feed_forward
                                        -> layer_norm_epsilon, dropout, dropatt, ff_chunk
    hash_seed                           -> the rotations themselves, drawn as the reference draws
                                           them (torch.manual_seed(hash_seed); torch.randn(H, D, R,
                                           n_b/2) on the CPU, the same in every LSH layer) and
                                           stored in the checkpoint. hash_seed null makes the
                                           reference draw new rotations at every call (its
                                           log-probs are then random); the rotations are drawn
                                           with seed 0 and a note says so: the reference with
                                           hash_seed 0 gives the same log-probs.
Refused, as the reference refuses them for a causal LM or cannot run them deterministically:
is_decoder false (ReformerModelWithLMHead asserts it), lsh_num_chunks_after or
local_num_chunks_after > 0 (asserted too: a causal chunk must not look ahead), num_buckets null
(the reference then picks it from the length of its first input, so the model's meaning depends
on that input), an odd bucket count, tie_word_embeddings (the head is 2·hidden_size wide, the
embeddings hidden_size), attention kinds other than lsh/local, activations we do not have, and
vocabularies that are not bytes.

Vocabulary. The enwik8 model's vocabulary has 258 ids: id = byte + 2 (ids 0 and 1 are padding
and an unused special id; its model card's tokenizer is `[b + 2 for b in text.encode()]`). Our
model is byte-level: the embedding and head rows of ids 2..257 become those of bytes 0..255, and
the rows of ids 0 and 1 are dropped. The head then normalises over the 256 bytes, so xlserve's
log-probabilities are the reference's conditioned on the next id being a byte:
    log p_xlserve(b) = log p_ref(b + 2) − log Σ_{i=2}^{257} p_ref(i).
(What the reference gives ids 0 and 1 is its probability of a padding or special token, which a
byte stream never contains.) vocab_size 256 (no shift) converts as is.

Tensors ("E." = "reformer.embeddings.", "L." = "reformer.encoder.layers.i.")
    E.word_embeddings.weight (V, d)                    -> embedding.weight (rows 2.. for V = 258)
    E.position_embeddings.weights.k (1.., n_k, .., d_k) -> positions.weights.k (n_k, d_k)
    E.position_embeddings.embedding.weight             -> positions.table.weight (no axial)
    L.attention.layer_norm                              -> layers.i.attn_norm
    L.attention.self_attention.query_key / value        -> layers.i.attention.query_key / value (lsh)
    L.attention.self_attention.query / key / value      -> layers.i.attention.query / key / value (local)
    L.attention.output.dense                            -> layers.i.attention.out
    L.feed_forward.layer_norm                           -> layers.i.ff_norm
    L.feed_forward.dense.dense / output.dense           -> layers.i.ff_in / ff_out
    reformer.encoder.layer_norm (2d)                    -> final_norm
    lm_head.decoder.weight (V, 2d), lm_head.bias        -> head.weight, head.bias (rows 2.. for V = 258;
                                                           lm_head.decoder.bias, the same tensor, if present)
Anything else is an error naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from xlserve.models.convert import ConversionError, Imported, SourceCheckpoint, SourceTensors, load_placed, skeleton
from xlserve.models.layers.feedforward import ACTIVATIONS
from xlserve.models.reformer import Reformer, ReformerConfig, bucket_factors, rotation_columns

ARCHITECTURE = "ReformerModelWithLMHead"
BYTE_SHIFT = 2  # google/reformer-enwik8: id = byte + 2
DEFAULT_HASH_SEED = 0  # the rotations' seed when the source config has hash_seed null

# what transformers' ReformerConfig (4.37.2) fills in when config.json leaves a key out
HF_DEFAULTS = {
    "attention_head_size": 64, "attn_layers": ["local", "lsh", "local", "lsh", "local", "lsh"],
    "axial_pos_embds": True, "axial_pos_shape": [64, 64], "axial_pos_embds_dim": [64, 192],
    "chunk_size_feed_forward": 0, "feed_forward_size": 512, "hash_seed": None, "hidden_act": "relu",
    "hidden_dropout_prob": 0.05, "hidden_size": 256, "is_decoder": False, "layer_norm_eps": 1e-12,
    "local_num_chunks_before": 1, "local_num_chunks_after": 0, "local_attn_chunk_length": 64,
    "lsh_attn_chunk_length": 64, "lsh_attention_probs_dropout_prob": 0.0, "lsh_num_chunks_before": 1,
    "lsh_num_chunks_after": 0, "max_position_embeddings": 4096, "num_attention_heads": 12, "num_buckets": None,
    "num_hashes": 1, "vocab_size": 320, "tie_word_embeddings": False,
}


def _source_vocabulary(vocab_size, where: Path) -> int:
    """The byte shift of a byte-level source vocabulary, or a refusal."""
    if vocab_size == 256 + BYTE_SHIFT:
        return BYTE_SHIFT
    if vocab_size == 256:
        return 0
    raise ConversionError(
        f"{where}: vocab_size {vocab_size} is not a byte vocabulary; xlserve converts byte-level Reformers: "
        f"{256 + BYTE_SHIFT} ids with id = byte + {BYTE_SHIFT} (google/reformer-enwik8) or 256"
    )


def translate_config(hf: dict, where: Path) -> tuple[ReformerConfig, list[str], int, int]:
    """Our config, notes for the user, the byte shift and the rotations' seed."""
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        raise ConversionError(f"{where} describes {architectures}; only {ARCHITECTURE} (a causal LM) converts")
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    notes = []
    if not get("is_decoder"):
        raise ConversionError(f"{where}: is_decoder is false; {ARCHITECTURE} needs is_decoder true (a causal "
                              "language model: the reference refuses to build it otherwise)")
    for name in ("lsh_num_chunks_after", "local_num_chunks_after"):
        if get(name):
            raise ConversionError(f"{where}: {name} is {get(name)}; a causal Reformer attends to no later chunk "
                                  "(the reference refuses it for ReformerModelWithLMHead)")
    layers = list(get("attn_layers") or [])
    if not layers or any(kind not in ("lsh", "local") for kind in layers):
        raise ConversionError(f"{where}: attn_layers {layers} must list only 'lsh' and 'local'")
    if get("num_buckets") is None and "lsh" in layers:
        raise ConversionError(f"{where}: num_buckets is null: the reference then chooses it from the length of the "
                              "first sequence it sees, so the model has no fixed meaning; set it in config.json "
                              "(the value the model was trained with)")
    n_buckets = get("num_buckets") if get("num_buckets") is not None else 2
    try:
        bucket_factors(n_buckets if isinstance(n_buckets, int) else list(n_buckets))
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{where}: {e}") from None
    if hf.get("tie_word_embeddings", False):
        raise ConversionError(f"{where}: tie_word_embeddings is true, but the LM head ({2 * get('hidden_size')} wide) "
                              f"cannot share the {get('hidden_size')}-wide word embeddings")
    if not isinstance(get("hidden_act"), str) or get("hidden_act") not in ACTIVATIONS:
        raise ConversionError(f"{where}: hidden_act {get('hidden_act')!r} is not one of {sorted(ACTIVATIONS)}")
    for name in ("lsh_attn_chunk_length", "local_attn_chunk_length"):
        kind = name.split("_")[0]
        if kind in layers and not (isinstance(get(name), int) and get(name) > 0):
            raise ConversionError(f"{where}: {name} must be a positive int, got {get(name)!r}")
    shift = _source_vocabulary(get("vocab_size"), where)
    seed = get("hash_seed")
    if seed is None and "lsh" in layers:
        seed = DEFAULT_HASH_SEED
        notes.append(f"hash_seed is null: the reference draws new LSH rotations at every call, so its log-probs "
                     f"are random; xlserve fixes them with seed {DEFAULT_HASH_SEED} (the reference with "
                     f"hash_seed={DEFAULT_HASH_SEED} gives the same log-probs)")
    axial = bool(get("axial_pos_embds"))
    if axial and get("max_position_embeddings") < _product(get("axial_pos_shape")):
        notes.append(f"max_position_embeddings {get('max_position_embeddings')} is below the axial positions' "
                     f"{_product(get('axial_pos_shape'))}: the reference refuses a one pass longer than the first "
                     "but decodes up to the second; xlserve serves histories up to the second")
    if shift:
        notes.append(f"vocabulary: ids 2..257 are bytes 0..255 (id = byte + {BYTE_SHIFT}); ids 0 and 1 are dropped "
                     "and log-probabilities are normalised over the 256 bytes (docs/convert.md)")
    chunk = lambda name: get(name) if isinstance(get(name), int) and get(name) > 0 else 64  # noqa: E731
    try:
        config = ReformerConfig(
            vocab_size=256, attn_layers=layers, d_model=get("hidden_size"), n_head=get("num_attention_heads"),
            d_head=get("attention_head_size"), d_inner=get("feed_forward_size"), activation=get("hidden_act"),
            lsh_chunk=chunk("lsh_attn_chunk_length"), lsh_chunks_before=get("lsh_num_chunks_before"),
            n_hashes=get("num_hashes"), n_buckets=n_buckets if isinstance(n_buckets, int) else list(n_buckets),
            local_chunk=chunk("local_attn_chunk_length"), local_chunks_before=get("local_num_chunks_before"),
            axial_pos_shape=list(get("axial_pos_shape")) if axial else None,
            axial_pos_dims=list(get("axial_pos_embds_dim")) if axial else None,
            max_positions=get("max_position_embeddings"), layer_norm_epsilon=get("layer_norm_eps"),
            dropout=get("hidden_dropout_prob"), dropatt=get("lsh_attention_probs_dropout_prob"),
            ff_chunk=get("chunk_size_feed_forward") or 0,
        )
        config.check()
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: {e}") from None
    return config, notes, shift, seed


def _product(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def reference_rotations(config: ReformerConfig, seed: int) -> Tensor:
    """The rotations the reference draws in every LSH layer: torch.manual_seed(seed) then
    torch.randn((H, D, R, n_b/2)) on the CPU, in float32 (a generator of our own, so the global
    one is left alone)."""
    generator = torch.Generator().manual_seed(int(seed))
    shape = (config.n_head, config.d_head, config.n_hashes, rotation_columns(config.n_buckets))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _place(model: Reformer, source: SourceTensors, shift: int) -> dict[str, Tensor]:
    c = model.config
    d, HD, V = c.d_model, c.n_head * c.d_head, 256 + shift
    placed = {"embedding.weight": source.take("reformer.embeddings.word_embeddings.weight", (V, d))[shift:]}
    if c.axial_pos_shape is not None:
        k = len(c.axial_pos_shape)
        for axis, (n, width) in enumerate(zip(c.axial_pos_shape, c.axial_pos_dims)):
            shape = [1] * k
            shape[axis] = n
            weight = source.take(f"reformer.embeddings.position_embeddings.weights.{axis}", (*shape, width))
            placed[f"positions.weights.{axis}"] = weight.reshape(n, width)
    else:
        placed["positions.table.weight"] = source.take("reformer.embeddings.position_embeddings.embedding.weight",
                                                       (c.max_positions, d))
    for i, kind in enumerate(c.attn_layers):
        hf, me = f"reformer.encoder.layers.{i}.", f"layers.{i}."
        names = [("query_key", "query_key"), ("value", "value")] if kind == "lsh" else \
            [("query", "query"), ("key", "key"), ("value", "value")]
        for theirs, ours in names:
            placed[f"{me}attention.{ours}.weight"] = source.take(f"{hf}attention.self_attention.{theirs}.weight", (HD, d))
        placed[f"{me}attention.out.weight"] = source.take(f"{hf}attention.output.dense.weight", (d, HD))
        for theirs, ours in [("attention.layer_norm", "attn_norm"), ("feed_forward.layer_norm", "ff_norm")]:
            placed[f"{me}{ours}.weight"] = source.take(f"{hf}{theirs}.weight", (d,))
            placed[f"{me}{ours}.bias"] = source.take(f"{hf}{theirs}.bias", (d,))
        placed[f"{me}ff_in.weight"] = source.take(f"{hf}feed_forward.dense.dense.weight", (c.d_inner, d))
        placed[f"{me}ff_in.bias"] = source.take(f"{hf}feed_forward.dense.dense.bias", (c.d_inner,))
        placed[f"{me}ff_out.weight"] = source.take(f"{hf}feed_forward.output.dense.weight", (d, c.d_inner))
        placed[f"{me}ff_out.bias"] = source.take(f"{hf}feed_forward.output.dense.bias", (d,))
    placed["final_norm.weight"] = source.take("reformer.encoder.layer_norm.weight", (2 * d,))
    placed["final_norm.bias"] = source.take("reformer.encoder.layer_norm.bias", (2 * d,))
    placed["head.weight"] = source.take("lm_head.decoder.weight", (V, 2 * d))[shift:]
    biases = [name for name in ("lm_head.bias", "lm_head.decoder.bias") if name in source.tensors]
    bias = source.take(biases[0] if biases else "lm_head.bias", (V,))
    for other in biases[1:]:  # the same tensor saved under both names
        if not torch.equal(source.take(other, (V,)), bias):
            raise ConversionError(f"{source.where}: tensors 'lm_head.bias' and 'lm_head.decoder.bias' differ; "
                                  "the reference ties them")
    placed["head.bias"] = bias[shift:]
    return placed


def import_checkpoint(source: SourceCheckpoint, symbols: Path | None = None) -> Imported:
    if symbols is not None:
        raise ConversionError("--symbols is for word-level models; a byte-level Reformer needs no tokenizer file")
    config, notes, shift, seed = translate_config(source.config, source.directory / "config.json")
    try:
        model = skeleton(Reformer, config)  # its random weights are all overwritten below
    except ValueError as e:
        raise ConversionError(f"{source.directory / 'config.json'}: {e}") from None
    tensors = SourceTensors(source)
    model = load_placed(model, _place(model, tensors, shift), tensors)
    if model.lsh_layers:
        rotations = reference_rotations(config, seed)
        with torch.no_grad():
            for i in model.lsh_layers:
                model.layers[i].attention.rotations.copy_(rotations)
    extra = {
        "converted_from": {
            "format": "huggingface",
            "architecture": ARCHITECTURE,
            "transformers_version": source.config.get("transformers_version"),
            "weights_file": source.weights_file,
            "byte_shift": shift,
            "hash_seed": seed,
            "hash_seed_in_source": source.config.get("hash_seed"),
            "dropped_ids": list(range(shift)),
            "log_probs": "normalised over the 256 bytes" if shift else "as the reference's",
        },
    }
    return Imported(model=model, config_extra=extra, notes=notes)
