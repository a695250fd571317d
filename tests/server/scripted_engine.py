"""An engine client answered from a script, for tests of the API process's routes without an
engine process: `submit` hands out a Submission filled with `events` (an exception among them is
raised to the consumer), or raises `refuse`; every session operation raises `session_error`."""

from __future__ import annotations

import threading

from xlserve.server.cache.errors import SessionNotFound
from xlserve.server.engine.errors import EngineLoading
from xlserve.server.engine.types import Submission
from xlserve.server.metrics import Metrics


class ScriptedEngine:
    status, reason = "ready", "the engine process is ready"

    def __init__(self, metrics: Metrics, alive: bool = True):
        self.metrics = metrics
        self.alive = alive  # False: /metrics renders the API half only, asking the engine nothing
        self.events: list = []
        self.refuse: BaseException | None = None
        self.session_error: BaseException = SessionNotFound("s")

    async def submit(self, model, tokens, params, lease, scope, owner=None):
        if self.refuse is not None:
            raise self.refuse
        submission = Submission(model, self.metrics, threading.Event(), wake=lambda: None)
        for event in self.events:
            submission.put(event)
        return submission

    async def session_info(self, session_id, owner):
        raise self.session_error

    async def acquire(self, session_id, owner, key):
        raise self.session_error

    def unavailable_error(self):
        return EngineLoading("the server is still loading its models; retry shortly", code="loading")


class RecordingEngine(ScriptedEngine):
    """Answers from its script, and keeps what every request it was sent asked for: its prompt's
    tokens (`prompts`) and its sampling parameters (`params`)."""

    def __init__(self, metrics: Metrics, alive: bool = True):
        super().__init__(metrics, alive)
        self.prompts: list[list[int]] = []
        self.params: list = []

    async def submit(self, model, tokens, params, lease, scope, owner=None):
        self.prompts.append(list(tokens))
        self.params.append(params)
        return await super().submit(model, tokens, params, lease, scope, owner)


def scripted_app(settings, engine: ScriptedEngine, models: dict, **state_fields):
    """(app, state): the API process's app for `settings`, its engine `engine` and its served
    `models` (name -> ServedModel), ready, with no engine process (a TestClient of it is not
    entered: no lifespan)."""
    from xlserve.server.api.deps import AppState
    from xlserve.server.app import build_app

    app = build_app(settings)
    state = AppState(settings=settings, metrics=engine.metrics, ready=True, **state_fields)
    state.engine, state.models = engine, models
    app.state.xlserve = state
    return app, state
