"""What the session cache tells its callers: its exceptions and `SessionInfo`.

Free of torch, so the API process, which never holds a model, imports them without it.
"""

from __future__ import annotations

from dataclasses import dataclass


class CacheError(Exception):
    """Base of every error the session cache raises to the API (mapped to statuses in one
    place: server/api/errors.py `ERROR_KINDS`)."""

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id


class _SessionError(CacheError):
    def __init__(self, session_id: str):
        super().__init__(session_id, session_id)


class SessionNotFound(_SessionError, LookupError):
    pass


class SessionLocked(_SessionError):
    """The session is in use by another request."""


class SessionConflict(_SessionError):
    """Another replica committed the session since this request started; nothing was written."""


class CacheFull(CacheError):
    """No room: every session that could move out of the way is in use, or storage is full."""


class SessionUnavailable(CacheError):
    """The session exists but cannot be served now (its model is not loaded, its state is
    corrupt, or a store is unreachable)."""


class SessionTooLarge(CacheError):
    """The session's state is larger than the whole budget of a tier it must live in (the
    model's device, or the last tier): no retry can make it fit, unlike CacheFull."""


class CommitOutcomeUnknown(CacheError):
    """A store did not answer a write in time, nor, within the settle wait, the question whether
    the write landed: the change may or may not be in the session. The client checks the
    session's version and tokens (or retries with the same Idempotency-Key, which applies at most
    once)."""


class IdempotencyKeyReused(CacheError):
    """An Idempotency-Key already used on this session for a different request."""


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
    in_use: bool = False

    def public(self) -> dict:
        return {
            "id": self.id, "object": "session", "model": self.model, "tokens": self.tokens,
            "state_bytes": self.state_bytes, "tier": self.tier, "version": self.version,
            "in_use": self.in_use, "created_at": self.created_at, "last_used_at": self.last_used_at,
        }


class CorruptState(ValueError):
    """A blob that is not a readable xlserve session (bad header, failed checksum)."""
