"""The engine process's memory policy (server/engine/memory.py), on the real components.

`MemoryReturner` hands memory back only once the engines are idle after something was freed,
keeps running when a trim fails, and does nothing when disabled. And the engine process lets go
of a finished request at once: a request and its rows refer to each other, and without the
engine process unlinking them they (and the session states they hold) would wait for the cyclic
garbage collector. Waits are bounded polls; nothing here is timed.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import weakref

from xlserve.server.engine.memory import IDLE_GROWTH_BOUND_MB, MemoryReturner, engine_environment, malloc_trim_function
from tests.server.polling import eventually

FAST = {"interval": 0.01, "quiet": 0.01}  # the returner's waits, short for tests


class Engines:
    """Stands in for the engines' idleness, and counts the trims."""

    def __init__(self, idle: bool):
        self.idle, self.trims, self.checks = idle, 0, 0

    def is_idle(self) -> bool:
        self.checks += 1
        return self.idle

    def trim(self) -> None:
        self.trims += 1


def test_memory_goes_back_only_once_the_engines_are_idle():
    engines = Engines(idle=False)
    returner = MemoryReturner(engines.is_idle, trim=engines.trim, **FAST)
    try:
        returner.freed()
        # busy: the returner keeps looking, and hands nothing back
        assert eventually(lambda: engines.checks >= 5)
        assert engines.trims == 0 and returner.returns == 0
        engines.idle = True
        # the returner counts a return after its trim: wait for both
        assert eventually(lambda: engines.trims == 1 and returner.returns == 1), (engines.trims, returner.returns)
    finally:
        returner.close()


def test_one_return_per_freeing_and_none_without():
    engines = Engines(idle=True)
    returner = MemoryReturner(engines.is_idle, trim=engines.trim, **FAST)
    try:
        assert not eventually(lambda: engines.trims > 0, seconds=0.2)  # nothing was freed yet
        returner.freed()
        assert eventually(lambda: engines.trims == 1)
        checks = engines.checks
        assert not eventually(lambda: engines.checks > checks, seconds=0.2)  # asleep until told again
        returner.freed()
        assert eventually(lambda: engines.trims == 2)
    finally:
        returner.close()


def test_many_freeings_in_a_burst_make_one_return():
    engines = Engines(idle=True)
    returner = MemoryReturner(engines.is_idle, trim=engines.trim, interval=0.5, quiet=0.01)
    try:
        for _ in range(100):
            returner.freed()
        assert eventually(lambda: engines.trims == 1)
        assert not eventually(lambda: engines.trims > 1, seconds=0.3)
    finally:
        returner.close()


def test_a_failing_trim_does_not_stop_the_returner():
    calls = []

    def trim():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no")

    returner = MemoryReturner(lambda: True, trim=trim, **FAST)
    try:
        returner.freed()
        assert eventually(lambda: len(calls) == 1)
        returner.freed()
        assert eventually(lambda: len(calls) == 2)
        assert eventually(lambda: returner.returns == 1)  # the second one went through
    finally:
        returner.close()


def test_disabled_it_does_nothing_and_starts_no_thread():
    engines = Engines(idle=True)
    before = {thread.name for thread in threading.enumerate()}
    returner = MemoryReturner(engines.is_idle, enabled=False, trim=engines.trim, **FAST)
    returner.freed()
    assert not eventually(lambda: engines.checks > 0, seconds=0.2)
    assert "memory-return" not in {thread.name for thread in threading.enumerate()} - before
    returner.close()


def test_glibc_trim_runs_and_the_engine_environment_limits_arenas(monkeypatch):
    trim = malloc_trim_function()
    assert trim is not None  # the test machine runs glibc
    assert trim() in (0, 1)  # 1: memory was released, 0: there was none to release
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert engine_environment()["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # an operator's own setting wins
    assert engine_environment()["MALLOC_ARENA_MAX"] == "8"
    monkeypatch.setenv("XLSERVE_API_KEYS", "secret-key")
    assert "XLSERVE_API_KEYS" not in engine_environment()  # authentication stays in the API process
    assert IDLE_GROWTH_BOUND_MB > 0


def test_the_engine_process_lets_go_of_a_finished_request_at_once(tmp_path):
    """A generation in a real EngineProcess (tiny Transformer-XL, events over a real socket),
    with the cyclic garbage collector off and the returner disabled: once its last event has
    arrived, the request object is gone."""
    from xlserve.server.engine.process import EngineProcess
    from xlserve.server.engine.types import SamplingParams
    from xlserve.server.engine.wire import Generate, event_from_wire, is_last, read_frame, request_frame
    from tests.server.engine_process_helpers import tiny_settings

    ours, theirs = socket.socketpair()
    process = EngineProcess(tiny_settings(tmp_path), theirs)
    engine = process.models["tiny"].engine
    captured = []
    enqueue = engine.enqueue

    def capture(request):
        captured.append(weakref.ref(request))
        enqueue(request)

    engine.enqueue = capture
    stream = ours.makefile("rb")
    collecting = gc.isenabled()
    gc.disable()
    try:
        params = SamplingParams(max_tokens=8, temperature=0, n=2)  # two rows: each refers back to the request
        process.dispatch(*request_frame(Generate(1, "tiny", [100, 101, 102], params), call_id=1))
        ended = False
        deadline = time.monotonic() + 60
        while not ended and time.monotonic() < deadline:
            frame = read_frame(stream)
            assert frame is not None
            header, _ = frame
            if header["op"] == "events":
                ended = any(request_id == 1 and is_last(event)
                            for request_id, event in map(event_from_wire, header["events"]))
        assert ended, "the request did not finish"
        (request,) = captured
        assert request() is None, f"still referred to by {[type(r).__name__ for r in gc.get_referrers(request())]}"
    finally:
        if collecting:
            gc.enable()
        process.close()
        ours.close()
        theirs.close()
