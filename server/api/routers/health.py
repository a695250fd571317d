"""GET /health, /ready, /metrics and /version: what orchestrators, Prometheus and people watch.

`/health` fails (503) only when the engine process is gone for good (it could not start, or it
died more often than XLSERVE_ENGINE_RESTART_LIMIT allows), so an orchestrator restarts the
server; while a dead or frozen engine process is being replaced it stays 200 (the server heals
itself), its body naming the engine process's state and why (`engine`, `reason`).
`/ready` is 503 while the server loads its models, restarts its engine process or drains, with
the reason, so no new traffic is routed to it meanwhile. Admission leaves /health, /ready and
/metrics open while the server drains (server/api/admission.py). They take no query parameters:
one is a 400 (`unknown_parameter`), as on every API route.
"""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from xlserve.server.api.protocol import (
    HealthResponse,
    ReadyResponse,
    ServerStatus,
    VersionResponse,
    error_responses,
)
from xlserve.server.api.serving import app_state, owner_of

router = APIRouter(default_response_class=JSONResponse)  # json.dumps writes the bodies (routers/completions.py)


def not_now(status: str, reason: str) -> JSONResponse:
    """503 with a status body (not the error body): what an orchestrator's probe reads."""
    return JSONResponse(ServerStatus(status=status, reason=reason).model_dump(), status_code=503)


@router.get("/health", response_model=HealthResponse, response_model_exclude_unset=True,
            responses={**error_responses(400), 503: {"model": ServerStatus, "description": "The engine process is gone "
                                                  "for good (`failed`): restart the server."}})
async def health(request: Request):
    engine = app_state(request).engine
    if engine is None:  # the engine process is not started yet
        return HealthResponse(status="ok", engine="loading", reason="the server is starting")
    if engine.status == "failed":
        return not_now("failed", engine.reason)
    if engine.status == "ready":
        return HealthResponse(status="ok", engine="ready")
    # alive, while the engine process loads or is replaced (a dead or frozen one): the server heals itself
    return HealthResponse(status="ok", engine=engine.status, reason=engine.reason)


@router.get("/ready", response_model=ReadyResponse, response_model_exclude_unset=True,
            responses={**error_responses(400), 503: {"model": ServerStatus, "description": "Send no traffic now: the "
                                                  "server is loading, restarting its engine process or draining."}})
async def ready(request: Request):
    state = app_state(request)
    engine = state.engine
    if state.draining:
        return not_now("draining", "the server is shutting down")
    if engine is None or not engine.alive or not state.ready:
        status = engine.status if engine is not None else "loading"
        reason = engine.reason if engine is not None else "the server is starting"
        return not_now(status, reason)
    return ReadyResponse(status="ready", models=sorted(state.models))


# how long /metrics waits for the engine process's half: a scrape every 10 s, each timing out at
# 10 s by default, must not fail whole while the engine process is frozen (up to
# XLSERVE_ENGINE_STALL_SECONDS, 60 s, before its watchdog replaces it)
ENGINE_METRICS_SECONDS = 2.0


# Prometheus's text format; 401 only with XLSERVE_METRICS_REQUIRE_KEY
@router.get("/metrics", response_class=PlainTextResponse, responses=error_responses(400, 401, by_reference=True))
async def metrics(request: Request):
    """Prometheus exposition: this process's metrics, then the engine process's."""
    state = app_state(request)
    if state.settings.security.metrics_require_key:
        owner_of(request)
    text = state.metrics.render(engine_side=False)
    if state.engine is not None and state.engine.alive:
        try:  # a frozen engine process (until its watchdog replaces it) must not take this half with it
            text += await asyncio.wait_for(state.engine.metrics_text(), ENGINE_METRICS_SECONDS)
        except Exception:  # the engine process died meanwhile, or did not answer in time: this half is all there is
            pass
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/version", response_model=VersionResponse, response_model_exclude_unset=True,
            responses=error_responses(400))
async def version(request: Request):
    """The xlserve version (the package's metadata, or pyproject.toml's in a source tree)."""
    return VersionResponse(version=request.app.version)
