"""The session store beyond one Redis (server/cache/redis_client.py, stores.py): the URL forms of
Redis Sentinel and Redis Cluster, a session's keys in one cluster slot, the stores against a real
three-node cluster, and two replicas that follow a real Sentinel failover with compare-and-set
intact. (tests/e2e/test_redis_cluster.py runs two whole servers against a cluster.)"""

from __future__ import annotations

import re
import time

import pytest

import redis
from redis.crc import key_slot

from xlserve.server.cache import SessionConflict
from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.cache.stores import RedisPrefixStore, RedisStore, StoreUnavailable
from xlserve.server.redis_urls import RedisTarget, masked_url, parse_redis_url
from xlserve.server.settings import Settings
from tests.redis_topologies import redis_cluster, redis_sentinel  # noqa: F401  (fixtures)
from tests.server.cache_helpers import MODEL, data, same


def sid(i: int) -> str:
    return f"sess_{i:032x}"


# -- URLs ------------------------------------------------------------------------------------------


def test_urls_name_one_redis_a_sentinel_or_a_cluster():
    assert parse_redis_url("redis://:pw@127.0.0.1:6379/2").mode == "single"  # redis-py reads those itself
    assert parse_redis_url("unix:///run/redis.sock?db=1").mode == "single"
    assert parse_redis_url("rediss://u:p@[::1]/0?ssl_cert_reqs=none").mode == "single"
    assert parse_redis_url("rediss+sentinel://user:p%40ss@s1,[::1]:26380/mymaster/3"
                           "?sentinel_username=su&sentinel_password=sp&ssl_cert_reqs=none") == RedisTarget(
        "sentinel", "rediss+sentinel://user:p%40ss@s1,[::1]:26380/mymaster/3"
                    "?sentinel_username=su&sentinel_password=sp&ssl_cert_reqs=none",
        (("s1", 26379), ("::1", 26380)), "mymaster", 3, "user", "p@ss", "su", "sp", True, {"ssl_cert_reqs": "none"})
    target = parse_redis_url("redis+sentinel://s1:5000/mymaster")
    assert (target.nodes, target.service, target.db, target.password, target.sentinel_password, target.tls) == (
        (("s1", 5000),), "mymaster", 0, None, None, False)
    target = parse_redis_url("redis+cluster://:pw@n1:7000,n2,n3:7002/0")
    assert (target.mode, target.nodes, target.db, target.password) == (
        "cluster", (("n1", 7000), ("n2", 6379), ("n3", 7002)), 0, "pw")
    for wrong, says in [("redis+sentinel://s1:26379", "names the master's service"),
                        ("redis+sentinel://s1/m/x", "not a database number"),
                        ("redis+cluster://n1/1", "database 0 only"),
                        ("redis+cluster://n1:70000", "not a port"),
                        ("redis+cluster://::1:7000", "in brackets"),
                        ("redis+cluster://n1?sentinel_password=x", "unknown option"),
                        ("redis+cluster://n1?ssl_ca_certs=/ca.pem", "TLS options need"),
                        ("rediss+cluster://n1?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
                        ("redis+cluster://:secret@", "not a host"),
                        ("memcached://x", "unknown Redis URL scheme"),
                        # redis-py's own parser would take these as database 0, sharing another's keys
                        ("redis://:secret@h:6379/1O", "not a database number: '1O'"),
                        ("rediss://h/staging", "not a database number: 'staging'"),
                        ("redis://:secret@h:port/0", "not a port")]:
        with pytest.raises(ValueError, match=says) as refused:
            parse_redis_url(wrong)
        assert "secret" not in str(refused.value)
    # the setting is checked at once, and a bad one is refused naming no credentials
    assert Settings(redis_url=" redis+cluster://n1:7000 ").cache.redis_url == "redis+cluster://n1:7000"
    with pytest.raises(ValueError, match="names the master's service") as refused:
        Settings(redis_url="redis+sentinel://:secret@s1")
    assert "secret" not in str(refused.value)  # pydantic would quote the input: settings hide it
    with pytest.raises(ValueError, match="names the master's service"):
        RedisStore("redis+sentinel://s1")  # refused when made, not at first use


def test_every_password_is_masked_in_every_form():
    assert masked_url("redis+sentinel://:pw@s1:26379,s2/m/0?sentinel_username=u&sentinel_password=sp") == \
        "redis+sentinel://:***@s1:26379,s2/m/0?sentinel_username=u&sentinel_password=***"
    assert masked_url("rediss+cluster://user:pw@[::1]:7000,n2") == "rediss+cluster://user:***@[::1]:7000,n2"
    assert masked_url("redis+cluster://n1:7000,n2:7001") == "redis+cluster://n1:7000,n2:7001"
    assert masked_url("redis://u:pw@h:1/0?password=x") == "redis://u:***@h:1/0?password=***"


@pytest.mark.parametrize("url", [
    "redis://:Zm9v/YmFyc2VjcmV0@redis:6379/0",  # a base64 password (openssl rand -base64) with a '/'
    "rediss://user:pa?ssecret@redis:6380",
    "redis://:p#ssecret@redis",
    "redis+sentinel://:Zm9v/secret@s1:26379,s2/mymaster",
    "redis+cluster://user:a/secret@n1:7000,n2",
])
def test_a_password_holding_a_slash_question_mark_or_hash_is_never_shown(url):
    """A '/' (or '?', '#') in a password ends the URL's host part early: the start-up error quoted
    that "host" (the password up to the '/'), and masked_url returned the URL unmasked."""
    with pytest.raises(ValueError, match="percent-encode") as refused:
        parse_redis_url(url)
    password = url.split("://", 1)[1].rpartition("@")[0].partition(":")[2]
    for fragment in (password, *re.split(r"[/?#]", password)):
        assert len(fragment) < 3 or fragment not in str(refused.value)
        assert len(fragment) < 3 or fragment not in masked_url(url)
    assert masked_url(url).endswith("@" + url.rpartition("@")[2])
    with pytest.raises(ValueError) as refused:  # the setting says the same
        Settings(redis_url=url)
    assert "secret" not in str(refused.value)
    # a sentinel password in the query may hold an '@' as it is
    assert parse_redis_url("redis+sentinel://s1/m?sentinel_password=p@ss").sentinel_password == "p@ss"


def test_a_sessions_keys_share_one_cluster_slot_and_are_the_single_server_keys():
    store = RedisStore("redis://127.0.0.1:1/0")  # nothing is connected
    slots = set()
    for i in range(64):
        key = store._key(sid(i))
        assert key == "xlserve:session:" + sid(i)  # the key layout of a single Redis: data moves as it is
        fence = store._fence_key(sid(i), f"write{i}")
        assert key_slot(fence.encode()) == key_slot(key.encode())
        slots.add(key_slot(key.encode()))
    assert len(slots) > 32  # and sessions spread over the slots
    with pytest.raises(ValueError, match="braces"):
        RedisStore("redis://127.0.0.1:1/0", prefix="{tenant}:session:")


# -- a real cluster ---------------------------------------------------------------------------------


def test_the_store_on_a_cluster_keeps_every_guarantee_of_one_redis(redis_cluster):  # noqa: F811
    store = RedisStore(redis_cluster.url, prefix="modes:", timeout_s=3, max_connections=4)
    ids = [sid(1000 + i) for i in range(12)]
    nodes = {redis_cluster.node_of(store._key(s)) for s in ids}
    assert len(nodes) == 3, nodes  # the sessions really are spread over the three masters
    for i, s in enumerate(ids):
        assert store.put(s, None, 0, {"i": i}, b"zero", f"w{i}") == 1
    assert store.heads() == {s: (0, {"i": i}) for i, s in enumerate(ids)}  # one listing over every node

    s = ids[0]
    assert store.put(s, None, 0, {}, b"again") == 0  # exists already
    assert store.put(s, 0, 1, {"v": 1}, b"one", "w-one", {"key": "k1"}) == 1
    assert store.put(s, 0, 1, {"v": 1}, b"stale") == 0  # compare-and-set, in the session's slot
    assert store.get(s) == (1, {"v": 1}, b"one")
    assert store.settle(s, "w-one") is True
    assert store.settle(s, "w-late") is False  # fenced: the fence lives in the session's slot
    assert store.put(s, 1, 2, {"v": 2}, b"two", "w-late") == -1
    assert store.remember(s, 1, {"key": "k2"})
    assert [e["key"] for e in store.head(s, remembered=True).remembered] == ["k2", "k1"]
    store.delete(s, "owner", {"key": "k3"})
    assert store.head(s) is None and store.tombstone(s) == ("owner", [{"key": "k3"}, {"key": "k2"}, {"key": "k1"}])
    store.delete(ids[1])
    assert set(store.heads()) == set(ids[2:])
    store.close()

    prefix = RedisPrefixStore(redis_cluster.url, prefix="modes:prefix:", timeout_s=3, ttl_s=60)
    blocks = [f"{i:02x}" * 16 for i in range(6)]
    for i, block in enumerate(blocks):
        prefix.put_entry(block, 16 * i + 3, f"{i:02x}" * 8, b"entry %d" % i)
    assert len({redis_cluster.node_of("modes:prefix:block:" + b) for b in blocks}) > 1
    assert prefix.filed(blocks) == [{16 * i + 3: f"{i:02x}" * 8} for i in range(6)]  # one call over the nodes
    assert prefix.get_entry("05" * 8) == b"entry 5" and prefix.get_entry("ff" * 8) is None
    # the entries spread over every primary, and each primary's memory is read: one node's INFO
    # would leave the others' room for sessions unchecked
    nodes = prefix.memory()
    assert len(nodes) == len(prefix.client.get_primaries()) > 1 and all(used > 0 for used, _ in nodes)
    prefix.close()


def test_delta_commits_on_a_cluster_stay_in_the_session_slot(redis_cluster):  # noqa: F811
    """A delta block is appended by a script that touches the session's hash and its write's
    fence only, both in the session's slot: compare-and-set, fences and compaction as on one Redis."""
    store = RedisStore(redis_cluster.url, prefix="modes-log:", timeout_s=3, max_connections=4)
    ids = [sid(2000 + i) for i in range(6)]
    assert len({redis_cluster.node_of(store._key(s)) for s in ids}) > 1
    for i, s in enumerate(ids):
        assert store.put(s, None, 0, {"v": 0}, b"base" * 8, f"b{i}") == 1
        assert store.append(s, 0, 1, {"v": 1}, b"d1", 1.0, 0.1, f"a{i}") == 1
        assert store.append(s, 0, 1, {}, b"stale", 1.0, 0.1) == 0  # compare-and-set on the version
        assert store.settle(s, f"late{i}") is False
        assert store.append(s, 1, 2, {}, b"fenced", 1.0, 0.1, f"late{i}") == -1
        assert store.append(s, 1, 2, {"v": 2}, b"d2", 1.0, 0.1, f"c{i}") == 3  # 4 bytes of log: a compaction is due
        assert store.get_chain(s) == (2, {"v": 2}, b"base" * 8, [b"d1", b"d2"]) and store.settle(s, f"c{i}")
        assert store.append(s, 2, 3, {}, b"x" * 40, 1.0, 0.1) == 2  # would outgrow its base: nothing written
        assert store.put(s, 2, 3, {"v": 3}, b"new base", f"w{i}") == 1  # the compaction clears the log
        assert store.get_chain(s) == (3, {"v": 3}, b"new base", [])
    store.close()


def test_a_cluster_that_is_not_there_is_unavailable_not_a_crash():
    store = RedisStore("redis+cluster://127.0.0.1:1", timeout_s=0.3)  # made at once: nothing is connected
    with pytest.raises(StoreUnavailable, match="Redis Cluster"):
        store.ping()
    with pytest.raises(StoreUnavailable):
        store.put(sid(1), None, 0, {}, b"x")
    store.close()


# -- a real Sentinel failover -------------------------------------------------------------------


def replica(tmp_path, name: str, url: str) -> SessionCache:
    cache = SessionCache(tmp_path / name, None, None, None, redis_url=url, store_timeout_s=3)
    cache.open({"toy": MODEL})
    return cache


def test_replicas_follow_a_sentinel_failover_with_compare_and_set_intact(tmp_path, redis_sentinel):  # noqa: F811
    a = replica(tmp_path, "a", redis_sentinel.url)
    b = replica(tmp_path, "b", redis_sentinel.url)
    session = a.create("toy", "k", data(10, 0)).id
    lease = a.acquire(session, "k")
    a.commit(lease, data(10, 1))  # v1, on the first master
    old_master = redis.Redis(port=redis_sentinel.master_port, socket_timeout=2)
    assert old_master.wait(1, 2000) == 1  # replicated (Redis replicates asynchronously: see docs/design.md)
    old_master.close()
    stale = a.acquire(session, "k")  # A leases v1 ...

    redis_sentinel.kill(redis_sentinel.master_port)  # ... the master dies; the sentinel promotes the replica
    deadline = time.monotonic() + 20
    while redis_sentinel.master() != redis_sentinel.replica_port:
        assert time.monotonic() < deadline, "the sentinel did not fail over"
        time.sleep(0.1)

    lease = b.acquire(session, "k")  # B, never restarted, reads from the new master
    assert lease.version == 1 and same(lease.data, data(10, 1))
    b.commit(lease, data(10, 2))
    with pytest.raises(SessionConflict):  # A's client found the new master too, and was refused there
        a.commit(stale, data(10, 99))
    a.release(stale)
    lease = a.acquire(session, "k")
    assert lease.version == 2 and same(lease.data, data(10, 2))  # the stale write never landed
    a.release(lease)
    a.close()
    b.close()
