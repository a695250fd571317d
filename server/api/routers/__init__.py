"""The HTTP and websocket routes. Each router only parses what arrives (server/api/protocol.py),
hands it to server/api/serving/ and sends back what that answers; no router imports another,
or the engine or the cache (tests/server/test_api_layers.py checks)."""
