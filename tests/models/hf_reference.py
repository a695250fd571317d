"""The second reference environment: transformers' Mamba, Mamba-2 and RWKV classes, run in a
subprocess whose PYTHONPATH puts `.venv/hf-reference` (transformers 4.57.1 and tokenizers 0.22.1,
installed there by `make test`) in front of the test environment's transformers 4.37.2.

Why two: the parity tests of TransfoXL, XLNet and the Reformer need transformers 4.37.2 (every
release that has Mamba-2, 4.44 on, ships a TransfoXL whose forward raises a TypeError), and one
process can import only one transformers. docs/convert.md says the same.

As a module: `reference_runs(specs)` runs this file as a script in that environment. As a
script: for every spec, it builds the reference model of a random config (seeded; weights drawn
wider than transformers' initialisation so that logits differ by more than the tolerance),
saves it with save_pretrained (safetensors) into spec["dir"]/hf (Mamba-2's gated RMSNorm made
per group, as mamba_ssm computes it: `_normalise_per_group`), then writes spec["dir"]/ref.safetensors:
  one_pass      log-probabilities of one forward over `tokens` (B, T) without a cache
  step_by_step  the same, one token at a time through the reference's own cache
  greedy        generate(tokens[:, :prompt], max_new_tokens=new, do_sample=False), the new tokens
(the last two one row at a time)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE_DIR = REPO / ".venv" / "hf-reference"
REFERENCE_VERSION = "4.57.1"


def reference_available() -> bool:
    return (REFERENCE_DIR / "transformers").is_dir()


def reference_runs(specs: list[dict], timeout: float = 600) -> None:
    """Run every spec in the reference environment (one subprocess, one transformers import)."""
    if not reference_available():
        pytest.skip(f"the reference environment {REFERENCE_DIR} is missing (make test installs it: "
                    f"transformers=={REFERENCE_VERSION} with --target)")
    env = {**os.environ, "PYTHONPATH": str(REFERENCE_DIR), "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, __file__, json.dumps(specs)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]


# -- the script (runs under the reference environment) ---------------------------------------------------


def _build(arch: str, config: dict):
    import transformers

    classes = {"mamba": ("MambaConfig", "MambaForCausalLM"), "mamba2": ("Mamba2Config", "Mamba2ForCausalLM"),
               "rwkv": ("RwkvConfig", "RwkvForCausalLM")}
    config_class, model_class = (getattr(transformers, name) for name in classes[arch])
    return getattr(transformers, model_class.__name__)(config_class(**config))


def _normalise_per_group(model) -> None:
    """Mamba-2's gated RMSNorm as mamba_ssm computes it, each group of intermediate_size / n_groups
    channels on its own (its reference `rms_norm_ref` and its CUDA kernel, with which the published
    checkpoints were trained; so do transformers' own CUDA path and vLLM). transformers 4.57.1's
    torch path, which this reference otherwise is, normalises over all channels; the two agree at
    n_groups 1. Only this one function of the reference is replaced."""
    import types

    import torch
    from torch.nn.functional import silu

    groups = model.config.n_groups

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * silu(gate.to(torch.float32))
        grouped = hidden_states.view(*hidden_states.shape[:-1], groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * grouped.view(hidden_states.shape).to(dtype)

    for layer in model.backbone.layers:
        layer.mixer.norm.forward = types.MethodType(forward, layer.mixer.norm)


def _widen(model, seed: int) -> None:
    """Weights of a trained model's spread: matrices N(0, 1/fan_in), vectors nudged by N(0, 0.1²)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
            else:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)


def _step_by_step(arch: str, model, tokens):
    import torch

    outputs, cache = [], None
    for t in range(tokens.shape[1]):
        piece = tokens[:, t : t + 1]
        if arch == "rwkv":
            out = model(piece, state=cache, use_cache=True)
            cache = out.state
        elif cache is None:  # the first token: the reference's own prefill, which creates its cache
            out = model(piece, use_cache=True)
            cache = out.cache_params
        else:  # a decoding step, at the position generate() would pass
            position = torch.tensor([model.config.conv_kernel + t])
            out = model(piece, cache_params=cache, use_cache=True, cache_position=position)
            cache = out.cache_params
        outputs.append(out.logits)
    return torch.cat(outputs, dim=1)


def main(specs: list[dict]) -> None:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    for spec in specs:
        torch.manual_seed(spec["seed"])
        model = _build(spec["arch"], spec["config"])
        _widen(model, spec["seed"])
        if spec["arch"] == "mamba2":
            _normalise_per_group(model)
        out = Path(spec["dir"])
        # saved before any forward in eval mode: transformers' RWKV divides weights in place there
        model.save_pretrained(out / "hf", safe_serialization=True)
        model.eval()
        tokens = torch.tensor(spec["tokens"])
        with torch.no_grad():
            one_pass = model(tokens).logits.log_softmax(-1)
            # row by row: transformers' RWKV mixes the rows of a batch when it decodes one token
            # (its token shift broadcasts (B, d) against (B, 1, d))
            step_by_step = torch.cat([_step_by_step(spec["arch"], model, row[None]) for row in tokens]).log_softmax(-1)
            greedy = torch.cat([
                model.generate(row[None, : spec["prompt"]], attention_mask=torch.ones(1, spec["prompt"], dtype=torch.long),
                               max_new_tokens=spec["new"], min_new_tokens=spec["new"], do_sample=False,
                               pad_token_id=0, eos_token_id=None)[:, spec["prompt"]:]
                for row in tokens])
        save_file({"one_pass": one_pass.contiguous(), "step_by_step": step_by_step.contiguous(),
                   "greedy": greedy.contiguous()}, str(out / "ref.safetensors"))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
