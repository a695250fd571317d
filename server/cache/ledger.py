"""The idempotency ledger: what a session remembers of the requests that changed it (docs/design.md
section 6, "At most once").

A request that changes a session may carry an Idempotency-Key, sent with a fingerprint of the
request ({key, fingerprint}). The session remembers its most recent IDEMPOTENCY_KEYS_PER_SESSION
keys, newest first, each as an entry {key, fingerprint, result, version, tokens, at}: the answer the
request got, and the session's version and tokens after it. The same key with the same fingerprint
is answered from the entry (a Replay) instead of being applied again; the same key with another
fingerprint is IdempotencyKeyReused (422). A delete with a key leaves a tombstone (the owner and the
keys) for TOMBSTONE_SECONDS, so that its retry gets the first answer rather than a 404.

Only decisions here, no I/O: the entries live in the session's durable copy, written in the same
atomic write as the change they belong to (durable.py: the file's metadata, or a field of the Redis
hash that the write script updates).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

from xlserve.server.cache.errors import IdempotencyKeyReused, SessionInfo

IDEMPOTENCY_KEYS_PER_SESSION = 32  # the most recent Idempotency-Keys a session remembers (README)
# ... and at most this many bytes of them (each entry as its JSON line, `entry_line`), the newest
# whatever its size: a remembered answer may hold 1 MiB (generation.py REMEMBERED_ANSWER_BYTES),
# and the entries ride in every write of the session and in the books' memory of it, uncounted
# by the budgets (32 of 1 MiB made a commit re-encode 32 MiB under the cache's lock)
REMEMBERED_BYTES_PER_SESSION = 2 << 20
TOMBSTONE_SECONDS = 24 * 3600  # how long a delete's Idempotency-Key is remembered


@dataclass
class Replay:
    """The answer of an operation whose Idempotency-Key was seen before: its remembered entry."""

    entry: dict


def remembered_entry(remembered: list[dict], idempotency: dict | None, session_id: str) -> dict | None:
    """The entry of `idempotency`'s key among a session's remembered ones; IdempotencyKeyReused
    when the key was used for a different request (another fingerprint)."""
    if idempotency is None:
        return None
    for entry in remembered:
        if entry.get("key") == idempotency["key"]:
            if entry.get("fingerprint") != idempotency["fingerprint"]:
                raise IdempotencyKeyReused(
                    f"Idempotency-Key '{idempotency['key']}' was already used on session '{session_id}' for a "
                    "different request; send a new key with a new request", session_id)
            return entry
    return None


def new_entry(idempotency: dict, result: dict, version: int, tokens: int, at: float | None = None) -> dict:
    """What a session remembers of a request with `idempotency` ({key, fingerprint}): its first
    `result`, and the session's `version` and `tokens` after it."""
    return {"key": idempotency["key"], "fingerprint": idempotency["fingerprint"], "result": result,
            "version": version, "tokens": tokens, "at": time.time() if at is None else at}


def commit_entry(remember: dict, committed: SessionInfo, at: float) -> dict:
    """What a session remembers of a commit with `remember` ({key, fingerprint, result}): the
    request's `result`, or when that is None the commit's own info as the client gets it."""
    result = remember.get("result")
    if result is None:
        result = dataclasses.asdict(committed)
    return new_entry(remember, result, committed.version, committed.tokens, at)


def entry_line(entry: dict) -> str:
    """An Idempotency-Key entry as one line of JSON (JSON escapes every newline inside; ASCII, so
    its length is its bytes, as Redis's scripts count them)."""
    return json.dumps(entry, separators=(",", ":"))


def kept(entry: dict, remembered: list[dict]) -> list[dict]:
    """The remembered entries once `entry` is added: newest first, the oldest dropped past
    IDEMPOTENCY_KEYS_PER_SESSION entries or REMEMBERED_BYTES_PER_SESSION bytes (stores.py's
    scripts keep the same ones in Redis)."""
    out, total = [entry], len(entry_line(entry))
    for older in remembered:
        size = len(entry_line(older))
        if len(out) >= IDEMPOTENCY_KEYS_PER_SESSION or total + size > REMEMBERED_BYTES_PER_SESSION:
            break
        out.append(older)
        total += size
    return out


def deleted_before(tombstone: tuple[str | None, list[dict]] | None, owner: str | None,
                   idempotency: dict | None, session_id: str) -> Replay | None:
    """A delete retried with its Idempotency-Key: the Replay of the first one, from the session's
    `tombstone` (owner, remembered entries); None when there is none for this owner and key."""
    if idempotency is None or tombstone is None or tombstone[0] != owner:
        return None
    entry = remembered_entry(tombstone[1], idempotency, session_id)
    return None if entry is None else Replay(entry)
