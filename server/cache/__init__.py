from server.cache.manager import Lease, SessionCache, SessionData, SessionInfo, SessionLocked, SessionNotFound

__all__ = ["Lease", "SessionCache", "SessionData", "SessionInfo", "SessionLocked", "SessionNotFound"]
