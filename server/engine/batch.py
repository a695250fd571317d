"""How the engine lays rows out in batches (engine process, the engine's worker thread).

Batching goes through the model's `State` interface only, so it works for every architecture:
rows are concatenated with `State.concat` and taken apart with `State.split`. A state class that
overrides `concat` (Transformer-XL pads memories of different lengths and masks the padding)
batches any rows together; one that keeps the default (equal shapes) is batched in groups of
rows whose state shapes agree; and a class whose concat turns out to fail runs row by row.

Decoding rows live in `Group`s: rows decoded together, with their concatenated state. A group
is kept from step to step, because re-forming it costs a copy of every row's state, and rows end
and begin at different steps. A row that leaves leaves its place idle where the class can write
a row in place (`State.put_row`), and the next row to join is written there; otherwise, and
once idle places have cost about a copy, the rows that stay are taken out in one `State.take`,
and rows that join are concatenated onto them.

A row here is anything with `state` (its own state between steps, None while it lives in a
group), `pending` (the token to feed next), `finish_reason` (set: it leaves after this step) and
`keeps_state` (its final state must survive the group: a session's new state); the engine's is
`server/engine/request.py`'s `Row`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from xlserve.models.allocation import out_of_memory
from xlserve.models.interface import State
from xlserve.server.engine.request import Row

IDLE_PLACE_STEPS = 16  # a group drops its idle places once they have cost this many row-steps, about a copy


@dataclass
class Group:
    """Rows decoded together: row i of `state` is rows[i]. None in rows is an idle place, kept
    for the next row to join (see `BatchLayout._leave`)."""

    rows: list[Row | None]
    state: State
    key: tuple  # rows whose states have this key may join
    idle_steps: int = 0  # row-steps spent decoding idle places since the group last dropped them

    @property
    def live(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    def pending_tokens(self, device: torch.device) -> torch.Tensor:
        """(B, 1): each row's pending token; an idle place decodes a 0, which nobody reads."""
        return torch.tensor([[0 if row is None else row.pending] for row in self.rows], device=device)

    def split(self) -> list[State]:
        """One state per place, views into the group's state."""
        return [self.state] if len(self.rows) == 1 else self.state.split()


class BatchLayout:
    """Which states batch together, and the engine's decoding groups from one step to the next."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.groups: list[Group] = []  # the groups that decode on at the next step
        self.ragged: dict[type, bool] = {}  # state class -> its concat takes rows of different shapes

    # -- which states batch together -------------------------------------------------------

    def key(self, state: State) -> tuple:
        """States with equal keys may be concatenated: any two of a class whose concat pads (it
        overrides State.concat), else those whose tensors have equal shapes."""
        cls = type(state)
        ragged = self.ragged.get(cls)
        if ragged is None:
            ragged = self.ragged[cls] = cls.concat.__func__ is not State.concat.__func__
        if ragged:
            return (cls,)
        return (cls, tuple(tuple(tensor.shape[1:]) for tensor in state_tensors(state)))

    def concat(self, states: list[State]) -> State | None:
        """The states as one batch, or None where the class refuses them (from then on its rows
        are batched by shape). Running out of memory is not a refusal: that batch is not made,
        and the class's rows of different shapes go on batching together at the next step."""
        try:
            return type(states[0]).concat(states)
        except (RuntimeError, ValueError, MemoryError) as error:
            if not out_of_memory(error):
                self.ragged[type(states[0])] = False
            return None

    def batches(self, items: list, state_of) -> list[list]:
        """Split items into lists whose states may be concatenated, up to max_batch_size each."""
        by_key: dict[tuple, list] = {}
        for item in items:
            by_key.setdefault(self.key(state_of(item)), []).append(item)
        return [members[start : start + self.max_batch_size]
                for members in by_key.values() for start in range(0, len(members), self.max_batch_size)]

    # -- decoding groups ---------------------------------------------------------------------

    def arrange(self, rows: list[Row]) -> list[Group]:
        """The groups that feed `rows` their pending tokens this step: last step's groups, less
        the rows that are not among `rows` (cancelled, failed, finished unforwarded), and the
        rows that are in none (new, or holding their own state) joined to them or grouped
        anew. Each group the caller runs goes back through `stepped`."""
        groups, loose = self._keep_groups(rows)
        for batch in self.batches(loose, lambda row: row.state):
            self._place(batch, groups)
        for group in groups:
            if group.idle_steps >= IDLE_PLACE_STEPS:
                self._compact(group)
        self.groups = []
        return groups

    def stepped(self, group: Group, state: State) -> None:
        """`group` ran a step and its state is now `state`: its finished rows leave, and it
        decodes on at the next step unless nobody is left in it."""
        group.state, group.key = state, self.key(state)  # shapes may have grown
        group.idle_steps += len(group.rows) - len(group.live)
        finished = [row for row in group.live if row.finish_reason is not None]
        if (not finished or self._leave(group, finished)) and group.live:
            self.groups.append(group)
        # else: empty, or broken up with every row holding its own state (those still decoding
        # are grouped afresh at the next step)

    def clear(self) -> None:
        """Let go of every group (nothing decodes, or the step failed)."""
        self.groups = []

    def _keep_groups(self, rows: list[Row]) -> tuple[list[Group], list[Row]]:
        """(last step's groups with only `rows` left in them, the rows of `rows` in no group)."""
        wanted = {id(row) for row in rows}
        groups, loose = [], []
        for group in self.groups:
            leaving = [row for row in group.live if id(row) not in wanted]
            if leaving and not self._leave(group, leaving):
                loose += [row for row in group.live if id(row) in wanted]  # broken up: each holds its state
                continue
            if group.live:
                groups.append(group)
        placed = {id(row) for group in groups for row in group.live} | {id(row) for row in loose}
        return groups, loose + [row for row in rows if id(row) not in placed]

    def _place(self, batch: list[Row], groups: list[Group]) -> None:
        """Put rows that may be concatenated into a group: into idle places or onto the end of
        a group of theirs that has room, else into a new group (one per row where their class
        refuses to concatenate them)."""
        key = self.key(batch[0].state)
        target = next((g for g in groups if g.key == key and len(g.live) + len(batch) <= self.max_batch_size), None)
        if target is not None:
            batch = self._join_idle_places(target, batch)
            if not batch:
                return
            merged = self.concat([target.state, *(row.state for row in batch)]) if self._compact(target) else None
            if merged is not None:
                target.state, target.rows = merged, target.rows + batch
                for row in batch:
                    row.state = None
                return
        state = batch[0].state if len(batch) == 1 else self.concat([row.state for row in batch])
        if state is None:
            groups.extend(Group(rows=[row], state=row.state, key=self.key(row.state)) for row in batch)
        else:
            groups.append(Group(rows=list(batch), state=state, key=key))
        for row in batch:
            row.state = None

    def _leave(self, group: Group, leaving: list[Row]) -> bool:
        """`leaving` rows leave `group`, each with its own state where it keeps one.

        Where the state class writes a row in place (State.put_row) and the group has places to
        spare, a row's place stays in the batch, idle: it decodes a dummy token, a small share of
        the step, until a joining row takes it (`_join_idle_places`, a copy of one row) or the
        idle places have cost IDLE_PLACE_STEPS row-steps, about a copy of the batch, and are
        dropped (`_compact`). A leaving row then gets a copy of its state, and only where it
        keeps it, for its place may be written over. Otherwise the rows that stay are taken out
        at once (State.take), and the rows that leave keep views into the old state, which the
        group no longer writes. False when the class cannot take rows out either: the group is
        broken up and every row holds its own state."""
        going = {id(row) for row in leaving}
        places = type(group.state).put_row is not State.put_row and len(group.rows) > 1
        kept = [row for row in leaving if row.keeps_state]
        states = group.split() if kept or not places else None
        for i, row in enumerate(group.rows):
            if row is not None and id(row) in going:
                if places and row in kept:
                    try:  # its own copy: a failure (out of memory) is that row's request's alone
                        row.state = states[i].clone()
                    except Exception as error:  # noqa: BLE001 - handed to the scheduler, which fails that request
                        row.state, row.state_error = None, error
                else:
                    row.state = None if places else states[i]
                group.rows[i] = None
        if places or self._compact(group):
            return True
        for row, state in zip(group.rows, states):
            if row is not None:
                row.state = state
        return False

    def _join_idle_places(self, group: Group, batch: list[Row]) -> list[Row]:
        """Write joining rows into the group's idle places (State.put_row); returns the rows
        that found none, or did not fit the one they found."""
        remaining = []
        for row in batch:
            place = next((i for i, other in enumerate(group.rows) if other is None), None)
            try:
                fits = place is not None and group.state.put_row(place, row.state)
            except (RuntimeError, ValueError):
                fits = False
            if fits:
                group.rows[place], row.state = row, None
            else:
                remaining.append(row)
        if None not in group.rows:
            group.idle_steps = 0
        return remaining

    def _compact(self, group: Group) -> bool:
        """Drop the group's idle places: its live rows, taken out in one State.take. False, with
        the group unchanged, where the class cannot."""
        indices = [i for i, row in enumerate(group.rows) if row is not None]
        if len(indices) == len(group.rows):
            return True
        if not indices:  # nobody left: the caller drops the group
            group.rows, group.idle_steps = [], 0
            return True
        try:
            state = group.split()[indices[0]] if len(indices) == 1 else group.state.take(indices)
        except (RuntimeError, ValueError):
            return False
        group.rows, group.state, group.idle_steps = [group.rows[i] for i in indices], state, 0
        group.key = self.key(state)
        return True


def state_tensors(state: State) -> list[torch.Tensor]:
    """Every tensor of a state, in field order."""
    tensors = []
    for state_field in dataclasses.fields(state):
        value = getattr(state, state_field.name)
        tensors.extend([value] if isinstance(value, torch.Tensor) else value)
    return tensors
