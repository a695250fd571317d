from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api.deps import app_state, owner_of

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    state = app_state(request)
    if not state.ready:
        return JSONResponse({"status": "starting or stopping"}, status_code=503)
    return {"status": "ready", "models": sorted(state.models)}


@router.get("/metrics")
async def metrics(request: Request):
    state = app_state(request)
    if state.settings.metrics_require_key:
        owner_of(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
