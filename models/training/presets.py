"""The model configurations `xlserve new` and `xlserve train` build by name: architecture ->
preset -> config. "small" is the one shipped as <arch>-stdlib.

Free of torch, so that the command line checks an --arch or --preset, and lists them in its
help, without the seconds a torch import costs (models/training/train.py builds from them).
"""

from __future__ import annotations

MAMBA_SMALL = dict(n_layer=8, d_model=192, d_inner=384, d_state=4, d_conv=4, dt_rank=12, chunk_size=32)

# architecture -> preset -> model config; "small" is the one shipped as <arch>-stdlib
PRESETS: dict[str, dict[str, dict]] = {
    "longformer": {
        # the paper's character LM: windows widen with depth, a few upper-layer heads dilated
        "small": dict(
            n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, window=[32, 64, 64, 96],
            dilation=[[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 2, 2], [1, 1, 2, 3]], n_global=4, dropout=0.0,
        ),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, window=[8, 16],
                     dilation=[[1, 1], [1, 2]], n_global=2),
    },
    "transformer-xl": {
        "small": dict(
            n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, mem_len=128, tgt_len=128,
            same_length=True, pre_norm=True, dropout=0.0,
        ),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, mem_len=32, tgt_len=32),
    },
    "infinity-former": {
        "small": dict(
            n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, segment_len=128, n_basis=128,
            basis_widths=[0.01, 0.05], ridge_penalty=0.5, tau=0.5, n_samples=128, sticky_memories=True,
            sticky_bins=128, kl_weight=1e-3, kl_sigma0=0.05, dropout=0.0,
        ),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, segment_len=32, n_basis=32,
                     n_samples=32, sticky_bins=32),
    },
    "vanilla": {
        "small": dict(n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, context_len=128, dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, context_len=32),
    },
    "xlnet": {
        "small": dict(
            n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, mem_len=128, seg_len=128,
            same_length=True, partial_prediction_k=6, dropout=0.0,
        ),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, mem_len=32, seg_len=32),
    },
    "logsparse": {
        "small": dict(n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, local_window=16, restart_len=256,
                      dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, local_window=8, restart_len=64),
    },
    "adaptive-span": {
        "small": dict(n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, max_span=512, ramp=32,
                      span_init=0.0, span_penalty=2e-6, dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, max_span=48, ramp=8, span_init=0.5),
    },
    "performer": {
        "small": dict(n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, n_features=96, conv_width=4,
                      dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, n_features=32, conv_width=4),
    },
    "linformer": {
        # L = 64: a 128-byte training segment spans two, so E and F learn in the graph (models/linformer.py)
        "small": dict(n_layer=4, d_model=192, n_head=4, d_head=48, d_inner=768, segment_len=64, compressed_len=16,
                      memory_segments=8, dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, segment_len=16, compressed_len=4,
                     memory_segments=4),
    },
    "lite-transformer": {
        # LSRA: 2 x 96 channels (4 attention heads over a window of 128, 8 groups of a dynamic
        # convolution of width 15); the feed-forward flattened to 2x d_model: 1.51M parameters
        "small": dict(n_layer=6, d_model=192, n_head=4, mem_len=128, conv_type="dynamic", n_conv_head=8,
                      conv_kernel=15, d_inner=384, dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, mem_len=16, conv_type="dynamic", n_conv_head=2,
                     conv_kernel=4, d_inner=128),
    },
    "conformer": {
        # the paper's Conformer (S) width (144, 4 heads, feed-forwards 4x wide): two feed-forwards
        # per block keep it near 2M parameters (2.05M); causal kernel 15, a window of 128 positions
        "small": dict(n_layer=4, d_model=144, n_head=4, d_head=36, d_inner=576, kernel_size=15, mem_len=128,
                      dropout=0.0),
        "tiny": dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, kernel_size=7, mem_len=32),
    },
    "reformer": {
        # local and LSH layers alternating (2 hash rounds of 32 buckets, chunks of 32 / 64), reversible
        # layers: 1.89M. Axial positions 8 x 256 = 2,048 = train_context: the lanes never pass it, so
        # a larger shape (enwik8's 65,536) would leave the first axis's rows past 8 untrained, and a
        # served history past 2,048 would meet them. This model stops at 2,048 bytes of history.
        "small": dict(attn_layers=["local", "lsh", "local", "lsh"], d_model=192, n_head=4, d_head=48, d_inner=768,
                      lsh_chunk=32, lsh_chunks_before=1, n_hashes=2, n_buckets=32, local_chunk=64,
                      local_chunks_before=1, axial_pos_shape=[8, 256], axial_pos_dims=[64, 128], dropout=0.0,
                      train_context=2048),
        "tiny": dict(attn_layers=["local", "lsh"], d_model=64, n_head=2, d_head=32, d_inner=128, lsh_chunk=16,
                     n_hashes=2, n_buckets=8, local_chunk=16, axial_pos_shape=[256, 256], axial_pos_dims=[16, 48],
                     train_context=512),
    },
    "mamba": {
        # 8 blocks of 192 wide, streams of 384 with 4 states each: 1.95M parameters (7.8 MB in
        # float32). The scan's cost in training is batch x length x 384 x N per block, so N = 4
        # (the paper's 16 quadruples it) keeps a step near 0.6 s on 2 idle cores: the standard
        # recipe's 9,765 steps took 117 minutes for the shipped mamba-stdlib (1.3429 bits per
        # byte held out). "stdlib" is the same preset under the name of that checkpoint
        "small": MAMBA_SMALL,
        "stdlib": MAMBA_SMALL,
        "tiny": dict(n_layer=2, d_model=64, d_inner=128, d_state=8, d_conv=4, dt_rank=4, chunk_size=16),
    },
    "mamba2": {
        "tiny": dict(n_layer=2, d_model=64, n_head=4, head_dim=32, d_state=16, n_groups=1, d_conv=4, chunk_size=16),
    },
    "rwkv": {
        # 4 layers: a session of about 6 kB, near the smallest other tiny state (the tests
        # that push sessions down the tiers create a few dozen to fill one)
        "tiny": dict(n_layer=4, d_model=64, d_attention=64, d_ffn=128, rescale_every=2),
    },
}


def preset_config(architecture: str, preset: str) -> dict:
    try:
        return dict(PRESETS[architecture][preset])
    except KeyError:
        raise ValueError(f"no preset '{preset}' for '{architecture}' (have: {PRESETS.get(architecture)})") from None
