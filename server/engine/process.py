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

What crosses the socket is server/engine/wire.py's: one dataclass per request the API process
makes (generate, append, cancel, acquire, commit, release, the session operations, and those of
the server's life), each answered by the method `EngineProcess` registers for its class
(`handlers`, checked whole at start-up) with a reply dataclass or an error; and, once per engine
step, one `events` frame with every token, choice end, finish and error of that step.

A request's new session state never leaves this process: a finished generation or append
leaves it waiting under its lease, and the API's `commit` (sent when the client has the whole
answer) makes it the session's state; `release` without a commit drops it.

Started by server/engine/client.py as `python -m xlserve.server.engine.process FD`; its settings
come as the first frame on the socket (`StartWithSettings`), never on the command line, which every
user sees in `ps` (a Redis URL may hold a password). On Linux it dies with the API process (a
kill -9 of the server stops both, as one process would stop); elsewhere it notices the socket
close, writes its sessions down and exits. If it dies on its own, the API process starts a new one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from xlserve.models.allocation import out_of_memory
from xlserve.models.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint, read_config
from xlserve.models.interface import LanguageModel
from xlserve.models.huge_pages import weights_on_huge_pages
from xlserve.models.quantize import QuantizationError, parameter_count, quantization_of, quantize_model, weight_bytes
from xlserve.models.tokenizer import tokenizer_for_checkpoint
from xlserve.server.cache import CorruptState, SessionInfo
from xlserve.server.cache.errors import CommitOutcomeUnknown
from xlserve.server.cache.session_cache import Lease, Replay, SessionCache
from xlserve.server.cache.codec import SessionData, conform_import, decode, floating_dtypes, session_data
from xlserve.server.cache.prefix_cache import PrefixCache
from xlserve.server.cache.state_directory import hold_state_directory
from xlserve.server.engine.errors import Cancelled, DeviceOutOfMemory, InvalidInput, ModelNotFound, QueueFull
from xlserve.server.engine.memory import MemoryReturner
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine, EventSink
from xlserve.server.engine.threads import own_torch_threads, threads_per_engine
from xlserve.server.engine.types import SamplingParams
from xlserve.server.engine.wire import (
    CHANGES_A_SESSION,
    HEARTBEAT_SECONDS,
    REQUESTS,
    Accepted,
    Acquire,
    Acquired,
    Append,
    Cancel,
    CheckIdle,
    Closed,
    Commit,
    CreateSession,
    DeleteSession,
    Done,
    StartWithSettings,
    ExportedState,
    ExportState,
    ForkSession,
    FrameKind,
    FrameWriter,
    Generate,
    GetMetrics,
    GetSession,
    Heartbeat,
    Idleness,
    ImportSession,
    ListSessions,
    MetricsText,
    Operation,
    Ready,
    Release,
    ReplaceState,
    Reply,
    Request,
    SessionChanged,
    SessionDescription,
    SessionPage,
    StartFailed,
    StopAdmitting,
    answer_frame,
    decode_request,
    error_answer_frame,
    event_to_wire,
    events_frame,
    is_last,
    read_frame,
)
from xlserve.server.metrics import Metrics
from xlserve.server.redis_urls import masked_url
from xlserve.server.settings import EngineSettings, Settings, environment_checked_elsewhere, parse_quantize
from xlserve.server.version import package_version

log = logging.getLogger("xlserve.engine_process")

SESSION_OP_THREADS = 32  # session operations in flight at once (most of their time is spent waiting on I/O)
# generations whose constraint compiles first wait on their own threads, at most this many at once
# and this many more queued (then 429): a client sending many distinct schemas must not hold the
# session operations' threads, which every other client's acquire and commit need
FIRST_COMPILE_THREADS = 4
FIRST_COMPILES_QUEUED = 32
# generations whose prefix lookup may wait (Redis, a file, a copy from host RAM: hundreds of MB at
# real size) wait on threads of their own too: a slow Redis must not hold the session operations'
PREFIX_LOOKUP_THREADS = 8


# the operations whose reply says a session changed (wire.py CHANGES_A_SESSION): one whose reply
# cannot be sent has changed it all the same (CommitOutcomeUnknown, never an error that reads as
# "nothing happened")
CHANGING_OPERATIONS = frozenset(request.operation for request in CHANGES_A_SESSION)


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


def exit_for_a_new_engine_process(error: BaseException) -> None:
    """An engine's step loop stopped on an error of its own (scheduler.py `_loop`): its requests
    were failed, but the model serves nothing more while the process, and its heartbeat, lives on.
    The process exits instead; the API process sees it go and starts a new one."""
    log.critical("an engine's step loop stopped (%s: %s); the engine process exits so that a new one starts",
                 type(error).__name__, error)
    logging.shutdown()
    os._exit(70)  # EX_SOFTWARE; os._exit: the other threads (and their locks) are not waited for


def load_models(settings: EngineSettings, metrics: Metrics, sink: EventSink,
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
    unknown = sorted(set(parse_quantize(settings.quantize)) - {""} - {directory.name for directory in directories})
    if unknown:
        raise QuantizationError(f"XLSERVE_QUANTIZE names {unknown[0]!r}, which is not a served model "
                                f"(served: {', '.join(directory.name for directory in directories)})")
    loaded = {}
    for directory in directories:
        started = time.perf_counter()
        model = load_checkpoint(directory, device=device, dtype=dtype)
        model = quantize_model(model, settings.quantize_for(directory.name))  # after .to(dtype): int8 stays int8
        weights_on_huge_pages(model)  # after quantizing: only the float tensors it still holds (models/huge_pages.py)
        tokenizer = tokenizer_for_checkpoint(read_config(directory), directory)
        # prefix entries shared through Redis outlive this process: they must name these weights
        shared = prefix_cache is not None and prefix_cache.remote is not None
        weights = weights_identity(directory, dtype, settings.quantize_for(directory.name)) if shared else b""
        engine = Engine(directory.name, model, tokenizer, metrics, sink, prefill_chunk=settings.prefill_chunk_tokens,
                        max_batch_size=settings.max_batch_size, max_queued=settings.max_queued_requests,
                        max_queued_per_key=settings.max_queued_per_key,
                        threads=threads, prompt_threads=prompt_threads, prefix_cache=prefix_cache,
                        constraint_cache_size=settings.structured_cache_size,
                        constraint_compile_seconds=settings.structured_compile_seconds,
                        constraint_token_seconds=settings.structured_token_milliseconds / 1000,
                        weights_identity=weights,
                        on_loop_failure=exit_for_a_new_engine_process)
        loaded[directory.name] = LoadedModel(directory.name, directory, model, tokenizer, engine,
                                             time.perf_counter() - started)
    return loaded


def weights_identity(directory: Path, dtype: torch.dtype, quantize: str) -> bytes:
    """What a model's prefix states depend on besides its served name: its checkpoint's bytes
    (config and weights, hashed: about 0.8 s for wt103's 1.1 GB, read from the page cache just
    after loading) and how this replica computes with them (dtype, quantization, and the
    version of xlserve: a release may compute a model otherwise, as Mamba-2's grouped norm
    changed). Prefix entries in Redis outlive the replica that wrote them and are found by every
    replica, so an entry written with other weights under the same name (a new checkpoint rolled
    out, an int8 replica beside float32 ones, a replica of another release during a rolling
    upgrade) must not be found: the engine mixes this into every scope."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(directory / name, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
    digest.update(f"dtype={dtype};quantize={quantize};xlserve={package_version()}".encode())
    return digest.digest()


def session_bytes_when_full(model: LanguageModel, state_dtype: torch.dtype) -> int | None:
    """What one session of `model` counts against the tier budgets once its memory is full
    (SessionData.nbytes): its state, floating tensors in the cache's `state_dtype`, and its
    float32 next-token row. From shapes, without a forward; None where the state grows without bound."""
    state = model.full_state_bytes(state_dtype)
    return None if state is None else state + model.vocab_size * 4  # float32 row


def model_card(loaded: LoadedModel, created: int, state_dtype: torch.dtype = torch.float32) -> dict:
    """/v1/models' card of one loaded model; `state_dtype`: the dtype the session cache keeps states in."""
    model = loaded.model
    return {
        "id": loaded.name, "object": "model", "created": created, "owned_by": "xlserve",
        "architecture": model.architecture, "state_kind": model.state_kind,
        "state_grows_with_context": model.state_grows_with_context, "max_context": model.max_context,
        "state_bytes_per_session": session_bytes_when_full(model, state_dtype),
        "parameters": parameter_count(model), "config": model.config.to_dict(),
        "quantize": quantization_of(model), "weight_bytes": weight_bytes(model),
    }


# -- importing a session state -----------------------------------------------------------------


# An imported state's safetensors header: its tensors' names, dtypes, shapes and offsets, and the
# metadata an export writes (a few KB for any shipped model). Bounded before it is parsed: an
# untrusted JSON header of the body's size takes about 24 bytes of memory a byte to parse, and
# metadata values are quoted back in error messages, which go to the API process whole
MAX_IMPORT_HEADER_BYTES = 1 << 20
MAX_IMPORT_METADATA_VALUE = 4096


def decode_import(blob: bytes):
    """An imported state's (metadata, state tensors, next_log_probs); InvalidInput (400
    invalid_state) for a body that is no xlserve session state, a header past
    MAX_IMPORT_HEADER_BYTES, or a metadata value past MAX_IMPORT_METADATA_VALUE characters."""

    def refuse(message: str) -> InvalidInput:
        return InvalidInput(message, param="body", code="invalid_state")

    declared = int.from_bytes(blob[:8], "little") if len(blob) >= 8 else 0
    if MAX_IMPORT_HEADER_BYTES < declared <= len(blob) - 8:  # one longer than the body is no safetensors file at all
        raise refuse(f"the body's safetensors header is {declared:,} bytes; an exported state's is a few KB, and "
                     f"the limit is {MAX_IMPORT_HEADER_BYTES:,}")
    try:
        meta, tensors, next_log_probs = decode(blob, require_checksum=False)  # a checksum, when present, must match
    except CorruptState as error:
        raise refuse(f"the body is not an xlserve session state: {error}") from None
    long = next((key for key, value in meta.items() if len(value) > MAX_IMPORT_METADATA_VALUE), None)
    if long is not None:
        raise refuse(f"the state's metadata value {long[:64]!r} is {len(meta[long]):,} characters; the limit is "
                     f"{MAX_IMPORT_METADATA_VALUE:,}")
    return meta, tensors, next_log_probs


# The largest magnitude a floating state tensor of an import may hold (float32, bfloat16 and
# float64 tensors; a float16 tensor's own range, 65,504, is its bound). No state the shipped
# checkpoints make comes near it: after a 4,000-token document the largest value is 4.6e4, in the
# Performer's `value_sums`, a running sum that grows about 11 per token (1e12 is ~1e11 tokens
# away); every other architecture stays under 2e3. And the model's arithmetic on such values
# stays finite: a product of two of them, summed over a head's dimensions, is ~1e27, far below
# float32's 3.4e38. A state of 3e38 passes the finiteness check and overflows the first forward.
STATE_MAGNITUDE_BOUND = 1e12

# the token the import probe feeds: any token does, the probe asks only whether the state still
# gives finite log-probabilities after one more
PROBE_TOKEN = 0


def validated_import(name: str, model: LanguageModel, meta: dict[str, str], tensors, next_log_probs,
                     state_dtype: torch.dtype | None = None) -> SessionData:
    """A decoded state that fits model `name`, on its device; InvalidInput (code "invalid_state",
    naming the tensor at fault) otherwise. Everything the model could not have produced is
    refused here (`LanguageModel.check_session`: finite tensors, lengths that agree with each
    other and with the token count, a next-token row that is a log-distribution; magnitudes
    within STATE_MAGNITUDE_BOUND), and so is a state the model cannot go on from (`probe_forward`:
    one forward step on PROBE_TOKEN must give finite log-probabilities), before the state
    replaces anything or runs beside another request. With `state_dtype` (the session cache's
    XLSERVE_STATE_DTYPE), what is checked and probed is the state as the cache will hold it: a
    float32 value that a 16-bit dtype rounds to 0 or saturates could pass in float32 and fail
    every request after."""

    def refuse(message: str):
        return InvalidInput(message, param="body", code="invalid_state")

    if meta.get("model") != name:
        raise refuse(f"the state belongs to model '{meta.get('model')}', not '{name}'")
    if meta.get("architecture") and meta["architecture"] != model.architecture:
        raise refuse(f"the state is of architecture '{meta['architecture']}', '{name}' is {model.architecture}")
    try:
        # a state exported in any floating dtype (`state_dtype` metadata) is checked and probed in
        # the model's compute dtype; the cache stores it in its own state dtype
        tensors = conform_import(tensors, compute_dtypes(model), meta.get("state_dtype"))
        data = session_data(model.state_class, meta, tensors, next_log_probs)
        if state_dtype is not None:  # as the cache keeps it, then as the model computes with it
            data = data.cast_state(state_dtype).cast_state(compute_dtypes(model))
        model.check_session(data.state, data.tokens, data.next_log_probs)
        check_state_magnitudes(data)
        data = data.to(model.device)
        probe_forward(model, data)
    except (ValueError, IndexError, RuntimeError, TypeError, OverflowError, MemoryError) as error:  # RuntimeError: torch on a malformed tensor
        if out_of_memory(error):  # a RuntimeError on the CPU too, but the server's trouble, not the state's
            raise DeviceOutOfMemory(f"the device of model '{name}' ran out of memory while checking the imported "
                                    "state; retry") from None
        raise refuse(f"the state does not fit model '{name}': {error}") from None
    return data


@functools.cache
def compute_dtypes(model: LanguageModel) -> dict[str, torch.dtype]:
    """The dtype of each floating tensor of `model`'s fresh state: what its forward computes in,
    and what a state kept in XLSERVE_STATE_DTYPE is converted to for a request. Once per model
    (a served model lives as long as the process)."""
    with torch.inference_mode():
        return floating_dtypes(model.init_state(1))


def check_state_magnitudes(data: SessionData) -> None:
    """Raise ValueError naming the first floating state tensor with a value beyond
    STATE_MAGNITUDE_BOUND (in a dtype that can hold the bound)."""
    for name, tensor in data.state.to_tensors().items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if torch.finfo(tensor.dtype).max <= STATE_MAGNITUDE_BOUND:
            continue  # float16: its range is already the bound, and the finiteness check holds it
        largest = float(tensor.detach().abs().max())
        if largest > STATE_MAGNITUDE_BOUND:
            raise ValueError(f"state tensor '{name}' holds a value of magnitude {largest:.3g}, beyond "
                             f"the {STATE_MAGNITUDE_BOUND:.0e} no state of this server reaches")


def probe_forward(model: LanguageModel, data: SessionData) -> None:
    """Raise ValueError when one forward step of `model` from the state on PROBE_TOKEN gives a
    log-probability that is not finite: the first use of the session would fail the same way.
    One token of batch one, on this session-op thread, beside (not in) the engine's batch: the
    forward changes neither the model nor the state. A state with no room for one more token (a
    model's history limit) is not probed: no request can feed it a token anyway."""
    limit = model.history_limit
    if limit is not None and data.tokens >= limit:
        return
    token = torch.tensor([[PROBE_TOKEN]], device=model.device)
    with torch.no_grad():
        log_probs, _ = model(token, data.state)
    if not bool(torch.isfinite(log_probs).all()):
        raise ValueError(f"one forward step from it on token {PROBE_TOKEN} gives log-probabilities that are "
                         "not finite")


# -- the process -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Handler:
    method: Callable[[EngineProcess, Request], Reply | Deferred | None]
    # answered on the reader thread, in the order the frames came: quick work only, and what must
    # not wait behind a session operation's I/O (a cancel)
    inline: bool


@dataclass(frozen=True)
class Deferred:
    """A handler's answer that comes later, from `work` run on the session-op pool (or `pool`): it
    may wait on I/O, which the reader thread must never do."""

    work: Callable[[], Reply]
    pool: ThreadPoolExecutor | None = None


class HandlerTable:
    """Which method of EngineProcess answers each request class (server/engine/wire.py), as
    registered with `register`; `check_complete` says whether every class has one."""

    def __init__(self):
        self.handlers: dict[type[Request], Handler] = {}

    def register(self, request_class: type[Request], inline: bool = False):
        def decorate(method):
            if request_class in self.handlers:
                raise TypeError(f"two handlers for {request_class.__name__}")
            self.handlers[request_class] = Handler(method, inline)
            return method

        return decorate

    def __getitem__(self, request_class: type[Request]) -> Handler:
        return self.handlers[request_class]

    def check_complete(self) -> None:
        missing = sorted(cls.__name__ for cls in REQUESTS.values() if cls not in self.handlers)
        if missing:
            raise RuntimeError(f"the engine process has no handler for {', '.join(missing)}")


class EngineProcess:
    """Answers the API process's requests, each with the handler registered for its class, and
    sends the engines' events back as they come."""

    handlers = HandlerTable()

    def __init__(self, settings: Settings, sock: socket.socket):
        self.handlers.check_complete()  # before anything loads: a request nobody answers is a bug
        self.settings = settings
        self.sock = sock
        self.writer = FrameWriter(sock)
        self.metrics = Metrics()
        self.state_directory = hold_state_directory(settings.cache.state_dir)  # held while this process lives
        self.cache = SessionCache.from_settings(settings.cache, self.metrics)
        # one budget per tier for both: entries take only the room sessions leave, and give it back
        self.prefix_cache = PrefixCache.from_settings(settings.prefix_cache, settings.cache, self.metrics,
                                                     sessions=self.cache.manager)
        if self.prefix_cache is not None:
            self.cache.lend_to(self.prefix_cache)
        self.models = load_models(settings.engine, self.metrics, sink=self._send_events, prefix_cache=self.prefix_cache)
        self.sessions_found = self.cache.open({name: loaded.model for name, loaded in self.models.items()})
        self.metrics.declare_engine_series(list(self.models), list(self.cache.manager.tiers))
        # each tier's budget and how full it is, read from the manager at every scrape
        self.metrics.declare_tiers(self.cache.manager.budgets, self.cache.manager.used, self.cache.manager.tiers[-1])
        self.lock = threading.Lock()  # guards the four tables below
        self.leases: dict[int, Lease] = {}
        self.results: dict[int, SessionData] = {}  # lease -> the state its request ended with, until commit
        # lease -> whether a release came while its commit runs (the release then waits for it)
        self.committing: dict[int, bool] = {}
        # request id -> (the request, its engine, the lease its result is for) while it runs
        self.requests: dict[int, tuple[EngineRequest, Engine, int | None]] = {}
        self.lease_ids = itertools.count(1)
        # session operations may read files or ask Redis: off the reader thread, so a cancel
        # is never stuck behind them. Enough threads that requests waiting on a slow Redis (each
        # for at most its own store timeout) do not queue the others behind them; the cache
        # serialises its local work on its own lock and never holds it while Redis is asked
        self.pool = ThreadPoolExecutor(max_workers=SESSION_OP_THREADS, thread_name_prefix="session-op",
                                       initializer=own_torch_threads, initargs=(1,))
        self.first_compiles = ThreadPoolExecutor(max_workers=FIRST_COMPILE_THREADS, thread_name_prefix="first-compile",
                                                 initializer=own_torch_threads, initargs=(1,))
        self.first_compiles_waiting = 0  # guarded by self.lock: deferred generations not yet queued
        # guarded by self.lock: generations waiting for their prefix lookup, not yet queued (their
        # engine's queue bound counts them only once queued: this bounds the pool's own queue)
        self.prefix_lookups_waiting = 0
        # and of them, each API key's owner's: XLSERVE_MAX_QUEUED_PER_KEY bounds one key's here too,
        # or one key's burst of slow lookups would fill the bound and every other key get 429
        self.prefix_lookups_of: Counter[str] = Counter()
        # likewise each key's generations waiting for a first compile: one key sending schemas
        # that differ by a title took every place, and every other key's first schema got 429
        self.first_compiles_of: Counter[str] = Counter()
        self.prefix_lookups = ThreadPoolExecutor(max_workers=PREFIX_LOOKUP_THREADS, thread_name_prefix="prefix-lookup",
                                                 initializer=own_torch_threads, initargs=(1,))
        # freed memory goes back to the system once the engines idle (server/engine/memory.py)
        self.memory = MemoryReturner.for_engine_process(
            lambda: all(loaded.engine.idle for loaded in self.models.values()), settings.engine.return_memory)

    def ready(self) -> Ready:
        """The models (what /v1/models says, and what the API process needs to tokenise for
        them) and what the start-up log says about this process."""
        models = []
        for name, loaded in self.models.items():
            created = int((loaded.directory / "config.json").stat().st_mtime)
            weights = next(loaded.model.parameters(), None)
            models.append({"name": name, "directory": str(loaded.directory), "vocab_size": loaded.model.vocab_size,
                           "checkpoint_config": read_config(loaded.directory),
                           "card": model_card(loaded, created, self.cache.state_dtype),
                           # an exported state of a full memory in float32, the widest an export is:
                           # what the API process sizes its state bodies by (deps.py state_body_limit)
                           "state_body_bytes": session_bytes_when_full(loaded.model, torch.float32),
                           "device": str(loaded.model.device),
                           "dtype": str(weights.dtype).removeprefix("torch.") if weights is not None else "none",
                           "load_seconds": round(loaded.load_seconds, 3),
                           "every_forward_on_prompt_threads": loaded.engine.every_forward_on_prompt_threads})
        engine, cache = self.settings.engine, self.settings.cache
        # what the engines run on (their worker threads settled it): counted again here, on this
        # thread, which runs torch on one since loading, it read 1 whatever the machine had
        engines = [loaded.engine for loaded in self.models.values()]
        threads, prompt_threads = ((engines[0].threads, engines[0].prompt_threads) if engines else
                                   threads_per_engine(engine.torch_threads, engine.prompt_threads, 1))
        store = {"state_dir": str(Path(cache.state_dir).resolve()), "device_bytes": cache.device_state_bytes,
                 "host_bytes": cache.host_state_bytes, "disk_bytes": cache.disk_state_bytes,
                 "redis": masked_url(cache.redis_url) if cache.redis_url else None,
                 "sessions": self.sessions_found}
        return Ready(models, os.getpid(), {"forward": threads, "prompt": prompt_threads, "cores": os.cpu_count()},
                     store)

    def serve(self, stream=None) -> None:
        """Answer frames until `shutdown` or until the API process is gone (`stream`: the socket's
        reader, when main() has already read the settings frame from it)."""
        self.writer.send(*self.ready().frame())
        stopping = threading.Event()
        threading.Thread(target=self._beat, args=(stopping,), name="heartbeat", daemon=True).start()
        stream = stream if stream is not None else self.sock.makefile("rb")
        graceful = False
        while True:
            frame = read_frame(stream)
            if frame is None:
                break
            header, blob = frame
            if header["op"] == FrameKind.SHUTDOWN.value:
                graceful = True
                break
            self.dispatch(header, blob)
        stopping.set()
        self.close()
        if graceful:
            self.writer.send(*Closed().frame())

    def _beat(self, stopping: threading.Event) -> None:
        """Tell the API process, from a thread of its own, that this process runs: its watchdog
        (XLSERVE_ENGINE_STALL_SECONDS) restarts one that falls silent while work waits. A thread
        apart from the engines' steps, because a long prefill step is no stall; what silences it is
        a frozen process (SIGSTOP, a debugger), not a step that runs long. Each beat also says how
        long every model's step under way has run, so that a step that never returns (a hung
        kernel) is noticed too (XLSERVE_ENGINE_STEP_SECONDS), although this thread beats on."""
        while not stopping.wait(HEARTBEAT_SECONDS):  # ends with serve(), or when the API process is gone
            steps = {name: seconds for name, loaded in self.models.items()
                     if (seconds := loaded.engine.step_seconds()) is not None}
            try:
                self.writer.send(*Heartbeat(steps_running=steps).frame())
            except OSError:
                return

    def close(self) -> None:
        self.memory.close()
        for loaded in self.models.values():
            loaded.engine.close()
        self.pool.shutdown(wait=True)
        self.first_compiles.shutdown(wait=True)
        self.prefix_lookups.shutdown(wait=True)
        self.cache.close()
        self.state_directory.close()  # the directory is free for the next process

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, header: dict, blob: bytes | None) -> None:
        """Run the handler of the request a frame carries (on this thread if it is inline, on
        the session-op pool otherwise); its reply or error goes back under the frame's id."""
        call_id = header.get("id")
        try:
            request = decode_request(header, blob)
        except (ValueError, TypeError) as error:  # an operation nobody defined, fields that do not fit it
            self.answer_error(call_id, header.get("op"), error)
            return
        handler = self.handlers[type(request)]
        work = functools.partial(handler.method, self, request)
        if handler.inline:
            self.run(work, call_id, request.operation)
        else:
            self.pool.submit(self.run, work, call_id, request.operation)

    def run(self, work: Callable[[], Reply | Deferred | None], call_id: int | None, operation: Operation) -> None:
        try:
            result = work()
        except Exception as error:
            self.answer_error(call_id, operation.value, error)
            return
        finally:
            self.memory.freed()  # a delete, release or commit may have let go of a state
        if isinstance(result, Deferred):
            (result.pool or self.pool).submit(self.run, result.work, call_id, operation)
        elif result is not None and call_id is not None:
            try:
                frame = answer_frame(call_id, result)
            except Exception as error:  # a reply that does not encode: its call is answered with the error, not left waiting
                log.exception("the answer to a %s call could not be encoded", operation.value)
                if operation in CHANGING_OPERATIONS:  # the change was made: the client must not take it as not made
                    error = CommitOutcomeUnknown(f"the {operation.value} was carried out, but its answer could not be "
                                                 f"sent ({type(error).__name__}): read the session to see it")
                self.answer_error(call_id, operation.value, error)
                return
            self.writer.send_in_parts(*frame)  # a large state in parts, so the steps' events go between them

    def answer_error(self, call_id: int | None, operation: str | None, error: BaseException) -> None:
        if call_id is None:  # a notice: nobody waits for an answer
            log.error("engine process: %s failed: %r", operation, error)
        else:
            self.writer.send(*error_answer_frame(call_id, error))

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

    @handlers.register(Generate, inline=True)
    def generate(self, request: Generate) -> Accepted | Deferred:
        engine = self.loaded(request.model).engine
        if request.lease is None:  # a prompt past the model's context is refused before any prefix lookup
            engine.check_context("generate", 0, len(request.prompt), request.params.max_tokens)
        params = request.params
        constraint = None
        if params.constraint_kind is not None:
            constraint = engine.constraints.cached_matcher(params.constraint_kind, params.constraint or "",
                                                           params.constraint_param)
        # a constraint compiled for the first time may take up to its time limit, and the prefix
        # cache may ask Redis or read a file: neither on the reader thread, where it would hold up
        # every other frame (a cancel among them)
        compile_first = params.constraint_kind is not None and constraint is None
        if compile_first or (request.lease is None and request.prefix_scope is not None
                             and engine.prefix_lookup_waits):
            with self.lock:
                if compile_first and self.first_compiles_waiting >= FIRST_COMPILE_THREADS + FIRST_COMPILES_QUEUED:
                    raise QueueFull(f"{self.first_compiles_waiting} requests wait for a constraint to compile; "
                                    "retry later", code="constraint_compiler_busy")
                if not compile_first and self.prefix_lookups_waiting >= PREFIX_LOOKUP_THREADS + engine.max_queued:
                    raise QueueFull(f"{self.prefix_lookups_waiting} requests wait for their prefix-cache lookup "
                                    f"(XLSERVE_MAX_QUEUED_REQUESTS: {engine.max_queued}); retry later", code="queue_full")
                owner, waiting_of = request.owner, self.first_compiles_of if compile_first else self.prefix_lookups_of
                if owner is not None and engine.max_queued_per_key and waiting_of[owner] >= engine.max_queued_per_key:
                    raise QueueFull(f"this API key has {waiting_of[owner]} requests waiting for "
                                    f"{'a constraint to compile' if compile_first else 'their prefix-cache lookup'}, "
                                    f"the limit per key is {engine.max_queued_per_key} (XLSERVE_MAX_QUEUED_PER_KEY); "
                                    "retry later", code="constraint_compiler_busy" if compile_first else "queue_full")
                self.first_compiles_waiting += compile_first
                self.prefix_lookups_waiting += not compile_first
                if owner is not None:
                    waiting_of[owner] += 1
            return self._off_the_reader(request.request_id, engine,
                                        lambda cancelled: self._deferred_generate(request, engine, cancelled, compile_first),
                                        self.first_compiles if compile_first else self.prefix_lookups)
        if request.lease is not None and self._casts(request.lease, engine):
            return self._off_the_reader(request.request_id, engine,
                                        lambda cancelled: self._generate(request, engine, cancelled, constraint))
        return self._generate(request, engine, constraint=constraint)

    def _deferred_generate(self, request: Generate, engine: Engine, cancelled: threading.Event,
                           compile_first: bool) -> Accepted:
        """`generate`'s slow part, on a pool of its own (first compiles', or prefix lookups', through
        `_off_the_reader`): the constraint's compile, or the prefix lookup, then the request queued."""
        params = request.params
        try:
            if cancelled.is_set():  # its client left while it waited: nothing to compile or look up for
                raise Cancelled("cancelled before its constraint compiled" if compile_first
                                else "cancelled before its prefix lookup")
            constraint = None
            if compile_first:
                constraint = engine.constraints.matcher(params.constraint_kind, params.constraint or "",
                                                        params.constraint_param)
            return self._generate(request, engine, cancelled, constraint)
        finally:
            with self.lock:
                if compile_first:
                    self.first_compiles_waiting -= 1
                else:
                    self.prefix_lookups_waiting -= 1
                waiting_of = self.first_compiles_of if compile_first else self.prefix_lookups_of
                if request.owner is not None:
                    waiting_of[request.owner] -= 1
                    if not waiting_of[request.owner]:
                        del waiting_of[request.owner]

    def _generate(self, request: Generate, engine: Engine, cancelled: threading.Event | None = None,
                  constraint: object = None) -> Accepted:
        """Queue the generation; `constraint` its compiled matcher, when it has one (the
        scheduler compiles it otherwise)."""
        params = request.params
        if request.lease is not None:
            fields = {"start": self.starting_data(request.lease, engine)}
        elif request.prefix_scope is not None:  # no session: reuse the longest cached prefix of the prompt
            # a request the queue would refuse is refused before its lookup reads, fetches or copies
            # hundreds of MB at real size, and counts a hit that reused nothing
            engine.check_admitted(params.n, request.owner)
            echo_alternatives = params.echo and bool(params.logprobs)
            fields = engine.start_from_prefix(request.prompt, bytes.fromhex(request.prefix_scope), echo_alternatives)
        else:
            fields = {"start": engine.fresh_data()}
        if cancelled is not None:
            fields["cancelled"] = cancelled
        owner = self.lease(request.lease).info.owner if request.lease is not None else request.owner
        queued = EngineRequest("generate", request.prompt, params=params, keep_state=request.lease is not None,
                               handle=request.request_id, owner=owner, constraint=constraint, **fields)
        return self._enqueue(queued, engine, request.lease)

    @handlers.register(Append, inline=True)
    def append(self, request: Append) -> Accepted | Deferred:
        lease = self.lease(request.lease)
        engine = self.loaded(lease.info.model).engine

        def queue(cancelled: threading.Event | None = None) -> Accepted:
            queued = EngineRequest("append", request.tokens, self.starting_data(request.lease, engine),
                                   SamplingParams(max_tokens=0), score=request.score,
                                   handle=request.request_id, owner=lease.info.owner,
                                   **({"cancelled": cancelled} if cancelled is not None else {}))
            return self._enqueue(queued, engine, request.lease)

        if self._casts(request.lease, engine):
            return self._off_the_reader(request.request_id, engine, queue)
        return queue()

    def _casts(self, lease_id: int, engine: Engine) -> bool:
        """Whether the leased state is kept in another dtype than `engine`'s model computes in
        (XLSERVE_STATE_DTYPE bfloat16 or float16): its conversion (`starting_data`) copies the
        whole state, 237 MB at transfo-xl-wt103's shape, which is not for the reader thread."""
        wanted = compute_dtypes(engine.model)
        return any(tensor.dtype != wanted.get(name, tensor.dtype)
                   for name, tensor in self.lease(lease_id).data.state._named_tensors() if tensor.is_floating_point())

    def _off_the_reader(self, request_id: int, engine: Engine, queue: Callable[[threading.Event], Accepted],
                        pool: ThreadPoolExecutor | None = None) -> Deferred:
        """Queue the request from `pool`'s threads (the session-op threads by default) with
        `queue(cancelled)`, a stand-in registered first so that a cancel sent meanwhile is not
        lost; whatever fails before it is queued takes the stand-in out of the table."""
        cancelled = threading.Event()
        with self.lock:
            self.requests[request_id] = (_PendingLookup(cancelled), engine, None)

        def run() -> Accepted:
            try:
                return queue(cancelled)
            except BaseException:
                with self.lock:
                    self.requests.pop(request_id, None)
                raise

        return Deferred(run, pool or self.pool)

    def starting_data(self, lease_id: int, engine: Engine) -> SessionData:
        """The leased session's state in the dtypes `engine`'s model computes in: the cache keeps
        it in XLSERVE_STATE_DTYPE, and the model code never sees another dtype than its own (with
        the two alike, the lease's own tensors, not a copy). The request's new state goes back
        to the state dtype when it is committed (SessionCache.commit)."""
        return self.lease(lease_id).data.cast_state(compute_dtypes(engine.model))

    def _enqueue(self, request: EngineRequest, engine: Engine, lease_id: int | None) -> Accepted:
        """Queue `request` (its handle is its id), registered first: its events may come at once."""
        with self.lock:
            self.requests[request.handle] = (request, engine, lease_id)
        try:
            engine.enqueue(request)
        except BaseException:
            with self.lock:
                self.requests.pop(request.handle, None)
            raise
        return Accepted()

    @handlers.register(Cancel, inline=True)
    def cancel(self, request: Cancel) -> None:
        with self.lock:
            running = self.requests.get(request.request_id)
        if running is not None:
            queued, engine, _ = running
            queued.cancelled.set()
            engine.wake()

    def _send_events(self, items: list[tuple[int, object]]) -> None:
        """The engines' sink (their worker threads): one frame per step."""
        events = []
        for request_id, event in items:
            if is_last(event):  # forget the request; keep a finished one's state for its commit
                self._ended(request_id, getattr(event, "data", None))
            events.append(event_to_wire(request_id, event))
        try:
            self.writer.send(*events_frame(events))
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

    @handlers.register(Acquire)
    def acquire(self, request: Acquire) -> Acquired:
        lease = self.cache.acquire(request.session_id, request.owner, request.idempotency)
        if lease.replay is not None:  # the request's Idempotency-Key was seen: its first result, nothing held
            return Acquired(lease.info, replay=lease.replay)
        with self.lock:
            lease_id = next(self.lease_ids)
            self.leases[lease_id] = lease
        return Acquired(lease.info, lease_id, has_history=lease.data.next_log_probs is not None)

    # A commit is taken on the reader thread, in the order the frames came, and written on the
    # session-op pool. The API process sends Release whenever it leaves a session's block: a
    # client that hung up once its commit had begun (a websocket closed, an SSE stream dropped
    # while the commit was on its way) sends Commit and Release back to back. Read at once, the
    # release would end the lease under the commit waiting in the pool, and a commit that had
    # begun would be lost (cancellation.py: once it has begun, a cancel changes nothing). So the
    # release of a lease whose commit runs waits for it, and runs after it; meanwhile the session's
    # hold is the commit's (session_cache.py `release_after_commit`), so that the client's retry
    # waits for the write, as design.md section 6 says, instead of 409 session_busy.

    @handlers.register(Commit, inline=True)
    def commit(self, request: Commit) -> Deferred:
        with self.lock:
            lease = self.leases.get(request.lease)
            if lease is None:
                raise ValueError(f"no lease {request.lease}")
            data = self.results.pop(request.lease, None)
            if data is None:
                raise ValueError("nothing to commit: the request did not finish")
            self.committing[request.lease] = False

        def write() -> SessionDescription:
            try:
                return SessionDescription(self.cache.commit(lease, data, request.remember))
            finally:
                with self.lock:
                    released = self.committing.pop(request.lease)
                if released:
                    self.release(Release(request.lease))

        return Deferred(write)

    @handlers.register(Release, inline=True)
    def release(self, request: Release) -> None:
        with self.lock:
            committing = request.lease in self.committing
            if committing:
                self.committing[request.lease] = True  # the commit's end releases it
                lease = self.leases.get(request.lease)
            else:
                lease = self.leases.pop(request.lease, None)
                self.results.pop(request.lease, None)
        if lease is None:
            return
        if committing:  # meanwhile its hold is the commit's: the client's retry waits for the write, not 409
            self.cache.release_after_commit(lease)
        else:
            self.cache.release(lease)

    @handlers.register(CreateSession)
    def create_session(self, request: CreateSession) -> SessionChanged:
        engine = self.loaded(request.model).engine
        return _changed(self.cache.create(request.model, request.owner, engine.fresh_data(), request.idempotency))

    @handlers.register(GetSession)
    def get_session(self, request: GetSession) -> SessionDescription:
        return SessionDescription(self.cache.info(request.session_id, request.owner))

    @handlers.register(ListSessions)
    def list_sessions(self, request: ListSessions) -> SessionPage:
        try:
            infos, has_more = self.cache.list_sessions(request.owner, request.limit, request.after)
        except ValueError as error:
            raise InvalidInput(str(error), param="after") from None
        return SessionPage(infos, has_more)

    @handlers.register(DeleteSession)
    def delete_session(self, request: DeleteSession) -> SessionChanged:
        replay = self.cache.delete(request.session_id, request.owner, request.idempotency)
        return SessionChanged(replay=None if replay is None else replay.entry)

    @handlers.register(ForkSession)
    def fork_session(self, request: ForkSession) -> SessionChanged:
        return _changed(self.cache.fork(request.session_id, request.owner, request.idempotency))

    @handlers.register(ExportState)
    def export_state(self, request: ExportState) -> ExportedState:
        info, state = self.cache.export(request.session_id, request.owner)
        return ExportedState(info, state)

    @handlers.register(ImportSession)
    def import_session(self, request: ImportSession) -> SessionChanged:
        meta, tensors, next_log_probs = decode_import(request.state)
        if not (request.model or meta.get("model")):  # a 404 would name a model the client never named
            raise InvalidInput("the state names no model in its metadata: import it with ?model=NAME",
                               param="body", code="invalid_state")
        loaded = self.loaded(request.model or meta["model"])
        data = validated_import(loaded.name, loaded.model, meta, tensors, next_log_probs, self.cache.state_dtype)
        return _changed(self.cache.import_new(loaded.name, request.owner, data, request.idempotency))

    @handlers.register(ReplaceState)
    def replace_state(self, request: ReplaceState) -> SessionChanged:
        current = self.cache.info(request.session_id, request.owner)
        loaded = self.loaded(current.model)
        data = validated_import(loaded.name, loaded.model, *decode_import(request.state), self.cache.state_dtype)
        return _changed(self.cache.replace(request.session_id, request.owner, data, request.idempotency))

    # -- the server's life -------------------------------------------------------------------

    @handlers.register(StopAdmitting, inline=True)
    def stop_admitting(self, request: StopAdmitting) -> Done:
        for loaded in self.models.values():
            loaded.engine.stop_admitting()
        return Done()

    @handlers.register(CheckIdle, inline=True)
    def check_idle(self, request: CheckIdle) -> Idleness:
        return Idleness(all(loaded.engine.idle for loaded in self.models.values()))

    @handlers.register(GetMetrics, inline=True)
    def get_metrics(self, request: GetMetrics) -> MetricsText:
        return MetricsText(self.metrics.render(engine_side=True).decode())


@dataclass
class _PendingLookup:
    """Stands for a generation while its prefix lookup runs: a cancel sets `cancelled`, which the
    request takes over when it is queued."""

    cancelled: threading.Event
    rows: list = None


def _changed(result: SessionInfo | Replay) -> SessionChanged:
    """A session change's reply: the session after it, or the entry of an Idempotency-Key seen before."""
    return SessionChanged(replay=result.entry) if isinstance(result, Replay) else SessionChanged(info=result)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the API process dies (a kill -9 of the server stops both)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def read_settings(stream) -> Settings:
    """The first frame from the API process: `StartWithSettings` (as JSON, without the API keys).
    Over the socket, not argv: a Redis URL may hold a password."""
    frame = read_frame(stream)
    if frame is None or frame[0].get("op") != FrameKind.SETTINGS.value:
        raise RuntimeError("the API process sent no settings")
    return Settings.from_engine_process_frame(StartWithSettings.from_frame(frame[0]).settings)


def main(argv: list[str]) -> None:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above took effect
        sys.exit(1)
    # signals are the API process's business: it drains, then sends `shutdown`
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s engine: %(message)s")
    environment_checked_elsewhere()  # the API process warned of a misspelt XLSERVE_ variable once
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
        password = urlsplit_password(settings.cache.redis_url) if settings is not None else None
        if password:
            message, details = message.replace(password, "***"), details.replace(password, "***")
        try:
            FrameWriter(sock).send(*StartFailed(message, details).frame())
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
