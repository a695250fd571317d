"""The API process's side of the engine process (server/engine/process.py); runs in the API
process and never imports torch.

`EngineClient` spawns the engine process with one end of a socketpair, sends it its settings as
the first frame (never on its command line: `ps` shows that to every user, and a Redis URL may
hold a password) and waits until it has loaded every model and opened the session cache. Then
one reader task routes what comes back: answers to the awaiting call, each step's events to the
queues of their requests.

A generation is a `RemoteSubmission`: the same consumer side as an in-process `Submission`
(`events()`, `cancel()`, the queue), so the routers do not care where the engine runs. A session
held by a request is a `RemoteLease`; its state stays in the engine process.

**The engine process heals.** Its life as seen from here (`status`): loading -> ready, and when
it dies, restarting -> ready again. Requests in flight when it dies get `EngineRestarting` (a
503 with Retry-After, or the error event of a stream that had started); new ones get the same
until the new process is ready. Nothing committed is lost: the session cache writes every
commit through to disk (or Redis) before it answers, and the new process indexes those files.
A lease belongs to the process that granted it (`generation`): one from a process that died is
never sent to its successor, whose lease ids start again at 1. More than
XLSERVE_ENGINE_RESTART_LIMIT restarts within XLSERVE_ENGINE_RESTART_WINDOW_SECONDS, or a first
start that fails, and the status is `failed` for good: `on_fatal` is told why, and
`xlserve serve` then exits non-zero so that a supervisor takes over.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from xlserve.server.cache.errors import CommitOutcomeUnknown, SessionInfo
from xlserve.server.engine.errors import EngineGone, EngineLoading, EngineRestarting, RequestFailed, ShuttingDown
from xlserve.server.engine.memory import engine_environment
from xlserve.server.engine.types import SamplingParams, Submission
from xlserve.server.engine.wire import (
    CHANGES_A_SESSION,
    Acquire,
    Append,
    Cancel,
    CheckIdle,
    Commit,
    CreateSession,
    DeleteSession,
    StartWithSettings,
    ExportState,
    ForkSession,
    PART_BYTES,
    FrameKind,
    Generate,
    GetMetrics,
    GetSession,
    Heartbeat,
    ImportSession,
    ListSessions,
    Ready,
    Release,
    ReplaceState,
    Reply,
    Request,
    SessionChanged,
    Shutdown,
    StartFailed,
    StopAdmitting,
    encode_frame,
    error_from_wire,
    frame_head,
    event_from_wire,
    is_last,
    read_frame_async,
    request_frame,
)
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

log = logging.getLogger("xlserve.engine_client")

# how long a dead (or closing) engine process may take to be reaped before it is killed
REAP_SECONDS = 10


class EngineStartFailed(RuntimeError):
    """The engine process could not load its models or open the session cache."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details  # the engine process's traceback, for a debug log


@dataclass
class RemoteLease:
    """A request's hold on a session; the state it starts from stays in the engine process."""

    id: int
    session_id: str
    info: SessionInfo  # as of the acquire: info.tokens is what the session's memory holds
    has_history: bool  # it has a next-token distribution to continue from
    released: bool = False
    generation: int = 0  # the engine process that granted it (EngineClient.generation)
    idempotency: dict | None = None  # the request's Idempotency-Key and fingerprint, remembered at commit
    replay: dict | None = None  # that key was seen before: its remembered entry (this lease holds nothing)


class RemoteSubmission(Submission):
    """A request running in the engine process; its events arrive through the reader task."""

    def __init__(self, client: "EngineClient", model: str, request_id: int):
        super().__init__(model, client.metrics, threading.Event())
        self.client, self.id = client, request_id
        self.ended = False  # the engine sent its last event (or this side gave it one)

    def _stop(self) -> None:
        if not self.ended and not self.cancelled.is_set():
            self.cancelled.set()
            self.client.send(Cancel(self.id))


def describe_exit(code: int | None) -> str:
    """How a process ended, in words: "was killed by SIGKILL", "exited with code 1"."""
    if code is None:
        return "closed its socket"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class EngineClient:
    def __init__(self, settings: Settings, metrics: Metrics,
                 on_ready: Callable[["EngineClient", bool], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        self.settings, self.metrics = settings, metrics
        self.on_ready = on_ready  # after every start: (this client, whether it was a restart)
        self.on_fatal = on_fatal  # once, when the engine cannot be (re)started: the server should stop
        self.process: subprocess.Popen | None = None
        self.models: list[dict] = []
        self.ready_frame: dict = {}  # what the engine process said when it was ready (the start-up log)
        self.status = "stopped"  # -> loading -> ready (-> restarting -> ready)* -> failed | closed
        self.reason = "the engine process has not started"
        self.generation = 0  # which engine process is the current one (counted from 1)
        self.ids = itertools.count(1)  # request and call ids: unique across engine processes
        self.calls: dict[int, asyncio.Future] = {}
        self.changing_calls: set[int] = set()  # those of `calls` that change a session (CHANGES_A_SESSION)
        self.parts: dict[int, list[bytes]] = {}  # call id -> the parts of its answer's blob so far (wire.py PART)
        self.submissions: dict[int, RemoteSubmission] = {}
        self.reader_task: asyncio.Task | None = None
        self.supervisor: asyncio.Task | None = None  # the background start, then any restart
        self.restarted_at: collections.deque[float] = collections.deque()  # within the window
        self.writer: asyncio.StreamWriter | None = None
        # while a frame with a large blob goes out in slices (`_write_large`), the whole frames
        # written meanwhile wait here, with the writer they were for, and follow it
        self.frames_behind: list[tuple[asyncio.StreamWriter, bytes]] | None = None
        self.large_write: asyncio.Lock = asyncio.Lock()
        self.closing = False
        self.heard_at = time.monotonic()  # the last frame from the engine process (its heartbeat at least)
        self.steps_running: dict[str, float] = {}  # the last heartbeat's: model -> seconds its step has run
        self.watchdog: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        """The engine process is up and answering."""
        return self.status == "ready"

    @property
    def exit_reason(self) -> str:  # the name /health used before restarts existed
        return self.reason

    # -- life --------------------------------------------------------------------------------

    async def start(self) -> "EngineClient":
        """Spawn the engine process and wait until it has loaded the models (from the running
        event loop's thread: on Linux the engine process dies with the thread that spawned it).
        Raises EngineStartFailed when it cannot start."""
        self.status, self.reason = "loading", "the engine process is loading the models"
        try:
            await self._spawn()
        except EngineStartFailed as error:
            self.status, self.reason = "failed", f"the engine process failed to start: {error}"
            raise
        self._ready(restarted=False)
        return self

    def start_in_background(self) -> None:
        """Start as `start` does, without waiting (the port can open meanwhile: requests get
        503 `loading`). A failure is `on_fatal`'s."""
        self.status, self.reason = "loading", "the engine process is loading the models"
        self.supervisor = asyncio.create_task(self._start_in_background())

    async def _start_in_background(self) -> None:
        try:
            await self.start()
        except EngineStartFailed as error:
            if not self.closing:
                log.debug("the engine process's traceback:\n%s", error.details)
                self._fatal(self.reason)
        except Exception as error:  # on_ready could not use what the engine process loaded
            log.debug("starting failed", exc_info=True)
            self._fatal(f"the server could not start: {type(error).__name__}: {error}")

    async def close(self, timeout: float = 120) -> int | None:
        """Stop the engines, let the cache write its sessions down, wait for the process. An
        engine process still loading (or restarting) has served nothing yet: it is killed."""
        self.closing = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            await asyncio.gather(self.watchdog, return_exceptions=True)
        if self.supervisor is not None and not self.supervisor.done():
            self.supervisor.cancel()
            await asyncio.gather(self.supervisor, return_exceptions=True)
        if self.process is None:
            self.status = "closed"
            return None
        if self.alive:
            self._write(encode_frame(*Shutdown().frame()))
        elif self.process.poll() is None:
            self.process.kill()
        self.status, self.reason = "closed", "the server is shutting down"
        try:
            code = await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not stop within %ss; killing it", timeout)
            self.process.kill()
            code = await asyncio.to_thread(self.process.wait)
        if self.reader_task is not None:
            self.reader_task.cancel()
            await asyncio.gather(self.reader_task, return_exceptions=True)
        if self.writer is not None:
            self.writer.close()
        self._fail_in_flight(lambda: ShuttingDown("the server is shutting down", code="shutting_down"),
                             changing=self._change_in_doubt)
        return code

    async def _spawn(self) -> None:
        """One engine process, up to its `ready` frame; EngineStartFailed if it says `failed`
        or dies first."""
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "xlserve.server.engine.process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=engine_environment(),  # fewer malloc arenas (memory.py)
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        writer.write(encode_frame(*StartWithSettings(self.settings.for_engine_process()).frame()))
        limit = self.settings.server.engine_start_seconds
        try:
            first = await asyncio.wait_for(read_frame_async(reader), limit)
        except TimeoutError:  # loading hung: a failed start, not a server loading for good
            writer.close()
            self.process.kill()
            await self._reap(self.process)
            raise EngineStartFailed(f"it was not ready after {limit:g}s (XLSERVE_ENGINE_START_SECONDS) and was "
                                    "killed", "") from None
        except BaseException:  # cancelled by close(), which kills the process
            writer.close()
            raise
        if first is None or first[0].get("op") != FrameKind.READY.value:
            writer.close()
            header = first[0] if first else {}
            failed = StartFailed.from_frame(header) if header.get("op") == FrameKind.FAILED.value else None
            code = await self._reap(self.process)
            reason = failed.error if failed is not None else f"it {describe_exit(code)} before it was ready"
            raise EngineStartFailed(self._masked(reason), failed.traceback if failed is not None else "")
        self._attach(reader, writer, Ready.from_frame(first[0]))

    def _attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ready: Ready) -> None:
        """Talk to the engine process that said `ready` on this connection from now on."""
        self.reader, self.writer = reader, writer
        self.generation += 1
        self.models = ready.models
        self.ready_frame = asdict(ready)
        self.heard_at = time.monotonic()
        self.steps_running = {}
        self.reader_task = asyncio.create_task(self._read(reader, self.generation))
        if self.watchdog is None or self.watchdog.done():
            self.watchdog = asyncio.create_task(self._watch())

    async def _reap(self, process: subprocess.Popen) -> int | None:
        """Wait for an engine process that is ending (killing it if it lingers); its exit code."""
        try:
            return await asyncio.to_thread(process.wait, REAP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            return await asyncio.to_thread(process.wait)

    def _ready(self, restarted: bool) -> None:
        self.status, self.reason = "ready", "the engine process is ready"
        for described in self.models:  # every model's restart count exists from the start, at 0
            self.metrics.engine_restarts.labels(described["name"])
        if self.on_ready is not None:
            self.on_ready(self, restarted)

    def _fatal(self, reason: str) -> None:
        self.status, self.reason = "failed", reason
        self._fail_in_flight(self.unavailable_error)
        if self.on_fatal is not None:
            self.on_fatal(reason)
        else:
            log.error("%s", reason)

    def _masked(self, text: str) -> str:
        """`text` without the Redis password, should the engine process have quoted it."""
        try:
            password = urlsplit(self.settings.cache.redis_url).password
        except ValueError:  # a URL urllib cannot take apart: Redis would not have taken it either
            password = None
        return text.replace(password, "***") if password else text

    # -- when the engine process dies ---------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader, generation: int) -> None:
        try:
            while True:
                frame = await read_frame_async(reader)
                if frame is None:
                    break
                header, blob = frame
                self.heard_at = time.monotonic()
                kind = header["op"]
                if kind == FrameKind.PART.value:  # a part of a large answer's blob: its answer follows
                    self.parts.setdefault(header["id"], []).append(blob)
                elif kind == FrameKind.EVENTS.value:
                    self._route(header["events"])
                elif kind == FrameKind.HEARTBEAT.value:
                    self.steps_running = Heartbeat.from_frame(header).steps_running
                elif kind == FrameKind.ANSWER.value:
                    future = self.calls.pop(header["id"], None)
                    self.changing_calls.discard(header["id"])
                    parts = self.parts.pop(header["id"], None)
                    if "parts" in header:  # joined by the call, off the event loop (`call`)
                        blob = parts or []
                    if future is not None and not future.done():
                        if "error" in header:
                            future.set_exception(_readable(error_from_wire, header["error"]))
                        else:
                            future.set_result((header["ok"], blob))
        finally:
            if not self.closing and generation == self.generation and self.status == "ready":
                self._lost()

    async def _watch(self) -> None:
        """Restart an engine process that is frozen: silent, not even its heartbeat, for
        XLSERVE_ENGINE_STALL_SECONDS while requests run or calls await answers. A dead one is
        noticed by `_read`; a stopped one (SIGSTOP) keeps its socket open and would hang every
        request. Idle, silence means nothing: no restart then.

        A process that beats while one of its models' steps never returns (a hung GPU kernel or
        driver call: every request of that model waits, and so would the others' at shutdown) is
        killed the same way once the step has run XLSERVE_ENGINE_STEP_SECONDS."""
        stall, step_limit = self.settings.server.engine_stall_seconds, self.settings.server.engine_step_seconds
        while not self.closing:  # ends with close()
            await asyncio.sleep(min(1.0, stall / 4, step_limit / 4))
            if self.status != "ready":
                continue
            pid = self.process.pid if self.process else "?"
            silent = time.monotonic() - self.heard_at
            if (self.calls or self.submissions) and silent > stall:
                self._kill_stuck(f"the engine process (pid {pid}) made no progress for {silent:.0f}s while work "
                                 f"waited (XLSERVE_ENGINE_STALL_SECONDS={stall:g}) and was killed")
                continue
            hung = {name: seconds for name, seconds in self.steps_running.items() if seconds > step_limit}
            if hung:
                name, seconds = max(hung.items(), key=lambda item: item[1])
                self._kill_stuck(f"model '{name}''s step had run for {seconds:.0f}s and never returned "
                                 f"(XLSERVE_ENGINE_STEP_SECONDS={step_limit:g}): the engine process (pid {pid}) "
                                 "was killed")

    def _kill_stuck(self, cause: str) -> None:
        """Kill an engine process that is alive but serves nothing (frozen, or a step hung), and
        restart it like a dead one."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()  # SIGKILL ends a stopped process too
        self._lost(cause)

    def _lost(self, cause: str | None = None) -> None:
        """The engine process is gone without being asked to stop: fail what was in flight,
        then start a new one (or give up), in the background."""
        self.status = "restarting"
        self.reason = f"{cause or 'the engine process died'}; a new one is starting"
        self._fail_in_flight(lambda: EngineRestarting(
            "the engine process died while this request ran; nothing of it was committed. A new engine "
            "process is starting: send the request again shortly", code="engine_restarting"),
            changing=self._change_in_doubt)
        self.supervisor = asyncio.create_task(self._restart(cause))

    @staticmethod
    def _change_in_doubt() -> CommitOutcomeUnknown:
        """What a call that changes a session is told when the engine process went while it ran
        (died, killed as frozen, or at shutdown): its write may have landed before the answer could
        be sent, so it is not "nothing was committed, send it again"."""
        return CommitOutcomeUnknown(
            "the engine process went while this request's change to a session was being written: it may have "
            "landed or not. Check the session (GET /v1/sessions/{id}: its version and tokens) before sending it "
            "again, or send it again with the same Idempotency-Key, which applies at most once")

    async def _restart(self, cause: str | None = None) -> None:
        """`cause`: why the engine process was killed, when it did not die of itself."""
        settings = self.settings.server
        dead = self.process
        code = await self._reap(dead) if dead is not None else None
        what = cause or f"the engine process (pid {dead.pid if dead else '?'}) {describe_exit(code)}"
        failures, counted = 0, False
        while True:
            now = time.monotonic()
            while self.restarted_at and now - self.restarted_at[0] > settings.engine_restart_window_seconds:
                self.restarted_at.popleft()
            if len(self.restarted_at) >= settings.engine_restart_limit:
                self._fatal(f"{what}; it was restarted {len(self.restarted_at)} times within "
                            f"{settings.engine_restart_window_seconds:g}s (XLSERVE_ENGINE_RESTART_LIMIT="
                            f"{settings.engine_restart_limit}): giving up")
                return
            self.restarted_at.append(now)
            if not counted:  # once per death, at its first start: however many attempts it takes, whether one succeeds
                for described in self.models:
                    self.metrics.engine_restarts.labels(described["name"]).inc()
                counted = True
            log.error("%s; starting a new one (restart %d of at most %d within %gs)", what, len(self.restarted_at),
                      settings.engine_restart_limit, settings.engine_restart_window_seconds)
            self.reason = f"{what}; a new one is starting"
            started = time.monotonic()
            try:
                await self._spawn()
            except EngineStartFailed as error:
                log.debug("the engine process's traceback:\n%s", error.details)
                what = f"the new engine process could not start ({error})"
                failures += 1
                await asyncio.sleep(min(failures, 5))  # a cause that persists is not retried at full speed
                continue
            log.warning("the engine process is back (pid %d, %.1fs); sessions are as last committed",
                        self.process.pid, time.monotonic() - started)
            self._ready(restarted=True)
            return

    def _fail_in_flight(self, error: Callable[[], BaseException],
                        changing: Callable[[], BaseException] | None = None) -> None:
        """Every call awaiting an answer and every running request ends with a fresh `error()`;
        with `changing`, a call that changes a session (CHANGES_A_SESSION) with `changing()`."""
        calls, self.calls = self.calls, {}
        changing_calls, self.changing_calls = self.changing_calls, set()
        self.parts = {}  # a dead process's answers never end
        for call_id, future in calls.items():
            if not future.done():
                future.set_exception(changing() if changing is not None and call_id in changing_calls else error())
        submissions, self.submissions = self.submissions, {}
        for submission in submissions.values():
            submission.ended = True
            submission.put(error())

    def cut(self, error: Callable[[], BaseException]) -> int:
        """End every generation and append still running with a fresh `error()` as its last
        event (shutdown, at the end of its grace period): each is cancelled in the engine, and
        its client is told why instead of seeing its stream stop. Returns how many there were."""
        submissions, self.submissions = self.submissions, {}
        for submission in submissions.values():
            submission.ended = True
            submission.cancelled.set()
            self.send(Cancel(submission.id))
            submission.put(error())
        return len(submissions)

    def unavailable_error(self) -> BaseException:
        """What a request gets while the engine process cannot take it."""
        if self.status in ("loading", "stopped"):
            return EngineLoading("the server is still loading its models; retry shortly", code="loading")
        if self.status == "restarting":
            return EngineRestarting(f"{self.reason}: retry shortly", code="engine_restarting")
        if self.status == "closed":
            return ShuttingDown("the server is shutting down", code="shutting_down")
        return EngineGone(f"{self.reason}; the server cannot serve requests", code="engine_gone")

    def _route(self, events: list) -> None:
        """One engine step's events into their requests' queues."""
        submissions = self.submissions
        for item in events:
            submission = submissions.get(item[0])
            if submission is None:  # a request this side already gave up on
                continue
            try:
                request_id, event = event_from_wire(item)
            except Exception as error:  # that request's event alone: it ends with the error, the frame's others go on
                log.exception("an event of request %s from the engine process could not be read", item[0])
                request_id, event = item[0], _unreadable(error)
                self.send(Cancel(request_id))  # and the engine stops it (harmless if that was its last event)
            if is_last(event):
                submission.ended = True
                del submissions[request_id]
            submission.put(event)

    # -- calls -------------------------------------------------------------------------------

    def send(self, notice: Request) -> None:
        """Send a request that is never answered (cancel, release); order with other frames is kept."""
        if self.alive:
            self._write(encode_frame(*request_frame(notice)))

    def _write(self, frame: bytes) -> None:
        """One whole frame to the engine process; behind a large frame going out in slices, after it."""
        if self.frames_behind is not None:
            self.frames_behind.append((self.writer, frame))
        else:
            self.writer.write(frame)

    async def _write_large(self, head: bytes, blob: bytes) -> None:
        """A frame whose blob is past PART_BYTES (a state to import, 237 MB at real size): its
        head, then the blob in PART_BYTES slices, the event loop free between them. Written whole
        (one write, or one frame joined first), it was copied twice more by the transport on the
        event loop, holding every client about 0.3 s, and held twice the state's memory while the
        answer was awaited. Frames written meanwhile follow it (`_write`); it goes to its end
        whatever happens to the request that sent it, or the stream would be cut mid-frame. The
        caller holds `large_write`, which this gives back once the frame is written."""
        writer, self.frames_behind = self.writer, []

        async def slices() -> None:
            try:
                writer.write(head)
                view = memoryview(blob)
                for start in range(0, len(view), PART_BYTES):
                    writer.write(view[start : start + PART_BYTES])
                    await writer.drain()
                    await asyncio.sleep(0)  # the others' turn, whether the socket took it all or not
            except ConnectionError:  # the engine process went: its calls fail with it (`_lost`)
                pass
            finally:
                behind, self.frames_behind = self.frames_behind, None
                for target, frame in behind:
                    if target is self.writer and not target.is_closing():
                        target.write(frame)
                self.large_write.release()  # here, not when the caller is cancelled: the frame goes on

        await asyncio.shield(asyncio.ensure_future(slices()))

    async def call(self, request: Request) -> Reply:
        """Send a request, wait for its reply (an instance of `request.reply`). Raises what the
        engine process raised (the same exception classes, through server/engine/wire.py)."""
        if not self.alive:
            raise self.unavailable_error()
        call_id = next(self.ids)
        header, blob = request_frame(request, call_id)
        large = blob is not None and len(blob) > PART_BYTES  # a state to import
        if not large:
            frame = encode_frame(header, blob, checked=True)  # MessageTooLarge: this request alone
        else:  # one large frame at a time; nothing is registered or written before it is its turn
            head = frame_head(header, len(blob), checked=True)
            generation = self.generation
            await self.large_write.acquire()
            if not self.alive or self.generation != generation:  # the engine process went meanwhile
                self.large_write.release()
                raise self.unavailable_error()
        future = asyncio.get_running_loop().create_future()
        self.calls[call_id] = future
        if isinstance(request, CHANGES_A_SESSION):
            self.changing_calls.add(call_id)
        if large:
            await self._write_large(head, blob)
            blob = None  # the request's own copy is the only one while the answer is awaited
        else:
            self._write(frame)
        if self.writer.transport.get_write_buffer_size() > (1 << 20):
            try:
                await self.writer.drain()
            except ConnectionError:  # the engine process went while a large request was being sent
                pass  # its answer is the future's: what `_lost` fails it with
        fields, blob = await future
        if isinstance(blob, list):  # an answer that came in parts: 237 MB joined off the event loop
            blob = await asyncio.to_thread(b"".join, blob)
        return request.reply.from_frame(fields, blob)

    def _check(self, lease: RemoteLease | None) -> int | None:
        """The lease's id, if the current engine process granted it; a lease of one that died
        means nothing to its successor."""
        if lease is None:
            return None
        if lease.generation != self.generation:
            raise EngineRestarting(f"the engine process was restarted while this request held session "
                                   f"'{lease.session_id}'; nothing of it was committed: send it again",
                                   code="engine_restarting")
        return lease.id

    async def submit(self, model: str, prompt: list[int], params: SamplingParams, lease: RemoteLease | None,
                     prefix_scope: bytes | None = None, owner: str | None = None) -> RemoteSubmission:
        """Queue a generation; raises QueueFull / ShuttingDown /
        ValueError before anything started. Without a lease, `prefix_scope`
        (server/cache/prefix_cache.py `scope_key`) lets it start from the longest cached prefix of
        its prompt and offer its own states. `owner`: whose share of each step's prefill it takes."""
        scope = None if prefix_scope is None or lease is not None else prefix_scope.hex()
        request = Generate(next(self.ids), model, prompt, params, self._check(lease), scope, owner)
        return await self._queue(model, request)

    async def append(self, lease: RemoteLease, tokens: list[int], score: bool) -> RemoteSubmission:
        """Queue a document chunk for a leased session (its new state waits for `commit`); the
        submission's last event is an `Appended` (see `types.appended`)."""
        return await self._queue(lease.info.model, Append(next(self.ids), self._check(lease), tokens, score))

    async def _queue(self, served_model: str, request: Generate | Append) -> RemoteSubmission:
        """Register the request's submission before asking: its events may arrive before the answer."""
        if not self.alive:
            raise self.unavailable_error()
        submission = RemoteSubmission(self, served_model, request.request_id)
        self.submissions[submission.id] = submission
        try:
            await self.call(request)
        except BaseException as error:
            self.submissions.pop(submission.id, None)
            if isinstance(error, asyncio.CancelledError):  # the caller left before the answer: if the
                self.send(Cancel(request.request_id))  # engine queued it, nobody would read its stream
            raise
        return submission

    async def acquire(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> RemoteLease:
        """Hold a session for a request. With `idempotency` ({key, fingerprint}) seen before on
        the session, nothing is held: the lease's `replay` is the remembered entry."""
        generation = self.generation
        acquired = await self.call(Acquire(session_id, owner, idempotency))
        if acquired.replay is not None:
            return RemoteLease(0, session_id, acquired.info, False, released=True, generation=generation,
                               replay=acquired.replay)
        return RemoteLease(acquired.lease, session_id, acquired.info, acquired.has_history, generation=generation,
                           idempotency=idempotency)

    async def commit(self, lease: RemoteLease, result: dict | None = None) -> SessionInfo:
        """Make the request's effect permanent; with the lease's Idempotency-Key, `result` (what
        the client is answered) is remembered with it, in the same write."""
        remember = None if lease.idempotency is None else {**lease.idempotency, "result": result}
        return (await self.call(Commit(self._check(lease), remember))).info

    def release(self, lease: RemoteLease) -> None:
        if not lease.released:
            lease.released = True
            if lease.generation == self.generation:  # the process that granted it is gone otherwise
                self.send(Release(lease.id))

    async def create_session(self, model: str, owner: str | None,
                             idempotency: dict | None = None) -> tuple[SessionInfo, bool]:
        return _info_or_replay(await self.call(CreateSession(model, owner, idempotency)))

    async def session_info(self, session_id: str, owner: str | None) -> SessionInfo:
        return (await self.call(GetSession(session_id, owner))).info

    async def import_session(self, model: str | None, owner: str | None, state: bytes,
                             idempotency: dict | None = None) -> tuple[SessionInfo, bool]:
        """A new session from safetensors bytes, for `model` or the model the state names."""
        return _info_or_replay(await self.call(ImportSession(model, owner, state, idempotency)))

    # create, import, fork, replace and delete may carry an Idempotency-Key ({key, fingerprint}, `idempotency`):
    # each says whether its answer is the remembered one of an earlier request with that key

    async def fork_session(self, session_id: str, owner: str | None,
                           idempotency: dict | None = None) -> tuple[SessionInfo, bool]:
        return _info_or_replay(await self.call(ForkSession(session_id, owner, idempotency)))

    async def replace_state(self, session_id: str, owner: str | None, state: bytes,
                            idempotency: dict | None = None) -> tuple[SessionInfo, bool]:
        return _info_or_replay(await self.call(ReplaceState(session_id, owner, state, idempotency)))

    async def delete_session(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> bool:
        return (await self.call(DeleteSession(session_id, owner, idempotency))).replay is not None

    async def list_sessions(self, owner: str | None, limit: int, after: str | None) -> tuple[list[SessionInfo], bool]:
        """`owner`'s sessions, newest first, after the session `after`; and whether more follow."""
        page = await self.call(ListSessions(owner, limit, after))
        return page.sessions, page.has_more

    async def export(self, session_id: str, owner: str | None) -> tuple[SessionInfo, bytes]:
        exported = await self.call(ExportState(session_id, owner))
        return exported.info, exported.state

    async def stop_admitting(self) -> None:
        await self.call(StopAdmitting())

    async def idle(self) -> bool:
        return (await self.call(CheckIdle())).idle

    async def metrics_text(self) -> bytes:
        return (await self.call(GetMetrics())).text.encode()


def _info_or_replay(reply: SessionChanged) -> tuple[SessionInfo, bool]:
    """A create's, an import's, a fork's or a replace's session, and whether it is what an earlier
    request with the same Idempotency-Key was answered (its remembered "result": the session's
    info as it was then; a create's or an import's: the session it made, as it is now)."""
    if reply.replay is not None:
        return SessionInfo(**reply.replay["result"]), True
    return reply.info, False


def _unreadable(error: Exception) -> RequestFailed:
    """What a request is told when a message of the engine process for it does not read here."""
    return RequestFailed(f"the engine process's answer for this request could not be read ({type(error).__name__}: "
                         f"{error}); nothing of it is known to be committed", code="engine_message_unreadable")


def _readable(read: Callable[[object], BaseException], wire: object) -> BaseException:
    """`read(wire)`, an error the engine process sent; one that does not read is `_unreadable`."""
    try:
        return read(wire)
    except Exception as error:
        log.exception("an error from the engine process could not be read")
        return _unreadable(error)
