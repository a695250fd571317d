"""The FastAPI application: `build_app(settings)` and its lifespan.

The lifespan starts the engine process (server/engine/process.py: every configured checkpoint
on the device, one engine per model, the session cache); this process keeps the HTTP side:
routing, validation, authentication, streaming, and the metrics a client sees. `xlserve serve`
lets the port open at once and loads in the background: until the models are loaded `/ready`
is 503 (`loading`) and every request gets 503 `loading` with Retry-After (`LoadingGate`), which
is what the README promises instead of "connection refused". When the models are loaded one
block of INFO lines says what the server is using (`log_startup`).

If the engine process dies, its client (server/engine/client.py) starts a new one; when it
cannot, `on_fatal` is told and `xlserve serve` exits non-zero.

Every HTTP response is counted by route template and status (`ResponseMetrics`, outside the
other middlewares, so that their answers count too).

On shutdown it stops admitting and waits for requests in flight (`drain`); those still running
when the grace period ends are cut with an error that says so (`server_shutting_down`), never
silently. Then it tells the engine process to close its engines and let the cache write its
sessions down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from starlette.routing import WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from xlserve.models.tokenizer import describe_tokenizer, missing_tokenizer_file, tokenizer_for_checkpoint
from xlserve.server.api.admission import OPEN_PATHS, AdmissionMiddleware
from xlserve.server.api.chat import load_chat_template
from xlserve.server.api.deps import AppState, ServedModel, owner_of
from xlserve.server.api.errors import (
    CLIENT_CLOSED_REQUEST,
    ERROR_STATUSES,
    ERROR_TYPES,
    as_api_error,
    install_error_handlers,
    send_error,
)
from xlserve.server.api.request_ids import RequestIdMiddleware
from xlserve.server.api.routers import chat, completions, health, models, playground, sessions, tokenize, ws
from xlserve.server.api.routers.docs import DOCUMENTATION_PATHS, documentation_router
from xlserve.server.api.routers.playground import PAGE_PATHS
from xlserve.server.api.serving import error_frame, refuse_unknown_query_parameters
from xlserve.server.cache.manager import home_tier, tier_too_small
from xlserve.server.engine.client import EngineClient
from xlserve.server.engine.errors import EngineError, ShuttingDown
from xlserve.server.metrics import HTTP_METHODS, OTHER_METHOD, UNMATCHED_ROUTE, Metrics
from xlserve.server.redis_urls import masked_url
from xlserve.server.settings import Settings, checkpoint_dir
from xlserve.server.version import package_version

log = logging.getLogger("xlserve.server")

# after the grace period, how long cut requests may take to send their error and let go of
# their sessions before the server closes the connections
CUT_SECONDS = 5


class StartupRefused(Exception):
    """The settings cannot give a working server (no checkpoint to serve, a named one missing):
    `xlserve serve` says why in one line and exits non-zero, before opening the port."""


def checkpoints_to_serve(settings: Settings) -> list[Path]:
    """The checkpoint directories the settings name (each a directory with a config.json), or
    StartupRefused saying what is missing. Only the file system is read: no torch here."""
    weights_dir = Path(settings.engine.weights_dir)
    available = sorted(p.name for p in weights_dir.iterdir() if (p / "config.json").exists()) \
        if weights_dir.is_dir() else []
    where = (f"{weights_dir.resolve()} does not exist" if not weights_dir.is_dir() else
             f"{weights_dir.resolve()} has no checkpoint directory (one with a config.json)")
    names = [name.strip() for name in settings.engine.models.split(",") if name.strip()]
    if not names:
        if not available:
            raise StartupRefused(f"no checkpoint to serve: {where}; name checkpoints with --models / XLSERVE_MODELS "
                                 "or point --weights-dir / XLSERVE_WEIGHTS_DIR at them")
        return settings.engine.model_dirs()
    directories = []
    for name in names:
        directory = checkpoint_dir(name, weights_dir)
        if not (directory / "config.json").exists():
            have = f"; checkpoints in {weights_dir}: {', '.join(available)}" if available else f"; {where}"
            raise StartupRefused(f"no checkpoint '{name}': neither a checkpoint directory nor one under "
                                 f"{weights_dir}{have}")
        directories.append(directory)
    seen: dict[str, Path] = {}
    for directory in directories:  # a model is served under its directory's name
        if directory.name in seen:
            raise StartupRefused(f"two checkpoints would be served as '{directory.name}': {seen[directory.name]} "
                                 f"and {directory}")
        seen[directory.name] = directory
    for directory in directories:
        check_tokenizer_file(directory)
    return directories


def check_tokenizer_file(directory: Path) -> None:
    """StartupRefused when the tokenizer file a checkpoint's config.json names is missing (a
    converted model whose symbols.json or tokenizer.json was never put beside its weights), so
    that the start stops in one line before its port opens, not once the engine process has
    loaded. A config.json that does not read is left to the engine's load, which names it."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return
    missing = missing_tokenizer_file(config, directory) if isinstance(config, dict) else None
    if missing is not None:
        raise StartupRefused(f"checkpoint {directory}: {missing}")


def served_models(engine: EngineClient, chat_template_file: Path | None = None) -> dict[str, ServedModel]:
    """What the engine process loaded, with a tokenizer here for prompts and logprob names, and
    its chat template (`chat_template_file`, the chat_template setting, for one that has none)."""
    served = {}
    for described in engine.models:
        directory = Path(described["directory"])
        tokenizer = tokenizer_for_checkpoint(described["checkpoint_config"], directory)
        served[described["name"]] = ServedModel(described["name"], tokenizer, described["vocab_size"],
                                                described["card"],
                                                load_chat_template(described["checkpoint_config"], directory,
                                                                   chat_template_file),
                                                described.get("state_body_bytes"))
    return served


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.3g} GiB"


def _budgets(store: dict) -> dict[str, int]:
    return {tier: store.get(f"{tier}_bytes", 0) for tier in ("device", "host", "disk")}


def full_sessions_refused(card: dict, store: dict, redis: bool) -> tuple[str, int] | None:
    """The tier (and its budget) too small for one session of this model at full memory, where
    the cache refuses it (placement.py refuse_never_fits); None when it fits."""
    per_session = card.get("state_bytes_per_session")
    return None if per_session is None else tier_too_small(per_session, _budgets(store), "redis" if redis else "disk")


def sessions_per_tier(card: dict, store: dict, redis: bool) -> str:
    """How many sessions of a model fit in each tier's budget once their memories are full (the
    card's state_bytes_per_session, in the cache's state dtype), for the start-up log: what an
    operator sizes XLSERVE_*_STATE_BYTES by."""
    per_session = card.get("state_bytes_per_session")
    if per_session is None:
        return ("its state grows with every token, so no fixed number of sessions fits a tier; and its sessions' "
                "state bodies are not sized by it: set XLSERVE_MAX_STATE_BODY_BYTES to the largest session to be "
                "imported (or PUT) back, which an export of a long one passes at the default")
    counts = ", ".join(f"{tier} {store.get(f'{tier}_bytes', 0) // per_session:,}" for tier in ("device", "host", "disk"))
    last = ", Redis up to its maxmemory" if redis else ""
    budgets = _budgets(store)
    too_small = full_sessions_refused(card, store, redis)
    if too_small is not None:
        tier, budget = too_small
        return (f"{per_session:,} bytes per session at full memory; sessions that fit: {counts}{last}; but every "
                f"session is refused (413 session_too_large) once its memory passes the {tier} budget of {budget:,} "
                f"bytes: raise XLSERVE_{tier.upper()}_STATE_BYTES to at least {per_session:,}")
    # larger than the device's whole budget: each lives on host RAM and runs on the device per request
    on_host = ("; larger than the device budget, so they live on host RAM and visit the device per request"
               if home_tier(per_session, budgets) == "host" else "")
    return f"{per_session:,} bytes per session at full memory; sessions that fit: {counts}{last}{on_host}"


def log_startup(state: AppState, engine: EngineClient, seconds: float) -> None:
    """One block of INFO lines: what this server runs and where its sessions go."""
    ready = engine.ready_frame
    settings = state.settings
    lines = [f"xlserve {package_version()} ready in {seconds:.1f}s (engine process pid {ready.get('pid')})"]
    for described in engine.models:
        card = described["card"]
        lines.append(f"  model {described['name']}: {card['architecture']}, {card['parameters']:,} parameters, "
                     f"{described.get('device')} {described.get('dtype')}, loaded in "
                     f"{described.get('load_seconds', 0):.2f}s from {described['directory']}, tokenizer "
                     f"{describe_tokenizer(described['checkpoint_config'])}"
                     + (", every forward on the prompt threads (its decode steps stream every weight from memory)"
                        if described.get("every_forward_on_prompt_threads") else ""))
    threads = ready.get("threads", {})
    lines.append(f"  threads per model: {threads.get('forward')} for forwards, {threads.get('prompt')} for prompts "
                 f"of 256 tokens or more ({threads.get('cores')} cores; XLSERVE_TORCH_THREADS, "
                 "XLSERVE_PROMPT_THREADS)")
    store = ready.get("session_store", {})
    lines.append(f"  state directory: {store.get('state_dir')} ({store.get('sessions')} sessions found)")
    tiers = (f"device {_gib(store.get('device_bytes', 0))} -> host {_gib(store.get('host_bytes', 0))} -> "
             f"disk {_gib(store.get('disk_bytes', 0))}")
    redis = store.get("redis") or (masked_url(settings.cache.redis_url) if settings.cache.redis_url else None)
    lines.append(f"  session store: {tiers} -> Redis {redis}" if redis else
                 f"  session store: {tiers} (no Redis: the disk is the last tier)")
    warnings = []
    for described in engine.models:
        line = f"  model {described['name']}: {sessions_per_tier(described['card'], store, redis is not None)}"
        refused = full_sessions_refused(described["card"], store, redis is not None) is not None
        (warnings if refused else lines).append(line)
    keys = len(state.api_keys)
    lines.append(f"  API keys: {keys}" if keys else "  API keys: none, the API is open (XLSERVE_API_KEYS)")
    for line in lines:
        log.info("%s", line)
    for line in warnings:  # budgets no full session of that model fits
        log.warning("%s", line.strip())


class LoadingGate:
    """Until the engine process has loaded the models, every request but the open paths gets
    503 `loading` with Retry-After (a websocket: an error frame, then close code 1013, "try
    again later"), rather than a 404 for a model that is not loaded yet."""

    def __init__(self, app: ASGIApp, open_paths: frozenset[str]):
        self.app, self.open_paths = app, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope["app"].state, "xlserve", None) if scope["type"] in ("http", "websocket") else None
        if state is None or state.models or state.engine is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        error = state.engine.unavailable_error()
        if scope["type"] == "websocket":
            if (await receive())["type"] == "websocket.connect":
                await send({"type": "websocket.accept"})
                await send({"type": "websocket.send", "text": json.dumps(error_frame(None, error, state))})
                await send({"type": "websocket.close", "code": 1013, "reason": "not ready"})
            return
        await send_error(scope, send, as_api_error(error))


class ResponseMetrics:
    """Every HTTP response counted, as prometheus-fastapi-instrumentator counts them
    (xlserve_http_requests_total{route, method, status}, and its duration in
    xlserve_http_request_duration_seconds), as a plain ASGI middleware: it adds one call per
    message sent, not a task per request as a BaseHTTPMiddleware would.

    `route` is the path template of the route that answered ("/v1/sessions/{session_id}"),
    never the raw path: the router leaves the route it dispatched to in the scope. A request
    answered before the router (a 413 or a 503 while loading or draining, by the middlewares
    inside this one) is matched against the same templates here; a path no route matches is
    UNMATCHED_ROUTE, so the label has as many values as the app has routes. A response counts
    once, when its last byte is sent: a stream when it ends, with the status it started with. A
    request whose app raised before answering counts as 500 (the server error middleware outside
    answers it so), one whose task was cancelled before answering as 499. A websocket counts its
    handshake, as GET: 101 when accepted, 403 when closed before that (or the status of a denial
    response)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.templates: list[tuple] | None = None  # (path regex, template, methods, websocket?), built at first use

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope["app"].state, "xlserve", None) if scope["type"] in ("http", "websocket") else None
        if state is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(state.metrics, scope, receive, send)
            return
        started, status = time.perf_counter(), None

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except BaseException as error:
            if status is None:
                status = 500 if isinstance(error, Exception) else CLIENT_CLOSED_REQUEST
            raise
        finally:
            if status is not None:
                route, method = self.route_of(scope), _method(scope)
                state.metrics.http_requests.labels(route, method, str(status)).inc()
                state.metrics.http_request_duration.labels(route, method).observe(time.perf_counter() - started)

    async def _websocket(self, metrics: Metrics, scope: Scope, receive: Receive, send: Send) -> None:
        status = None

        def count(code: int) -> None:
            nonlocal status
            status = code
            metrics.http_requests.labels(self.route_of(scope), "GET", str(code)).inc()

        async def send_counted(message: Message) -> None:
            if status is None:
                kind = message["type"]
                if kind == "websocket.accept":
                    count(101)
                elif kind == "websocket.close":
                    count(403)
                elif kind == "websocket.http.response.start":
                    count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            if status is None:
                count(500)
            raise

    def route_of(self, scope: Scope) -> str:
        """The path template of the route that answers `scope`, or UNMATCHED_ROUTE."""
        template = getattr(scope.get("route"), "path_format", None)
        if template:
            return template
        if self.templates is None:
            self.templates = list(_route_templates(scope["app"].router.routes))
        websocket, path, partial = scope["type"] == "websocket", scope["path"], None
        for regex, template, methods, for_websocket in self.templates:
            if for_websocket != websocket or not regex.match(path):
                continue
            if websocket or methods is None or scope["method"] in methods:
                return template
            partial = partial or template  # the path's route, another method: answered 405
        return partial or UNMATCHED_ROUTE


def _method(scope: Scope) -> str:
    method = scope["method"]
    return method if method in HTTP_METHODS else OTHER_METHOD


def documentation_paths(app: FastAPI) -> set[str]:
    """/openapi.json, the reference pages (/docs, /redoc) and their assets (server/api/routers/docs.py)."""
    return {app.openapi_url, *DOCUMENTATION_PATHS} if app.openapi_url else set(DOCUMENTATION_PATHS)


def expected_responses(app: FastAPI) -> list[tuple[str, str, int]]:
    """(route template, method, status) of the responses counted at 0 from the start, so that the
    first of each reads as a rate above 0: every API route and method with 200 and each status
    an error is answered with (server/api/errors.py), the pages (documentation, playground)
    with 200, the websocket with 101."""
    pages = PAGE_PATHS | documentation_paths(app)
    responses = []
    for _, template, methods, websocket in _route_templates(app.router.routes):
        if websocket:
            responses.append((template, "GET", 101))
            continue
        statuses = [200] if template in pages else [200, *ERROR_STATUSES]
        responses += [(template, method, status) for method in sorted(methods or ()) if method != "HEAD"
                      for status in statuses]
    return responses


def _every_route(routes) -> Iterator:
    """Every route, those of included routers too (FastAPI keeps an included router whole: its
    routes are under `original_router`; xlserve includes its routers without a path prefix)."""
    for route in routes:
        router = getattr(route, "original_router", None)
        if router is not None:
            yield from _every_route(router.routes)
        else:
            yield route


def _route_templates(routes) -> Iterator[tuple]:
    """(path regex, path template, methods or None, websocket route?) of every route (`_every_route`)."""
    for route in _every_route(routes):
        if getattr(route, "path_regex", None) is not None:
            yield (route.path_regex, route.path_format, getattr(route, "methods", None),
                   isinstance(route, WebSocketRoute))


def cut_streams(app: FastAPI) -> int:
    """End every generation and append still running with `server_shutting_down`: a stream gets
    it as its error event (then [DONE]), a websocket as an error frame, a plain request as a 503.
    Nothing of a cut request is committed. Returns how many were cut."""
    state = getattr(app.state, "xlserve", None)
    if state is None or state.engine is None:
        return 0
    return state.engine.cut(lambda: ShuttingDown(
        "the server is shutting down and this request did not finish within its grace period "
        "(XLSERVE_SHUTDOWN_GRACE_SECONDS); nothing of it was committed: send it again", code="server_shutting_down"))


async def drain(app: FastAPI, grace_seconds: float) -> None:
    """Graceful shutdown, first half: stop admitting (new requests get 503, /ready turns 503)
    and wait up to `grace_seconds` for requests in flight to finish and commit their sessions;
    then cut those still running, each with an error that says why (`cut_streams`; a state upload
    still arriving at its next part, `AppState.cutting`). The server
    then stops and the lifespan closes the engines and the cache (which persists)."""
    state = getattr(app.state, "xlserve", None)
    if state is None:
        return
    state.draining, state.ready = True, False
    engine = state.engine
    if engine is None or not engine.alive:
        return
    deadline = time.monotonic() + grace_seconds
    try:
        await engine.stop_admitting()
        while time.monotonic() < deadline and engine.alive:
            if state.inflight == 0 and await engine.idle():
                return
            await asyncio.sleep(0.05)
    except EngineError:  # the engine process died meanwhile: what ran has had its error
        return
    state.cutting = True  # a state upload still arriving is answered 503 at its next part (serving/requests.py read_body)
    if cut_streams(app):
        log.warning("the grace period (%gs) is over: requests still running were stopped", grace_seconds)
    deadline = time.monotonic() + CUT_SECONDS
    while state.inflight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def build_app(settings: Settings | None = None, *, load_in_background: bool = False,
              on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The app. `load_in_background`: start serving at once and load the models meanwhile
    (`xlserve serve`); otherwise the lifespan's start-up waits for them (tests, embedding).
    `on_fatal(reason)`: the engine process cannot be started or restarted (else it is logged,
    and /health turns 503)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics = Metrics()
        metrics.declare_http_series(expected_responses(app))
        state = AppState(settings=settings, metrics=metrics, api_keys=settings.security.api_key_list())
        app.state.xlserve = state
        started = time.monotonic()

        def ready(engine: EngineClient, restarted: bool) -> None:
            if not restarted:
                state.models = served_models(engine, settings.server.chat_template)
                state.metrics.declare_api_series(list(state.models), ERROR_TYPES)
                log_startup(state, engine, time.monotonic() - started)
            state.ready = not state.draining

        # loads the models and finds the sessions an earlier run wrote down (graceful or killed)
        state.engine = EngineClient(settings, metrics, on_ready=ready, on_fatal=on_fatal)
        if load_in_background:
            state.engine.start_in_background()
        else:
            await state.engine.start()
        try:
            yield
        finally:
            state.ready = False
            await state.engine.close()

    # FastAPI's own /docs and /redoc load their scripts from a CDN: xlserve serves its own pages,
    # with the assets of an installed package (documentation_router)
    app = FastAPI(title="xlserve", version=package_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    open_paths = OPEN_PATHS | PAGE_PATHS | documentation_paths(app)
    app.add_middleware(LoadingGate, open_paths=frozenset(open_paths))
    app.add_middleware(AdmissionMiddleware, max_body_bytes=settings.server.max_request_body_bytes)
    app.add_middleware(ResponseMetrics)  # it counts what the others answer too
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer the others give carries the id

    # every API route refuses a query parameter it does not take; the websocket checks its own
    # once accepted (an error frame), and the playground's pages take whatever a browser adds
    for router in (health.router, models.router, completions.router, chat.router, tokenize.router,
                   sessions.router):
        app.include_router(router, dependencies=[Depends(refuse_unknown_query_parameters)])
    app.include_router(ws.router)
    app.include_router(playground.router)
    app.include_router(documentation_router(app.title))
    app.openapi = lambda: openapi_with_keys(app, settings.security.metrics_require_key)
    return app


def openapi_with_keys(app: FastAPI, metrics_require_key: bool = False) -> dict:
    """FastAPI's /openapi.json, with the API key as a bearer scheme on every route that asks for
    one (`owner_of`): the routes take it through a plain dependency, which FastAPI does not
    describe, so Swagger UI (/docs) had no Authorize button and every try of a route on a server
    with keys was a 401."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {}).setdefault("securitySchemes", {})[API_KEY_SCHEME] = {
            "type": "http", "scheme": "bearer",
            "description": "one of the server's API keys (XLSERVE_API_KEYS); a server without keys takes any or none"}
        for route in _every_route(app.router.routes):
            if not isinstance(route, APIRoute):
                continue
            # /metrics asks in its body, when XLSERVE_METRICS_REQUIRE_KEY says so
            if _asks_for_a_key(route.dependant) or (metrics_require_key and route.path_format == "/metrics"):
                for method in route.methods:
                    operation = schema["paths"].get(route.path_format, {}).get(method.lower())
                    if operation is not None:
                        operation["security"] = [{API_KEY_SCHEME: []}]
        app.openapi_schema = schema
    return app.openapi_schema


API_KEY_SCHEME = "apiKey"


def _asks_for_a_key(dependant) -> bool:
    return any(dependency.call is owner_of or _asks_for_a_key(dependency) for dependency in dependant.dependencies)
