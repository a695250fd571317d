from fastapi import APIRouter, Depends, Request

from server.api.deps import app_state, owner_of

router = APIRouter()


def model_card(served) -> dict:
    model = served.model
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "xlserve",
        "architecture": model.architecture,
        "state_kind": model.state_kind,
        "state_grows_with_context": model.state_grows_with_context,
        "max_context": model.max_context,
        "parameters": served.parameters,
        "config": model.config.to_dict(),
    }


@router.get("/v1/models", dependencies=[Depends(owner_of)])
async def list_models(request: Request):
    return {"object": "list", "data": [model_card(s) for s in app_state(request).models.values()]}


@router.get("/v1/models/{name}", dependencies=[Depends(owner_of)])
async def get_model(name: str, request: Request):
    return model_card(app_state(request).served(name))
