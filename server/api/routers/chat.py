"""POST /v1/chat/completions: OpenAI's chat completions API, for checkpoints that carry a chat
template (server/api/chat.py says where it is found and how it is rendered).

The messages become one prompt through the template (ending where the assistant's answer
begins), which then runs as a completion: the same sampling fields, limits and errors as
/v1/completions, answered as OpenAI does (`chat.completion`; streamed, `chat.completion.chunk`s
whose first delta per choice carries the role, then `data: [DONE]`). A checkpoint without a
template gets 400 `no_chat_template`, as vLLM answers. Chat keeps no session: the messages are
the whole history, so an X-Session-Id header (which a proxy routes by) gets 400
`session_id_mismatch`, as on /v1/completions without `session_id`.
"""

from fastapi import APIRouter, Depends, Header, Request

from xlserve.server.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    error_responses,
    event_stream,
)
from xlserve.server.api.serving import (
    SESSION_ID_HEADER,
    ChatCompletion,
    PartedJSONResponse,
    app_state,
    body_size,
    check_session_header,
    complete,
    owner_of,
    sized_work,
    stream_completion,
)

router = APIRouter(default_response_class=PartedJSONResponse)  # json.dumps writes the bodies (routers/completions.py)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_unset=True,
             responses={**error_responses(400, 401, 404, 413, 429, 500, 503),
                        200: event_stream(ChatCompletionStreamResponse,
                                          "The chat completion; with `stream`, its chunks.")})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, owner: str | None = Depends(owner_of),
                                 session_header: str | None = Header(None, alias=SESSION_ID_HEADER)):
    check_session_header(session_header, None)  # chat is about no session
    # the template rendered and the prompt tokenized (large messages) on a worker thread
    completion = await sized_work(body_size(request), ChatCompletion, app_state(request), body, owner)
    if body.stream:
        return await stream_completion(completion, request)
    return await complete(completion, request)
