"""POST /tokenize and /detokenize, as vLLM serves them (clients of vLLM and llama.cpp count
tokens with these before they send a prompt):

    POST /tokenize    {"model", "prompt"} or {"model", "messages"[, "tools", "add_generation_prompt"]}
                      -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

`messages` (with `tools`) are rendered by the model's chat template, as /v1/chat/completions would send them.
`max_model_len` is the model's context length (null for a model whose context has no bound).
"""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from xlserve.server.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    error_responses,
)
from xlserve.server.api.serving import app_state, detokenize, owner_of, tokenize

router = APIRouter(default_response_class=JSONResponse)  # json.dumps writes the bodies (routers/completions.py)


@router.post("/tokenize", dependencies=[Depends(owner_of)], response_model=TokenizeResponse,
             response_model_exclude_unset=True, responses=error_responses(400, 401, 404, 413, 503))
async def tokenize_prompt(body: TokenizeRequest, request: Request):
    return tokenize(app_state(request), body)


@router.post("/detokenize", dependencies=[Depends(owner_of)], response_model=DetokenizeResponse,
             response_model_exclude_unset=True, responses=error_responses(400, 401, 404, 413, 503))
async def detokenize_tokens(body: DetokenizeRequest, request: Request):
    return detokenize(app_state(request), body)
