"""The session cache: owns every session's model state and its bookkeeping.

A session is (model, state, token count, version, owner). A request takes a lease on its
session (one at a time: a second gets SessionBusy), works on a copy of the state, and either
commits the new state (the version goes up by one) or releases the lease, leaving the session
exactly as it was.

This first version keeps every state on the device where its model runs; tiers, byte budgets,
persistence and Redis come with the cache manager of issue 3 behind the same interface.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from models.interface import State


class SessionNotFound(LookupError):
    pass


class SessionLocked(RuntimeError):
    """The session is in use by another request."""


@dataclass
class SessionData:
    """What a session remembers: the model's state, how many tokens it has seen, and the
    distribution of the next token (needed to continue generating without a prompt)."""

    state: State
    tokens: int
    next_log_probs: torch.Tensor | None  # (V,) float32, None before the first token

    def nbytes(self) -> int:
        extra = 0 if self.next_log_probs is None else self.next_log_probs.numel() * 4
        return self.state.nbytes() + extra


@dataclass
class SessionInfo:
    id: str
    model: str
    owner: str | None
    tokens: int
    version: int
    state_bytes: int
    tier: str
    created_at: float
    last_used_at: float

    def public(self) -> dict:
        return {
            "id": self.id, "object": "session", "model": self.model, "tokens": self.tokens,
            "state_bytes": self.state_bytes, "tier": self.tier, "version": self.version,
            "created_at": self.created_at, "last_used_at": self.last_used_at,
        }


@dataclass
class _Entry:
    info: SessionInfo
    data: SessionData
    leased: bool = False


@dataclass
class Lease:
    """A request's hold on a session: `data` is the committed state it starts from."""

    session_id: str
    version: int
    data: SessionData
    info: SessionInfo
    done: bool = field(default=False)


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)  # 128 random bits


class SessionCache:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def create(self, model: str, owner: str | None, data: SessionData) -> SessionInfo:
        now = time.time()
        info = SessionInfo(
            id=new_session_id(), model=model, owner=owner, tokens=data.tokens, version=0,
            state_bytes=data.nbytes(), tier="device", created_at=now, last_used_at=now,
        )
        with self._lock:
            self._entries[info.id] = _Entry(info=info, data=data)
        return info

    def _entry(self, session_id: str, owner: str | None) -> _Entry:
        entry = self._entries.get(session_id)
        if entry is None or entry.info.owner != owner:  # another key's session does not exist for you
            raise SessionNotFound(session_id)
        return entry

    def info(self, session_id: str, owner: str | None) -> SessionInfo:
        with self._lock:
            return self._entry(session_id, owner).info

    def acquire(self, session_id: str, owner: str | None) -> Lease:
        with self._lock:
            entry = self._entry(session_id, owner)
            if entry.leased:
                raise SessionLocked(session_id)
            entry.leased = True
            return Lease(session_id, entry.info.version, entry.data, entry.info)

    def commit(self, lease: Lease, data: SessionData) -> SessionInfo:
        with self._lock:
            entry = self._entries[lease.session_id]
            entry.data = data
            entry.info.tokens = data.tokens
            entry.info.state_bytes = data.nbytes()
            entry.info.version += 1
            entry.info.last_used_at = time.time()
            entry.leased = False
            lease.done = True
            return entry.info

    def release(self, lease: Lease) -> None:
        """End a lease without changing the session (cancel, disconnect, error)."""
        with self._lock:
            if lease.done:
                return
            entry = self._entries.get(lease.session_id)
            if entry is not None:
                entry.leased = False
                entry.info.last_used_at = time.time()
            lease.done = True

    def delete(self, session_id: str, owner: str | None) -> None:
        with self._lock:
            entry = self._entry(session_id, owner)
            if entry.leased:
                raise SessionLocked(session_id)
            del self._entries[session_id]

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return [e.info for e in self._entries.values()]

    def close(self) -> None:
        pass
