"""POST /tokenize and /detokenize, as vLLM answers them."""

from __future__ import annotations

from xlserve.server.api.deps import AppState
from xlserve.server.api.errors import InvalidRequest
from xlserve.server.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from xlserve.server.api.serving.completions import chat_prompt
from xlserve.server.api.serving.requests import prompt_tokens


# -- POST /tokenize and /detokenize (as vLLM) -------------------------------------------------------


def tokenize(state: AppState, body: TokenizeRequest) -> TokenizeResponse:
    """A prompt's tokens as the model sees them (`messages` and `tools` through its chat template,
    as chat renders them), their count and the model's context length (`max_model_len`, null for a
    model without a bound)."""
    served = the_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send either prompt or messages", param="prompt")
    if body.tools is not None and body.messages is None:
        raise InvalidRequest("tools are rendered with messages, by the chat template; a prompt is tokenized as it is",
                             param="tools")
    if body.chat_template_kwargs is not None and body.messages is None:
        raise InvalidRequest("chat_template_kwargs are the chat template's, which renders messages; a prompt is "
                             "tokenized as it is", param="chat_template_kwargs")
    text = body.prompt if body.prompt is not None else chat_prompt(served, body.messages, body.add_generation_prompt,
                                                                   body.tools, body.continue_final_message,
                                                                   body.chat_template_kwargs)
    tokens = prompt_tokens(state, served, text, param="prompt" if body.prompt is not None else "messages")
    answer = TokenizeResponse(count=len(tokens), max_model_len=served.card.get("max_context"), tokens=tokens)
    if body.return_token_strs:  # vLLM's convert_ids_to_tokens: the vocabulary's entries ("Ġthe", "▁the")
        answer.token_strs = [served.tokenizer.token_text(token) for token in tokens]
    return answer


def the_model(state: AppState, name: str | None):
    """The served model `name` names; without a name, the one the server serves (vLLM's tokenize
    and detokenize take no model), or a 400 naming the choices where it serves several."""
    if name is not None:
        return state.served(name)
    if len(state.models) == 1:
        return next(iter(state.models.values()))
    raise InvalidRequest(f"model is required: this server serves {len(state.models)} models "
                         f"({', '.join(sorted(state.models))})", param="model")


def detokenize(state: AppState, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids (bytes that are not UTF-8 become U+FFFD)."""
    served = the_model(state, body.model)
    tokens = prompt_tokens(state, served, body.tokens, param="tokens")
    return DetokenizeResponse(prompt=served.tokenizer.decode(tokens))
