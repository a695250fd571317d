"""The contract every architecture in xlserve implements.

A model is a pure function of its weights: `forward(tokens, state) -> (log_probs, new_state)`.
Whatever a model must remember between calls (Transformer-XL's memory, a window of keys and
values, a linear-attention summary) lives in a `State` value that the caller owns. The server's
session cache stores, moves, saves and batches these values without knowing what is inside them,
through the small interface below.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

# how far from 0 the logsumexp of an imported next-token row may be (float32 rounding over a
# large vocabulary stays far below it; a row that is not log-probabilities is far above it)
LOG_PROBS_SUM_TOLERANCE = 1e-3


@dataclass
class ArchConfig:
    """Hyperparameters of one architecture; serialised as the "config" object of config.json."""

    vocab_size: int = 256  # byte-level by default: every UTF-8 text is a sequence of bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ArchConfig":
        """The config `values` (config.json's "config") describe; ValueError naming the field when
        one is unknown or not of its type (a count that is a string, a flag that is a number),
        which would otherwise fail somewhere inside the model's constructor, or not at all."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no fields {unknown}")
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            if not _fits(value, hints[name]):
                raise ValueError(f"{cls.__name__}.{name} must be {_described(hints[name])}, not {value!r}")
            if name in SIZES and value < 1:  # n_layer -1 built a model of no layers in some architectures
                raise ValueError(f"{cls.__name__}.{name} must be at least 1, not {value!r}")
        return cls(**values)


# the sizes every architecture that has them needs at least one of (a vocabulary, layers, widths, heads)
SIZES = frozenset({"vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner"})


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a config field's type (a list stands for a tuple; an int for a
    float; a bool for neither). A hint it does not know lets anything through."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_fits(item, args[0]) for item in value) if args else \
            isinstance(value, (list, tuple))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _described(hint: Any, plural: bool = False) -> str:
    """A field's type in words, for the message that refuses a value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_described(arg, plural) for arg in args)
    if hint is type(None):
        return "null"
    if origin in (list, tuple):
        return f"a list of {_described(args[0], plural=True)}" if args else "a list"
    names = {bool: ("true or false", "true or false values"), int: ("an integer", "integers"),
             float: ("a number", "numbers"), str: ("a string", "strings")}
    if hint in names:
        return names[hint][plural]
    return getattr(hint, "__name__", str(hint))


@dataclass
class TransformerConfig(ArchConfig):
    """The shape of a multi-head transformer, the fields every architecture's config but the
    Reformer's and the Lite Transformer's starts with (in this order, after vocab_size). A config
    that wants other defaults restates the field."""

    n_layer: int = 4
    d_model: int = 192  # width of the residual stream
    n_head: int = 4
    d_head: int = 48  # per-head width D; n_head * d_head need not equal d_model
    d_inner: int = 768  # width of the position-wise feed-forward layer


# -- what a commit changed: the positions a state added, dropped or overwrote ------------------------
#
# A session's commit writes only what changed when its model's state grows or slides by appending
# (issue 36, "commits that cost the new tokens"). The state class names, per field, the axis its
# positions lie along (`State.delta_axes`); `State.delta_from` then describes each tensor's
# change as one of
#     same    unchanged, nothing written
#     slide   the first `drop` positions dropped, `values` appended (a sliding or growing memory)
#     slots   the positions `index` overwritten with `values` (a ring buffer)
#     whole   `values` is the new tensor (a counter, a mask that changed shape, anything else)
# and every candidate is checked bit for bit against the new tensor before it is chosen, so a
# delta applied to the old state gives exactly the new one, whatever the model did: a change
# that is neither slide nor slots (every position rewritten) is written whole, never wrongly.


@dataclass
class TensorChange:
    """How one state tensor changed between two versions of a session (module comment above)."""

    op: str  # "same", "slide", "slots" or "whole"
    axis: int = 0
    drop: int = 0  # slide: how many positions left the front
    values: Tensor | None = None  # slide: the appended positions; slots: the new slots; whole: the tensor
    index: Tensor | None = None  # slots: (n,) int64, which positions along `axis` were overwritten

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.index) if t is not None)


def _bits(t: Tensor) -> Tensor:
    """`t` viewed as integers of its element size: equal bits compare equal (-0.0 and 0.0 differ,
    a NaN equals itself), which is what a stored state must reproduce."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# elements checked at a time by `all_finite`: 4 MB of float32
FINITE_CHECK_ELEMENTS = 1 << 20


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite, checked a block at a time: torch.isfinite on a whole
    tensor makes temporaries of about 1.75× its bytes (its absolute values and two masks), 172 MB
    for a 98 MB embedding, a GB for a 2.8B model's; a block's are 7 MB. On an accelerator, where
    each block's answer waits for the device, the blocks are 64 times larger."""
    block = FINITE_CHECK_ELEMENTS * (1 if tensor.device.type == "cpu" else 64)
    if tensor.dim() > 1 and not tensor.is_contiguous():  # slices along the first axis, about a block each
        rows = max(1, block // max(1, tensor[0].numel()))
        return all(bool(torch.isfinite(part).all()) for part in tensor.split(rows))
    flat = tensor.reshape(-1)  # a view: contiguous, or one axis
    return all(bool(torch.isfinite(flat[start : start + block]).all()) for start in range(0, flat.numel(), block))


def tensor_change(old: Tensor, new: Tensor, axis: int | None, appended: int) -> TensorChange:
    """The cheapest exact description of `old` -> `new`: positions along `axis` (None: the tensor
    has no positions, it is same or whole) slid by `appended` new ones, or else overwritten in
    place. One pass over the tensor for a sliding memory, two for a ring (the slide is tried
    first, then the slots), which on the state's device costs far less than writing it."""
    whole = TensorChange("whole", values=new)
    if axis is None or old.dtype != new.dtype or old.dim() != new.dim() or \
            any(o != n for d, (o, n) in enumerate(zip(old.shape, new.shape)) if d != axis):
        return TensorChange("same") if same_bits(old, new) else whole
    old_len, new_len = old.shape[axis], new.shape[axis]
    drop = min(max(old_len + appended - new_len, 0), old_len)  # what `appended` new positions pushed out
    kept = old_len - drop
    if kept <= new_len and same_bits(new.narrow(axis, 0, kept), old.narrow(axis, drop, kept)):
        if drop == 0 and kept == new_len:
            return TensorChange("same")
        slide = TensorChange("slide", axis=axis, drop=drop, values=new.narrow(axis, kept, new_len - kept))
        if slide.nbytes() < whole.nbytes():
            return slide
    if old.shape == new.shape:
        differs = (_bits(old) != _bits(new)).movedim(axis, 0).reshape(old_len, -1).any(dim=1)
        index = differs.nonzero().flatten()
        if index.numel() == 0:
            return TensorChange("same")
        slots = TensorChange("slots", axis=axis, values=new.index_select(axis, index), index=index)
        return slots if slots.nbytes() < whole.nbytes() else whole
    return whole


def apply_change(old: Tensor | None, change: TensorChange) -> Tensor:
    """`old` with `change` applied (out of place: states are values)."""
    if change.op == "same":
        return old
    if change.op == "whole":
        return change.values
    if change.op == "slide":
        kept = old.shape[change.axis] - change.drop
        return torch.cat([old.narrow(change.axis, change.drop, kept), change.values.to(old.device)], dim=change.axis)
    if change.op == "slots":
        return old.index_copy(change.axis, change.index.to(old.device), change.values.to(old.device))
    raise ValueError(f"unknown state change {change.op!r}")


@dataclass
class State:
    """Per-session model state: a dataclass whose fields are tensors or lists of tensors.

    Every tensor has the batch on dimension 0, so a state can be split into per-session states
    and concatenated back into a batch. Subclasses whose tensors vary in length between sessions
    (a memory that is not full yet) override `concat` to pad.

    `delta_axes` says what kind of state this is for a commit (the comment above `TensorChange`):
    field name -> the axis its positions lie along, for the fields a new token appends to, slides
    or overwrites a few positions of; empty (the default) for a state that changes as a whole
    (running sums, compressed slots), whose every commit is a whole write.
    """

    delta_axes: ClassVar[dict[str, int]] = {}
    # fields a session store in 16 bits (XLSERVE_STATE_DTYPE) keeps in float32: a quantity whose
    # rounding would change every value it scales (RWKV's log-scale exponent), not one value
    kept_in_float32: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def stored_dtype(cls, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a session store in floating `dtype` keeps the floating tensor `name` (as
        `to_tensors` names it) in: float32 for a field in `kept_in_float32`, else `dtype`."""
        return torch.float32 if name.split(".")[0] in cls.kept_in_float32 else dtype

    @classmethod
    def commits_deltas(cls) -> bool:
        return bool(cls.delta_axes)

    def delta_from(self, old: "State", appended: int) -> dict[str, TensorChange] | None:
        """What changed from `old` to this state, `appended` tokens later, by tensor name
        (`to_tensors`' names); None for a state that changes as a whole, or when the two do
        not have the same tensors (nothing to describe a change against)."""
        if not self.delta_axes:
            return None
        mine, theirs = dict(self._named_tensors()), dict(old._named_tensors())
        if mine.keys() != theirs.keys():
            return None
        return {name: tensor_change(theirs[name], new, self.delta_axes.get(name.split(".")[0]), appended)
                for name, new in mine.items()}

    def apply_delta(self, delta: dict[str, TensorChange]) -> "State":
        """The state `delta` (from `delta_from`) leads to from this one."""
        named = dict(self._named_tensors())
        return type(self).from_tensors({name: apply_change(named.get(name), change) for name, change in delta.items()})

    def _named_tensors(self) -> list[tuple[str, Tensor]]:
        named = []
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                named.append((field.name, value))
            else:
                named.extend((f"{field.name}.{i}", t) for i, t in enumerate(value))
        return named

    def _map(self, fn) -> "State":
        changes = {}
        for field in fields(self):
            value = getattr(self, field.name)
            changes[field.name] = fn(value) if isinstance(value, Tensor) else [fn(t) for t in value]
        return dataclasses.replace(self, **changes)

    @property
    def batch_size(self) -> int:
        return self._named_tensors()[0][1].shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._named_tensors())

    def to(self, device: torch.device | str) -> "State":
        return self._map(lambda t: t.to(device))

    def clone(self) -> "State":
        return self._map(lambda t: t.clone())

    def to_tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor dict, ready for safetensors (contiguous, on the CPU)."""
        return {name: t.detach().contiguous().cpu() for name, t in self._named_tensors()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "State":
        """Inverse of `to_tensors`. Raises ValueError naming what is missing or unexpected."""
        values: dict[str, Any] = {}
        used = set()
        for field in fields(cls):
            if field.name in tensors:
                values[field.name] = tensors[field.name]
                used.add(field.name)
                continue
            items = []
            while f"{field.name}.{len(items)}" in tensors:
                name = f"{field.name}.{len(items)}"
                items.append(tensors[name])
                used.add(name)
            if not items:
                raise ValueError(f"state tensor '{field.name}' is missing")
            values[field.name] = items
        unexpected = sorted(set(tensors) - used)
        if unexpected:
            raise ValueError(f"unexpected state tensors {unexpected}")
        return cls(**values)

    def split(self) -> list["State"]:
        """One batch-1 state per batch row."""
        return [self._map(lambda t, i=i: t[i : i + 1]) for i in range(self.batch_size)]

    def take(self, rows: list[int]) -> "State":
        """The batch rows at `rows`, in that order, as a new batch: what a batch keeps when some
        of its rows leave. A class may do it in fewer copies than splitting and concatenating."""
        parts = self.split()
        return type(self).concat([parts[i] for i in rows])

    def check_consistent(self) -> None:
        """Raise ValueError, naming the tensor, where this state's tensors disagree with each
        other (lengths of keys, values and masks). Nothing to check by default: a class whose
        tensors share a varying length overrides it."""

    def put_row(self, index: int, row: "State") -> bool:
        """Overwrite batch row `index` with the batch-1 state `row` in place and return True, or
        return False and change nothing where the class cannot (the default) or not for this
        row. Writing in place breaks the rule that states are values, so only the owner of a
        batch that nobody else can see may call it: the engine does, to give a row that joins
        the place a finished row left, instead of copying the whole batch."""
        return False

    @classmethod
    def concat(cls, states: list["State"]) -> "State":
        """Stack batch rows; the default needs equal shapes."""
        first = states[0]
        changes = {}
        for field in fields(first):
            value = getattr(first, field.name)
            if isinstance(value, Tensor):
                changes[field.name] = torch.cat([getattr(s, field.name) for s in states])
            else:
                changes[field.name] = [
                    torch.cat([getattr(s, field.name)[i] for s in states]) for i in range(len(value))
                ]
        return dataclasses.replace(first, **changes)


@dataclass
class FixedShapeState(State):
    """A State whose every tensor's shape is fixed by the model's config, never by the history
    (rings, look-back windows, running sums): rows of any histories stack with the default
    `concat`, `take` is one index per tensor, and any batch-1 row of the same model fits any
    place of a batch (`put_row`)."""

    def take(self, rows: list[int]) -> "State":
        """State.take in one indexing per tensor."""
        index = torch.tensor(rows, dtype=torch.long, device=self._named_tensors()[0][1].device)
        return self._map(lambda t: t.index_select(0, index))

    def put_row(self, index: int, row: "State") -> bool:
        """State.put_row: a batch-1 row whose tensors have this batch's names and row shapes is
        written in place; any other row (another model's) is refused, writing nothing. Not under
        autograd."""
        if torch.is_grad_enabled() or row.batch_size != 1:
            return False
        mine, theirs = self._named_tensors(), row._named_tensors()
        if [name for name, _ in mine] != [name for name, _ in theirs] or \
                any(a.shape[1:] != b.shape[1:] for (_, a), (_, b) in zip(mine, theirs)):
            return False
        for (_, a), (_, b) in zip(mine, theirs):
            a[index].copy_(b[0])
        return True


def last_positions(tokens: Tensor, lengths: Tensor | None) -> Tensor:
    """(B,) the position of each row's last token in a chunk (B, T): lengths[b] - 1 for
    right-padded rows, else T - 1."""
    B, T = tokens.shape
    return torch.full((B,), T - 1, device=tokens.device) if lengths is None else lengths.to(tokens.device) - 1


def rows_and_scores(log_probs: Tensor, tokens: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """From whole rows (B, T, V): each row's last one (B, V) (`last_positions`) and the
    log-probability of each next token of the chunk (B, T - 1) (`LanguageModel.forward_scored`)."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    next_rows = log_probs[rows, last_positions(tokens, lengths)]  # (B, V)
    scores = log_probs[:, :-1].gather(2, tokens[:, 1:, None])[..., 0]  # (B, T - 1)
    return next_rows, scores


class LanguageModel(nn.Module):
    """Base class of every architecture. Subclasses set the class attributes and implement
    `init_state` and `forward`."""

    architecture: ClassVar[str]  # registry name, e.g. "transformer-xl"
    config_class: ClassVar[type[ArchConfig]]
    state_class: ClassVar[type[State]]
    state_kind: ClassVar[str]  # "segment-recurrence", "continuous", "window", "linear", "none"
    state_grows_with_context: ClassVar[bool]
    # True: forward also takes `lengths` (B,), for a batch of chunks of different lengths, each
    # row right-padded to T: row b's tokens are tokens[b, :lengths[b]], its log-probabilities
    # past that are meaningless, and the state returned holds each row after its own tokens
    # only. The engine then prefills prompts of different lengths in one forward.
    ragged_chunks: ClassVar[bool] = False
    # where the served model departs from its paper, in a few sentences for the checkpoint's card
    # (the module docstring says it in full); None where it follows the paper
    departures_from_the_paper: ClassVar[str | None] = None

    config: ArchConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int | None:
        """Longest history the model can condition on, or None when unbounded."""
        return None

    @property
    def sliding_window(self) -> int | None:
        """`max_context` when the model goes on past it by forgetting its oldest bytes (a window
        that slides, as the vanilla transformer's); None when it is unbounded, or when
        max_context is where it stops (a longer history is refused, as the Reformer's)."""
        return self.max_context

    @property
    def history_limit(self) -> int | None:
        """The longest history a session can hold: max_context when the model stops there (the
        Reformer), None when it has no limit or slides past it (the vanilla window)."""
        return self.max_context if self.sliding_window is None else None

    @property
    def chunking_invariant(self) -> bool:
        """True when feeding a text in one call or in chunks of any size (one token at a time
        included) gives the same log-probabilities, to float tolerance: then a state may be
        resumed from after any token (sessions, the prefix cache) with the result of one pass.
        False (the safe default) where the architecture's semantics depend on the chunking."""
        return False

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def init_state(self, batch_size: int) -> State:
        raise NotImplementedError

    def forward(self, tokens: Tensor, state: State) -> tuple[Tensor, State]:
        """tokens (B, T) int64 -> float32 log-probabilities (B, T, V) of the next token after
        each position, and the state after these T tokens."""
        raise NotImplementedError

    def forward_scored(self, tokens: Tensor, state: State,
                       lengths: Tensor | None = None) -> tuple[Tensor, Tensor, State]:
        """`forward` for a prompt chunk whose whole rows are not needed: the log-probabilities
        (B, V) of the next token after each row's last token (position lengths[b] - 1, or T - 1),
        the log-probability (B, T - 1) of each next token of the chunk, tokens[b, t + 1], after
        position t, and the state. `lengths` as `forward` takes it (right-padded rows, only for a
        model with `ragged_chunks`); scores past a row's length mean nothing.

        The same numbers as `forward` (to float tolerance). This default computes every row,
        through `self(...)` (hooks and a patched forward see it); a model whose head can score a
        token without its whole row overrides it: Transformer-XL's adaptive softmax over 267,735
        words spends a third of a 128-token append on whole rows. The engine prefills through it
        (server/engine/scheduler.py), so a wrapper of a model's forward wraps this one too."""
        log_probs, state = self(tokens, state) if lengths is None else self(tokens, state, lengths=lengths)
        return rows_and_scores(log_probs, tokens, lengths) + (state,)

    # -- the size of a full memory --------------------------------------------------------------

    def full_state_bytes(self, floating_dtype: torch.dtype | None = None) -> int | None:
        """Bytes of one session's state once its memory is full: what a long session settles at
        (Transformer-XL's mem_len positions, a full window, running sums of fixed size), and for
        a state that grows until `history_limit` (the Reformer's) its bytes there; where a state
        is larger on the way (the vanilla window with its key/value cache, one byte short of
        full), that largest size, which budgets and the state-body limit must hold. None when the
        state grows without bound (XLNet with mem_len None). `floating_dtype`, when given, is the
        dtype floating tensors are counted in (the session cache's XLSERVE_STATE_DTYPE); integer
        and bool tensors keep their own.

        Computed from shapes, never by running the model (at real size a forward over a full
        memory would cost seconds at start-up): a fresh state gives every tensor's name, dtype
        and fixed dimensions (`_fixed_state_dims`), `_full_state_length` the length of the others
        once the memory is full. A fresh state of fixed shape is a full one's size already, so
        those architectures need nothing more (it costs one allocation of one session's state)."""
        total, fresh = 0, self.init_state(1)
        for name, tensor in fresh._named_tensors():
            shape = list(tensor.shape)
            for dim in sorted(set(range(1, tensor.dim())) - set(self._fixed_state_dims(name, tensor))):
                length = self._full_state_length(name)
                if length is None:
                    return None
                shape[dim] = length
            element = tensor.element_size()
            if floating_dtype is not None and tensor.is_floating_point():
                element = torch.empty(0, dtype=fresh.stored_dtype(name, floating_dtype)).element_size()
            total += math.prod(shape) * element
        return total

    def _full_state_length(self, name: str) -> int | None:
        """The length of state tensor `name`'s varying dimensions (the positions it holds) once
        the memory is full; None when it has no bound. Called only for tensors whose length
        varies (`_fixed_state_dims`), so each architecture with such tensors overrides it."""
        raise NotImplementedError(f"{type(self).__name__} has state tensors of varying length ('{name}') "
                                  "and must say how long they are when the memory is full")

    def step_bytes_beside_weights(self, positions: int) -> int:
        """Bytes a one-token decoding step after `positions` of history reads besides every
        weight (models/quantize.py `weight_bytes_per_step`) and the rows' states, shared by the
        rows of a batch as the weights are: tables derived from the weights, less the weights
        such tables stand in for (so it may be negative). The benches' bandwidth measure; 0
        unless an architecture says otherwise."""
        return 0

    # -- checking states that come from outside (imports, restores) ----------------------------
    # A state or a next-token row that the model could not have produced must be refused before
    # anything runs on it: a NaN in one session's memory would otherwise reach every request
    # batched with it. Each check raises ValueError naming the tensor at fault.

    def check_session(self, state: State, tokens: int, next_log_probs: Tensor | None) -> None:
        """Everything a session holds, checked together: its state (`check_state`, also against
        the number of tokens it has seen) and its next-token row (`check_next_log_probs`)."""
        self.check_state(state, tokens)
        self.check_next_log_probs(next_log_probs, tokens)

    def check_next_log_probs(self, next_log_probs: Tensor | None, tokens: int) -> None:
        """Raise ValueError unless `next_log_probs` is what this model's forward leaves after
        `tokens` tokens: None before the first token, else a finite float32 vector of vocab_size
        log-probabilities whose probabilities sum to 1."""
        if next_log_probs is None:
            if tokens > 0:
                raise ValueError("a state that has seen tokens needs next_log_probs")
            return
        if tokens == 0:
            raise ValueError("a state that has seen no tokens has no next_log_probs")
        if next_log_probs.dim() != 1 or next_log_probs.shape[0] != self.vocab_size \
                or next_log_probs.dtype != torch.float32:
            raise ValueError(f"next_log_probs must be a float32 vector of {self.vocab_size} values, "
                             f"got {next_log_probs.dtype} {tuple(next_log_probs.shape)}")
        if not all_finite(next_log_probs):
            raise ValueError("next_log_probs holds NaN or infinite values")
        total = float(torch.logsumexp(next_log_probs.double(), dim=0))
        if abs(total) > LOG_PROBS_SUM_TOLERANCE:
            raise ValueError(f"next_log_probs is not a log-distribution: its probabilities sum to "
                             f"exp({total:.4g}), not 1")

    def check_state(self, state: State, tokens: int | None = None) -> None:
        """Raise ValueError, naming the tensor at fault, when `state` could not have come from
        this model: wrong class or tensor names; a dtype, or a fixed dimension
        (`_fixed_state_dims`), other than a fresh state's; a floating tensor holding NaN or
        infinities; tensors whose lengths disagree (`State.check_consistent`); and, given
        `tokens`, a batch-1 state whose `position` (where it has one) is not that count or whose
        lengths do not fit it (`_check_tokens`). Sequence lengths may differ from a fresh state."""
        if not isinstance(state, self.state_class):
            raise ValueError(f"expected a {self.state_class.__name__}, got {type(state).__name__}")
        fresh = dict(self.init_state(1)._named_tensors())
        given = dict(state._named_tensors())
        if set(fresh) != set(given):
            raise ValueError(f"state tensors {sorted(given)} do not match {sorted(fresh)}")
        for name, expected in fresh.items():
            actual = given[name]
            if actual.dtype != expected.dtype or actual.dim() != expected.dim():
                raise ValueError(
                    f"state tensor '{name}' is {actual.dtype} with {actual.dim()} dims, "
                    f"expected {expected.dtype} with {expected.dim()}"
                )
            for dim in self._fixed_state_dims(name, expected):
                if actual.shape[dim] != expected.shape[dim]:
                    raise ValueError(
                        f"state tensor '{name}' has shape {tuple(actual.shape)}, "
                        f"dimension {dim} must be {expected.shape[dim]}"
                    )
        batch = state.batch_size
        for name, actual in given.items():
            if actual.shape[0] != batch:
                raise ValueError(f"state tensor '{name}' holds {actual.shape[0]} batch rows, the others {batch}")
            if actual.is_floating_point() and not all_finite(actual):
                raise ValueError(f"state tensor '{name}' holds NaN or infinite values")
        state.check_consistent()
        if tokens is not None:
            if tokens < 0:
                raise ValueError(f"a state cannot have seen {tokens} tokens")
            if batch != 1:
                raise ValueError(f"a session state has batch size 1, this one has {batch}")
            position = getattr(state, "position", None)  # the states that count their own tokens
            if isinstance(position, Tensor) and int(position[0]) != tokens:
                raise ValueError(f"state tensor 'position' says {int(position[0])} tokens, the session has seen {tokens}")
            self._check_tokens(state, tokens)

    def _check_tokens(self, state: State, tokens: int) -> None:
        """Raise ValueError when the batch-1 `state` does not fit having seen `tokens` tokens,
        beyond what `check_state` checks for every state (a `position` tensor equal to the count);
        an architecture whose state says more about its history overrides it."""

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        """Dimensions of a state tensor that never change (all but batch by default)."""
        return range(1, fresh.dim())
