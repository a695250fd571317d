"""Commits that cost the new tokens (issue 36): a model whose state grows or slides by appending
has each commit written as a delta block appended to the session's log (on disk and in Redis),
compacted into a new base when the log outgrows it. What must hold: the stored session is bit
for bit the state a whole write would have stored, through forks, deletes, evictions, restarts
and compactions; a kill -9 at any point of a log write or a compaction leaves a whole version;
replicas still compare-and-set on the version; an append writes about its new positions' bytes.
A compaction runs after the commit that made it due has been answered (compactor.py), under a
hold a request waits for, and with Redis compare-and-set on the version it writes back."""

import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from xlserve.models.interface import same_bits
from xlserve.models.registry import ARCHITECTURES
from xlserve.models.training.presets import PRESETS
from xlserve.server.cache import SessionConflict
from xlserve.server.cache.codec import SessionData, decode, encode, floating_dtypes, session_data
from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.metrics import Metrics
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from tests.server.test_cache_architectures import feed, tiny_model

REPO = Path(__file__).resolve().parents[2]
# the states that change as a whole: running sums (Performer), a continuous memory refitted at
# every segment (∞-former), compressed segment slots (Linformer), recurrent states (Mamba, RWKV);
# every other architecture's state grows or slides by appending, or overwrites ring slots
WHOLE = {"infinity-former", "performer", "linformer", "mamba", "mamba2", "rwkv"}
# the architectures with a tiny preset (one being added may not have one yet)
TINY = sorted(name for name in ARCHITECTURES if "tiny" in PRESETS.get(name, {}))


def identical(a: SessionData, b: SessionData) -> bool:
    """Bit for bit: tokens, every state tensor (names, dtypes, shapes, bits) and next_log_probs."""
    ta, tb = a.state.to_tensors(), b.state.to_tensors()
    if a.tokens != b.tokens or ta.keys() != tb.keys() or not all(same_bits(ta[n], tb[n]) for n in ta):
        return False
    if (a.next_log_probs is None) != (b.next_log_probs is None):
        return False
    return a.next_log_probs is None or same_bits(a.next_log_probs.cpu(), b.next_log_probs.cpu())


def stored(cache: SessionCache, session_id: str) -> SessionData:
    """The session as its last tier holds it (disk: base file and log; Redis: base and log), once
    the compactions behind the answers are done (read here without the session's hold)."""
    assert cache.compactions.wait_idle(timeout=60)
    if cache.redis is None:
        return cache.durable.read_disk(cache.manager.get(session_id))
    cache.info(session_id, None)  # a replica that has not seen it yet takes it into its books
    return cache.durable.fetch(cache.manager.get(session_id))


def full_write(data: SessionData, state_class) -> SessionData:
    """What a whole write of `data` reads back as: the reference the stored session must equal."""
    meta, tensors, next_log_probs = decode(encode(data, {"model": "m"}))
    return session_data(state_class, meta, tensors, next_log_probs)


def step(model, cache: SessionCache, session_id: str, tokens: list[int]) -> SessionData:
    """One append through the cache: acquire, run the model on the tokens, commit."""
    lease = cache.acquire(session_id, None)
    computed = lease.data.cast_state(floating_dtypes(model.init_state(1)))  # as the engine does
    new = feed(model, computed, tokens)[1]
    cache.commit(lease, new)
    return new.cast_state(cache.state_dtype)


@pytest.mark.parametrize("architecture", TINY)
def test_every_commit_stores_exactly_the_new_state(architecture, tmp_path):
    """Per architecture: each commit's delta applied to the old state is the new state, bit for
    bit, and the session read back from its base and log is the state a whole write stores; the
    architectures whose state changes as a whole write whole, the others write deltas."""
    model = tiny_model(architecture)
    assert model.state_class.commits_deltas() == (architecture not in WHOLE)
    cache = SessionCache(tmp_path / "state", None, None, None, compact_ratio=4.0)
    cache.open({"m": model})
    rng = random.Random(architecture)
    session_id = cache.create("m", None, SessionData(model.init_state(1), 0, None)).id
    for n in [40] + [rng.choice([1, 2, 3, 5, 9]) for _ in range(7)]:  # a prefill, then short appends
        tokens = [rng.randrange(model.vocab_size) for _ in range(n)]
        lease = cache.acquire(session_id, None)
        old = lease.data
        cache.release(lease)
        new = step(model, cache, session_id, tokens)
        changes = new.state.delta_from(old.state, len(tokens))
        if changes is not None:
            assert identical(SessionData(old.state.apply_delta(changes), new.tokens, new.next_log_probs), new)
        assert identical(stored(cache, session_id), full_write(new, model.state_class))
    kinds = cache.durable.written
    if architecture in WHOLE:
        assert set(kinds) == {"whole"}
    else:
        assert kinds["delta"][0] >= 3, kinds


@pytest.mark.parametrize("architecture", ["transformer-xl", "longformer"])
def test_deltas_of_a_bfloat16_state(architecture, tmp_path):
    """XLSERVE_STATE_DTYPE=bfloat16: the kept positions survive bfloat16 -> float32 -> bfloat16
    exactly, so the commit is still a delta, and it stores exactly the new state."""
    model = tiny_model(architecture)
    cache = SessionCache(tmp_path / "state", None, None, None, state_dtype=torch.bfloat16)
    cache.open({"m": model})
    session_id = cache.create("m", None, SessionData(model.init_state(1), 0, None)).id
    for n in (30, 7, 3, 12):
        new = step(model, cache, session_id, list(range(n)))
        assert identical(stored(cache, session_id), new)
    assert cache.durable.written["delta"][0] >= 2


def assert_books_count_the_logs(cache: SessionCache) -> None:
    """Every session's log on disk is in the books, and the disk's bytes are the states' and
    their logs': the disk's budget counts what the disk holds."""
    records = list(cache.manager.records.values())
    for record in records:
        assert record.disk_log_bytes == cache.durable.disk_log_bytes(record.id), record.id
    assert cache.manager.used("disk") == sum(r.nbytes + r.disk_log_bytes for r in records if "disk" in r.copies)


def run_random_operations(make_cache, models, tiers: list[str], seed: int, operations: int = 200) -> None:
    """`operations` random appends, forks, deletes, evictions and restarts on a cache; after each,
    a session's stored copy equals a whole write of what it should hold, and at the end all do,
    and each continues from exactly that state after a restart."""
    rng = random.Random(seed)
    cache = make_cache()
    expected: dict[str, tuple[str, SessionData]] = {}
    for name, model in models.items():
        data = feed(model, SessionData(model.init_state(1), 0, None), list(range(20)))[1]
        expected[cache.create(name, None, data).id] = (name, data)
    for _ in range(operations):
        op = rng.choices(["append", "fork", "delete", "evict", "restart"], weights=[60, 10, 6, 16, 4])[0]
        session_id = rng.choice(sorted(expected))
        name, data = expected[session_id]
        if op == "append":
            lease = cache.acquire(session_id, None)
            assert identical(lease.data, data)  # the cache hands out exactly the committed state
            cache.release(lease)
            tokens = [rng.randrange(256) for _ in range(rng.choice([1, 1, 2, 3, 8, 24]))]
            expected[session_id] = (name, step(models[name], cache, session_id, tokens))
        elif op == "fork":
            expected[cache.fork(session_id, None).id] = (name, data)
        elif op == "delete" and len(expected) > 2:
            cache.delete(session_id, None)
            del expected[session_id]
        elif op == "evict":
            cache.info(session_id, None)  # after a restart on Redis: into this replica's books first
            cache.move(session_id, rng.choice(tiers))  # waits for a compaction that holds the session
        elif op == "restart":
            cache.close()
            cache = make_cache()
        checked = rng.choice(sorted(expected))
        name, data = expected[checked]
        assert identical(stored(cache, checked), full_write(data, models[name].state_class)), (op, checked)
        assert_books_count_the_logs(cache)  # stored() waited for the compactions
    cache.close()
    cache = make_cache()
    for session_id, (name, data) in expected.items():
        assert identical(stored(cache, session_id), full_write(data, models[name].state_class))
        lease = cache.acquire(session_id, None)
        assert identical(lease.data, data)
        cache.release(lease)
    cache.close()


@pytest.fixture(scope="module")
def two_models():
    """A sliding memory (Transformer-XL) and ring buffers (Longformer)."""
    return {"xl": tiny_model("transformer-xl"), "lf": tiny_model("longformer")}


def test_random_operations_on_disk_equal_whole_writes(two_models, tmp_path):
    written = {}

    def make_cache():
        cache = SessionCache(tmp_path / "state", None, None, None, compact_ratio=1.0)
        cache.open(two_models)
        cache.durable.written = written  # one count across restarts
        return cache

    run_random_operations(make_cache, two_models, ["host", "disk"], seed=1)
    assert written["delta"][0] > 50 and written["compaction"][0] > 0 and written["fork"][0] > 0, written
    assert not any((tmp_path / "state").glob("*.corrupt"))


def test_random_operations_on_redis_equal_whole_writes(two_models, tmp_path, redis_url):  # noqa: F811
    written = {}

    def make_cache():
        cache = SessionCache(tmp_path / "state", None, None, None, redis_url=redis_url, compact_ratio=1.0)
        cache.open(two_models)
        cache.durable.written = written
        return cache

    run_random_operations(make_cache, two_models, ["host", "disk", "redis"], seed=2)
    assert written["delta"][0] > 50 and written["compaction"][0] > 0, written


# -- kill -9 in the middle of a log write or a compaction ------------------------------------------

CHILD = """
import sys
import torch
torch.set_num_threads(1)
from tests.server.test_cache_architectures import feed, tiny_model
from xlserve.server.cache.codec import floating_dtypes
from xlserve.server.cache.session_cache import SessionCache
state_dir, session_id, ratio, n = sys.argv[1:]
model = tiny_model("transformer-xl")
cache = SessionCache(state_dir, None, None, None, compact_ratio=float(ratio))
cache.open({"m": model})
if n == "fork":
    cache.fork(session_id, None)
else:
    lease = cache.acquire(session_id, None)
    cache.commit(lease, feed(model, lease.data, list(range(int(n))))[1])
print("acknowledged", flush=True)
"""


def log_to_ratio(cache: SessionCache, session_id: str) -> float:
    """The session's log over its base file, in bytes, on disk."""
    return cache.disk.log_bytes(session_id) / cache.disk.path(session_id).stat().st_size


def a_base_and_a_log_of_two_blocks(state_dir: Path) -> tuple:
    """A Transformer-XL session on disk with a base and a log of two blocks, its cache closed:
    (model, session id, its state, its log's bytes over its base's)."""
    model = tiny_model("transformer-xl")
    cache = SessionCache(state_dir, None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    session_id = cache.create("m", None, SessionData(model.init_state(1), 0, None)).id
    for n in (40, 5, 9):
        acknowledged = step(model, cache, session_id, list(range(n)))
    ratio = log_to_ratio(cache, session_id)
    cache.close()
    assert state_dir.joinpath(session_id + ".log").exists()
    return model, session_id, acknowledged, ratio


def assert_opens_as(state_dir: Path, model, session_id: str, version: int, expected: SessionData) -> None:
    """The directory opened again holds exactly `expected` as `version`, later commits go on from
    it (the log takes blocks again after a cut), and nothing corrupt or temporary is left."""
    cache = SessionCache(state_dir, None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    assert cache.info(session_id, None).version == version
    assert identical(stored(cache, session_id), expected)
    after = step(model, cache, session_id, list(range(3)))
    cache.close()
    cache = SessionCache(state_dir, None, None, None)
    cache.open({"m": model})
    assert identical(stored(cache, session_id), after)
    assert not list(state_dir.glob("*.corrupt")) and not list(state_dir.glob(".*.tmp"))


@pytest.mark.parametrize("point, ratio, lands", [
    ("log-write", 100.0, False),  # killed before the block's first byte
    ("log-write-torn", 100.0, False),  # half a block written: cut off on open
    ("log-synced", 100.0, True),  # the block is durable, the commit not yet answered
    ("compaction-temp", 0.01, False),  # the new base written under its temporary name
    ("compaction-renamed", 0.01, True),  # the new base in place, the old log not yet removed
])
def test_kill_9_during_a_log_write_or_a_compaction(point, ratio, lands, tmp_path):
    """A process is killed (SIGKILL) at `point` of a commit; the directory opened again holds
    exactly the last acknowledged version (or, past the point where the write is durable, the new
    one, whole, as with a whole write killed after its rename), and later commits go on from it."""
    state_dir = tmp_path / "state"
    model, session_id, acknowledged, _ = a_base_and_a_log_of_two_blocks(state_dir)
    child = subprocess.run([sys.executable, "-c", CHILD, str(state_dir), session_id, str(ratio), "6"], cwd=REPO,
                           env={**os.environ, "XLSERVE_TEST_CRASH_AT": point, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "acknowledged" not in child.stdout
    landed = feed(model, acknowledged, list(range(6)))[1]
    assert_opens_as(state_dir, model, session_id, 4 if lands else 3, landed if lands else acknowledged)


def test_kill_9_during_a_fork_on_disk(tmp_path):
    """Killed between the fork's log and the link to its base: the fork was never acknowledged,
    and the directory opened again holds the source alone, unchanged (the fork's log removed)."""
    model = tiny_model("transformer-xl")
    state_dir = tmp_path / "state"
    cache = SessionCache(state_dir, None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    session_id = cache.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(40)))[1]).id
    acknowledged = step(model, cache, session_id, [1, 2])
    cache.close()
    child = subprocess.run([sys.executable, "-c", CHILD, str(state_dir), session_id, "100", "fork"], cwd=REPO,
                           env={**os.environ, "XLSERVE_TEST_CRASH_AT": "fork-log", "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert len(list(state_dir.glob("sess_*.log"))) == 2  # the source's and the fork's, without its base
    cache = SessionCache(state_dir, None, None, None)
    assert cache.open({"m": model}) == 1
    assert sorted(p.name for p in state_dir.glob("sess_*")) == [f"{session_id}.log", f"{session_id}.safetensors"]
    assert identical(stored(cache, session_id), acknowledged)


def test_a_damaged_block_with_blocks_after_it_is_corruption_not_a_torn_tail(tmp_path):
    """Only the last block of a log can be torn (an append that was never acknowledged). A block
    whose header is damaged with a whole block after it is damage to acknowledged commits: read,
    it is refused (503), never served as the older version before it; committed on, the session
    is written whole (base and log replaced) from the state the cache holds; opened again, the
    session is moved aside with its log, nothing cut off."""
    from xlserve.server.cache import SessionUnavailable

    state_dir = tmp_path / "state"
    model, session_id, acknowledged, _ = a_base_and_a_log_of_two_blocks(state_dir)
    log = state_dir / f"{session_id}.log"
    damaged = bytearray(log.read_bytes())
    damaged[0] ^= 0xFF  # the first block's magic: its header no longer reads as a frame
    log.write_bytes(bytes(damaged))

    cache = SessionCache(state_dir, None, None, None, compact_ratio=100.0)
    assert cache.open({"m": model}) == 0  # not opened at the base's version
    assert sorted(p.name for p in state_dir.iterdir() if p.name != ".role") == [f"{session_id}.corrupt",
                                                                                f"{session_id}.log.corrupt"]
    assert (state_dir / f"{session_id}.log.corrupt").read_bytes() == bytes(damaged)  # nothing cut off
    cache.close()

    # the same damage while a cache runs with the session in its books
    model, session_id, acknowledged, _ = a_base_and_a_log_of_two_blocks(tmp_path / "running")
    cache = SessionCache(tmp_path / "running", None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    cache.release(cache.acquire(session_id, None))  # read while the log was whole: now on the device
    log = tmp_path / "running" / f"{session_id}.log"
    intact = log.read_bytes()
    log.write_bytes(bytes([intact[0] ^ 0xFF]) + intact[1:])
    with pytest.raises(SessionUnavailable):
        cache.durable.read_disk(cache.manager.get(session_id))
    after = step(model, cache, session_id, [3, 1, 4])  # from the state the cache holds, written whole
    assert cache.durable.written["compaction"][0] == 1 and not log.exists()
    assert identical(stored(cache, session_id), after)
    assert identical(after, feed(model, acknowledged, [3, 1, 4])[1])
    cache.close()


def test_a_write_that_landed_though_reported_failed_is_not_appended_to(tmp_path, monkeypatch):
    """A whole write whose rename landed but whose directory sync failed is answered 503 and the
    session stays at its version; the next commit is a change from that version, so it must not
    be appended after the landed base: it is written whole, and the disk holds exactly it."""
    from xlserve.server.cache import SessionUnavailable

    model, _, cache, session_id = a_session_with_one_delta(tmp_path, 5)  # version 1, a delta
    disk = cache.disk
    sync = disk._sync_directory

    def failing():
        raise OSError(5, "Input/output error")

    lease = cache.acquire(session_id, None)
    kept = lease.data
    monkeypatch.setattr(disk, "_sync_directory", failing)
    with pytest.raises(SessionUnavailable):
        cache.commit(lease, feed(model, lease.data, [8, 8, 8])[1], whole=True)  # the base lands, unacknowledged
    monkeypatch.setattr(disk, "_sync_directory", sync)
    cache.release(lease)
    assert cache.info(session_id, None).version == 1
    lease = cache.acquire(session_id, None)
    assert identical(lease.data, kept)
    after = feed(model, lease.data, [2, 7])[1]
    cache.commit(lease, after)  # a delta from version 1: the stored session is at 2
    assert "delta" not in cache.durable.written or cache.durable.written["delta"][0] == 1
    assert identical(stored(cache, session_id), after.cast_state(cache.state_dtype))
    cache.close()
    reopened = SessionCache(tmp_path / "state", None, None, None)
    reopened.open({"m": model})
    assert reopened.info(session_id, None).version == 2
    assert identical(stored(reopened, session_id), after.cast_state(reopened.state_dtype))
    reopened.close()


# -- replicas -----------------------------------------------------------------------------------


def test_two_replicas_race_with_delta_commits(tmp_path, redis_url):  # noqa: F811
    """Two replicas on one Redis commit deltas from the same version: one wins, the other gets
    SessionConflict and writes nothing; the loser then reads the winner's state (base and log)
    and commits a delta on top of it, and a compaction on one replica is read by the other."""
    model = tiny_model("transformer-xl")
    a = SessionCache(tmp_path / "a", None, None, None, redis_url=redis_url)
    b = SessionCache(tmp_path / "b", None, None, None, redis_url=redis_url, compact_ratio=0.05)
    a.open({"m": model})
    b.open({"m": model})
    session_id = a.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(30)))[1]).id
    step(model, a, session_id, [1, 2, 3])  # version 1, a delta

    lease_a, lease_b = a.acquire(session_id, None), b.acquire(session_id, None)  # both at version 1
    assert identical(lease_a.data, lease_b.data)
    mine = feed(model, lease_a.data, [7, 7])[1]
    theirs = feed(model, lease_b.data, [9, 9, 9])[1]
    a.commit(lease_a, mine)  # wins
    with pytest.raises(SessionConflict):
        b.commit(lease_b, theirs)
    b.release(lease_b)
    assert a.durable.written["delta"][0] == 2 and "delta" not in b.durable.written
    assert identical(stored(b, session_id), mine) and b.info(session_id, None).version == 2

    after_b = step(model, b, session_id, [4, 5])  # b's log would outgrow 5% of the base: compacted
    assert b.durable.written == {"compaction": [1, b.durable.written["compaction"][1]]}
    lease = a.acquire(session_id, None)
    assert identical(lease.data, after_b) and lease.version == 3
    a.release(lease)
    after_a = step(model, a, session_id, [6])  # a delta on b's new base
    assert a.durable.written["delta"][0] == 3
    assert identical(stored(b, session_id), after_a)
    a.close()
    b.close()


def test_a_session_made_anew_under_its_keyed_id_is_never_taken_for_the_old_one(tmp_path, redis_url):  # noqa: F811
    """A session made with an Idempotency-Key, deleted without one and made again with the key,
    has the same id and, after as many commits, the same version as before, with another state.
    A replica that still holds the old one must neither serve it nor append a delta computed from
    it onto the new base (nor write it whole over the new one): the commit id, not the version
    alone, says which state Redis holds (manager.py `Record.commit_id`)."""
    model = tiny_model("transformer-xl")
    a, b, c = (SessionCache(tmp_path / name, None, None, None, redis_url=redis_url) for name in "abc")
    for cache in (a, b, c):
        cache.open({"m": model})
    fresh = SessionData(model.init_state(1), 0, None)
    key = {"key": "made-twice", "fingerprint": "create m"}
    session_id = a.create("m", None, feed(model, fresh, list(range(30)))[1], idempotency=key).id
    step(model, a, session_id, [1, 2, 3])  # version 1 on a, which keeps it on its device
    stale = a.acquire(session_id, None)  # a request on a reads the old version 1 ...
    old = feed(model, stale.data, [4, 4])[1]

    b.delete(session_id, None)  # ... another replica deletes the session without a key ...
    made_again = c.create("m", None, feed(model, fresh, list(range(50, 90)))[1], idempotency=key)
    assert made_again.id == session_id and made_again.version == 0
    new = step(model, c, session_id, [5, 6])  # ... and a third makes it anew: version 1 again
    listed = {info.id: info for info in a.list_sessions(None)[0]}[session_id]  # a lists the new one
    assert (listed.version, listed.tokens, listed.created_at) == (1, new.tokens, c.info(session_id, None).created_at)

    with pytest.raises(SessionConflict):  # the delta from the old version 1 is not appended to the new one
        a.commit(stale, old)
    a.release(stale)
    assert identical(stored(c, session_id), new)
    lease = a.acquire(session_id, None)  # a's copy of the old version 1 is not served
    assert lease.version == 1 and identical(lease.data, new)
    a.release(lease)
    after = step(model, a, session_id, [7])  # a delta on the new base
    assert a.durable.written["delta"][0] >= 2
    assert identical(stored(c, session_id), after) and identical(stored(b, session_id), after)
    for cache in (a, b, c):
        cache.close()


def test_a_version_redis_lost_and_another_replica_wrote_again_is_not_appended_to(tmp_path, redis_url):  # noqa: F811
    """Redis acknowledged a's version 2 and then lost it (a failover with asynchronous
    replication); b wrote another version 2. a's copy of its own version 2 is not Redis's: a
    serves b's, and its next delta goes onto b's base."""
    import redis as redis_client

    model = tiny_model("transformer-xl")
    a, b = (SessionCache(tmp_path / name, None, None, None, redis_url=redis_url) for name in "ab")
    for cache in (a, b):
        cache.open({"m": model})
    session_id = a.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(30)))[1]).id
    step(model, a, session_id, [1, 2, 3])  # version 1
    server = redis_client.Redis.from_url(redis_url)
    key = a.redis.prefix + session_id
    snapshot = server.dump(key)
    step(model, a, session_id, [4, 4])  # version 2, acknowledged ...
    server.restore(key, 0, snapshot, replace=True)  # ... and lost
    theirs = step(model, b, session_id, [8, 8, 8])  # another version 2
    lease = a.acquire(session_id, None)
    assert lease.version == 2 and identical(lease.data, theirs)
    a.release(lease)
    after = step(model, a, session_id, [9])
    assert identical(stored(b, session_id), after)
    server.close()
    for cache in (a, b):
        cache.close()


# -- compactions behind the answer -----------------------------------------------------------------


def gate_compactions(cache: SessionCache):
    """Make the cache's compactions wait for the returned event before they write (the real
    compaction runs once it is set); the second value is set when one has begun waiting."""
    release, waiting = threading.Event(), threading.Event()
    compact = cache.durable.compact

    def gated(record, blob):
        waiting.set()
        assert release.wait(timeout=60)
        return compact(record, blob)

    cache.durable.compact = gated
    return release, waiting


def a_session_with_one_delta(tmp_path: Path, tokens: int, redis_url: str | None = None) -> tuple:  # noqa: F811
    """A Transformer-XL session on disk (or Redis, given its URL: 40 tokens, then one delta commit
    of `tokens`) in a cache that counts its metrics and compacts only past a ratio of 100:
    (model, metrics, cache, id)."""
    model = tiny_model("transformer-xl")
    metrics = Metrics()
    cache = SessionCache(tmp_path / "state", None, None, None, metrics=metrics, compact_ratio=100.0, redis_url=redis_url)
    cache.open({"m": model})
    session_id = cache.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(40)))[1]).id
    step(model, cache, session_id, list(range(tokens)))
    return model, metrics, cache, session_id


def test_a_compaction_runs_after_the_commit_is_answered_and_a_request_waits_for_it(tmp_path):
    """A commit whose log passes compact_ratio times its base answers after writing its delta
    block; the session is compacted next, in the background, under a hold that a request for it
    waits for (not a 409): the request then starts from exactly the committed state, and the
    disk holds one base and no log, counted so in the books."""
    model, metrics, cache, session_id = a_session_with_one_delta(tmp_path, 9)
    cache.durable.compact_ratio = log_to_ratio(cache, session_id)  # the next block takes the log past it
    release, waiting = gate_compactions(cache)
    committed = step(model, cache, session_id, list(range(6)))
    assert cache.durable.written["delta"][0] == 2 and "compaction" not in cache.durable.written  # answered first
    assert waiting.wait(timeout=60)  # the compaction holds the session now

    started, got = threading.Event(), {}

    def request():
        started.set()
        lease = cache.acquire(session_id, None)  # waits for the compaction's hold
        got["data"], got["compactions"] = lease.data, dict(cache.durable.written).get("compaction")
        cache.release(lease)

    thread = threading.Thread(target=request)
    thread.start()
    assert started.wait(timeout=60)
    thread.join(timeout=0.3)
    assert thread.is_alive()  # still waiting for the compaction
    release.set()
    thread.join(timeout=60)
    assert got["compactions"][0] == 1 and identical(got["data"], committed)
    assert cache.compactions.wait_idle(timeout=60)
    assert not cache.disk.log_path(session_id).exists()
    assert identical(stored(cache, session_id), full_write(committed, model.state_class))
    assert_books_count_the_logs(cache)
    sample = metrics.registry.get_sample_value
    assert sample("xlserve_session_compactions_total", {"model": "m", "outcome": "compacted"}) == 1
    assert sample("xlserve_session_compaction_seconds_count", {"model": "m"}) == 1
    assert sample("xlserve_session_compaction_seconds_sum", {"model": "m"}) >= 0.3  # it held the request back
    cache.close()


def test_a_session_in_use_is_not_compacted_and_its_log_stays_bounded(tmp_path):
    """A session that a request holds when its compaction's turn comes is skipped (its next
    commit asks again); a log that reaches LOG_SLACK times the ratio meanwhile is compacted by
    the commit itself."""
    from xlserve.server.cache.durable import LOG_SLACK

    model, metrics, cache, session_id = a_session_with_one_delta(tmp_path, 5)
    lease = cache.acquire(session_id, None)
    assert cache.compact(session_id) is False and cache.disk.log_path(session_id).exists()
    cache.release(lease)
    assert metrics.registry.get_sample_value("xlserve_session_compactions_total", {"model": "m", "outcome": "busy"}) == 1

    cache.compactions.close()  # no compaction behind the answers from here: only the slack bounds the log
    cache.durable.compact_ratio = log_to_ratio(cache, session_id) / (LOG_SLACK - 0.5)
    latest = None
    for _ in range(20):
        latest = step(model, cache, session_id, [3])
        if "compaction" in cache.durable.written:
            break
        assert log_to_ratio(cache, session_id) <= LOG_SLACK * cache.durable.compact_ratio
    assert cache.durable.written["compaction"][0] == 1 and not cache.disk.log_path(session_id).exists()
    assert identical(stored(cache, session_id), full_write(latest, model.state_class))


def test_a_compaction_behind_the_answer_never_overwrites_another_replicas_commit(tmp_path, redis_url):  # noqa: F811
    """With Redis a compaction writes the same version back, compare-and-set on it: a replica
    that committed between the answer and the compaction keeps its version, and the compaction
    gives way; one that comes in time leaves the session with its state, no log, same version."""
    model = tiny_model("transformer-xl")
    metrics = Metrics()
    a = SessionCache(tmp_path / "a", None, None, None, redis_url=redis_url, metrics=metrics, compact_ratio=100.0)
    b = SessionCache(tmp_path / "b", None, None, None, redis_url=redis_url)
    a.open({"m": model})
    b.open({"m": model})
    session_id = a.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(30)))[1]).id
    step(model, a, session_id, [1, 2, 3])
    base_bytes = len(a.redis.get_chain(session_id)[2])
    a.durable.compact_ratio = sum(map(len, a.redis.get_chain(session_id)[3])) / base_bytes  # the next block passes it
    release, waiting = gate_compactions(a)
    step(model, a, session_id, [4, 5])  # version 2, a delta; its compaction waits at the gate
    assert waiting.wait(timeout=60) and a.durable.written["delta"][0] == 2
    theirs = step(model, b, session_id, [6])  # b commits version 3 meanwhile
    release.set()
    assert a.compactions.wait_idle(timeout=60)
    assert "compaction" not in a.durable.written  # compare-and-set on version 2: given way
    assert metrics.registry.get_sample_value("xlserve_session_compactions_total",
                                             {"model": "m", "outcome": "moved_on"}) == 1
    version, _, _, log_blocks = a.redis.get_chain(session_id)
    assert version == 3 and len(log_blocks) == 3 and identical(stored(a, session_id), theirs)

    del a.durable.compact  # the gate off: the class's own compact again
    mine = step(model, a, session_id, [7])  # from b's version: its log is past the ratio, compacted after
    assert a.compactions.wait_idle(timeout=60) and a.durable.written["compaction"][0] == 1
    version, _, _, log_blocks = a.redis.get_chain(session_id)
    assert version == 4 and log_blocks == []
    assert identical(stored(b, session_id), mine)
    a.close()
    b.close()


BACKGROUND_CHILD = """
import sys
import threading
import torch
torch.set_num_threads(1)
from tests.server.test_cache_architectures import feed, tiny_model
from xlserve.server.cache.session_cache import SessionCache
state_dir, session_id, ratio = sys.argv[1:]
model = tiny_model("transformer-xl")
cache = SessionCache(state_dir, None, None, None, compact_ratio=float(ratio))
cache.open({"m": model})
answered, compact = threading.Event(), cache.durable.compact
cache.durable.compact = lambda record, blob: answered.wait(60) and compact(record, blob)  # after the print
lease = cache.acquire(session_id, None)
cache.commit(lease, feed(model, lease.data, list(range(6)))[1])
print("acknowledged", flush=True)
answered.set()
cache.compactions.wait_idle(timeout=60)  # killed in the compaction behind the answer
"""


@pytest.mark.parametrize("point", ["compaction-temp", "compaction-renamed"])
def test_kill_9_during_a_compaction_behind_the_answer(point, tmp_path):
    """The commit was answered (its delta block durable), then the process is killed in the
    compaction that followed it: the directory opened again holds exactly the answered version."""
    state_dir = tmp_path / "state"
    model, session_id, acknowledged, ratio = a_base_and_a_log_of_two_blocks(state_dir)  # a block of 6 passes it, not twice
    child = subprocess.run([sys.executable, "-c", BACKGROUND_CHILD, str(state_dir), session_id, repr(ratio)], cwd=REPO,
                           env={**os.environ, "XLSERVE_TEST_CRASH_AT": point, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "acknowledged" in child.stdout
    assert_opens_as(state_dir, model, session_id, 4, feed(model, acknowledged, list(range(6)))[1])


# -- what a commit costs -------------------------------------------------------------------------


def test_an_append_writes_about_its_new_positions(tmp_path):
    """An append of k tokens to a full Transformer-XL memory writes at most twice the bytes of
    its k new positions (keys, values and mask of every layer) plus a small header; the metric
    xlserve_session_commit_bytes_total{kind} counts the same bytes."""
    model = tiny_model("transformer-xl")
    metrics = Metrics()
    cache = SessionCache(tmp_path / "state", None, None, None, metrics=metrics, compact_ratio=100.0)
    cache.open({"m": model})
    full = feed(model, SessionData(model.init_state(1), 0, None), list(range(model.config.mem_len + 5)))[1]
    session_id = cache.create("m", None, full).id
    per_position = full.state.nbytes() // model.config.mem_len  # the memory is full: mem_len positions
    for k in (16, 1, 5):
        before = cache.durable.written.get("delta", [0, 0])[1]
        step(model, cache, session_id, list(range(k)))
        written = cache.durable.written["delta"][1] - before
        assert k * per_position < written <= 2 * k * per_position + 4096, (k, written, per_position)
    whole = cache.durable.written["whole"][1]
    assert whole > full.state.nbytes()  # the create: one whole write
    sample = metrics.registry.get_sample_value("xlserve_session_commit_bytes_total", {"model": "m", "kind": "delta"})
    assert sample == cache.durable.written["delta"][1]


def test_the_disk_budget_counts_the_logs_and_a_full_disk_compacts_before_it_refuses(tmp_path):
    """Where the disk is the last tier, a session's log counts against its budget with its state:
    without that, logs up to compact_ratio times their bases would fill a disk past its budget.
    A delta commit that would pass the budget is written whole instead, which removes the log;
    only a state that does not fit whole is refused."""
    from xlserve.server.cache import CacheFull

    model = tiny_model("transformer-xl")
    full = feed(model, SessionData(model.init_state(1), 0, None), list(range(model.config.mem_len + 5)))[1]
    budget = int(1.5 * full.nbytes())
    cache = SessionCache(tmp_path / "state", None, None, budget, compact_ratio=100.0)  # logs may grow long
    cache.open({"m": model})
    session_id = cache.create("m", None, full).id
    for _ in range(12):
        step(model, cache, session_id, list(range(8)))
        assert_books_count_the_logs(cache)
        record = cache.manager.get(session_id)
        assert cache.manager.used("disk") <= budget
        on_disk = sum(path.stat().st_size for path in (tmp_path / "state").glob(f"{session_id}.*"))
        assert on_disk <= budget + (64 << 10)  # the base file's header and the log's frames beside the books
    written = cache.durable.written
    assert written["delta"][0] >= 4 and written["whole"][0] >= 2, written  # the create, then compactions
    assert record.disk_log_bytes < budget - full.nbytes()
    # the books after a restart count the log found on disk
    cache.close()
    cache = SessionCache(tmp_path / "state", None, None, budget, compact_ratio=100.0)
    cache.open({"m": model})
    assert_books_count_the_logs(cache)
    # a second session whose state fits the budget whole but not beside the first: refused, nothing written
    with pytest.raises(CacheFull):
        cache.create("m", None, full)
    assert [p.name for p in (tmp_path / "state").glob("*.safetensors")] == [f"{session_id}.safetensors"]
    cache.close()


def a_session_with_a_log(model, full: SessionData, directory: Path) -> tuple[str, int, int]:
    """A session of `full` memory in `directory` with six delta commits in its log, written with
    no disk budget: (its id, its log's bytes, the disk's bytes used)."""
    cache = SessionCache(directory, None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    session_id = cache.create("m", None, full).id
    for i in range(6):
        step(model, cache, session_id, [i, i + 1])
    log_bytes, used = cache.manager.get(session_id).disk_log_bytes, cache.manager.used("disk")
    assert cache.durable.written["delta"][0] == 6 and log_bytes > 0
    cache.close()
    return session_id, log_bytes, used


def test_a_delta_books_its_whole_block_and_a_disk_over_budget_still_takes_commits_that_shrink_it(tmp_path):
    """A delta block holds more than the changed positions (the next-token row, the metadata):
    a commit books all of it, so a budget a few kB above the state is never passed. And a disk
    over its budget (a smaller budget after a restart) still takes a commit that does not grow
    it: a delta becomes a whole write, which removes the log, and is not refused."""
    from xlserve.server.cache import CacheFull

    model = tiny_model("transformer-xl")
    full = feed(model, SessionData(model.init_state(1), 0, None), list(range(model.config.mem_len + 5)))[1]
    budget = full.nbytes() + 8500
    cache = SessionCache(tmp_path / "tight", None, None, budget, compact_ratio=100.0)
    cache.open({"m": model})
    session_id = cache.create("m", None, full).id
    for i in range(12):
        step(model, cache, session_id, [i])
        assert cache.manager.used("disk") <= budget
        assert_books_count_the_logs(cache)
    cache.close()

    session_id, log_bytes, _ = a_session_with_a_log(model, full, tmp_path / "state")
    budget = full.nbytes() + log_bytes // 2  # the disk is now over its budget
    cache = SessionCache(tmp_path / "state", None, None, budget, compact_ratio=100.0)
    cache.open({"m": model})
    assert cache.manager.used("disk") > budget
    with pytest.raises(CacheFull):  # nothing new fits
        cache.create("m", None, full)
    step(model, cache, session_id, [7])  # not refused: written whole, it shrinks the disk
    assert cache.durable.written == {"whole": [1, cache.durable.written["whole"][1]]}
    assert cache.manager.get(session_id).disk_log_bytes == 0 and cache.manager.used("disk") <= budget
    assert_books_count_the_logs(cache)
    cache.close()


def test_a_fork_books_the_log_it_copies(tmp_path):
    """A fork on disk copies its source's log: its admission counts it, so a fork whose copy does
    not fit is refused with nothing written, and one that fits leaves the books equal to the files."""
    from xlserve.server.cache import CacheFull

    model = tiny_model("transformer-xl")
    full = feed(model, SessionData(model.init_state(1), 0, None), list(range(model.config.mem_len + 5)))[1]
    source, log_bytes, used = a_session_with_a_log(model, full, tmp_path / "state")
    # room for a second state but not for its copy of the log: refused, no file left behind
    cache = SessionCache(tmp_path / "state", None, None, used + full.nbytes() + log_bytes // 2, compact_ratio=100.0)
    cache.open({"m": model})
    with pytest.raises(CacheFull):
        cache.fork(source, None)
    assert len(list((tmp_path / "state").glob("*.safetensors"))) == 1 and cache.manager.used("disk") == used
    cache.close()
    cache = SessionCache(tmp_path / "state", None, None, used + full.nbytes() + 2 * log_bytes + 8192,
                         compact_ratio=100.0)
    cache.open({"m": model})
    fork = cache.fork(source, None).id
    assert cache.manager.get(fork).disk_log_bytes > log_bytes  # the copy and its metadata block
    assert_books_count_the_logs(cache)
    assert cache.manager.used("disk") <= cache.manager.budgets["disk"]
    cache.close()


def test_a_fork_shares_its_base_and_an_import_is_a_whole_write(tmp_path):
    """On disk a fork hard-links its source's base file and copies only its log (then goes its
    own way: the source's compaction or deletion leaves it whole); an import into a session
    (PUT) is a whole write, which removes the log it replaces."""
    model = tiny_model("transformer-xl")
    cache = SessionCache(tmp_path / "state", None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    source = cache.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(40)))[1]).id
    for n in (2, 3):
        state = step(model, cache, source, list(range(n)))
    fork = cache.fork(source, None).id
    base, fork_base = tmp_path / "state" / f"{source}.safetensors", tmp_path / "state" / f"{fork}.safetensors"
    assert base.stat().st_ino == fork_base.stat().st_ino and base.stat().st_nlink == 2
    assert cache.durable.written["fork"][1] < (tmp_path / "state" / f"{source}.log").stat().st_size + 4096
    assert identical(stored(cache, fork), state)
    forked = step(model, cache, fork, [5])
    imported = feed(model, SessionData(model.init_state(1), 0, None), list(range(9)))[1]
    cache.replace(source, None, imported)  # an import over the source: a new base of its own
    assert cache.durable.written["whole"][0] == 2 and not (tmp_path / "state" / f"{source}.log").exists()
    assert identical(stored(cache, source), imported)
    assert fork_base.stat().st_nlink == 1 and identical(stored(cache, fork), forked)
    cache.delete(source, None)
    cache.close()
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"m": model})
    assert identical(stored(cache, fork), forked)
    assert not list((tmp_path / "state").glob("*.corrupt"))


def test_the_servers_compact_ratio_is_the_caches_default():
    """XLSERVE_COMPACT_RATIO's default (server/settings.py) and the cache's own (durable.py, which
    says why) are one number: the cache imports nothing of the settings."""
    from xlserve.server.cache.durable import DEFAULT_COMPACT_RATIO
    from xlserve.server.settings import CacheSettings

    assert CacheSettings.model_fields["compact_ratio"].default == DEFAULT_COMPACT_RATIO
    import inspect

    assert inspect.signature(SessionCache).parameters["compact_ratio"].default == DEFAULT_COMPACT_RATIO



def test_a_fork_never_shares_a_write_that_was_answered_as_failed(tmp_path, monkeypatch):
    """A whole write whose rename landed but whose directory sync failed was answered as failed:
    the books stay at the last acknowledged version, the file holds the failed one. A fork made
    then is written whole from what the source holds, not linked to that file."""
    from xlserve.server.cache import SessionUnavailable
    from xlserve.server.cache.stores import DiskStore

    model = tiny_model("transformer-xl")
    cache = SessionCache(tmp_path / "state", None, None, None, compact_ratio=100.0)
    cache.open({"m": model})
    acknowledged = feed(model, SessionData(model.init_state(1), 0, None), list(range(40)))[1]
    source = cache.create("m", None, acknowledged).id
    lease = cache.acquire(source, None)
    failed = feed(model, SessionData(model.init_state(1), 0, None), list(range(7)))[1]  # not an append: a whole write
    sync = DiskStore._sync_directory
    monkeypatch.setattr(DiskStore, "_sync_directory", lambda self: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(SessionUnavailable):
        cache.commit(lease, failed)
    cache.release(lease)
    monkeypatch.setattr(DiskStore, "_sync_directory", sync)
    assert cache.info(source, None).version == 0
    fork = cache.fork(source, None).id
    assert identical(stored(cache, fork), full_write(acknowledged, type(acknowledged.state)))
    assert "fork" not in cache.durable.written  # written whole
    cache.close()


def test_a_fork_of_a_session_stored_in_another_dtype_is_written_in_the_caches(tmp_path):
    """A session stored in float32 before XLSERVE_STATE_DTYPE became bfloat16 keeps its file; a
    fork of it is counted in bfloat16, so it is written in bfloat16 (whole), not linked to the
    float32 file under metadata that says bfloat16."""
    model = tiny_model("transformer-xl")
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"m": model})
    source = cache.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(40)))[1]).id
    cache.close()
    cache = SessionCache(tmp_path / "state", None, None, None, state_dtype=torch.bfloat16)
    cache.open({"m": model})
    fork = cache.fork(source, None)
    cache.close()
    cache = SessionCache(tmp_path / "state", None, None, None, state_dtype=torch.bfloat16)
    cache.open({"m": model})
    lease = cache.acquire(fork.id, None)
    assert lease.data.nbytes() == fork.state_bytes == cache.info(fork.id, None).state_bytes
    assert {t.dtype for t in lease.data.state.to_tensors().values() if t.is_floating_point()} == {torch.bfloat16}
    cache.release(lease)
    cache.close()


def test_a_compaction_whose_old_log_stays_counts_it(tmp_path, monkeypatch):
    """A compaction's new base is written but the old log cannot be removed (its blocks name the
    old base: never read): the books count the log the disk still holds, not 0."""
    model = tiny_model("transformer-xl")
    cache = SessionCache(tmp_path / "state", None, None, None, compact_ratio=0.3)
    cache.open({"m": model})
    full = feed(model, SessionData(model.init_state(1), 0, None), list(range(model.config.mem_len + 5)))[1]
    session_id = cache.create("m", None, full).id
    unlink = Path.unlink

    def refuse_logs(path, missing_ok=False):
        if path.suffix == ".log":
            raise PermissionError(13, "Permission denied")
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_logs)
    for i in range(12):
        step(model, cache, session_id, [i, i + 1])
        assert cache.compactions.wait_idle(timeout=60)
        if cache.durable.written.get("compaction", [0])[0]:
            break
    assert cache.durable.written["compaction"][0] >= 1
    assert cache.durable.disk_log_bytes(session_id) > 0
    assert_books_count_the_logs(cache)
    monkeypatch.setattr(Path, "unlink", unlink)
    cache.close()


def test_a_commit_whose_state_cannot_be_kept_in_memory_still_answers_success(tmp_path, monkeypatch):
    """The write landed; keeping the new state on the device failed (out of memory). The client
    is told the commit succeeded (a failure would invite it to apply the change twice), and the
    session is read back from its durable copy when next used."""
    model = tiny_model("transformer-xl")
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"m": model})
    session_id = cache.create("m", None, feed(model, SessionData(model.init_state(1), 0, None), list(range(9)))[1]).id
    device = cache.placement._store("device")
    put = device.put
    monkeypatch.setattr(device, "put", lambda *arguments: (_ for _ in ()).throw(RuntimeError("out of memory")))
    new = step(model, cache, session_id, [1, 2, 3])
    monkeypatch.setattr(device, "put", put)
    info = cache.info(session_id, None)
    assert info.version == 1 and info.tier == "disk"
    lease = cache.acquire(session_id, None)
    assert identical(lease.data, new)
    cache.release(lease)
    cache.close()


def test_an_append_that_could_not_be_cut_off_is_rewritten_before_the_session_leaves_memory(tmp_path, monkeypatch):
    """A delta block was written but not synced, and cutting it off again failed too: the log may
    hold the version the client was told failed. The session's disk copy is in doubt: evicting it
    writes it whole from memory, so it is read back at its acknowledged version."""
    from xlserve.server.cache import SessionUnavailable

    model = tiny_model("transformer-xl")
    first = feed(model, SessionData(model.init_state(1), 0, None), list(range(40)))[1]
    cache = SessionCache(tmp_path / "state", first.nbytes() + 4096, 0, None, compact_ratio=100.0)
    cache.open({"m": model})
    session_id = cache.create("m", None, first).id
    acknowledged = step(model, cache, session_id, [1, 2])
    lease = cache.acquire(session_id, None)
    failed = feed(model, lease.data.cast_state(floating_dtypes(model.init_state(1))), [3, 4])[1]
    fsync, truncate = os.fsync, os.truncate
    monkeypatch.setattr(os, "fsync", lambda descriptor: (_ for _ in ()).throw(OSError(5, "I/O error")))
    monkeypatch.setattr(os, "truncate", lambda path, size: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(SessionUnavailable):
        cache.commit(lease, failed)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "truncate", truncate)
    cache.release(lease)
    other = cache.create("m", None, first).id  # takes the device: the first session leaves memory
    assert cache.info(session_id, None).tier == "disk"
    lease = cache.acquire(session_id, None)
    assert lease.version == 1 and identical(lease.data, full_write(acknowledged, type(acknowledged.state)))
    cache.release(lease)
    assert_books_count_the_logs(cache)
    cache.close()
    assert other


@pytest.mark.parametrize("store", ["disk", "redis"])
def test_a_compaction_asked_for_a_log_already_gone_writes_nothing(store, tmp_path, request):
    """A compaction whose turn comes after the log was cleared (the session written whole
    meanwhile: another compaction, an import) does not write the whole state again."""
    url = request.getfixturevalue("redis_url") if store == "redis" else None
    model, metrics, cache, session_id = a_session_with_one_delta(tmp_path, 5, url)
    assert cache.compact(session_id) is True
    assert cache.redis is not None or not cache.disk.log_path(session_id).exists()
    assert cache.compact(session_id) is False  # nothing to compact: no second whole write
    assert cache.durable.written["compaction"][0] == 1
    sample = metrics.registry.get_sample_value
    assert sample("xlserve_session_compactions_total", {"model": "m", "outcome": "moved_on"}) == 1
    cache.close()


def test_a_compaction_runs_torch_on_one_thread_of_its_own(tmp_path):
    """The compactor thread encodes a whole state (seconds at real size) beside the engines'
    steps: on one torch thread, not on the process-wide default the engines move (server/engine/
    threads.py says why a thread outside an engine keeps to one)."""
    model, metrics, cache, session_id = a_session_with_one_delta(tmp_path, 9)
    cache.durable.compact_ratio = log_to_ratio(cache, session_id)
    seen = []
    compact = cache.durable.compact

    def counting(record, blob):
        seen.append(torch.get_num_threads())
        return compact(record, blob)

    cache.durable.compact = counting
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the default an engine leaves behind when its compactor thread starts
    try:
        step(model, cache, session_id, list(range(6)))
        assert cache.compactions.wait_idle(timeout=60)
    finally:
        torch.set_num_threads(before)
        cache.close()
    assert seen == [1]
