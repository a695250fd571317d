"""The idempotency ledger (server/cache/ledger.py): remembered entries, replays, tombstones."""

import pytest

from xlserve.server.cache.errors import IdempotencyKeyReused, SessionInfo
from xlserve.server.cache.ledger import (
    IDEMPOTENCY_KEYS_PER_SESSION,
    REMEMBERED_BYTES_PER_SESSION,
    Replay,
    commit_entry,
    deleted_before,
    entry_line,
    kept,
    new_entry,
    remembered_entry,
)


def key(name: str, fingerprint: str = "request-a") -> dict:
    return {"key": name, "fingerprint": fingerprint}


def test_an_entry_holds_the_first_answer_and_the_session_after_it():
    entry = new_entry(key("k"), {"answer": 1}, version=3, tokens=12, at=5.0)
    assert entry == {"key": "k", "fingerprint": "request-a", "result": {"answer": 1}, "version": 3, "tokens": 12,
                     "at": 5.0}
    assert new_entry(key("k"), {}, 0, 0)["at"] > 0


def test_a_seen_key_is_found_another_request_with_it_is_refused():
    remembered = [new_entry(key("k1"), {"n": 1}, 1, 1), new_entry(key("k2"), {"n": 2}, 2, 2)]
    assert remembered_entry(remembered, None, "sess_a") is None  # no key: nothing to look up
    assert remembered_entry(remembered, key("k2"), "sess_a")["result"] == {"n": 2}
    assert remembered_entry(remembered, key("k3"), "sess_a") is None
    with pytest.raises(IdempotencyKeyReused, match="k1") as refused:
        remembered_entry(remembered, key("k1", "request-b"), "sess_a")
    assert refused.value.session_id == "sess_a"


def test_kept_is_newest_first_and_bounded():
    remembered = []
    for i in range(IDEMPOTENCY_KEYS_PER_SESSION + 5):
        remembered = kept(new_entry(key(f"k{i}"), {}, i, i), remembered)
    assert len(remembered) == IDEMPOTENCY_KEYS_PER_SESSION
    assert remembered[0]["key"] == f"k{IDEMPOTENCY_KEYS_PER_SESSION + 4}"
    assert remembered[-1]["key"] == "k5"  # the five oldest are forgotten


def test_a_delete_retried_with_its_key_is_answered_from_the_tombstone():
    tombstone = ("owner", [new_entry(key("d", "delete"), {}, 4, 9)])
    replay = deleted_before(tombstone, "owner", key("d", "delete"), "sess_a")
    assert isinstance(replay, Replay) and replay.entry["version"] == 4
    assert deleted_before(tombstone, "someone else", key("d", "delete"), "sess_a") is None  # not theirs
    assert deleted_before(tombstone, "owner", None, "sess_a") is None  # without the key: a plain 404
    assert deleted_before(None, "owner", key("d", "delete"), "sess_a") is None
    assert deleted_before(tombstone, "owner", key("other", "delete"), "sess_a") is None
    with pytest.raises(IdempotencyKeyReused):
        deleted_before(tombstone, "owner", key("d", "a-commit"), "sess_a")


def test_a_commits_entry_holds_the_requests_answer_or_else_the_commits_own():
    info = SessionInfo(id="sess_a", model="toy", owner=None, tokens=9, version=4, state_bytes=10, tier="device",
                       created_at=1.0, last_used_at=2.0, in_use=False)
    own = commit_entry({**key("k"), "result": None}, info, at=3.0)
    assert own["result"]["version"] == 4 and own["result"]["tier"] == "device" and (own["version"], own["tokens"]) == (4, 9)
    answered = commit_entry({**key("k"), "result": {"choices": []}}, info, at=3.0)
    assert answered["result"] == {"choices": []} and answered["at"] == 3.0


def test_kept_is_bounded_in_bytes_the_newest_whatever_its_size():
    """At most REMEMBERED_BYTES_PER_SESSION bytes of entries (their JSON lines): 32 answers of
    1 MiB rode in every write of the session and in the books' memory of it."""
    big = "x" * (REMEMBERED_BYTES_PER_SESSION // 3)
    remembered = []
    for i in range(5):
        remembered = kept(new_entry(key(f"k{i}"), {"text": big}, i, i), remembered)
    assert [entry["key"] for entry in remembered] == ["k4", "k3"]  # a third would pass the bound
    assert sum(len(entry_line(entry)) for entry in remembered) <= REMEMBERED_BYTES_PER_SESSION
    huge = new_entry(key("huge"), {"text": "y" * REMEMBERED_BYTES_PER_SESSION}, 9, 9)
    assert kept(huge, remembered) == [huge]  # the newest is kept, alone
    assert [entry["key"] for entry in kept(new_entry(key("small"), {}, 10, 10), [huge])] == ["small"]
