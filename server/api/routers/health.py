"""GET /health, /ready and /metrics: what orchestrators and Prometheus watch.

`/health` fails (503) only when the engine process has died, so an orchestrator restarts the
server; `/ready` is 503 while the server starts or drains, so no new traffic is routed to it.
Admission leaves these three open while the server drains (server/api/admission.py).
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xlserve.server.api.serving import app_state, owner_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    engine = app_state(request).engine
    if engine is not None and not engine.alive and engine.process is not None:
        return JSONResponse({"status": "failed", "reason": engine.exit_reason}, status_code=503)
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    state = app_state(request)
    if not state.ready or state.engine is None or not state.engine.alive:
        return JSONResponse({"status": "starting or stopping"}, status_code=503)
    return {"status": "ready", "models": sorted(state.models)}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus exposition: this process's metrics, then the engine process's."""
    state = app_state(request)
    if state.settings.metrics_require_key:
        owner_of(request)
    text = state.metrics.render(engine_side=False)
    if state.engine is not None and state.engine.alive:
        text += await state.engine.metrics_text()
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
