"""GET /health, /ready, /metrics and /version: what orchestrators, Prometheus and people watch.

`/health` fails (503) only when the engine process is gone for good (it could not start, or it
died more often than XLSERVE_ENGINE_RESTART_LIMIT allows), so an orchestrator restarts the
server; while a dead engine process is being replaced it stays 200 (the server heals itself).
`/ready` is 503 while the server loads its models, restarts its engine process or drains, with
the reason, so no new traffic is routed to it meanwhile. Admission leaves /health, /ready and
/metrics open while the server drains (server/api/admission.py).
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xlserve.server.api.serving import app_state, owner_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    engine = app_state(request).engine
    if engine is not None and engine.status == "failed":
        return JSONResponse({"status": "failed", "reason": engine.reason}, status_code=503)
    return {"status": "ok"}  # loading or restarting included: /ready says which


@router.get("/ready")
async def ready(request: Request):
    state = app_state(request)
    engine = state.engine
    if state.draining:
        return JSONResponse({"status": "draining", "reason": "the server is shutting down"}, status_code=503)
    if engine is None or not engine.alive or not state.ready:
        status = engine.status if engine is not None else "loading"
        reason = engine.reason if engine is not None else "the server is starting"
        return JSONResponse({"status": status, "reason": reason}, status_code=503)
    return {"status": "ready", "models": sorted(state.models)}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus exposition: this process's metrics, then the engine process's."""
    state = app_state(request)
    if state.settings.metrics_require_key:
        owner_of(request)
    text = state.metrics.render(engine_side=False)
    if state.engine is not None and state.engine.alive:
        try:
            text += await state.engine.metrics_text()
        except Exception:  # the engine process died meanwhile: this half is all there is
            pass
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/version")
async def version(request: Request):
    """The xlserve version (the package's metadata, or pyproject.toml's in a source tree)."""
    return {"version": request.app.version}
