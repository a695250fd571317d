"""Session state (docs/design.md section 6): the session cache that runs in the engine process, and
what it tells its callers.

Only the torch-free names are here: the exceptions and `SessionInfo` (errors.py), which the API
process imports without ever loading torch. What needs torch is imported from its own module:

    SessionCache, Lease, Replay     xlserve.server.cache.session_cache
    SessionData                     xlserve.server.cache.codec
    CacheManager, TIERS             xlserve.server.cache.manager
"""

from xlserve.server.cache.errors import (
    CacheError,
    CacheFull,
    CommitOutcomeUnknown,
    CorruptState,
    IdempotencyKeyReused,
    SessionConflict,
    SessionInfo,
    SessionLocked,
    SessionNotFound,
    SessionTooLarge,
    SessionUnavailable,
)

__all__ = [
    "CacheError", "CacheFull", "CommitOutcomeUnknown", "CorruptState", "IdempotencyKeyReused", "SessionConflict",
    "SessionInfo", "SessionLocked", "SessionNotFound", "SessionTooLarge", "SessionUnavailable",
]
