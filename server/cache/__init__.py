"""Session state: the bookkeeping manager, the stores that move bytes, and the session cache
(which runs in the engine process; docs/design.md section 6).

The exceptions and `SessionInfo` (server/cache/errors.py) are imported at once; the rest, which
needs torch, on first use, so that the API process never loads torch.
"""

from importlib import import_module

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

_LAZY = {"SessionData": "codec", "TIERS": "manager", "CacheManager": "manager", "Lease": "session_cache",
         "SessionCache": "session_cache"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"xlserve.server.cache.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'xlserve.server.cache' has no attribute {name!r}")


__all__ = [
    "TIERS", "CacheError", "CacheFull", "CacheManager", "CommitOutcomeUnknown", "CorruptState", "IdempotencyKeyReused",
    "Lease", "SessionCache", "SessionConflict", "SessionData", "SessionInfo", "SessionLocked", "SessionNotFound",
    "SessionTooLarge", "SessionUnavailable",
]
