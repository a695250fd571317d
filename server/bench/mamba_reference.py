"""The reference side of `xlserve bench vs-hf-mamba`, run as a script in a process of its own
whose transformers has MambaForCausalLM (4.39 or newer; the test extra pins 4.37.2 for TransfoXL,
so `make test` installs 4.57.1 apart, in .venv/hf-reference, and the benchmark puts that first
on this process's PYTHONPATH; see vs_hf_mamba.py).

    python mamba_reference.py SPEC_JSON

SPEC_JSON: {"config": MambaConfig fields, "seed", "dir", "threads", "prefill_len", "prompt_len",
"new_tokens", "batch_sizes"}. It builds the random reference (`widen`), saves it with
save_pretrained into DIR/hf (for `xlserve convert`), then times, on the same prompts the
benchmark gives xlserve (drawn from the seed here and written beside the results):
- prefill: one forward over a batch-1 prompt of prefill_len tokens that fills the cache
  (use_cache=True), as generate() starts;
- generate(): greedy, with its cache, min_new_tokens = max_new_tokens, per batch size;
and writes DIR/reference.json (times, tokens, versions).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path


def prompts(seed: int, vocab_size: int, prefill_len: int, prompt_len: int, batch_sizes: list[int]):
    """The prompts both sides use: one of prefill_len tokens, one (batch, prompt_len) per batch size."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    long = torch.randint(0, vocab_size, (1, prefill_len), generator=generator)
    return long, {b: torch.randint(0, vocab_size, (b, prompt_len), generator=generator) for b in batch_sizes}


def widen(model, seed: int) -> None:
    """Weights at a trained model's spread rather than the initialisation's: every matrix
    N(0, 1/fan_in), A_log and the vectors nudged by N(0, 0.1²). A random model at initialisation
    soon repeats one token; these keep greedy decoding varied (and choices far from ties)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
            else:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)


def main(spec: dict) -> None:
    import torch
    import transformers
    from transformers import MambaConfig, MambaForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MambaForCausalLM(MambaConfig(**spec["config"]))
    widen(model, spec["seed"])
    out = Path(spec["dir"])
    model.save_pretrained(out / "hf", safe_serialization=True)
    model.eval()
    long, batches = prompts(spec["seed"], spec["config"]["vocab_size"], spec["prefill_len"], spec["prompt_len"],
                            spec["batch_sizes"])
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "generate": {}}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(long[:, :8], use_cache=True)  # warm up
        start = time.perf_counter()
        model(long, use_cache=True)
        result["prefill_s"] = time.perf_counter() - start
        for batch, prompt in batches.items():
            ones = torch.ones_like(prompt)
            generate = lambda n: model.generate(prompt, attention_mask=ones, max_new_tokens=n, min_new_tokens=n,  # noqa: E731
                                                do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
            generate(2)  # warm up
            start = time.perf_counter()
            tokens = generate(spec["new_tokens"])[:, prompt.shape[1]:]
            total_s = time.perf_counter() - start
            start = time.perf_counter()
            generate(1)  # the same call's fixed part: the prompt's forward and one token
            first_s = time.perf_counter() - start
            result["generate"][str(batch)] = {"tokens": tokens.tolist(), "total_s": total_s, "prompt_and_first_s": first_s}
    (out / "reference.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
