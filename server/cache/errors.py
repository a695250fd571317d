"""What the session cache tells its callers: its exceptions and `SessionInfo`.

Free of torch, so the API process, which never holds a model, imports them without it. Each
exception declares what a client sees when it is raised (the attributes of `RegisteredError`,
server/errors.py); defining it registers it for the wire and the API's status table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from xlserve.server.errors import RegisteredError


class CacheError(RegisteredError, abstract=True):
    """Base of every error the session cache raises to the API."""

    default_param = "session_id"

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id

    def wire_fields(self) -> dict[str, Any]:
        return {"message": str(self), "session_id": self.session_id}

    @classmethod
    def from_wire_fields(cls, fields: dict[str, Any]) -> CacheError:
        return cls(fields.get("message", ""), fields.get("session_id"))


# The most of a session id an error message repeats: an id is "sess_" and 32 hex digits, and a
# request can name one of any length (a 1 MB `session_id` must not come back as a 1 MB 404)
SHOWN_ID_CHARS = 64


class _SessionError(CacheError, abstract=True):
    """An error about one session, made from its id alone; the client's message says which."""

    message_template: ClassVar[str] = "session '{session}'"

    def __init__(self, session_id: str):
        super().__init__(session_id, session_id)

    def client_message(self) -> str:
        session = self.session_id or ""
        if len(session) > SHOWN_ID_CHARS:
            session = f"{session[:SHOWN_ID_CHARS]}... ({len(session)} characters)"
        return self.message_template.format(session=session)

    @classmethod
    def from_wire_fields(cls, fields: dict[str, Any]) -> _SessionError:
        return cls(fields.get("session_id") or fields.get("message", ""))


class SessionNotFound(_SessionError, LookupError):
    http_status, error_type, default_code = 404, "not_found_error", "session_not_found"
    message_template = "session '{session}' does not exist"


class SessionLocked(_SessionError):
    """The session is in use by another request."""

    http_status, error_type, default_code = 409, "session_busy", "session_busy"
    message_template = "session '{session}' is busy with another request; retry when it finishes"


class SessionConflict(_SessionError):
    """Another replica committed the session since this request started; nothing was written."""

    http_status, error_type, default_code = 409, "conflict", "session_version_conflict"
    message_template = ("session '{session}' was changed by another request (another replica) since this one "
                        "started; nothing was written. Retry from the current version")


class CacheFull(CacheError):
    """No room: every session that could move out of the way is in use, or storage is full."""

    http_status, error_type, default_code = 503, "service_unavailable", "session_cache_full"
    retry_after_seconds = 1


class SessionQuotaExceeded(CacheError):
    """The API key already holds as many sessions as XLSERVE_MAX_SESSIONS_PER_KEY allows: a new
    one (create, import, fork) is refused until one of them is deleted. Not a 429: no wait frees
    a place, so a client that retries 429s by itself must not retry this."""

    http_status, error_type, default_code = 403, "permission_error", "session_quota_exceeded"
    default_param = None  # no field of the request is at fault


class SessionQuotaBusy(CacheError):
    """With XLSERVE_MAX_SESSIONS_PER_KEY and Redis, a replica makes one API key's new sessions one
    at a time (their count is a scan of Redis, which one made beside it would miss): another of
    the key's is being made, longer than the wait. A retry soon finds its turn."""

    http_status, error_type, default_code = 429, "rate_limit_error", "sessions_being_made"
    default_param = None
    retry_after_seconds = 1


class SessionUnavailable(CacheError):
    """The session exists but cannot be served now (its model is not loaded, its state is
    corrupt, or a store is unreachable)."""

    http_status, error_type, default_code = 503, "service_unavailable", "session_unavailable"


class SessionReadOutOfMemory(SessionUnavailable):
    """Memory (host RAM, or the device) ran out while the session's stored state was read back:
    the stored copy is fine, it is not set aside, and a retry may find the memory."""

    http_status, error_type, default_code = 503, "service_unavailable", "device_out_of_memory"
    retry_after_seconds = 1


class SessionTooLarge(CacheError):
    """The session's state is larger than the whole budget of a tier it must live in (the
    model's device, or the last tier): no retry can make it fit, unlike CacheFull (so no
    Retry-After)."""

    http_status, error_type, default_code = 413, "request_too_large", "session_too_large"


class CommitOutcomeUnknown(CacheError):
    """A store did not answer a write in time, nor, within the settle wait, the question whether
    the write landed: the change may or may not be in the session. The client checks the
    session's version and tokens (or retries with the same Idempotency-Key, which applies at most
    once). No Retry-After: a blind retry could apply the change twice."""

    http_status, error_type, default_code = 503, "service_unavailable", "commit_outcome_unknown"


class IdempotencyKeyReused(CacheError):
    """An Idempotency-Key already used on this session for a different request."""

    http_status, error_type, default_code = 422, "invalid_request_error", "idempotency_key_reused"
    default_param = "Idempotency-Key"  # a header, not a field of the body


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


class CorruptState(RegisteredError, ValueError):
    """A blob that is not a readable xlserve session (bad header, failed checksum). The cache and
    the engine process turn it into what the request did wrong (an invalid import) or into
    SessionUnavailable; one that escapes them is the server's fault: a 500 naming only the class."""

    internal = True
