"""POST /tokenize and /detokenize, as vLLM serves them (clients of vLLM and llama.cpp count
tokens with these before they send a prompt):

    POST /tokenize    {"model", "prompt"} or {"model", "messages"[, "add_generation_prompt"]}
                      -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

`messages` are rendered by the model's chat template, as /v1/chat/completions would send them.
`max_model_len` is the model's context length (null for a model whose context has no bound).
"""

from fastapi import APIRouter, Depends, Request

from xlserve.server.api.protocol import DetokenizeRequest, TokenizeRequest
from xlserve.server.api.serving import app_state, detokenize, owner_of, tokenize

router = APIRouter()


@router.post("/tokenize", dependencies=[Depends(owner_of)])
async def tokenize_prompt(body: TokenizeRequest, request: Request):
    return tokenize(app_state(request), body)


@router.post("/detokenize", dependencies=[Depends(owner_of)])
async def detokenize_tokens(body: DetokenizeRequest, request: Request):
    return detokenize(app_state(request), body)
