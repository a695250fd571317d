"""GET /v1/models and /v1/models/{name}: the served models, as OpenAI lists them (each card also
says what kind of state its sessions hold)."""

from fastapi import APIRouter, Depends, Request

from xlserve.server.api.serving import app_state, owner_of

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(owner_of)])
async def list_models(request: Request):
    return {"object": "list", "data": [s.card for s in app_state(request).models.values()]}


@router.get("/v1/models/{name}", dependencies=[Depends(owner_of)])
async def get_model(name: str, request: Request):
    return app_state(request).served(name).card
