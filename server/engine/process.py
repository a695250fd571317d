"""The engine process: the models, their engines and the session cache, beside the HTTP front
(this module is that process's main).

`xlserve serve` runs two processes. The API process (uvicorn, FastAPI, server/api/) parses
requests, authenticates, streams SSE and websocket frames. This process owns everything below
it in the design (engine -> session cache -> models). They talk over a socketpair in frames of
JSON plus raw safetensors bytes (server/engine/wire.py): nothing is pickled.

Why two processes: in one, the engine's worker thread and the event loop share one interpreter
lock. For small models a decode step is mostly Python (many small torch calls), so every SSE
write the event loop makes is time the engine does not step, and the server never uses more
than one core. Here the engine steps while the API process formats and writes the previous
step's tokens, as vLLM splits its engine core from its API server.

What crosses the socket, API -> engine (each with an `id` the answer carries back):
  generate {model, prompt, params, lease?}   queue a generation (events follow)
  append {lease, tokens, score}              feed a document chunk into a leased session
  cancel {id}                                drop a request at the next step
  acquire / commit / release                 a request's hold on a session (leases stay here)
  create / info / delete / fork / export / replace / import_new   the other session operations
  stop_admitting / idle / metrics / shutdown
and engine -> API: `ready` (the models) once; answers {id, ok | error}; and, once per engine
step, `events`: every token, choice end, finish and error of that step in one frame.

A request's new session state never leaves this process: a finished generation or append
leaves it waiting under its lease, and the API's `commit` (sent when the client has the whole
answer) makes it the session's state; `release` without a commit drops it.

Started by server/engine/client.py as `python -m xlserve.server.engine.process FD SETTINGS_JSON`.
On Linux it dies with the API process (a kill -9 of the server stops both, as one process would
stop); elsewhere it notices the socket close, writes its sessions down and exits.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from xlserve.models.checkpoint import load_checkpoint, read_config
from xlserve.models.interface import LanguageModel
from xlserve.models.tokenizer import tokenizer_for_checkpoint
from xlserve.server.cache import CorruptState, Lease, SessionCache, SessionData
from xlserve.server.cache.codec import decode, session_data
from xlserve.server.engine.errors import InvalidInput, ModelNotFound
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine
from xlserve.server.engine.threads import own_torch_threads, threads_per_engine
from xlserve.server.engine.types import SamplingParams
from xlserve.server.engine.wire import FrameWriter, error_to_wire, event_to_wire, is_last, read_frame
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

log = logging.getLogger("xlserve.engine_process")


# -- loading ---------------------------------------------------------------------------------


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("XLSERVE_DEVICE=cuda but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    # CPUs without native bfloat16 emulate it, many times slower: bfloat16 is only ever used on CUDA
    if setting == "bfloat16" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


@dataclass
class LoadedModel:
    name: str
    directory: Path
    model: LanguageModel
    tokenizer: object
    engine: Engine


def load_models(settings: Settings, metrics: Metrics, sink=None) -> dict[str, LoadedModel]:
    """Every configured checkpoint on the device, each with its engine (events to `sink`).

    Each engine's worker thread runs its model on its share of `settings.torch_threads` and,
    for big prompt batches, of `settings.prompt_threads`; this thread, which loads the models,
    and the session-op threads run torch on one (server/engine/threads.py says why)."""
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    directories = [Path(directory) for directory in settings.model_dirs()]
    threads, prompt_threads = threads_per_engine(settings.torch_threads, settings.prompt_threads, len(directories))
    own_torch_threads(1)
    loaded = {}
    for directory in directories:
        model = load_checkpoint(directory, device=device).to(dtype)
        tokenizer = tokenizer_for_checkpoint(read_config(directory), directory)
        engine = Engine(directory.name, model, tokenizer, metrics, settings.prefill_chunk_tokens,
                        max_batch_size=settings.max_batch_size, max_queued=settings.max_queued_requests, sink=sink,
                        threads=threads, prompt_threads=prompt_threads)
        loaded[directory.name] = LoadedModel(directory.name, directory, model, tokenizer, engine)
    return loaded


def model_card(loaded: LoadedModel, created: int) -> dict:
    model = loaded.model
    return {
        "id": loaded.name, "object": "model", "created": created, "owned_by": "xlserve",
        "architecture": model.architecture, "state_kind": model.state_kind,
        "state_grows_with_context": model.state_grows_with_context, "max_context": model.max_context,
        "parameters": sum(p.numel() for p in model.parameters()), "config": model.config.to_dict(),
    }


# -- importing a session state -----------------------------------------------------------------


def decode_import(blob: bytes):
    try:
        return decode(blob, require_checksum=False)  # a checksum, when present, must match
    except CorruptState as error:
        raise InvalidInput(f"the body is not an xlserve session state: {error}", param="body",
                             code="invalid_state") from None


def validated_import(name: str, model: LanguageModel, meta: dict[str, str], tensors, next_log_probs) -> SessionData:
    """A decoded state that fits model `name`, on its device; InvalidInput otherwise."""

    def refuse(message: str):
        return InvalidInput(message, param="body", code="invalid_state")

    if meta.get("model") != name:
        raise refuse(f"the state belongs to model '{meta.get('model')}', not '{name}'")
    if meta.get("architecture") and meta["architecture"] != model.architecture:
        raise refuse(f"the state is of architecture '{meta['architecture']}', '{name}' is {model.architecture}")
    try:
        data = session_data(model.state_class, meta, tensors, next_log_probs)
        if data.state.batch_size != 1:
            raise ValueError(f"a session state has batch size 1, this one has {data.state.batch_size}")
        model.check_state(data.state)
    except (ValueError, IndexError) as error:
        raise refuse(f"the state does not fit model '{name}': {error}") from None
    if next_log_probs is not None and (next_log_probs.dim() != 1 or next_log_probs.shape[0] != model.vocab_size
                                       or not next_log_probs.is_floating_point()):
        raise refuse(f"next_log_probs must be a float vector of {model.vocab_size} values, "
                     f"got {next_log_probs.dtype} {tuple(next_log_probs.shape)}")
    if data.tokens > 0 and next_log_probs is None:
        raise refuse("a state that has seen tokens needs next_log_probs")
    return data.to(model.device)


# -- the process -------------------------------------------------------------------------------


class EngineProcess:
    """Answers the API process's frames, one `op_<name>` method per operation, and sends the
    engines' events back as they come."""

    def __init__(self, settings: Settings, sock: socket.socket):
        self.settings = settings
        self.sock = sock
        self.writer = FrameWriter(sock)
        self.metrics = Metrics()
        self.cache = SessionCache.from_settings(settings, self.metrics)
        self.models = load_models(settings, self.metrics, sink=self._send_events)
        self.cache.open({name: loaded.model for name, loaded in self.models.items()})
        self.lock = threading.Lock()  # guards the three tables below
        self.leases: dict[int, Lease] = {}
        self.results: dict[int, SessionData] = {}  # lease -> the state its request ended with, until commit
        # request id -> (the request, its engine, the lease its result is for) while it runs
        self.requests: dict[int, tuple[EngineRequest, Engine, int | None]] = {}
        self.lease_ids = itertools.count(1)
        # session operations may read files or ask Redis: off the reader thread, so a cancel
        # is never stuck behind them (the cache serialises them on its own lock anyway)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="session-op",
                                       initializer=own_torch_threads, initargs=(1,))

    def ready_frame(self) -> dict:
        models = []
        for name, loaded in self.models.items():
            created = int((loaded.directory / "config.json").stat().st_mtime)
            models.append({"name": name, "directory": str(loaded.directory), "vocab_size": loaded.model.vocab_size,
                           "checkpoint_config": read_config(loaded.directory), "card": model_card(loaded, created)})
        return {"op": "ready", "models": models, "pid": os.getpid()}

    def serve(self) -> None:
        """Answer frames until `shutdown` or until the API process is gone."""
        self.writer.send(self.ready_frame())
        stream = self.sock.makefile("rb")
        graceful = False
        while True:
            frame = read_frame(stream)
            if frame is None:
                break
            header, blob = frame
            if header["op"] == "shutdown":
                graceful = True
                break
            self.dispatch(header, blob)
        self.close()
        if graceful:
            self.writer.send({"op": "closed"})

    def close(self) -> None:
        for loaded in self.models.values():
            loaded.engine.close()
        self.pool.shutdown(wait=True)
        self.cache.close()

    # -- dispatch --------------------------------------------------------------------------

    INLINE = {"generate", "append", "cancel", "release", "stop_admitting", "idle", "metrics"}

    def dispatch(self, header: dict, blob: bytes | None) -> None:
        op = header["op"]
        handler = getattr(self, "op_" + op, None)
        if handler is None:
            self.answer(header, error=ValueError(f"unknown operation {op!r}"))
        elif op in self.INLINE:
            self.run(handler, header, blob)
        else:
            self.pool.submit(self.run, handler, header, blob)

    def run(self, handler, header: dict, blob: bytes | None) -> None:
        try:
            result = handler(header, blob)
        except Exception as error:
            self.answer(header, error=error)
            return
        if result is not None:
            body, data = result if isinstance(result, tuple) else (result, None)
            self.answer(header, body, data)

    def answer(self, header: dict, body=None, blob: bytes | None = None, error: BaseException | None = None) -> None:
        if "id" not in header:
            if error is not None:
                log.error("engine process: %s failed: %r", header.get("op"), error)
            return
        if error is not None:
            self.writer.send({"op": "answer", "id": header["id"], "error": error_to_wire(error)})
        else:
            self.writer.send({"op": "answer", "id": header["id"], "ok": body}, blob)

    def loaded(self, name: str) -> LoadedModel:
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound.named(name, self.models) from None

    def lease(self, lease_id: int) -> Lease:
        with self.lock:
            lease = self.leases.get(lease_id)
        if lease is None:
            raise ValueError(f"no lease {lease_id}")
        return lease

    # -- generation --------------------------------------------------------------------------

    def op_generate(self, header: dict, blob) -> dict:
        engine = self.loaded(header["model"]).engine
        lease_id = header.get("lease")
        start = engine.fresh_data() if lease_id is None else self.lease(lease_id).data
        request = EngineRequest("generate", header["prompt"], start, SamplingParams(**header["params"]),
                                keep_state=lease_id is not None, handle=header["id"])
        return self._enqueue(request, engine, lease_id)

    def op_append(self, header: dict, blob) -> dict:
        lease = self.lease(header["lease"])
        engine = self.loaded(lease.info.model).engine
        request = EngineRequest("append", header["tokens"], lease.data, SamplingParams(max_tokens=0),
                                score=header["score"], handle=header["id"])
        return self._enqueue(request, engine, header["lease"])

    def _enqueue(self, request: EngineRequest, engine: Engine, lease_id: int | None) -> dict:
        """Queue `request` (its handle is its id), registered first: its events may come at once."""
        with self.lock:
            self.requests[request.handle] = (request, engine, lease_id)
        try:
            engine.enqueue(request)
        except BaseException:
            with self.lock:
                self.requests.pop(request.handle, None)
            raise
        return {"accepted": True}  # the request's events may already be on their way

    def op_cancel(self, header: dict, blob) -> None:
        with self.lock:
            running = self.requests.get(header["request"])
        if running is not None:
            request, engine, _ = running
            request.cancelled.set()
            engine.wake()

    def _send_events(self, items: list[tuple[int, object]]) -> None:
        """The engines' sink (their worker threads): one frame per step."""
        events = []
        for request_id, event in items:
            if is_last(event):  # forget the request; keep a finished one's state for its commit
                self._ended(request_id, getattr(event, "data", None))
            events.append(event_to_wire(request_id, event))
        try:
            self.writer.send({"op": "events", "events": events})
        except OSError:  # the API process is gone; the reader thread sees it too and shuts down
            pass

    def _ended(self, request_id: int, data: SessionData | None) -> None:
        with self.lock:
            _, _, lease_id = self.requests.pop(request_id, (None, None, None))
            if data is not None and lease_id is not None and lease_id in self.leases:
                self.results[lease_id] = data

    # -- sessions ----------------------------------------------------------------------------

    def op_acquire(self, header: dict, blob) -> dict:
        lease = self.cache.acquire(header["session_id"], header["owner"])
        with self.lock:
            lease_id = next(self.lease_ids)
            self.leases[lease_id] = lease
        return {"lease": lease_id, "info": asdict(lease.info), "has_history": lease.data.next_log_probs is not None}

    def op_commit(self, header: dict, blob) -> dict:
        lease = self.lease(header["lease"])
        with self.lock:
            data = self.results.pop(header["lease"], None)
        if data is None:
            raise ValueError("nothing to commit: the request did not finish")
        return asdict(self.cache.commit(lease, data))

    def op_release(self, header: dict, blob) -> None:
        with self.lock:
            lease = self.leases.pop(header["lease"], None)
            self.results.pop(header["lease"], None)
        if lease is not None:
            self.cache.release(lease)

    def op_create(self, header: dict, blob) -> dict:
        engine = self.loaded(header["model"]).engine
        return asdict(self.cache.create(header["model"], header["owner"], engine.fresh_data()))

    def op_info(self, header: dict, blob) -> dict:
        return asdict(self.cache.info(header["session_id"], header["owner"]))

    def op_delete(self, header: dict, blob) -> dict:
        self.cache.delete(header["session_id"], header["owner"])
        return {}

    def op_fork(self, header: dict, blob) -> dict:
        return asdict(self.cache.fork(header["session_id"], header["owner"]))

    def op_export(self, header: dict, blob) -> tuple[dict, bytes]:
        info, data = self.cache.export(header["session_id"], header["owner"])
        return asdict(info), data

    def op_import_new(self, header: dict, blob: bytes) -> dict:
        meta, tensors, next_log_probs = decode_import(blob)
        loaded = self.loaded(header.get("model") or meta.get("model", ""))
        data = validated_import(loaded.name, loaded.model, meta, tensors, next_log_probs)
        return asdict(self.cache.import_new(loaded.name, header["owner"], data))

    def op_replace(self, header: dict, blob: bytes) -> dict:
        current = self.cache.info(header["session_id"], header["owner"])
        loaded = self.loaded(current.model)
        data = validated_import(loaded.name, loaded.model, *decode_import(blob))
        return asdict(self.cache.replace(header["session_id"], header["owner"], data))

    # -- the server's life -------------------------------------------------------------------

    def op_stop_admitting(self, header: dict, blob) -> dict:
        for loaded in self.models.values():
            loaded.engine.stop_admitting()
        return {}

    def op_idle(self, header: dict, blob) -> dict:
        return {"idle": all(loaded.engine.idle for loaded in self.models.values())}

    def op_metrics(self, header: dict, blob) -> dict:
        return {"text": self.metrics.render(engine_side=True).decode()}


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the API process dies (a kill -9 of the server stops both)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def main(argv: list[str]) -> None:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above took effect
        sys.exit(1)
    # signals are the API process's business: it drains, then sends `shutdown`
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s engine: %(message)s")
    sock = socket.socket(fileno=int(argv[0]))
    settings = Settings(**json.loads(argv[1]))
    try:
        process = EngineProcess(settings, sock)
    except Exception as error:  # tell the API process why it cannot start
        FrameWriter(sock).send({"op": "failed", "error": f"{type(error).__name__}: {error}"})
        raise
    process.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
