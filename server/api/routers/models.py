"""GET /v1/models and /v1/models/{name}: the served models, as OpenAI lists them (each card also
says what kind of state its sessions hold)."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from xlserve.server.api.protocol import ModelCard, ModelList, error_responses
from xlserve.server.api.serving import app_state, owner_of

router = APIRouter(default_response_class=JSONResponse)  # json.dumps writes the bodies (routers/completions.py)


@router.get("/v1/models", dependencies=[Depends(owner_of)], response_model=ModelList,
            response_model_exclude_unset=True, responses=error_responses(400, 401, 413, 503))
async def list_models(request: Request):
    return {"object": "list", "data": [s.card for s in app_state(request).models.values()]}


@router.get("/v1/models/{name}", dependencies=[Depends(owner_of)], response_model=ModelCard,
            response_model_exclude_unset=True, responses=error_responses(400, 401, 404, 413, 503))
async def get_model(name: str, request: Request):
    return app_state(request).served(name).card
