"""The model card's state_bytes_per_session is what a session whose memory is full really
counts (GET /v1/sessions/{id}'s state_bytes), on the real server; and the start-up log's line of
sessions per tier divides each budget by it."""

from xlserve.server.app import sessions_per_tier

from tests.e2e.session_tools import MODEL, append, create, document, info, ok


def test_the_card_says_what_a_full_session_holds(client):
    card = next(model for model in ok(client.get("/v1/models"))["data"] if model["id"] == MODEL)
    session = create(client)
    append(client, session, document(1))  # longer than mem_len: the memory is full
    assert card["state_bytes_per_session"] == info(client, session)["state_bytes"]
    append(client, session, document(2))
    assert card["state_bytes_per_session"] == info(client, session)["state_bytes"]  # and stays so


def test_the_start_up_line_counts_sessions_per_tier():
    store = {"device_bytes": 1 << 30, "host_bytes": 4 << 30, "disk_bytes": 64 << 30}
    wt103 = 18 * 1600 * 2 * 1024 * 4 + 1600 + 267_735 * 4  # transfo-xl-wt103 in float32
    line = sessions_per_tier({"state_bytes_per_session": wt103}, store, redis=False)
    assert line == (f"{wt103:,} bytes per session at full memory; sessions that fit: device 4, host 18, disk 289")
    assert sessions_per_tier({"state_bytes_per_session": wt103}, store, redis=True).endswith(
        ", Redis up to its maxmemory")
    small_device = sessions_per_tier({"state_bytes_per_session": wt103}, store | {"device_bytes": 128 << 20}, redis=False)
    assert small_device.startswith(f"{wt103:,} bytes per session at full memory; sessions that fit: device 0, host 18")
    assert small_device.endswith("they live on host RAM and visit the device per request")
    assert "grows with every token" in sessions_per_tier({"state_bytes_per_session": None}, store, redis=False)
