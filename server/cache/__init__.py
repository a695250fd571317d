"""Session state: the bookkeeping manager, the stores that move bytes, and the cache the API uses."""

from server.cache.codec import CorruptState, SessionData
from server.cache.manager import TIERS, CacheManager
from server.cache.session_cache import (
    CacheError,
    CacheFull,
    Lease,
    SessionCache,
    SessionConflict,
    SessionInfo,
    SessionLocked,
    SessionNotFound,
    SessionUnavailable,
)

__all__ = [
    "TIERS", "CacheError", "CacheFull", "CacheManager", "CorruptState", "Lease", "SessionCache", "SessionConflict",
    "SessionData", "SessionInfo", "SessionLocked", "SessionNotFound", "SessionUnavailable",
]
