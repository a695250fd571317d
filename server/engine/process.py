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
  generate {model, prompt, params, lease?, prefix_scope?}   queue a generation (events follow); without
                                             a lease, prefix_scope (hex) reuses the prefix cache
  append {lease, tokens, score}              feed a document chunk into a leased session
  cancel {id}                                drop a request at the next step
  acquire / commit / release                 a request's hold on a session (leases stay here)
  create / info / delete / fork / export / replace / import_new / list_sessions   the other session operations
                                             (an `idempotency` {key, fingerprint} on acquire, fork, replace,
                                             delete; `remember` on commit: the request's Idempotency-Key)
  stop_admitting / idle / metrics / shutdown
and engine -> API: `ready` (the models) once; answers {id, ok | error}; and, once per engine
step, `events`: every token, choice end, finish and error of that step in one frame.

A request's new session state never leaves this process: a finished generation or append
leaves it waiting under its lease, and the API's `commit` (sent when the client has the whole
answer) makes it the session's state; `release` without a commit drops it.

Started by server/engine/client.py as `python -m xlserve.server.engine.process FD`; its settings
come as the first frame on the socket (`settings`), never on the command line, which every user
sees in `ps` (a Redis URL may hold a password). On Linux it dies with the API process (a kill -9
of the server stops both, as one process would stop); elsewhere it notices the socket close,
writes its sessions down and exits. If it dies on its own, the API process starts a new one.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from xlserve.models.checkpoint import load_checkpoint, read_config
from xlserve.models.interface import LanguageModel
from xlserve.models.tokenizer import tokenizer_for_checkpoint
from xlserve.server.cache import CorruptState, Lease, SessionCache, SessionData
from xlserve.server.cache.session_cache import Replay
from xlserve.server.cache.codec import decode, session_data
from xlserve.server.cache.prefix_cache import PrefixCache
from xlserve.server.engine.errors import InvalidInput, ModelNotFound
from xlserve.server.engine.memory import MemoryReturner
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine, EventSink
from xlserve.server.engine.threads import own_torch_threads, threads_per_engine
from xlserve.server.engine.types import SamplingParams
from xlserve.server.engine.wire import FrameWriter, error_to_wire, event_to_wire, is_last, read_frame
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings, masked_url

log = logging.getLogger("xlserve.engine_process")

SESSION_OP_THREADS = 32  # session operations in flight at once (most of their time is spent waiting on I/O)


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
    load_seconds: float = 0.0  # reading and placing its weights (said in the start-up log)


def load_models(settings: Settings, metrics: Metrics, sink: EventSink,
                prefix_cache: PrefixCache | None = None) -> dict[str, LoadedModel]:
    """Every configured checkpoint on the device, each with its engine (events to `sink`),
    the engines sharing one `prefix_cache` (None: no reuse without sessions).

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
        started = time.perf_counter()
        model = load_checkpoint(directory, device=device).to(dtype)
        tokenizer = tokenizer_for_checkpoint(read_config(directory), directory)
        engine = Engine(directory.name, model, tokenizer, metrics, sink, prefill_chunk=settings.prefill_chunk_tokens,
                        max_batch_size=settings.max_batch_size, max_queued=settings.max_queued_requests,
                        threads=threads, prompt_threads=prompt_threads, prefix_cache=prefix_cache)
        loaded[directory.name] = LoadedModel(directory.name, directory, model, tokenizer, engine,
                                             time.perf_counter() - started)
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
    """A decoded state that fits model `name`, on its device; InvalidInput (code "invalid_state",
    naming the tensor at fault) otherwise. Everything the model could not have produced is
    refused here (`LanguageModel.check_session`: finite tensors, lengths that agree with each
    other and with the token count, a next-token row that is a log-distribution), before the
    state replaces anything or runs beside another request."""

    def refuse(message: str):
        return InvalidInput(message, param="body", code="invalid_state")

    if meta.get("model") != name:
        raise refuse(f"the state belongs to model '{meta.get('model')}', not '{name}'")
    if meta.get("architecture") and meta["architecture"] != model.architecture:
        raise refuse(f"the state is of architecture '{meta['architecture']}', '{name}' is {model.architecture}")
    try:
        data = session_data(model.state_class, meta, tensors, next_log_probs)
        model.check_session(data.state, data.tokens, data.next_log_probs)
    except (ValueError, IndexError, RuntimeError) as error:  # RuntimeError: torch on a malformed tensor
        raise refuse(f"the state does not fit model '{name}': {error}") from None
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
        # one budget per tier for both: entries take only the room sessions leave, and give it back
        self.prefix_cache = PrefixCache.from_settings(settings, self.metrics, sessions=self.cache.manager)
        if self.prefix_cache is not None:
            self.cache.lend_to(self.prefix_cache)
        self.models = load_models(settings, self.metrics, sink=self._send_events, prefix_cache=self.prefix_cache)
        self.sessions_found = self.cache.open({name: loaded.model for name, loaded in self.models.items()})
        self.metrics.declare_engine_series(list(self.models), list(self.cache.manager.tiers))
        # each tier's budget and how full it is, read from the manager at every scrape
        self.metrics.declare_tiers(self.cache.manager.budgets, self.cache.manager.used)
        self.lock = threading.Lock()  # guards the three tables below
        self.leases: dict[int, Lease] = {}
        self.results: dict[int, SessionData] = {}  # lease -> the state its request ended with, until commit
        # request id -> (the request, its engine, the lease its result is for) while it runs
        self.requests: dict[int, tuple[EngineRequest, Engine, int | None]] = {}
        self.lease_ids = itertools.count(1)
        # session operations may read files or ask Redis: off the reader thread, so a cancel
        # is never stuck behind them. Enough threads that requests waiting on a slow Redis (each
        # for at most its own store timeout) do not queue the others behind them; the cache
        # serialises its local work on its own lock and never holds it while Redis is asked
        self.pool = ThreadPoolExecutor(max_workers=SESSION_OP_THREADS, thread_name_prefix="session-op",
                                       initializer=own_torch_threads, initargs=(1,))
        # freed memory goes back to the system once the engines idle (server/engine/memory.py)
        self.memory = MemoryReturner.for_engine_process(
            lambda: all(loaded.engine.idle for loaded in self.models.values()), settings.return_memory)

    def ready_frame(self) -> dict:
        """The models (what /v1/models says, and what the API process needs to tokenise for
        them) and what the start-up log says about this process."""
        models = []
        for name, loaded in self.models.items():
            created = int((loaded.directory / "config.json").stat().st_mtime)
            weights = next(loaded.model.parameters(), None)
            models.append({"name": name, "directory": str(loaded.directory), "vocab_size": loaded.model.vocab_size,
                           "checkpoint_config": read_config(loaded.directory), "card": model_card(loaded, created),
                           "device": str(loaded.model.device),
                           "dtype": str(weights.dtype).removeprefix("torch.") if weights is not None else "none",
                           "load_seconds": round(loaded.load_seconds, 3)})
        settings = self.settings
        threads, prompt_threads = threads_per_engine(settings.torch_threads, settings.prompt_threads, len(self.models))
        store = {"state_dir": str(Path(settings.state_dir).resolve()), "device_bytes": settings.device_state_bytes,
                 "host_bytes": settings.host_state_bytes, "disk_bytes": settings.disk_state_bytes,
                 "redis": masked_url(settings.redis_url) if settings.redis_url else None,
                 "sessions": self.sessions_found}
        return {"op": "ready", "models": models, "pid": os.getpid(),
                "threads": {"forward": threads, "prompt": prompt_threads, "cores": os.cpu_count()},
                "session_store": store}

    def serve(self, stream=None) -> None:
        """Answer frames until `shutdown` or until the API process is gone (`stream`: the socket's
        reader, when main() has already read the settings frame from it)."""
        self.writer.send(self.ready_frame())
        stream = stream if stream is not None else self.sock.makefile("rb")
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
        self.memory.close()
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
        finally:
            self.memory.freed()  # a delete, release or commit may have let go of a state
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

    def op_generate(self, header: dict, blob) -> dict | None:
        engine = self.loaded(header["model"]).engine
        if header.get("lease") is None and header.get("prefix_scope") is not None and engine.prefix_lookup_waits:
            # the prefix cache asks Redis: not on the reader thread, where it would hold up every
            # other frame; registered first, so that a cancel sent meanwhile is not lost
            cancelled = threading.Event()
            with self.lock:
                self.requests[header["id"]] = (_PendingLookup(cancelled), engine, None)
            self.pool.submit(self.run, lambda h, b: self._generate(h, engine, cancelled), header, blob)
            return None
        return self._generate(header, engine)

    def _generate(self, header: dict, engine: Engine, cancelled: threading.Event | None = None) -> dict:
        lease_id = header.get("lease")
        params = SamplingParams(**header["params"])
        scope = header.get("prefix_scope")
        if lease_id is not None:
            fields = {"start": self.lease(lease_id).data}
        elif scope is not None:  # no session: reuse the longest cached prefix of the prompt
            echo_alternatives = params.echo and bool(params.logprobs)
            fields = engine.start_from_prefix(header["prompt"], bytes.fromhex(scope), echo_alternatives)
        else:
            fields = {"start": engine.fresh_data()}
        if cancelled is not None:
            fields["cancelled"] = cancelled
        request = EngineRequest("generate", header["prompt"], params=params, keep_state=lease_id is not None,
                                handle=header["id"], **fields)
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
            request, _, lease_id = self.requests.pop(request_id, (None, None, None))
            if data is not None and lease_id is not None and lease_id in self.leases:
                self.results[lease_id] = data
        if request is not None:
            # a request and its rows refer to each other (Row.request): unlinked, they and the
            # states they hold (the one it started from, each row's last) go now, not whenever
            # the cyclic garbage collector runs; the engine is done with them (this is its last event)
            request.rows = []
        self.memory.freed()  # the request's batch rows and activations are gone

    # -- sessions ----------------------------------------------------------------------------

    def op_acquire(self, header: dict, blob) -> dict:
        lease = self.cache.acquire(header["session_id"], header["owner"], header.get("idempotency"))
        if lease.replay is not None:  # the request's Idempotency-Key was seen: its first result, nothing held
            return {"replay": lease.replay, "info": asdict(lease.info)}
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
        return asdict(self.cache.commit(lease, data, header.get("remember")))

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

    def op_list_sessions(self, header: dict, blob) -> dict:
        try:
            infos, has_more = self.cache.list_sessions(header["owner"], header["limit"], header.get("after"))
        except ValueError as error:
            raise InvalidInput(str(error), param="after") from None
        return {"data": [asdict(info) for info in infos], "has_more": has_more}

    def op_delete(self, header: dict, blob) -> dict:
        replay = self.cache.delete(header["session_id"], header["owner"], header.get("idempotency"))
        return {} if replay is None else {"replay": replay.entry}

    def op_fork(self, header: dict, blob) -> dict:
        return _maybe_replay(self.cache.fork(header["session_id"], header["owner"], header.get("idempotency")))

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
        return _maybe_replay(self.cache.replace(header["session_id"], header["owner"], data,
                                                header.get("idempotency")))

    # -- the server's life -------------------------------------------------------------------

    def op_stop_admitting(self, header: dict, blob) -> dict:
        for loaded in self.models.values():
            loaded.engine.stop_admitting()
        return {}

    def op_idle(self, header: dict, blob) -> dict:
        return {"idle": all(loaded.engine.idle for loaded in self.models.values())}

    def op_metrics(self, header: dict, blob) -> dict:
        return {"text": self.metrics.render(engine_side=True).decode()}


@dataclass
class _PendingLookup:
    """Stands for a generation while its prefix lookup runs: a cancel sets `cancelled`, which the
    request takes over when it is queued."""

    cancelled: threading.Event
    rows: list = None


def _maybe_replay(result) -> dict:
    """A session operation's answer: its info, or {"replay": entry} for an Idempotency-Key seen before."""
    return {"replay": result.entry} if isinstance(result, Replay) else asdict(result)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the API process dies (a kill -9 of the server stops both)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def read_settings(stream) -> Settings:
    """The first frame from the API process: {"op": "settings", "settings": {...}} (as JSON,
    without the API keys). Over the socket, not argv: a Redis URL may hold a password."""
    frame = read_frame(stream)
    if frame is None or frame[0].get("op") != "settings":
        raise RuntimeError("the API process sent no settings")
    return Settings(**frame[0]["settings"])


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
    stream = sock.makefile("rb")  # one buffered reader for the settings and every frame after them
    settings = None
    try:
        settings = read_settings(stream)
        process = EngineProcess(settings, sock)
    except Exception as error:
        # tell the API process why this process cannot start, in one line (it says it once, as
        # the reason the server stops); the traceback goes along for its debug log
        message, details = f"{type(error).__name__}: {error}", traceback.format_exc()
        password = urlsplit_password(settings.redis_url) if settings is not None else None
        if password:
            message, details = message.replace(password, "***"), details.replace(password, "***")
        try:
            FrameWriter(sock).send({"op": "failed", "error": message, "traceback": details})
        except OSError:  # the API process is gone too: this line is all anyone gets
            print(f"xlserve engine process: {message}", file=sys.stderr)
        sys.exit(1)
    process.serve(stream)


def urlsplit_password(url: str) -> str | None:
    """The password in a URL (None without one), to keep it out of what this process reports."""
    try:
        return urlsplit(url).password
    except ValueError:
        return None


if __name__ == "__main__":
    main(sys.argv[1:])
