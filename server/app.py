"""The FastAPI application: `build_app(settings)` and its lifespan.

The lifespan loads every configured checkpoint onto the device, creates the session cache,
one engine per model and the metrics registry; on shutdown it stops admitting, closes the
engines and lets the cache write its sessions down.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import FastAPI

from models.checkpoint import load_checkpoint, read_config
from models.tokenizer import tokenizer_for_checkpoint
from server.api import completions, health, models, sessions, ws
from server.api.admission import AdmissionMiddleware
from server.api.deps import AppState, ServedModel
from server.cache import SessionCache
from server.engine import Engine
from server.errors import install_error_handlers
from server.metrics import Metrics
from server.settings import Settings


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("XLSERVE_DEVICE=cuda but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    # CPUs without native bfloat16 run it ~50x slower, so bfloat16 is only ever used on CUDA
    if setting == "bfloat16" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def load_models(settings: Settings, metrics: Metrics) -> dict[str, ServedModel]:
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    served = {}
    for directory in settings.model_dirs():
        directory = Path(directory)
        model = load_checkpoint(directory, device=device).to(dtype)
        name = directory.name
        tokenizer = tokenizer_for_checkpoint(read_config(directory), directory)
        served[name] = ServedModel(
            name=name, model=model, tokenizer=tokenizer,
            engine=Engine(name, model, tokenizer, metrics, settings.prefill_chunk_tokens,
                          max_batch_size=settings.max_batch_size, max_queued=settings.max_queued_requests),
            created=int((directory / "config.json").stat().st_mtime),
            parameters=sum(p.numel() for p in model.parameters()),
        )
    return served


async def drain(app: FastAPI, grace_seconds: float) -> None:
    """Graceful shutdown, first half: stop admitting (new requests get 503, /ready turns 503)
    and wait up to `grace_seconds` for requests in flight to finish and commit their sessions.
    The server then stops and the lifespan closes the engines and the cache (which persists)."""
    state = getattr(app.state, "xlserve", None)
    if state is None:
        return
    state.draining, state.ready = True, False
    for served in state.models.values():
        served.engine.stop_admitting()
    deadline = time.monotonic() + grace_seconds
    while (state.inflight > 0 or not all(s.engine.idle for s in state.models.values())) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def build_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.torch_threads > 0:
            torch.set_num_threads(settings.torch_threads)
        metrics = Metrics()
        cache = SessionCache.from_settings(settings, metrics)
        state = AppState(settings=settings, metrics=metrics, cache=cache, api_keys=settings.api_key_list())
        app.state.xlserve = state
        state.models = await asyncio.to_thread(load_models, settings, metrics)
        # sessions written down by an earlier run (graceful or killed) are found again here
        await asyncio.to_thread(cache.open, {name: served.model for name, served in state.models.items()})
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            for served in state.models.values():
                served.engine.close()
            state.cache.close()

    app = FastAPI(title="xlserve", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    app.add_middleware(AdmissionMiddleware, max_body_bytes=settings.max_request_body_bytes)

    for router in (health.router, models.router, completions.router, sessions.router, ws.router):
        app.include_router(router)
    return app
