"""Two server processes sharing one real redis-server: a session moves between replicas and a
stale writer is refused with 409, never overwriting a newer version."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, info, ok, race_generate_against_append
from tests.redis_server import redis_url  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint, tmp_path_factory, redis_url):  # noqa: F811
    logs = tmp_path_factory.mktemp("logs")
    servers = [ServerProcess([tiny_checkpoint], env={
        "XLSERVE_REDIS_URL": redis_url, "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp(f"state-{name}")),
    }, log_path=logs / f"{name}.log") for name in "ab"]
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            list(pool.map(ServerProcess.start, servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_create_on_a_continue_on_b_then_a_with_a_stale_write_refused(replicas):
    a_server, b_server = replicas
    with a_server.client() as a, b_server.client() as b:
        reference = create(a)  # the same history, all on one replica
        expected = [append(a, reference, document(i), score=True)["logprob"] for i in range(3)]

        session = create(a)
        assert append(a, session, document(0), score=True)["logprob"] == expected[0]
        on_b = info(b, session)  # B never saw it: found in Redis
        assert (on_b["version"], on_b["tier"]) == (1, "redis")
        step = append(b, session, document(1), score=True)
        assert (step["logprob"], step["version"]) == (expected[1], 2)
        step = append(a, session, document(2), score=True)  # A's own copy is version 1: stale, reloaded
        assert (step["logprob"], step["version"]) == (expected[2], 3)

        # A generates while B commits: whoever commits second started from version 3 and is refused
        final = race_generate_against_append(a, b, session, document(3))
        assert final["version"] == 4

        assert b.delete(f"/v1/sessions/{session}").status_code == 200
        assert a.get(f"/v1/sessions/{session}").status_code == 404
        assert ok(a.get(f"/v1/sessions/{reference}"))["version"] == 3
