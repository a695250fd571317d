"""The FastAPI application: `build_app(settings)` and its lifespan.

The lifespan starts the engine process (server/engine/process.py: every configured checkpoint
on the device, one engine per model, the session cache) and waits until it is ready; this
process keeps the HTTP side: routing, validation, authentication, streaming, and the metrics a
client sees. On shutdown it stops admitting, then tells the engine process to close its engines
and let the cache write its sessions down.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from xlserve.models.tokenizer import tokenizer_for_checkpoint
from xlserve.server.api.admission import AdmissionMiddleware
from xlserve.server.api.deps import AppState, ServedModel
from xlserve.server.api.errors import install_error_handlers
from xlserve.server.api.routers import completions, health, models, sessions, ws
from xlserve.server.engine.client import EngineClient
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings


def served_models(engine: EngineClient) -> dict[str, ServedModel]:
    """What the engine process loaded, with a tokenizer here for prompts and logprob names."""
    served = {}
    for described in engine.models:
        directory = Path(described["directory"])
        tokenizer = tokenizer_for_checkpoint(described["checkpoint_config"], directory)
        served[described["name"]] = ServedModel(described["name"], tokenizer, described["vocab_size"],
                                                described["card"])
    return served


async def drain(app: FastAPI, grace_seconds: float) -> None:
    """Graceful shutdown, first half: stop admitting (new requests get 503, /ready turns 503)
    and wait up to `grace_seconds` for requests in flight to finish and commit their sessions.
    The server then stops and the lifespan closes the engines and the cache (which persists)."""
    state = getattr(app.state, "xlserve", None)
    if state is None:
        return
    state.draining, state.ready = True, False
    if state.engine is None or not state.engine.alive:
        return
    await state.engine.stop_admitting()
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and state.engine.alive:
        if state.inflight == 0 and await state.engine.idle():
            break
        await asyncio.sleep(0.05)


def build_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics = Metrics()
        state = AppState(settings=settings, metrics=metrics, api_keys=settings.api_key_list())
        app.state.xlserve = state
        # loads the models and finds the sessions an earlier run wrote down (graceful or killed)
        state.engine = await EngineClient(settings, metrics).start()
        state.models = served_models(state.engine)
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            await state.engine.close()

    app = FastAPI(title="xlserve", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    app.add_middleware(AdmissionMiddleware, max_body_bytes=settings.max_request_body_bytes)

    for router in (health.router, models.router, completions.router, sessions.router, ws.router):
        app.include_router(router)
    return app
