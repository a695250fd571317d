"""Two xlserve processes sharing a real three-node Redis Cluster (`redis-server --cluster-enabled`,
`redis-cli --cluster create`, on loopback; XLSERVE_REDIS_URL=redis+cluster://...): sessions whose
keys live on different masters move between the replicas with the log-probabilities of one pass
over their whole text, both replicas list every node's sessions, and of two commits started from
the same version one wins and the other is refused with 409, as on a single Redis
(tests/e2e/test_sessions_redis.py). The test process runs no model: HTTP, and redis-py to look
at where the keys are."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import redis

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, info, ok, race_generate_against_append
from tests.redis_topologies import redis_cluster  # noqa: F401  (fixture)

SESSION_KEY = "xlserve:session:"  # server/cache/stores.py: the same keys as on a single Redis


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint, tmp_path_factory, redis_cluster):  # noqa: F811
    logs = tmp_path_factory.mktemp("logs")
    servers = [ServerProcess([tiny_checkpoint], env={
        "XLSERVE_REDIS_URL": redis_cluster.url, "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp(f"state-{name}")),
    }, log_path=logs / f"{name}.log") for name in "ab"]
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            list(pool.map(ServerProcess.start, servers))
        yield servers
    finally:  # also when a start failed: every process this fixture began is stopped
        for server in servers:
            server.stop()


def one_pass(client, text: str) -> list[float | None]:
    """Per-token log-probs of `text` in one request without a session."""
    body = ok(client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 0, "echo": True,
                                                   "logprobs": 0, "prefix_cache": False}))
    return body["choices"][0]["logprobs"]["token_logprobs"]


def sessions_on_every_node(client, cluster, most: int = 40) -> dict[int, str]:
    """Create sessions until each of the cluster's masters holds one: {port: session id}."""
    found: dict[int, str] = {}
    for _ in range(most):
        session = create(client)
        found.setdefault(cluster.node_of(SESSION_KEY + session), session)
        if len(found) == len(cluster.ports):
            return found
    raise AssertionError(f"{most} sessions all hashed to the masters {sorted(found)}")


def test_sessions_on_every_node_move_between_replicas_with_the_log_probs_of_one_pass(
        replicas, redis_cluster):  # noqa: F811
    a_server, b_server = replicas
    pieces = [document(i) for i in range(3)]
    with a_server.client() as a, b_server.client() as b:
        whole = one_pass(a, "".join(pieces))
        bounds = [0]
        for piece in pieces:
            bounds.append(bounds[-1] + len(piece))

        placed = sessions_on_every_node(a, redis_cluster)  # created on A
        for port, session in placed.items():  # the state really is on that master, and only there
            node = redis.Redis(port=port, socket_timeout=5)
            assert node.hget(SESSION_KEY + session, "version") == b"0"
            node.close()
        listed = {s["id"] for s in ok(b.get("/v1/sessions", params={"limit": 100}))["data"]}
        assert set(placed.values()) <= listed  # B lists what A created, whichever node holds it

        for turn, (start, end) in enumerate(zip(bounds, bounds[1:])):
            for k, session in enumerate(placed.values()):
                replica = (a, b)[(turn + k + 1) % 2]  # every session changes replica at every turn
                step = append(replica, session, pieces[turn], score=True)
                assert step["version"] == turn + 1 and step["session_tokens"] == end
                assert step["logprob"] == pytest.approx(sum(whole[max(start, 1):end]), abs=1e-3), (session, turn)
        for session in placed.values():
            on_a, on_b = info(a, session), info(b, session)
            assert (on_a["version"], on_a["tokens"]) == (on_b["version"], on_b["tokens"]) == (3, bounds[-1])


def test_of_two_commits_from_one_version_one_wins_and_the_other_gets_a_conflict(replicas):
    a_server, b_server = replicas
    with a_server.client() as a, b_server.client() as b:
        session = create(b)
        step = append(b, session, document(7), score=True)
        assert step["version"] == 1 and info(a, session)["version"] == 1  # A sees B's commit through the cluster

        # A generates while B commits: whoever commits second started from version 1 and is refused
        final = race_generate_against_append(a, b, session, document(8))
        assert final["version"] == 2

        assert a.delete(f"/v1/sessions/{session}").status_code == 200
        assert b.get(f"/v1/sessions/{session}").status_code == 404
