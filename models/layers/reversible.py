"""Reversible residual layers (Gomez et al. 2017, "The Reversible Residual Network"; used by
Kitaev et al. 2020, "Reformer", section 3), with the feed-forward applied in chunks.

A stack of layers carries two streams (x1, x2), and each layer is

    y1 = x1 + F(x2)        (F: attention)
    y2 = x2 + G(y1)        (G: feed-forward)

which can be run backwards exactly: x2 = y2 − G(y1), x1 = y1 − F(x2). So training need not keep
any layer's activations for the backward pass: only the last layer's outputs are stored, and the
backward pass walks the stack from the top, reconstructing each layer's inputs from its outputs
and recomputing F and G to get their gradients. Activation memory is then that of one layer,
whatever the depth (the paper's 'reversible layers'). The reconstruction is exact in real
arithmetic; in float32 it is exact to rounding, so gradients agree with ordinary backpropagation
to about 1e-6 relative.

Chunking (the paper's 'chunking' of the feed-forward, section 3): G is position-wise, so it is
computed over pieces of `ff_chunk` positions at a time, forward and backward, and only one
piece's d_inner-wide activations exist at once. The result is the same.

Dropout inside F or G draws the same random numbers when recomputed: the random generator's
state before each F and G of the forward pass is restored for the recomputation.

A block for `reversible_stack` has `attend(x2, context) -> (F(x2), memory)` (the memory is what
the layer hands to the model's state; it never carries gradients), `feed_forward(y)` (G on a
piece of positions) and `ff_chunk` (0: one piece).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function


def chunked(function, x: Tensor, chunk: int) -> Tensor:
    """function(x) for a position-wise `function` of x (B, T, d), over pieces of `chunk` positions
    (0 or >= T: one piece)."""
    if chunk <= 0 or x.shape[1] <= chunk:
        return function(x)
    return torch.cat([function(x[:, s : s + chunk]) for s in range(0, x.shape[1], chunk)], dim=1)


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _recompute_rng(device: torch.device, state):
    """A context in which the random generators are at `state` (and are left as they were)."""
    cpu, cuda = state
    fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])

    class _Restore:
        def __enter__(self):
            fork.__enter__()
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)

        def __exit__(self, *exc):
            return fork.__exit__(*exc)

    return _Restore()


def reversible_stack(x1: Tensor, x2: Tensor, blocks, contexts: list) -> tuple[Tensor, Tensor, list]:
    """Run `blocks` as reversible layers from (x1, x2), each with its context; returns (y1, y2)
    of the last layer and every layer's memory. With autograd on, through `_Reversible` (one
    layer's activations at a time in the backward pass); otherwise a plain loop."""
    memories: list = []
    if not torch.is_grad_enabled():
        for block, context in zip(blocks, contexts):
            attended, memory = block.attend(x2, context)
            x1 = x1 + attended
            x2 = x2 + chunked(block.feed_forward, x1, block.ff_chunk)
            memories.append(memory)
        return x1, x2, memories
    y1, y2 = _Reversible.apply(x1, x2, blocks, contexts, memories)
    return y1, y2, memories


class _Reversible(Function):
    @staticmethod
    def forward(ctx, x1, x2, blocks, contexts, memories):
        rng = []
        for block, context in zip(blocks, contexts):  # autograd is off inside Function.forward
            f_state = _rng_state(x2.device)
            attended, memory = block.attend(x2, context)
            x1 = x1 + attended
            g_state = _rng_state(x2.device)
            x2 = x2 + chunked(block.feed_forward, x1, block.ff_chunk)
            memories.append(memory)
            rng.append((f_state, g_state))
        ctx.blocks, ctx.contexts, ctx.rng = blocks, contexts, rng
        ctx.save_for_backward(x1.detach(), x2.detach())
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        for block, context, (f_state, g_state) in reversed(list(zip(ctx.blocks, ctx.contexts, ctx.rng))):
            # G: y2 = x2 + G(y1), piece by piece; accumulates G's parameter gradients
            g_out, dy1_from_g = [], []
            chunk = block.ff_chunk if block.ff_chunk > 0 else y1.shape[1]
            with _recompute_rng(y1.device, g_state), torch.enable_grad():
                for s in range(0, y1.shape[1], chunk):
                    piece = y1[:, s : s + chunk].detach().requires_grad_(True)
                    out = block.feed_forward(piece)
                    torch.autograd.backward(out, dy2[:, s : s + chunk])
                    g_out.append(out.detach())
                    dy1_from_g.append(piece.grad)
            x2 = y2 - torch.cat(g_out, dim=1)
            dy1 = dy1 + torch.cat(dy1_from_g, dim=1)
            # F: y1 = x1 + F(x2); accumulates F's parameter gradients
            with _recompute_rng(y1.device, f_state), torch.enable_grad():
                x2 = x2.detach().requires_grad_(True)
                attended, _ = block.attend(x2, context)
                torch.autograd.backward(attended, dy1)
            x1 = y1 - attended.detach()
            dy2 = dy2 + x2.grad
            y1, y2 = x1, x2.detach()
        return dy1, dy2, None, None, None
