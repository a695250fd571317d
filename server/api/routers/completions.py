"""POST /v1/completions: OpenAI's completions API, plus `session_id`, `top_k`, `min_p` and
`repetition_penalty`.

With `session_id` the prompt continues the session's memory instead of starting from nothing:
the history is not recomputed, and `usage.prompt_tokens_details.cached_tokens` says how many
tokens of context came from memory. The session's memory afterwards holds the prompt and every
generated token (a stop string included, since the model produced it), committed only when the
request completes: a client that disconnects (streamed or not), an error or a cancel leaves the
session as it was. `n > 1` cannot be combined with `session_id` (which choice would the session
keep?).

Streaming is SSE as OpenAI does it: `data: {chunk}` events, one per released piece of text per
choice, a last chunk per choice with its `finish_reason`, with `stream_options.include_usage`
a final chunk with empty `choices` and the `usage`, then `data: [DONE]`. An error after the
stream started is sent in the stream as `data: {"error": {...}}`; one before it (an invalid
request, a busy session, a full queue) is an HTTP error status, as without streaming.
"""

from fastapi import APIRouter, Depends, Header, Request, Response

from xlserve.server.api.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    error_responses,
    event_stream,
)
from xlserve.server.api.serving import (
    IDEMPOTENCY_KEY_HEADER,
    SESSION_ID_HEADER,
    Completion,
    PartedJSONResponse,
    app_state,
    body_size,
    check_session_header,
    complete,
    owner_of,
    replayed_headers,
    sized_work,
    stream_completion,
)

# JSONResponse (json.dumps) writes the bodies, byte for byte as before they were typed (sent in parts,
# each within the stream send timeout: PartedJSONResponse); FastAPI's
# default for a route with a response_model, pydantic's serialiser, writes some numbers otherwise
# (1e-05 as 0.00001)
router = APIRouter(default_response_class=PartedJSONResponse)


@router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_unset=True,
             responses={**error_responses(400, 401, 404, 409, 413, 422, 429, 500, 503),
                        200: event_stream(CompletionStreamResponse, "The completion; with `stream`, its chunks.")})
async def create_completion(body: CompletionRequest, request: Request, response: Response,
                            owner: str | None = Depends(owner_of),
                            idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER),
                            session_header: str | None = Header(None, alias=SESSION_ID_HEADER)):
    check_session_header(session_header, body.session_id)
    # with session_id, an Idempotency-Key makes the request apply at most once (routers/sessions.py)
    # tokenized (a large prompt) on a worker thread, off the event loop every client shares
    completion = await sized_work(body_size(request), Completion, app_state(request), body, owner, idempotency_key)
    if body.stream:
        return await stream_completion(completion, request)
    answer = await complete(completion, request)
    response.headers.update(replayed_headers(completion.replayed))
    return answer
