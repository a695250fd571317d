"""The Reformer (Kitaev et al. 2020) as xlserve serves it: its LSH and local attention patterns
against brute-force definitions, in one pass and decoding; the documented chunking semantics
(a first call is one pass, every later token a decoding step, in any chunking); batching; the
growing state, its round trip and its checks; reversible layers; training.
Parity with Hugging Face's reference is in test_convert_reformer.py."""

from dataclasses import replace

import pytest
import torch

import xlserve.models.reformer as reformer_module
from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.reformer import (
    SELF_SCORE, AxialPositions, FirstCall, LSHMemory, Reformer, ReformerConfig, hash_buckets, unit_rms,
)
from xlserve.models.registry import build_model
from xlserve.models.training.card import describe_state
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import assert_state_round_trips, run_in_chunks, tokens

C_LSH, C_LOCAL = 4, 3  # lcm 12: a first call of 17 tokens is padded to 24


def small_model(**overrides) -> Reformer:
    torch.manual_seed(0)
    settings = dict(attn_layers=["lsh", "local", "lsh"], d_model=16, n_head=2, d_head=8, d_inner=32, lsh_chunk=C_LSH,
                    lsh_chunks_before=1, n_hashes=2, n_buckets=4, local_chunk=C_LOCAL, local_chunks_before=1,
                    axial_pos_shape=[16, 16], axial_pos_dims=[6, 10])
    model = Reformer(ReformerConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():  # weights large enough that the attention pattern shows in the log-probs
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.4)
    return model


# -- brute-force definitions (the module docstring, position by position) -------------------------


def one_pass_lsh_counts(buckets, T, padded, chunk, before):
    """buckets (R, T) -> per round a (T, T) count matrix: how often query i's round-r window holds
    key j. Each round: positions sorted by (bucket, position), then padded − T empty slots; the
    rounds end to end, chunks of `chunk`; a slot sees its chunk and `before` earlier ones,
    cyclically, keys at positions <= its own."""
    R = len(buckets)
    if padded <= chunk:
        return [torch.tril(torch.ones(T, T))]
    slots = []
    for r in range(R):
        slots += sorted(range(T), key=lambda j: (int(buckets[r][j]), j)) + [None] * (padded - T)
    n_chunks = len(slots) // chunk
    counts = [torch.zeros(T, T) for _ in range(R)]
    for s, i in enumerate(slots):
        if i is None:
            continue
        for m in range(before + 1):
            k = (s // chunk - m) % n_chunks
            for j in slots[k * chunk : (k + 1) * chunk]:
                if j is not None and j <= i:
                    counts[s // padded][i, j] += 1
    return counts


def one_pass_local_counts(T, padded, chunk, before):
    if padded <= chunk:
        return torch.tril(torch.ones(T, T))
    counts, n_chunks = torch.zeros(T, T), padded // chunk
    for i in range(T):
        for m in range(before + 1):
            k = (i // chunk - m) % n_chunks
            for j in range(k * chunk, (k + 1) * chunk):
                if j < T and j <= i:
                    counts[i, j] += 1
    return counts


def decode_lsh_counts(values, t, chunk, before, hashed):
    """values (R, t + 1) stored bucket values of positions 0..t -> per round the counts (t + 1,)
    of query t's window: positions sorted by (value, position), the query's slot u, the slots
    (u // c · c − before · c + k) mod (t + 1); or every position once before hashing."""
    if not hashed:
        return [torch.ones(t + 1)]
    counts = []
    for row in values:
        order = sorted(range(t + 1), key=lambda j: (int(row[j]), j))
        u = order.index(t)
        start = (u // chunk - before) * chunk
        count = torch.zeros(t + 1)
        for k in range((before + 1) * chunk):
            count[order[(start + k) % (t + 1)]] += 1
        counts.append(count)
    return counts


def decode_local_visible(t, chunk, before):
    start = (t // chunk - before) * chunk
    lo = start if start >= 0 else max(t + start, 0)
    return list(range(lo, t + 1))


def dense_rounds(q, keys, values, rounds, self_rule):
    """q (T, D) queries, keys (K, D) scaled, values (K, D), rounds: per round (T, K) counts.
    Per round a softmax over the counted keys, a key counted twice entering twice (with
    `self_rule` key i of query i scores SELF_SCORE); the rounds combined by their log-sum-exps,
    exp(lse_r − logsumexp(lse)), computed as the reference computes them."""
    T, K = rounds[0].shape
    scores = q @ keys.T  # (T, K)
    if self_rule:
        offset = K - T  # query i is key offset + i
        scores[torch.arange(T), offset + torch.arange(T)] = SELF_SCORE
    outs, lses = [], []
    for counts in rounds:
        copies = int(counts.max())
        present = torch.arange(copies)[None, None, :] < counts[..., None]  # (T, K, copies)
        repeated = torch.where(present, scores[..., None], torch.full_like(present, float("-inf"), dtype=scores.dtype))
        lse = torch.logsumexp(repeated.reshape(T, -1), dim=-1)  # (T,)
        weights = torch.exp(repeated - lse[:, None, None]).sum(-1)  # (T, K): each copy's weight, summed
        outs.append(weights @ values)
        lses.append(lse[:, None])
    if len(rounds) == 1:
        return outs[0]
    lse = torch.cat(lses, dim=-1)  # (T, R)
    weights = torch.exp(lse - torch.logsumexp(lse, dim=-1, keepdim=True))
    return sum(weights[:, r : r + 1] * outs[r] for r in range(len(rounds)))


def record_layers(model):
    """Forward hooks on every attention module: (normalised input, context, output, memory)."""
    calls = [[] for _ in model.layers]
    for i, layer in enumerate(model.layers):
        layer.attention.register_forward_hook(
            lambda m, args, out, i=i: calls[i].append((args[0].detach(), args[1], out[0].detach(), out[1])))
    return calls


def lsh_projections(attention, x):
    c = attention.config
    T = x.shape[1]
    qk = attention.query_key(x).view(1, T, c.n_head, c.d_head).transpose(1, 2)[0]  # (H, T, D)
    v = attention.value(x).view(1, T, c.n_head, c.d_head).transpose(1, 2)[0]
    return qk, unit_rms(qk) * c.d_head ** -0.5, v


# -- (a) the attention patterns -----------------------------------------------------------------


@pytest.mark.parametrize("T", [5, 12, 17])
def test_one_pass_layers_are_their_brute_force_definitions(T):
    """A first call of T tokens (17: padded to 24, LSH windows wrapping across rounds and into
    padding slots): every layer's output is dense attention under the definition's counts."""
    model = small_model()
    c = model.config
    calls = record_layers(model)
    run_in_chunks(model, tokens(1, T, 1), T)
    padded = c.padded_length(T)
    assert padded == {5: 12, 12: 12, 17: 24}[T]
    with torch.no_grad():
        for layer, [(x, context, out, _)] in zip(model.layers, calls):
            attention = layer.attention
            assert isinstance(context, FirstCall) and context.padded == padded
            heads = []
            for h in range(c.n_head):
                if layer.kind == "lsh":
                    qk, keys, v = (t[h] for t in lsh_projections(attention, x))
                    buckets = hash_buckets(qk[None, None], attention.rotations[h : h + 1], c.n_buckets)[0, 0]
                    counts = one_pass_lsh_counts(buckets, T, padded, C_LSH, 1)
                    heads.append(dense_rounds(qk, keys, v, counts, self_rule=True))
                else:
                    split = lambda t: t.view(T, c.n_head, c.d_head)[:, h]  # noqa: E731
                    q, k, v = split(attention.query(x[0])), split(attention.key(x[0])), split(attention.value(x[0]))
                    counts = one_pass_local_counts(T, padded, C_LOCAL, 1)
                    heads.append(dense_rounds(q, k * c.d_head ** -0.5, v, [counts], self_rule=False))
            expected = attention.out(torch.stack(heads, dim=1).reshape(1, T, -1))
            assert (out - expected).abs().max().item() < 1e-5, layer.kind


@pytest.mark.parametrize("decode_path", ["dense", "gathered"])
def test_decoding_layers_are_their_brute_force_definitions(decode_path, monkeypatch):
    """After a first call, tokens one at a time (and in a chunk of 9): each query's LSH windows
    among the sorted buckets of positions 0..t, its local positions lo(t)..t (a negative start
    early on), and full attention until the cache is hashed. Both ways of computing the LSH
    windows' attention (the whole short history scored at once, or each window gathered)."""
    if decode_path == "gathered":
        monkeypatch.setattr(reformer_module, "DENSE_DECODE_HISTORY", 0)
    for first, chunk in [(3, 1), (17, 1), (2, 9)]:
        model = small_model(local_chunks_before=2)
        c = model.config
        text = tokens(1, first + 18, 2)
        _, state = run_in_chunks(model, text[:, :first], first)
        calls = record_layers(model)
        run_in_chunks(model, text[:, first:], chunk, state)
        with torch.no_grad():
            for index, layer in enumerate(model.layers):
                attention = layer.attention
                for x, context, out, memory in calls[index]:
                    start, n = int(context.position[0]), x.shape[1]
                    for step in range(n):
                        t = start + step
                        heads = []
                        for h in range(c.n_head):
                            if layer.kind == "lsh":
                                keys_all = memory[0][0, :, h] * c.d_head ** -0.5  # (N, D): positions 0 .. end of call
                                values_all = memory[1][0, :, h]
                                qk = lsh_projections(attention, x)[0][h]
                                hashed = bool(context.hashed[0]) or t >= max(start + 1, C_LSH)
                                counts = decode_lsh_counts(memory[2][0, : t + 1, h].T, t, C_LSH, 1, hashed)
                                heads.append(dense_rounds(qk[step : step + 1], keys_all[: t + 1], values_all[: t + 1],
                                                          [k[None] for k in counts], self_rule=True))
                            else:
                                D = c.d_head
                                q = attention.query(x[0, step]).view(c.n_head, D)[h]
                                # positions start − S .. start + n − 1: the window before the call, then the call's
                                S = context.memory[0].shape[1]
                                keys = torch.cat([context.memory[0][0, :, h], attention.key(x[0]).view(n, c.n_head, D)[:, h]])
                                vals = torch.cat([context.memory[1][0, :, h], attention.value(x[0]).view(n, c.n_head, D)[:, h]])
                                visible = [p - (start - S) for p in decode_local_visible(t, C_LOCAL, 2)]
                                heads.append(dense_rounds(q[None], keys[visible] * D ** -0.5, vals[visible],
                                                          [torch.ones(1, len(visible))], self_rule=False))
                        expected = attention.out(torch.cat(heads, dim=-1))
                        assert (out[0, step] - expected[0]).abs().max().item() < 1e-5, (first, chunk, layer.kind, t)


def test_hashing_is_the_argmax_over_rotated_vectors():
    torch.manual_seed(1)
    vectors, rotations = torch.randn(1, 2, 7, 8), torch.randn(2, 8, 3, 2 + 3)
    buckets = hash_buckets(vectors, rotations, [4, 6])  # factorised: 4 · 6 buckets
    for h in range(2):
        for r in range(3):
            for t in range(7):
                rotated = vectors[0, h, t] @ rotations[h, :, r]
                first = int(torch.cat([rotated[:2], -rotated[:2]]).argmax())
                second = int(torch.cat([rotated[2:], -rotated[2:]]).argmax())
                assert int(buckets[0, h, r, t]) == first + 4 * second
    assert 0 <= int(buckets.min()) and int(buckets.max()) < 24


def test_axial_positions_unravel_row_major():
    axial = AxialPositions([3, 4, 5], [2, 3, 1])
    with torch.no_grad():
        for table in axial.weights:
            table.normal_()
    positions = torch.tensor([[0, 7, 59]])
    out = axial(positions)
    for column, p in enumerate([0, 7, 59]):
        expected = torch.cat([axial.weights[0][p // 20], axial.weights[1][(p // 5) % 4], axial.weights[2][p % 5]])
        assert torch.equal(out[0, column], expected)
    with pytest.raises(ValueError, match="beyond the 60 axial positions"):
        axial(torch.tensor([[60]]))


# -- (b) chunking: a first call is one pass, later tokens decode ------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_later_calls_in_any_chunking_decode_token_by_token(chunk):
    """After the same first call, feeding the rest in calls of 1, 7 or 64 tokens gives the same
    log-probs and state: a later call is that many decoding steps."""
    model = small_model()
    text = tokens(2, 100, 3)
    one, first_state = run_in_chunks(model, text[:, :13], 13)
    by_token, state_a = run_in_chunks(model, text[:, 13:], 1, first_state)
    chunked, state_b = run_in_chunks(model, text[:, 13:], chunk, first_state)
    assert (chunked - by_token).abs().max().item() < 1e-5
    assert torch.equal(state_a.position, state_b.position) and torch.equal(state_a.hashed, state_b.hashed)
    for (name, a), (_, b) in zip(state_a._named_tensors(), state_b._named_tensors()):
        if a.is_floating_point():
            assert (a - b).abs().max().item() < 1e-5, name
        else:
            assert torch.equal(a, b), name


def test_one_pass_and_decoding_differ_as_documented():
    """The reference's semantics: LSH chunks of a one pass are not a decoding step's windows, so
    the same text fed in one call or token by token gives different log-probs once it is longer
    than a chunk (and the same while it fits in one)."""
    model = small_model()
    text = tokens(1, 40, 4)
    short, _ = run_in_chunks(model, text[:, :C_LOCAL], C_LOCAL)  # one chunk of every kind, not padded
    short_stepped, _ = run_in_chunks(model, text[:, :C_LOCAL], 1)
    assert (short - short_stepped).abs().max().item() < 1e-5
    whole, _ = run_in_chunks(model, text, 40)
    stepped, _ = run_in_chunks(model, text, 1)
    assert (whole - stepped).abs().max().item() > 1e-2
    assert not model.chunking_invariant


def test_groups_and_pieces_change_nothing(monkeypatch):
    """A one pass's chunks in groups of one, decoding queries one at a time, a later call in
    pieces of 4 tokens: the same results, in less memory."""
    model = small_model()
    text = tokens(1, 90, 5)
    first, state = run_in_chunks(model, text[:, :20], 20)
    expected, _ = run_in_chunks(model, text[:, 20:], 70, state)
    monkeypatch.setattr(reformer_module, "CHUNK_GROUP_SCORES", 1)
    monkeypatch.setattr(reformer_module, "DECODE_GROUP_ELEMENTS", 1)
    model.max_piece_positions = 4
    first_grouped, _ = run_in_chunks(model, text[:, :20], 20)
    got, _ = run_in_chunks(model, text[:, 20:], 70, state)
    assert (first_grouped - first).abs().max().item() < 1e-5
    assert (got - expected).abs().max().item() < 1e-5


def test_dense_and_gathered_decoding_give_the_same_loss_and_gradients(monkeypatch):
    """Training decodes later segments with the dense form (short histories), serving a long
    history with the gathered one: the same log-probabilities, and the same gradients. In
    float64: in float32 the two orders of summation differ by about 1e-6, enough to flip a
    ReLU whose input is that close to 0 and so change a gradient by a kink, not an error."""
    model = small_model().train().double()
    text = tokens(2, 60, 12)
    _, state = model(text[:, :17], model.init_state(2))
    assert state.lsh_keys[0].dtype == torch.float64

    def loss_and_gradients():
        model.zero_grad()
        log_probs, _ = model(text[:, 17:], state)
        log_probs[..., 5].sum().backward()
        return log_probs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    dense, dense_gradients = loss_and_gradients()
    monkeypatch.setattr(reformer_module, "DENSE_DECODE_HISTORY", 0)
    gathered, gathered_gradients = loss_and_gradients()
    assert (dense - gathered).abs().max().item() < 1e-10
    assert len(dense_gradients) == len(gathered_gradients) > 0
    for a, b in zip(dense_gradients, gathered_gradients):
        assert (a - b).abs().max().item() <= 1e-9 * max(1.0, b.abs().max().item())


# -- (c) batching ---------------------------------------------------------------------------------


def test_rows_of_different_histories_batch_like_single_rows():
    """Fresh rows (a one pass) and continuing rows of different lengths, in one batch, and the
    batch decoding on: each row as if alone."""
    model = small_model()
    histories = [tokens(1, 0, 6), tokens(1, 2, 7), tokens(1, 25, 8), tokens(1, 0, 9), tokens(1, 61, 10)]
    step = tokens(5, 6, 11)
    with torch.no_grad():
        states = [model(h, model.init_state(1))[1] if h.shape[1] else model.init_state(1) for h in histories]
        singles = [model(step[i : i + 1], s) for i, s in enumerate(states)]
        batched, batch_state = model(step, LSHMemory.concat(states))
        decoded, _ = model(step[:, :1], batch_state)
        for i, (single, single_state) in enumerate(singles):
            assert (batched[i] - single[0]).abs().max().item() < 1e-5, i
            again, _ = model(step[i : i + 1, :1], single_state)
            assert (decoded[i] - again[0]).abs().max().item() < 1e-5, i
        for part, (_, single_state) in zip(batch_state.split(), singles):
            for (name, a), (_, b) in zip(part._named_tensors(), single_state._named_tensors()):
                assert a.shape == b.shape and (a.double() - b.double()).abs().max().item() < 1e-5, name
            model.check_state(part, int(part.position[0]))
        taken = batch_state.take([4, 1])
        assert taken.position.tolist() == [batch_state.position[4].item(), batch_state.position[1].item()]
        assert taken.length == int(batch_state.position[4])  # no more padding than its rows need


# -- (d) the state --------------------------------------------------------------------------------


def test_state_round_trips_through_safetensors(tmp_path):
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 30, 12), model.init_state(1))
        _, state = model(tokens(1, 5, 13), state)
    assert isinstance(state, LSHMemory)
    assert_state_round_trips(model, state, 35, tokens(1, 9, 14), tmp_path, required="hashed")
    with pytest.raises(ValueError, match="unexpected"):
        LSHMemory.from_tensors({**state.to_tensors(), "extra": torch.zeros(1)})


def test_state_grows_with_the_history_up_to_max_context():
    model = small_model()  # axial 16 x 16: 256 positions
    c = model.config
    assert model.max_context == 256 and model.state_grows_with_context
    S, H, D, R = c.local_window, c.n_head, c.d_head, c.n_hashes
    with torch.no_grad():
        _, state = model(tokens(1, 100, 15), model.init_state(1))
        assert state.nbytes() == 9 + 2 * 100 * H * (2 * D * 4 + 4 * R) + 2 * S * H * D * 4
        _, state = model(tokens(1, 156, 16), state)
        assert state.length == 256
        with pytest.raises(ValueError, match="max_context = 256"):
            model(tokens(1, 1, 17), state)
        with pytest.raises(ValueError, match="max_context = 256"):
            model(tokens(1, 257, 17), model.init_state(1))


def test_the_card_says_the_state_grows_up_to_max_context():
    words = describe_state(small_model(), (64, 256))
    assert "grows with the history, up to the model's maximum of 256 bytes" in words, words
    # past its maximum a session cannot go: the card measures the longest one instead of failing
    words = describe_state(small_model(), (64, 4096, 65536))
    assert "bytes after 64 bytes, " in words and "bytes after 256 bytes;" in words, words
    assert "no session holds more than the 256 bytes measured" in words, words


def test_check_state_accepts_real_states_and_refuses_poisoned_ones():
    model = small_model()
    model.check_state(model.init_state(1), 0)
    with torch.no_grad():
        for n in (1, 2, 4, 5, 30):
            model.check_state(model(tokens(1, n, 18), model.init_state(1))[1], n)
        _, state = model(tokens(1, 2, 19), model.init_state(1))

    def poisoned(change):
        tensors = {name: t.clone() for name, t in state.to_tensors().items()}
        change(tensors)
        return LSHMemory.from_tensors(tensors)

    cases = [
        (lambda t: t["lsh_keys.0"].view(-1).__setitem__(0, float("nan")), "lsh_keys.0.*NaN"),
        (lambda t: t["buckets.1"].view(-1).__setitem__(1, 99), "buckets.1.*outside"),
        (lambda t: t.__setitem__("lsh_values.1", t["lsh_values.1"][:, :1]), "lsh_values.1"),
        (lambda t: t["local_keys.0"][0, 0].fill_(1.0), "local_keys.0.*no position has reached"),
        (lambda t: t.__setitem__("position", torch.tensor([-1])), "negative"),
        (lambda t: t.__setitem__("buckets.0", t["buckets.0"].long()), "buckets.0"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            model.check_state(poisoned(change), 2)
    with pytest.raises(ValueError, match="position"):
        model.check_state(state, 3)
    with torch.no_grad():
        _, long = model(tokens(1, 2, 20), model.init_state(1))
        _, long = model(tokens(1, 5, 21), long)
    tensors = {name: t.clone() for name, t in long.to_tensors().items()}
    tensors["hashed"] = torch.tensor([False])
    with pytest.raises(ValueError, match="hashed"):
        model.check_state(LSHMemory.from_tensors(tensors), 7)


def test_a_model_without_lsh_layers_has_a_fixed_state(tmp_path):
    model = small_model(attn_layers=["local", "local"])
    with torch.no_grad():
        _, a = model(tokens(1, 10, 22), model.init_state(1))
        _, b = model(tokens(1, 90, 23), a)
    assert a.nbytes() == b.nbytes() and not a.buckets
    restored = LSHMemory.from_tensors(b.to_tensors())
    model.check_state(restored, 100)


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "reformer")
    loaded = load_checkpoint(tmp_path / "reformer")
    text = tokens(1, 30, 24)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])
    for a, b in zip(model.lsh_layers, loaded.lsh_layers):  # the rotations are in the checkpoint
        assert torch.equal(model.layers[a].attention.rotations, loaded.layers[b].attention.rotations)
    assert loaded.state_kind == "window" and loaded.max_context == 256 and not loaded.chunking_invariant


# -- (e) reversible layers and training -------------------------------------------------------------


def plain_stack(x1, x2, blocks, contexts, memories):
    for block, context in zip(blocks, contexts):
        attended, memory = block.attend(x2, context)
        x1 = x1 + attended
        x2 = x2 + reformer_module.position_wise_in_pieces(block.feed_forward, x1, block.ff_chunk)  # the same dropout draws
        memories.append(memory)
    return x1, x2


@pytest.mark.parametrize("carried", [False, True])
def test_reversible_gradients_equal_ordinary_backpropagation(monkeypatch, carried):
    """Reconstructing each layer's inputs from its outputs (and the feed-forward in pieces of 5)
    gives the gradients of ordinary backpropagation, from a fresh state and from a carried one."""
    model = small_model(ff_chunk=5, dropout=0.1, dropatt=0.1).train()
    inputs, targets = tokens(2, 26, 25), tokens(2, 26, 26)
    state = model.init_state(2)
    if carried:
        with torch.no_grad():
            _, state = model(tokens(2, 20, 27), state)

    def gradients():
        model.zero_grad()
        torch.manual_seed(5)  # the same dropout masks in both runs
        loss, _ = model.training_loss(inputs, targets, state, 0.0)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = gradients()
    monkeypatch.setattr(reformer_module._Reversible, "apply", plain_stack)
    plain = gradients()
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        assert (ours[name] - grad).abs().max().item() <= 1e-5 * max(1.0, grad.abs().max().item()), name


def test_chunked_feed_forward_gives_the_same_output():
    model = small_model()
    text = tokens(1, 30, 28)
    whole, _ = run_in_chunks(model, text, 30)
    for layer in model.layers:
        layer.ff_chunk = 4
    pieces, _ = run_in_chunks(model, text, 30)
    assert (pieces - whole).abs().max().item() < 1e-5


def test_training_lanes_restart_before_train_context():
    model = small_model(train_context=40).train()
    with torch.no_grad():
        _, state = model(tokens(2, 30, 29), model.init_state(2))
        _, state = model(tokens(2, 5, 29), state)
    rows = state.split()
    state = LSHMemory.concat([rows[0], model.init_state(1)])  # lane 1 starts a file
    _, after = model.training_loss(tokens(2, 8, 30), tokens(2, 8, 31), state, 0.0)
    assert after.position.tolist() == [8, 8]  # lane 0 (35 + 8 > 40) restarted; lane 1 was fresh


def test_three_training_steps_with_the_standard_loop(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    model = train("reformer", "tiny", tmp_path / "rf", recipe, log=lambda s: None)
    loaded = load_checkpoint(tmp_path / "rf")
    text = tokens(1, 50, 32)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])


def test_presets_build():
    for preset, (low, high) in {"small": (1_000_000, 3_000_000), "tiny": (10_000, 500_000)}.items():
        model = build_model("reformer", preset_config("reformer", preset))
        assert low < sum(p.numel() for p in model.parameters()) < high, preset
        # training reaches positions below train_context only: a larger axial shape would leave
        # position rows untrained that serving then uses
        assert model.max_context == model.config.train_context if preset == "small" else model.max_context == 65536


def test_held_out_scoring_stops_where_the_model_stops():
    """max_context is where a Reformer stops, not a window that slides: evaluation scores a
    document's first max_context + 1 bytes (the most it can be fed) and never by windows."""
    from xlserve.models.training import card
    from xlserve.models.training.evaluate import bits_per_byte
    from xlserve.models.training.presets import preset_config

    torch.manual_seed(0)
    model = build_model("reformer", {**preset_config("reformer", "tiny"), "axial_pos_shape": [8, 16]}).eval()
    assert model.max_context == 128 and model.sliding_window is None and model.history_limit == 128
    document = bytes(range(32, 127)) * 4  # 380 bytes, longer than the model can take
    assert bits_per_byte(model, [document], window_stride=32) == bits_per_byte(model, [document[:129]])
    assert [v.get("window_stride") for v in card.card_variants(model, segment_len=128)] == [None]
    # the card's count of scored bytes is what was scored: each held-out file's first 129 bytes
    (row,) = card.evaluate_for_card(model, segment_len=128)
    documents = card.held_out_documents(card.stdlib_corpus())
    assert row["scored_bytes"] == sum(min(len(d), 129) - 1 for d in documents) < sum(len(d) - 1 for d in documents)
