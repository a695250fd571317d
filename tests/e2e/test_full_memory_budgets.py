"""The model card's state_bytes_per_session is what a session whose memory is full really
counts (GET /v1/sessions/{id}'s state_bytes), on the real server; and the start-up log's line of
sessions per tier divides each budget by it."""

from xlserve.server.app import full_sessions_refused, sessions_per_tier

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


def test_the_start_up_line_says_when_no_full_session_fits():
    """Budgets where the cache refuses every session of the model once its memory is full (413
    session_too_large) are said so, naming the setting to raise, as placement.py refuses them:
    host RAM too small for a session larger than the device budget, no host tier and a device
    too small, a disk too small without Redis. It was counted as 'device 0, host 0, disk 289'."""
    wt103 = {"state_bytes_per_session": 18 * 1600 * 2 * 1024 * 4 + 1600 + 267_735 * 4}
    full = f"{wt103['state_bytes_per_session']:,}"
    for store, setting in [
        ({"device_bytes": 128 << 20, "host_bytes": 100 << 20, "disk_bytes": 64 << 30}, "XLSERVE_HOST_STATE_BYTES"),
        ({"device_bytes": 128 << 20, "host_bytes": 0, "disk_bytes": 64 << 30}, "XLSERVE_DEVICE_STATE_BYTES"),
        ({"device_bytes": 1 << 30, "host_bytes": 4 << 30, "disk_bytes": 0}, "XLSERVE_DISK_STATE_BYTES"),
    ]:
        line = sessions_per_tier(wt103, store, redis=False)
        assert "refused (413 session_too_large)" in line and f"raise {setting} to at least {full}" in line, line
        assert full_sessions_refused(wt103, store, redis=False) is not None
    # with Redis the disk is only a spill: a disk budget of 0 refuses nothing
    spill_only = {"device_bytes": 1 << 30, "host_bytes": 4 << 30, "disk_bytes": 0}
    assert full_sessions_refused(wt103, spill_only, redis=True) is None
    assert "refused" not in sessions_per_tier(wt103, spill_only, redis=True)
