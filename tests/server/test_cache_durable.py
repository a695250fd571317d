"""The durable store (server/cache/durable.py): the last tier, disk or Redis, compare-and-set,
settling a write that got no answer, metadata records, heads and tombstones."""

from __future__ import annotations

import pytest

from xlserve.server.cache.codec import encode
from xlserve.server.cache.durable import DurableStore
from xlserve.server.cache.errors import (
    CacheFull,
    CommitOutcomeUnknown,
    SessionConflict,
    SessionNotFound,
    SessionUnavailable,
)
from xlserve.server.cache.ledger import new_entry
from xlserve.server.cache.manager import Record
from xlserve.server.cache.stores import DiskStore, RedisStore, StoreFull, StoreUnavailable
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from tests.server.cache_helpers import MODEL, data, same, size


def record(n: int = 10, version: int = 0, session_id: str = "sess_" + "a" * 32, **fields) -> Record:
    return Record(id=session_id, model="toy", owner=fields.get("owner"), nbytes=size(n), tokens=5, version=version,
                  created_at=1.5, last_used_at=2.5, remembered=fields.get("remembered", []))


def on_disk(tmp_path, redis=None, settle_s: float = 1.0) -> DurableStore:
    return DurableStore(DiskStore(tmp_path / "state"), redis, {"toy": MODEL}, settle_s)


def write(store: DurableStore, r: Record, seed: int, expected=None, entry=None) -> None:
    store.write(r, encode(data(10, seed), store.metadata(r)), expected, entry)


def test_a_disk_write_is_read_back_as_the_same_record_and_state(tmp_path):
    store = on_disk(tmp_path)
    kept = [new_entry({"key": "k", "fingerprint": "f"}, {"answer": 1}, 3, 5)]
    r = record(version=3, owner="owner", remembered=kept)
    write(store, r, seed=7)
    (session_id, meta), = store.open()  # indexed from the file's header
    again = DurableStore.record_from_meta(session_id, meta, {"disk"})
    assert (again.id, again.model, again.owner, again.nbytes, again.tokens, again.version, again.created_at,
            again.last_used_at, again.remembered) == (r.id, "toy", "owner", size(10), 5, 3, 1.5, 2.5, kept)
    assert same(store.decode(again, "disk", store.disk.read(r.id)), data(10, 7))
    assert store.tier == "disk" and store.head(r.id) is None and store.heads() is None  # no Redis, no heads


def test_decode_refuses_another_version_or_a_model_not_served(tmp_path):
    store = on_disk(tmp_path)
    r = record(version=3)
    write(store, r, seed=1)
    with pytest.raises(SessionUnavailable, match="expected version 4"):
        store.decode(record(version=4), "disk", store.disk.read(r.id))
    unserved = record(version=3)
    unserved.model = "gone"
    with pytest.raises(SessionUnavailable, match="does not serve"):
        store.decode(unserved, "disk", store.disk.read(r.id))


def test_running_out_of_memory_while_reading_a_state_is_no_sign_of_damage(tmp_path, monkeypatch, caplog):
    """Host RAM that runs out while a stored state is read back (torch's CPU allocator raises a
    plain RuntimeError, the class a tensor that does not fit raises too) fails that read alone
    with a 503 that says to retry: never "the stored state is unusable", which an operator would
    take for damage, and the same copy reads back once memory is there."""
    import logging

    from tests.models.helpers import allocator_refusal
    from xlserve.server.cache import durable
    from xlserve.server.cache.errors import SessionReadOutOfMemory

    store = on_disk(tmp_path)
    r = record(version=3)
    write(store, r, seed=1)
    blob = store.disk.read(r.id)
    materialise = durable.materialise

    def without_memory(*args):
        raise allocator_refusal()  # the CPU allocator's own failure, of a size the machine holds

    monkeypatch.setattr(durable, "materialise", without_memory)
    with caplog.at_level(logging.WARNING, logger="xlserve"), pytest.raises(SessionUnavailable) as refused:
        store.decode(r, "disk", blob)
    assert "ran out of memory" in str(refused.value) and "unusable" not in str(refused.value)
    assert isinstance(refused.value, SessionReadOutOfMemory) and refused.value.retry_after_seconds == 1
    assert not any("unusable" in line.getMessage() for line in caplog.records)
    monkeypatch.setattr(durable, "materialise", materialise)
    assert same(store.decode(r, "disk", blob), data(10, 1))


def test_a_disk_delete_with_a_key_leaves_a_tombstone_one_without_does_not(tmp_path):
    store = on_disk(tmp_path)
    first, second = record(owner="o"), record(session_id="sess_" + "b" * 32, owner="o")
    for r in (first, second):
        write(store, r, seed=0)
    entry = new_entry({"key": "d", "fingerprint": "delete"}, {}, 0, 5)
    store.delete(first, entry)
    store.delete(second, None)
    assert not store.disk.exists(first.id) and not store.disk.exists(second.id)
    assert store.tombstone(first.id) == ("o", [entry])
    assert store.tombstone(second.id) is None
    assert store.tombstone("../etc/passwd") is None


class ScriptedRedis:
    """Stands in for RedisStore in the settle tests: `put` answers from `puts` (a value or an
    exception), `settle` from `settles`."""

    def __init__(self, puts: list, settles: list):
        self.puts, self.settles, self.settled = puts, settles, 0

    @staticmethod
    def _answer(queue: list):
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def put(self, *args):
        return self._answer(self.puts)

    def settle(self, session_id: str, write_id: str) -> bool:
        self.settled += 1
        return self._answer(self.settles)


def test_a_write_without_an_answer_is_settled_either_way(tmp_path):
    lost = StoreUnavailable("timed out")
    landed = ScriptedRedis([lost], [StoreUnavailable("still paused"), True])  # silent once, then: it landed
    on_disk(tmp_path, landed).write(record(version=1), b"blob", expected=0)
    assert landed.settled == 2

    fenced = ScriptedRedis([lost], [False])  # not there, and now never will be
    with pytest.raises(SessionUnavailable, match="nothing was written"):
        on_disk(tmp_path, fenced).write(record(version=1), b"blob", expected=0)

    silent = ScriptedRedis([lost], [StoreUnavailable("paused")])
    with pytest.raises(CommitOutcomeUnknown, match="Idempotency-Key"):
        on_disk(tmp_path, silent, settle_s=0.3).write(record(version=1), b"blob", expected=0)
    assert silent.settled >= 2  # asked again, with backoff, for the whole settle wait


def test_compare_and_set_answers_conflict_full_and_fenced(tmp_path):
    with pytest.raises(SessionConflict):
        on_disk(tmp_path, ScriptedRedis([0], [True])).write(record(version=2), b"blob", expected=1)
    with pytest.raises(CacheFull, match="full"):
        on_disk(tmp_path, ScriptedRedis([StoreFull("OOM")], [True])).write(record(version=2), b"blob", expected=1)
    with pytest.raises(SessionUnavailable, match="refused as settled"):
        on_disk(tmp_path, ScriptedRedis([-1], [True])).write(record(version=2), b"blob", expected=1)


def test_redis_heads_fetch_remember_and_tombstones(tmp_path, redis_url):  # noqa: F811
    store = on_disk(tmp_path, RedisStore(redis_url, prefix="durable-test:"))
    assert store.tier == "redis"
    r = record(owner="o")
    write(store, r, seed=3)
    head = store.head(r.id)
    assert head.version == 0 and head.meta["owner"] == "o" and head.meta["nbytes"] == size(10)
    assert store.heads()[r.id][0] == 0
    assert same(store.fetch(r), data(10, 3))
    with pytest.raises(SessionConflict):
        write(store, record(version=1, owner="o"), seed=4, expected=5)  # Redis holds version 0, not 5
    with pytest.raises(SessionConflict):
        store.fetch(record(version=1))  # another replica's version: this record is stale

    entry = new_entry({"key": "f", "fingerprint": "fork"}, {"id": "x"}, 0, 5)
    assert store.remember(r.id, 0, entry) is True
    assert store.remember(r.id, 7, entry) is False  # not at that version any more
    assert store.head(r.id, remembered=True).remembered == [entry]

    deleted = new_entry({"key": "d", "fingerprint": "delete"}, {}, 0, 5)
    store.delete(r, deleted)
    assert store.head(r.id).version == -1  # gone, as every replica sees it
    assert store.tombstone(r.id) == ("o", [deleted, entry])
    with pytest.raises(SessionNotFound):
        store.fetch(r)
    with pytest.raises(SessionNotFound):
        store.head("not-a-session-id")
    store.close()
