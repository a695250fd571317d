"""The one registry of the errors that travel from the engine process and the session cache to a
client.

Each such exception class declares, once and on itself, what a client sees when it is raised:
its HTTP status, the error type of the body, the code and param the body carries when the
exception brings none of its own, and, for the errors a retry can cure, how many seconds the
client should wait (Retry-After). Defining a subclass of `RegisteredError` registers it by name
in `ERROR_CLASSES`; from that registry the wire (server/engine/wire.py) rebuilds the same
exception in the API process, and the API (server/api/errors.py) builds its status table. A new
error class is thus on the wire and in the table as soon as it is written;
tests/server/test_error_registry.py checks that no exception that can reach a client is left out.

Free of torch and of any web framework: the engine process and the session cache import it, and
know of HTTP only a status number and a few strings.
"""

from __future__ import annotations

from typing import Any, ClassVar

# class name -> class, of every RegisteredError subclass defined so far: the wire's registry
ERROR_CLASSES: dict[str, type[RegisteredError]] = {}


class RegisteredError(Exception):
    """Base of the exceptions a client can be answered with (directly or through the wire).

    A subclass declares what differs from its parent among the class attributes below. A class
    given `abstract=True` (`class CacheError(RegisteredError, abstract=True)`) is a base that is
    never raised itself: it crosses the wire, but has no row of its own in the status table."""

    http_status: ClassVar[int] = 500
    # None: the answer has no error body (Cancelled: the client has gone, nobody reads it)
    error_type: ClassVar[str | None] = "internal_error"
    default_code: ClassVar[str | None] = None  # when the exception carries no code of its own
    default_param: ClassVar[str | None] = None  # likewise for the request field at fault
    retry_after_seconds: ClassVar[int | None] = None  # a retry can help, after this long
    # a 500 on purpose: the server failed, not the request. The client reads only the class's
    # name (the details are the server's), unless the class says otherwise (`client_message`)
    internal: ClassVar[bool] = False
    abstract: ClassVar[bool] = True  # RegisteredError itself; each subclass says (default False)

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls.abstract = abstract
        known = ERROR_CLASSES.get(cls.__name__)
        # the wire names a class by its bare name, so two classes may not share one (the same
        # class defined again, as a reloaded module does, replaces itself)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"two error classes named {cls.__name__}: {known.__module__} and {cls.__module__}")
        ERROR_CLASSES[cls.__name__] = cls

    def client_message(self) -> str:
        """The message the client reads."""
        if self.internal:
            return f"internal error: {type(self).__name__}"
        return str(self)

    def wire_fields(self) -> dict[str, Any]:
        """What the wire carries of this exception, beside its class name (JSON values only)."""
        return {"message": str(self)}

    @classmethod
    def from_wire_fields(cls, fields: dict[str, Any]) -> RegisteredError:
        """The exception back from `wire_fields`."""
        return cls(fields.get("message", ""))


def answered_error_classes() -> list[type[RegisteredError]]:
    """The registered classes a client is answered with an error body for (the status table's
    rows): every one defined so far, less the abstract bases and those answered without a body."""
    return [cls for cls in ERROR_CLASSES.values() if not cls.abstract and cls.error_type is not None]


# The codes a client can read beyond the registered classes' own (their `default_code`), each with
# the error type it is answered with: the codes the API's own error classes are raised with
# (server/api/errors.py: InvalidRequest, Conflict, ...) and those a registered class is raised
# with at one place instead of its default. With the defaults (`error_codes`) they are every code
# an error body can carry, and so every value the `code` label of xlserve_request_errors_total
# can take besides "none" (server/metrics.py). tests/server/test_http_metrics.py checks that
# every code written in server/ is listed here or is a class's default.
RAISED_CODES: dict[str, str] = {
    # 400s of the API layer: the request as sent
    "invalid_text": "invalid_request_error",
    "json_too_deep": "invalid_request_error",
    "malformed_frame": "invalid_request_error",
    "unknown_parameter": "invalid_request_error",
    "session_id_mismatch": "invalid_request_error",
    "invalid_idempotency_key": "invalid_request_error",
    "remembered_answer_too_large": "request_too_large",
    "prompt_too_long": "invalid_request_error",
    "echo_logprobs_too_large": "invalid_request_error",
    # an echo's prompt text over every prompt and choice past MAX_ECHOED_TOKENS (server/api/protocol.py)
    "echo_too_large": "invalid_request_error",
    # an answer that is not streamed would return more generated tokens' log-probabilities than
    # MAX_GENERATED_LOGPROBS (server/api/protocol.py)
    "generated_logprobs_too_large": "invalid_request_error",
    # a list of prompts that could not be queued even on an idle server (server/api/serving/generation.py)
    "too_many_prompts": "invalid_request_error",
    "invalid_logit_bias": "invalid_request_error",
    "token_id_out_of_vocabulary": "invalid_request_error",
    "word_not_in_vocabulary": "invalid_request_error",
    "no_chat_template": "invalid_request_error",
    "chat_template_error": "invalid_request_error",
    # structured output (server/engine/constraints.py): a schema, regex, grammar or tool list that
    # llguidance rejects; one over a size or compile-time limit; a model whose tokens are not bytes
    "invalid_response_format": "invalid_request_error",
    "grammar_too_large": "invalid_request_error",
    "constraint_not_supported": "invalid_request_error",
    # a constrained row's parser took longer than XLSERVE_STRUCTURED_TOKEN_MILLISECONDS for each of
    # 3 tokens in a row (an ambiguous grammar): its request ends, mid-stream too, and the others go on
    "constraint_too_slow": "invalid_request_error",
    # no compile thread freed within the compile limit (QueueFull's other code)
    "constraint_compiler_busy": "rate_limit_error",
    # as many session states as the API process holds at once are moving through it already
    # (import, PUT state, export: server/api/serving/requests.py MAX_STATES_IN_FLIGHT)
    "states_in_flight": "rate_limit_error",
    # a session state's upload that came slower than STATE_BODY_BYTES_PER_SECOND after its grace
    # (server/api/serving/requests.py read_body): it gave its place among those states back
    "state_body_too_slow": "invalid_request_error",
    "body_too_slow": "invalid_request_error",
    # an imported or PUT state the model cannot take (the engine's InvalidInput)
    "invalid_state": "invalid_request_error",
    "invalid_api_key": "authentication_error",
    # a web page of another origin opening the websocket (server/api/deps.py `cross_origin_error`)
    "cross_origin": "permission_error",
    # the websocket's one request at a time
    "nothing_to_cancel": "conflict",
    "request_in_progress": "conflict",
    # the model's forward raised for one request alone (RequestFailed's other code)
    "forward_failed": "internal_error",
    # a step's work for one request alone raised (its prefill's results, its detokenizer's end,
    # its final state taken out of its batch): that request fails, the step's others go on
    "finish_failed": "internal_error",
    # a step failed outside any one request's work: each of its requests is told so
    "step_failed": "internal_error",
    # an event or error the engine process sent for one request did not read in the API process
    # (server/engine/client.py): that request ends with it, the others go on
    "engine_message_unreadable": "internal_error",
    # requests still running when the shutdown grace period ended
    "server_shutting_down": "service_unavailable",
}


def error_codes() -> dict[str, str]:
    """Every code an error body can carry -> the error type it is answered with: the default codes
    of the registered classes defined so far, and `RAISED_CODES`."""
    defaults = {cls.default_code: cls.error_type for cls in answered_error_classes() if cls.default_code}
    return {**defaults, **RAISED_CODES}
