"""The one error registry (server/errors.py): every exception that can reach a client declares
its status, type and default code on its class, and both the wire and the API's status table
are built from those declarations. Here: nothing that can reach a client is left out of it,
nothing maps to a 500 by accident, and the table is what clients have always been answered."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil

import pytest

import xlserve.server
from xlserve.server.api.errors import APIError, CLIENT_CLOSED_REQUEST, ERROR_KINDS, ERROR_STATUSES, ERROR_TYPES, \
    as_api_error
from xlserve.server.engine.wire import error_from_wire, error_to_wire
from xlserve.server.errors import ERROR_CLASSES, RegisteredError, answered_error_classes

# the modules a registered class must be defined in: both torch-free and imported by the wire and
# by server/api/errors.py, so that the API process knows every class the engine process may send
ERROR_MODULES = {"xlserve.server.errors", "xlserve.server.engine.errors", "xlserve.server.cache.errors"}

# exceptions of server/ that are not registered because no client ever receives them, and why
NEVER_REACH_A_CLIENT = {
    "xlserve.server.app.StartupRefused": "raised before the port opens; `xlserve serve` prints it and exits",
    "xlserve.server.engine.client.EngineStartFailed": "the server stops (on_fatal) or retries the start; "
                                                      "requests meanwhile get EngineLoading or EngineRestarting",
    "xlserve.server.api.chat.ChatTemplateError": "completions answer it as an InvalidRequest (chat_template_error)",
    "xlserve.server.cache.stores.StoreUnavailable": "the session cache answers it as SessionUnavailable, or settles "
                                                    "the write (CommitOutcomeUnknown); the prefix cache goes without",
    "xlserve.server.cache.stores.StoreFull": "the session cache answers it as CacheFull",
    "xlserve.server.cache.stores.StoreWriteInDoubt": "the session cache answers it as SessionUnavailable, and stops "
    "counting the disk copy it may have changed",
    "xlserve.server.cache.session_cache._AlreadyMade": "create answers it with the session its Idempotency-Key "
                                                       "made (a Replay), or SessionLocked while that is written",
    "xlserve.server.bench.soak.HttpError": "the soak benchmark's own HTTP client: it runs against a server",
    "xlserve.server.cache.state_directory.StateDirectoryRefused": "raised as the engine process starts: the server stops "
                                                       "(EngineStartFailed) naming the directory and its holder",
}

# what clients were answered before the registry existed (the table server/api/errors.py used
# to spell out): class -> (status, type, default code, default param, headers)
ANSWERED = {
    "InvalidInput": (400, "invalid_request_error", None, None, {}),
    # added since: a prompt or append past a model's max_context (its param, prompt or text, is its own)
    "ContextLengthExceeded": (400, "invalid_request_error", "context_length_exceeded", None, {}),
    "ModelNotFound": (404, "not_found_error", "model_not_found", "model", {}),
    "QueueFull": (429, "rate_limit_error", "queue_full", None, {"Retry-After": "1"}),
    "ShuttingDown": (503, "service_unavailable", "shutting_down", None, {}),
    "EngineGone": (503, "service_unavailable", "engine_gone", None, {}),
    "EngineRestarting": (503, "service_unavailable", "engine_restarting", None, {"Retry-After": "2"}),
    "EngineLoading": (503, "service_unavailable", "loading", None, {"Retry-After": "2"}),
    "RequestFailed": (500, "internal_error", "sampling_failed", None, {}),
    # added since: a request whose message to the engine process is over the frame it reads
    "MessageTooLarge": (413, "request_too_large", "message_too_large", None, {}),
    # a session whose state gives non-finite log-probs at use (issue 35): the client's state, a 4xx
    "StateNotUsable": (422, "invalid_request_error", "state_not_usable", "session_id", {}),
    # added since: the device out of memory while checking an imported state (a RuntimeError like a
    # malformed state's, which was answered 400 before)
    "DeviceOutOfMemory": (503, "service_unavailable", "device_out_of_memory", None, {"Retry-After": "1"}),
    # added since: a stream whose client stopped reading, stopped with nothing committed
    "StreamNotRead": (408, "invalid_request_error", "stream_not_read", None, {}),
    "SessionNotFound": (404, "not_found_error", "session_not_found", "session_id", {}),
    "SessionLocked": (409, "session_busy", "session_busy", "session_id", {}),
    "SessionConflict": (409, "conflict", "session_version_conflict", "session_id", {}),
    "CacheFull": (503, "service_unavailable", "session_cache_full", "session_id", {"Retry-After": "1"}),
    "SessionUnavailable": (503, "service_unavailable", "session_unavailable", "session_id", {}),
    # added since: memory ran out while a stored state was read back (its copy is fine: retry)
    "SessionReadOutOfMemory": (503, "service_unavailable", "device_out_of_memory", "session_id",
                               {"Retry-After": "1"}),
    "SessionTooLarge": (413, "request_too_large", "session_too_large", "session_id", {}),
    "SessionQuotaExceeded": (403, "permission_error", "session_quota_exceeded", None, {}),
    "SessionQuotaBusy": (429, "rate_limit_error", "sessions_being_made", None, {"Retry-After": "1"}),
    "CommitOutcomeUnknown": (503, "service_unavailable", "commit_outcome_unknown", "session_id", {}),
    "IdempotencyKeyReused": (422, "invalid_request_error", "idempotency_key_reused", "Idempotency-Key", {}),
    "CorruptState": (500, "internal_error", None, None, {}),
}


def server_exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of xlserve.server (each module imported), by
    its dotted name."""
    found = {}
    for module_info in pkgutil.walk_packages(xlserve.server.__path__, "xlserve.server."):
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{value.__qualname__}"] = value
    return found


def test_every_exception_that_can_reach_a_client_is_registered():
    classes = server_exception_classes()
    assert "xlserve.server.engine.errors.QueueFull" in classes  # the walk saw the package
    unaccounted, misplaced = [], []
    for name, cls in classes.items():
        if issubclass(cls, APIError) or cls is RegisteredError:
            continue  # the API's own errors carry their status on the class (checked below); the base
        if issubclass(cls, RegisteredError):
            if ERROR_CLASSES.get(cls.__name__) is not cls:
                unaccounted.append(f"{name}: a RegisteredError missing from the registry")
            if cls.__module__ not in ERROR_MODULES:
                misplaced.append(name)
        elif name not in NEVER_REACH_A_CLIENT:
            unaccounted.append(name)
    assert not unaccounted, (
        "exceptions neither registered (subclass RegisteredError, server/errors.py, and declare what a client "
        f"sees) nor listed in NEVER_REACH_A_CLIENT with the reason: {unaccounted}")
    assert not misplaced, f"registered classes outside {sorted(ERROR_MODULES)}: the API process would not know " \
                          f"them: {misplaced}"
    assert set(NEVER_REACH_A_CLIENT) <= set(classes), \
        f"NEVER_REACH_A_CLIENT names classes that do not exist: {set(NEVER_REACH_A_CLIENT) - set(classes)}"


def test_no_registered_error_is_a_500_unless_it_says_it_is_internal():
    for cls in ERROR_CLASSES.values():
        if cls.abstract:
            continue  # a base, never raised itself
        assert 400 <= cls.http_status < 600, cls
        assert cls.http_status != 500 or cls.internal, f"{cls.__name__} maps to 500 without being marked internal"
    for cls in (APIError, *APIError.__subclasses__()):
        assert cls.status != 500 or cls is APIError, cls


def test_the_status_table_is_built_from_the_classes_and_is_what_clients_saw_before():
    table = {cls.__name__: (kind.status, kind.type, kind.code, kind.param, kind.headers)
             for cls, kind in ERROR_KINDS.items()}
    assert table == ANSWERED
    assert set(ERROR_KINDS) == set(answered_error_classes())
    # the abstract bases have no row (a bare one would be a 500 naming only its class), nor has
    # Cancelled, answered 499 without a body by its own handler
    assert {cls.__name__ for cls in ERROR_CLASSES.values() if cls not in ERROR_KINDS} == \
        {"EngineError", "CacheError", "_SessionError", "Cancelled"}
    assert CLIENT_CLOSED_REQUEST == 499
    # the table adds no type or status of its own beyond those of the API errors and the table
    assert {kind.type for kind in ERROR_KINDS.values()} <= set(ERROR_TYPES)
    assert {kind.status for kind in ERROR_KINDS.values()} <= set(ERROR_STATUSES)


def sample(cls: type[RegisteredError]) -> RegisteredError:
    """An instance of a registered class, as its own codec builds one."""
    return cls.from_wire_fields({"message": "what went wrong", "param": "prompt", "code": "its_code",
                                 "session_id": "sess_a"})


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
def test_every_registered_error_crosses_the_wire_as_itself(name):
    cls = ERROR_CLASSES[name]
    error = sample(cls)
    back = error_from_wire(json.loads(json.dumps(error_to_wire(error))))
    assert type(back) is cls
    assert error_to_wire(back) == error_to_wire(error)
    direct, crossed = as_api_error(error), as_api_error(back)
    assert (crossed.status, crossed.body(), crossed.headers) == (direct.status, direct.body(), direct.headers)


def test_what_a_client_reads_of_each_kind_of_error():
    from xlserve.server.cache.errors import CorruptState, SessionLocked
    from xlserve.server.engine.errors import QueueFull, RequestFailed

    busy = as_api_error(SessionLocked("sess_a"))
    assert busy.body()["error"] == {"message": "session 'sess_a' is busy with another request; retry when it finishes",
                                    "type": "session_busy", "param": "session_id", "code": "session_busy"}
    full = as_api_error(QueueFull("4 requests wait, the limit is 4"))
    assert (full.status, full.code, full.headers) == (429, "queue_full", {"Retry-After": "1"})
    assert as_api_error(QueueFull("x", code="own_code")).code == "own_code"  # the exception's own code wins
    # internal: a row's failure is the client's to know; a corrupt blob's details are not
    failed = as_api_error(RequestFailed("the forward failed for this row", code="forward_failed"))
    assert (failed.status, failed.message, failed.code) == (500, "the forward failed for this row", "forward_failed")
    corrupt = as_api_error(CorruptState("checksum mismatch at /var/lib/xlserve/sess_a"))
    assert (corrupt.status, corrupt.message, corrupt.code) == (500, "internal error: CorruptState", None)


def test_a_session_id_of_any_length_comes_back_cut_to_a_few_dozen_characters():
    """A request may name a session with a `session_id` of megabytes (the body's limit): its 404
    repeats the id's start and says how long it was, never the whole id."""
    from xlserve.server.cache.errors import SessionNotFound

    named = "sess_" + "ab" * 500_000
    error = as_api_error(SessionNotFound(named))
    assert error.status == 404 and error.code == "session_not_found"
    assert len(error.message) < 160, error.message[:200]
    assert error.message.startswith("session '" + named[:64] + "...") and "(1000005 characters)" in error.message
    # an id as the server makes them comes back whole
    assert as_api_error(SessionNotFound("sess_" + "0" * 32)).message == f"session 'sess_{'0' * 32}' does not exist"
    # the wire still carries it whole between the processes
    assert error_from_wire(error_to_wire(SessionNotFound(named))).session_id == named


def test_two_error_classes_cannot_share_a_name_on_the_wire():
    with pytest.raises(TypeError, match="two error classes named QueueFull"):
        class QueueFull(RegisteredError):  # noqa: F811 - the point: a second class of that name
            http_status, error_type = 429, "rate_limit_error"
    assert ERROR_CLASSES["QueueFull"].__module__ == "xlserve.server.engine.errors"
