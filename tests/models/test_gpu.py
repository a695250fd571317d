"""Checks that need CUDA; `make gpu-check` runs them (CPU-only CI skips them)."""

import copy

import pytest
import torch

from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def model_pair():
    torch.manual_seed(0)
    cpu = TransformerXL(TransformerXLConfig(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, mem_len=32)).eval()
    gpu = TransformerXL(cpu.config).eval()
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu.cuda()


@torch.no_grad()
def test_cuda_float32_matches_cpu_in_chunks():
    cpu, gpu = model_pair()
    tokens = torch.randint(0, 256, (2, 100))
    expected, _ = cpu(tokens, cpu.init_state(2))
    state, outputs = gpu.init_state(2), []
    for start in range(0, 100, 9):
        log_probs, state = gpu(tokens[:, start : start + 9].cuda(), state)
        outputs.append(log_probs)
    assert (torch.cat(outputs, 1).cpu() - expected).abs().max().item() < 1e-4


@torch.no_grad()
def test_cuda_bfloat16_stays_close_and_state_moves_between_devices():
    cpu, gpu = model_pair()
    tokens = torch.randint(0, 256, (1, 64))
    expected, cpu_state = cpu(tokens, cpu.init_state(1))
    bf16 = copy.deepcopy(gpu).to(torch.bfloat16)  # Module.to changes the module itself: a copy, or gpu is bf16 too
    log_probs, _ = bf16(tokens.cuda(), bf16.init_state(1))
    assert (log_probs.float().cpu().exp() - expected.exp()).abs().max().item() < 0.05
    # a state made on the CPU continues on the GPU (the float32 weights, never rounded to bf16)
    gpu32 = gpu
    next_cpu, _ = cpu(tokens[:, :5], cpu_state)
    next_gpu, _ = gpu32(tokens[:, :5].cuda(), cpu_state.to("cuda"))
    assert (next_gpu.cpu() - next_cpu).abs().max().item() < 1e-4
