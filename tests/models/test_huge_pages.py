"""models/huge_pages.py: a model's large weights moved into one mapping on huge pages compute the
same bits, keep their names, ties and state dict, and, where the kernel gives huge pages, lie on
them; small weights and quantized models are handled."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from xlserve.models.huge_pages import HUGE_PAGE_BYTES, transparent_huge_pages_mode, weights_on_huge_pages
from xlserve.models.quantize import quantize_model
from xlserve.models.registry import build_model

DEFRAG = Path("/sys/kernel/mm/transparent_hugepage/defrag")

# per layer a qkv weight of 1,536 x 512 floats (3 MB) and feed-forward weights of 512 x 2,048 (4 MB
# each), and the embedding the head shares (1,024 x 512: 2 MB): 24 MB of weights to move
LARGE = dict(vocab_size=1024, d_model=512, n_head=8, d_head=64, d_inner=2048, n_layer=2, mem_len=32, tgt_len=16,
             dropout=0.0)
SMALL = dict(vocab_size=256, d_model=64, n_head=2, d_head=32, d_inner=128, n_layer=2, mem_len=16, tgt_len=8,
             dropout=0.0)


def mapping_of(address: int) -> dict[str, int] | None:
    """/proc/self/smaps' sizes (kB) of the mapping holding `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
                fields = {"start": start, "end": end}
            elif inside and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields if inside else None


def model(shape: dict):
    torch.manual_seed(0)
    return build_model("transformer-xl", shape).eval()


def log_probs(net, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        prompt, state = net(tokens[:, :-1], net.init_state(tokens.shape[0]))
        step, _ = net(tokens[:, -1:], state)  # a decode step after the prompt
    return torch.cat([prompt, step], 1)


def test_large_weights_move_into_one_mapping_and_compute_the_same_bits():
    tokens = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    net = model(LARGE)
    before = log_probs(net, tokens)
    state_before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    parameters_before = {name: id(p) for name, p in net.named_parameters()}
    assert net.head.weight is net.embedding.weight  # tied: one Parameter under two names

    assert weights_on_huge_pages(net) is net
    if transparent_huge_pages_mode() not in ("always", "madvise"):
        pytest.skip("this kernel gives no transparent huge pages: nothing moves")

    large = [p for p in net.parameters() if p.nbytes >= HUGE_PAGE_BYTES]
    assert len(large) == 7  # per layer qkv (3 MB) and two feed-forward weights (4 MB), and the embedding (2 MB)
    mappings = {(m["start"], m["end"]) for m in (mapping_of(p.data_ptr()) for p in large)}
    assert len(mappings) == 1  # one mapping, the weights one after the other
    assert all(p.data_ptr() % 64 == 0 for p in large)
    assert {name: id(p) for name, p in net.named_parameters()} == parameters_before  # the same Parameters
    assert net.head.weight is net.embedding.weight
    after_state = net.state_dict()
    assert after_state.keys() == state_before.keys()
    assert all(torch.equal(after_state[name], tensor) for name, tensor in state_before.items())
    assert torch.equal(log_probs(net, tokens), before)
    # the kernel backs at least one of its 2 MB stretches with a huge page (unless it never
    # compacts memory to find one: defrag `never` gives huge pages only when some lie free)
    if DEFRAG.read_text().find("[never]") < 0:
        assert mapping_of(large[0].data_ptr())["AnonHugePages"] >= 2048


def test_small_weights_stay_and_a_quantized_model_moves_what_it_still_reads():
    net = model(SMALL)
    addresses = {name: p.data_ptr() for name, p in net.named_parameters()}
    weights_on_huge_pages(net)
    assert {name: p.data_ptr() for name, p in net.named_parameters()} == addresses  # nothing of 2 MB

    tokens = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(2))
    quantized = quantize_model(copy.deepcopy(model(LARGE)), "int8")
    before = log_probs(quantized, tokens)
    float_tensors = {id(t): t.data_ptr() for t in (*quantized.parameters(), *quantized.buffers())}
    weights_on_huge_pages(quantized)
    assert torch.equal(log_probs(quantized, tokens), before)
    if transparent_huge_pages_mode() in ("always", "madvise"):  # the shared embedding (2 MB) moved
        assert quantized.embedding.weight.data_ptr() != float_tensors[id(quantized.embedding.weight)]


def test_a_kernel_that_refuses_the_advice_leaves_the_weights_where_they_are(monkeypatch, caplog):
    """MADV_HUGEPAGE refused (a sandbox's seccomp filter, EINVAL while /sys says `madvise`): the
    model loads as it is, with a warning, instead of the server failing to start over a speed-up."""
    import errno
    import mmap

    from xlserve.models import huge_pages

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(huge_pages, "transparent_huge_pages_mode", lambda: "madvise")
    monkeypatch.setattr(mmap, "mmap", Refusing)
    net = model(LARGE)
    addresses = {name: p.data_ptr() for name, p in net.named_parameters()}
    assert weights_on_huge_pages(net) is net
    assert {name: p.data_ptr() for name, p in net.named_parameters()} == addresses
    assert "refused MADV_HUGEPAGE" in caplog.text
