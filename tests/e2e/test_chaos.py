"""A bounded chaos run against one real server and one real redis-server (issue 35, item 6):
five probes, each repeated CHAOS_ROUNDS times, then a table of what each saw.

The server runs with Redis as its session store, two API keys, and a prefill chunk of
PREFILL_CHUNK tokens, so that a 100 KB prompt takes seconds to prefill on a CPU and a probe has
time to act while it does.

- fairness: key A streams a completion of a long prompt; once it is prefilling, key B asks for a
  few tokens of a 10-byte prompt. B's answer must be complete before A's first token. Only the
  order is asserted, never a duration.
- disconnect: a long non-streamed append and a long streamed completion on a fresh session, each
  given up by its client (a short read timeout) while it prefills. The running gauge must go back
  to 0 within a bound and the session must be as it was (version 0, no tokens), as the README
  promises for any client disconnect.
- poison imports: state imports with extreme values (every float 3e38, ±3e38, NaN, infinities,
  tensors of the wrong shape or dtype) are each refused with 400 invalid_state, on import and on
  replace, while a victim's greedy stream beside them gets all the tokens it gets alone.
- redis pause: redis-server is stopped (SIGSTOP) for REDIS_PAUSE seconds while appends and
  generations commit in a loop on their own sessions. Each answer is a 200, a session conflict, or
  a 5xx with its own error code (never internal_error), within a bound; victim streams that touch
  no session finish all their tokens meanwhile; afterwards every session reads at the version its
  last answer gave.
- engine kill: kill -9 of the engine process while streams run (one continuing a session). Every
  stream ends with an engine_restarting error event, /ready is 200 again within a bound, the
  sessions committed before are byte for byte as they were, and new requests succeed.

Every loop has a count and every request a timeout. A probe does not stop at its first problem:
it notes them all and the next probe still runs; the test fails at the end, after printing the
table, if any probe saw one. `make test` runs one round of each (well under a minute on two
cores); `make chaos` runs CHAOS_ROUNDS of them (5–10 minutes at 20). The test process runs
no model: everything is HTTP, signals and /proc.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.process_tools import committed_content, engine_pid, gone_within, replaced
from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, document, metric
from tests.e2e.test_isolation import VICTIM, poisoned_blobs, stream_events, tokens_of
from tests.e2e.test_poison_imports import alternating_extreme, every_float_replaced, extreme
from tests.redis_server import RedisServer, redis_server  # noqa: F401 (redis_server: a fixture)

ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))
KEY_A, KEY_B = "key-a", "key-b"
PREFILL_CHUNK = 64  # tokens per engine step: a 100 KB prompt takes seconds to prefill
LONG_PROMPT_BYTES = 100_000  # the tiny model's tokens are bytes
STORE_TIMEOUT = 1.0  # XLSERVE_STORE_TIMEOUT_SECONDS
COMMIT_SETTLE = 2.0  # XLSERVE_COMMIT_SETTLE_SECONDS
REDIS_PAUSE = 3.0  # seconds redis-server stays stopped in each round
# the longest any answer may take while Redis is paused: the pause, then the request's own
# store timeout and settle wait, and slack for a loaded two-core machine
ANSWER_BOUND = REDIS_PAUSE + STORE_TIMEOUT + COMMIT_SETTLE + 10.0
IDLE_BOUND = 30.0  # seconds for the running gauge to go back to 0 after a client left
HEAL_BOUND = 60.0  # seconds for a new engine process to be ready after a kill
VICTIM_TOKENS = 64  # of each stateless stream beside a Redis pause
ENDLESS = 100_000  # max_tokens of a generation still running whenever a probe acts
REQUEST_TIMEOUT = 60.0


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Probe:
    """One row of the table: what a probe saw over its rounds, and what went wrong."""
    name: str
    rounds: int = 0
    outcomes: Counter = field(default_factory=Counter)
    measure: str = ""  # the number that matters for this probe
    seconds: float = 0.0  # wall time of all its rounds
    problems: list[str] = field(default_factory=list)

    def check(self, condition: bool, problem: str) -> bool:
        if not condition:
            self.problems.append(problem)
        return condition

    @property
    def passed(self) -> bool:
        return not self.problems


def table(probes: list[Probe]) -> str:
    header = ("probe", "rounds", "outcomes", "measure", "seconds", "result")
    rows = [(p.name, str(p.rounds), ", ".join(f"{k} x{v}" for k, v in sorted(p.outcomes.items())) or "-",
             p.measure or "-", f"{p.seconds:.1f}", "pass" if p.passed else f"FAIL ({len(p.problems)})")
            for p in probes]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    for probe in probes:
        lines += [f"  {probe.name}: {problem}" for problem in probe.problems[:10]]
        if len(probe.problems) > 10:
            lines.append(f"  {probe.name}: ... and {len(probe.problems) - 10} more")
    return "\n".join(lines)


def long_prompt(tag: str, size: int = LONG_PROMPT_BYTES) -> str:
    """A prompt of `size` bytes that starts with `tag`, so that no earlier prompt is a prefix of
    it and the prefix cache cannot skip its prefill."""
    body = "".join(f"def step_{i}(value):\n    return value * {i % 97} + {i % 13}\n\n" for i in range(size // 40 + 1))
    return (f"# {tag}\n" + body)[:size]


class StreamedCompletion(threading.Thread):
    """One SSE completion read in a thread: its data events, when the first arrived and when the
    stream ended, and an exception instead of them when the client failed."""

    def __init__(self, server: ServerProcess, key: str, body: dict, read_timeout: float = REQUEST_TIMEOUT):
        super().__init__(daemon=True)
        self.server, self.key, self.body, self.read_timeout = server, key, body, read_timeout
        self.status: int | None = None
        self.events: list[dict] = []
        self.first_event_at: float | None = None
        self.ended_at: float | None = None
        self.failure: BaseException | None = None
        self.started = threading.Event()  # set at the first event, or when the stream ends without one

    def run(self) -> None:
        try:
            timeout = httpx.Timeout(REQUEST_TIMEOUT, read=self.read_timeout)
            with httpx.Client(base_url=self.server.url, timeout=timeout, headers=bearer(self.key)) as client:
                with client.stream("POST", "/v1/completions", json={**self.body, "stream": True}) as response:
                    self.status = response.status_code
                    if response.status_code != 200:
                        self.events.append(json.loads(response.read()))
                        return
                    for event in stream_events(response):
                        if self.first_event_at is None:
                            self.first_event_at = time.monotonic()
                            self.started.set()
                        self.events.append(event)
        except BaseException as error:  # the probe reports it
            self.failure = error
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def error(self) -> dict | None:
        return next((event["error"] for event in self.events if "error" in event), None)

    def completion_tokens(self) -> int | None:
        """From the final usage chunk (the body asks for stream_options.include_usage)."""
        usage = [event["usage"] for event in self.events if event.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None

    def problem(self) -> str | None:
        """Why this stream did not end normally, or None."""
        if self.is_alive():
            return "still running past its bound"
        if self.failure is not None:
            return f"client failed: {self.failure!r}"
        if self.status != 200:
            return f"answered {self.status}: {self.events!r:.200}"
        if self.error() is not None:
            return f"ended with an error event: {self.error()}"
        return None



@pytest.fixture(scope="module")
def chaos_server(tiny_checkpoint, tmp_path_factory, redis_server):
    server = ServerProcess([tiny_checkpoint], env={
        "XLSERVE_REDIS_URL": redis_server.url, "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state")),
        "XLSERVE_API_KEYS": f"{KEY_A},{KEY_B}",
        "XLSERVE_PREFILL_CHUNK_TOKENS": str(PREFILL_CHUNK),
        "XLSERVE_STORE_TIMEOUT_SECONDS": str(STORE_TIMEOUT), "XLSERVE_COMMIT_SETTLE_SECONDS": str(COMMIT_SETTLE),
        "XLSERVE_MAX_TOKENS_LIMIT": str(ENDLESS),
        # every round of the engine-kill probe restarts the engine once; more would stop the server
        "XLSERVE_ENGINE_RESTART_LIMIT": str(ROUNDS + 3),
    }, log_path=tmp_path_factory.mktemp("logs") / "chaos.log").start()
    yield server
    server.stop()


def running(client: httpx.Client) -> float:
    return metric(client.get("/metrics").text, "xlserve_requests_running", model=MODEL)


def seconds_until_idle(client: httpx.Client, bound: float = IDLE_BOUND) -> float | None:
    """Seconds until the running gauge reads 0, or None when it still does not after `bound`."""
    started = time.monotonic()
    while time.monotonic() - started < bound:
        if running(client) == 0:
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def create_session(client: httpx.Client) -> str:
    response = client.post("/v1/sessions", json={"model": MODEL})
    response.raise_for_status()
    return response.json()["id"]


def session_info(client: httpx.Client, session_id: str, bound: float = 30) -> dict:
    """The session once no request holds it (a cancelled request lets go within a step)."""
    deadline = time.monotonic() + bound
    while True:
        response = client.get(f"/v1/sessions/{session_id}")
        response.raise_for_status()
        described = response.json()
        if not described["in_use"] or time.monotonic() > deadline:
            return described
        time.sleep(0.05)


def outcome(response: httpx.Response) -> str:
    """A response as a table cell: its status, and its error code when it has one."""
    if response.status_code == 200:
        return "200"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} (not the error body)"
    label = error.get("code") or error.get("type")
    return f"{response.status_code} {'internal_error ' if error.get('type') == 'internal_error' else ''}{label}"


def clear_answer(seen: str) -> bool:
    """Whether an answer while the store was down says what happened: a success, a session
    conflict, or a 5xx other than 500 with a code of its own."""
    status, _, code = seen.partition(" ")
    if status == "200" or (status == "409" and code.startswith("session_")):
        return True
    return status.startswith("5") and status != "500" and bool(code) and "internal_error" not in code \
        and "not the error body" not in code


def probe_fairness(server: ServerProcess) -> Probe:
    probe = Probe("fairness")
    small_latencies, leads = [], []
    with server.client(headers=bearer(KEY_A)) as client:
        for round_number in range(ROUNDS):
            probe.rounds += 1
            tag = f"fairness {round_number} {time.time_ns()}"
            long = StreamedCompletion(server, KEY_A, {"model": MODEL, "prompt": long_prompt(tag), "max_tokens": 1})
            long.start()
            deadline = time.monotonic() + 30
            while running(client) < 1 and time.monotonic() < deadline and long.is_alive():
                time.sleep(0.02)  # until the engine holds the long prompt
            max_tokens = random.Random(round_number).randint(1, 4)
            small = StreamedCompletion(server, KEY_B, {
                "model": MODEL, "prompt": f"x{round_number:09d}"[-10:], "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}})
            sent_at = time.monotonic()
            small.start()
            small.join(REQUEST_TIMEOUT)
            long.join(REQUEST_TIMEOUT * 2)
            problems = [f"{name}: {problem}" for name, stream in (("long", long), ("small", small))
                        if (problem := stream.problem())]
            if not probe.check(not problems, f"round {round_number}: {problems}"):
                probe.outcomes["error"] += 1
                continue
            probe.check(small.completion_tokens() == max_tokens,
                        f"round {round_number}: the small one got {small.completion_tokens()} of {max_tokens} tokens")
            if long.first_event_at < sent_at:
                probe.check(False, f"round {round_number}: the long prompt was prefilled before the small one was "
                                   "sent; the probe needs a longer prompt or a smaller XLSERVE_PREFILL_CHUNK_TOKENS")
                probe.outcomes["long done too soon"] += 1
                continue
            small_first = small.ended_at < long.first_event_at
            probe.outcomes["small first" if small_first else "long first"] += 1
            probe.check(small_first, f"round {round_number}: the 10-byte request ended "
                                     f"{small.ended_at - long.first_event_at:.2f} s after the long one's first token")
            small_latencies.append(small.ended_at - sent_at)
            leads.append(long.first_event_at - small.ended_at)
    if small_latencies:
        probe.measure = (f"small done in <= {max(small_latencies):.2f} s; "
                         f">= {min(leads):.2f} s before the long one's first token")
    return probe


def abandoned_while_prefilling(probe: Probe, server: ServerProcess, client: httpx.Client, kind: str,
                               round_number: int) -> tuple[float | None, str]:
    """Start a long request of `kind` ("append" or "stream") on a fresh session, give it up after
    a short read timeout, and check what it left. Returns (seconds until the gauge read 0, its
    outcome)."""
    session = create_session(client)
    text = long_prompt(f"disconnect {kind} {round_number} {time.time_ns()}")
    impatient = httpx.Timeout(REQUEST_TIMEOUT, read=1.0)
    label = f"{kind} round {round_number}"
    answered: list = []

    def give_up_mid_prefill() -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=impatient, headers=bearer(KEY_A)) as own:
                if kind == "append":
                    answered.append(own.post(f"/v1/sessions/{session}/append", json={"text": text}))
                else:
                    body = {"model": MODEL, "prompt": text, "max_tokens": 4, "stream": True, "session_id": session}
                    with own.stream("POST", "/v1/completions", json=body) as response:
                        answered.extend(line for line in response.iter_lines() if line.startswith("data: "))
        except httpx.ReadTimeout:
            pass  # httpx closes the connection on a read timeout: the client has given up

    impatient_client = threading.Thread(target=give_up_mid_prefill, daemon=True)
    impatient_client.start()
    # httpx hangs up the moment its read times out, so whether the engine held the request is
    # seen while it waits, not after
    running_seen = False
    while impatient_client.is_alive() and not running_seen:
        running_seen = running(client) >= 1
        time.sleep(0.02)
    impatient_client.join(REQUEST_TIMEOUT)
    left_at = time.monotonic()
    if answered:
        probe.check(False, f"{label}: answered before the client gave up; the probe needs a longer prompt")
        return None, "answered too soon"
    probe.check(running_seen, f"{label}: the engine was never seen holding the request before the client gave up")
    idle_after = seconds_until_idle(client)
    probe.check(idle_after is not None, f"{label}: the running gauge was not 0 within {IDLE_BOUND:.0f} s")
    described = session_info(client, session)
    unchanged = (described["version"], described["tokens"], described["in_use"]) == (0, 0, False)
    probe.check(unchanged, f"{label}: the abandoned request changed the session: version {described['version']}, "
                           f"{described['tokens']} tokens, in_use {described['in_use']} "
                           f"({time.monotonic() - left_at:.1f} s after the client left)")
    again = client.post(f"/v1/sessions/{session}/append", json={"text": "ok"})
    probe.check(again.status_code == 200, f"{label}: the session refused the next append: {again.text:.200}")
    return idle_after, "session unchanged" if unchanged else "session changed"


def probe_disconnect(server: ServerProcess) -> Probe:
    probe = Probe("disconnect mid-prefill")
    idle_times = []
    with server.client(headers=bearer(KEY_A)) as client:
        for round_number in range(ROUNDS):
            probe.rounds += 1
            for kind in ("append", "stream"):
                idle_after, seen = abandoned_while_prefilling(probe, server, client, kind, round_number)
                probe.outcomes[f"{kind}: {seen}"] += 1
                if idle_after is not None:
                    idle_times.append(idle_after)
    if idle_times:
        probe.measure = f"gauge 0 within {max(idle_times):.2f} s of the client leaving"
    return probe


def probe_poison_imports(server: ServerProcess) -> Probe:
    probe = Probe("poison imports")
    with server.client(headers=bearer(KEY_A)) as client:
        with client.stream("POST", "/v1/completions", json=VICTIM) as response:
            expected_tokens, expected_logprobs = tokens_of(list(stream_events(response)))
        session = create_session(client)
        client.post(f"/v1/sessions/{session}/append", json={"text": document(81)}).raise_for_status()
        before = session_info(client, session)
        exported = client.get(f"/v1/sessions/{session}/state").content
        poisons = {"3e38": every_float_replaced(exported, extreme),
                   "±3e38": every_float_replaced(exported, alternating_extreme),
                   **{name: blob for name, (blob, _) in poisoned_blobs(exported).items()}}
        for round_number in range(ROUNDS):
            probe.rounds += 1
            with client.stream("POST", "/v1/completions", json=VICTIM) as victim:
                events = stream_events(victim)
                seen = [next(events)]  # the victim is running
                for name, blob in poisons.items():
                    for route, answer in (("import", client.post("/v1/sessions/import", content=blob)),
                                          ("replace", client.put(f"/v1/sessions/{session}/state", content=blob))):
                        probe.outcomes[outcome(answer)] += 1
                        probe.check(outcome(answer) == "400 invalid_state",
                                    f"round {round_number}: {route} of {name}: {answer.status_code} {answer.text:.200}")
                seen += list(events)
            try:
                tokens, logprobs = tokens_of(seen)
                same = tokens == expected_tokens and all(
                    abs(a - b) <= 1e-4 for a, b in zip(logprobs, expected_logprobs, strict=True))
            except (AssertionError, ValueError) as error:
                same = False
                seen.append({"problem": repr(error)})
            probe.outcomes["victim as alone" if same else "victim harmed"] += 1
            probe.check(same, f"round {round_number}: the victim's stream differs from alone: {seen[-2:]!r:.300}")
        after = session_info(client, session)
        probe.check((after["version"], after["tokens"]) == (before["version"], before["tokens"]),
                    f"a refused replace changed the session: {before} -> {after}")
        listed = client.get("/v1/sessions", params={"limit": 1}).json()["data"]
        probe.check(listed and listed[0]["id"] == session, f"a refused import created a session: {listed!r:.200}")
    probe.measure = f"{len(poisons)} poisons x 2 routes per round, victim {len(expected_tokens)} tokens"
    return probe


class Committer(threading.Thread):
    """Commits to its own session in a loop until told to stop (at most `limit` requests): appends,
    or generations continuing the session. Keeps each answer: (outcome, seconds, version)."""

    def __init__(self, server: ServerProcess, session_id: str, generate: bool, stop: threading.Event, limit: int = 400):
        super().__init__(daemon=True)
        self.server, self.session_id, self.generate, self.stop, self.limit = server, session_id, generate, stop, limit
        self.answers: list[tuple[str, float, int | None]] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.server.url, headers=bearer(KEY_A), timeout=ANSWER_BOUND + 30) as client:
                for index in range(self.limit):
                    if self.stop.is_set():
                        return
                    started = time.monotonic()
                    if self.generate:
                        response = client.post("/v1/completions", json={
                            "model": MODEL, "prompt": f"\n# {index}\n", "max_tokens": 8, "session_id": self.session_id})
                    else:
                        response = client.post(f"/v1/sessions/{self.session_id}/append",
                                               json={"text": document(index, repeat=1)})
                    # an append's answer says the version it made; a generation's does not
                    version = response.json()["version"] if response.status_code == 200 and not self.generate else None
                    self.answers.append((outcome(response), time.monotonic() - started, version))
                    if response.status_code != 200:
                        time.sleep(0.1)  # not a tight loop against a store that is down
        except BaseException as error:  # the probe reports it
            self.failure = error


def victim_streams_until(server: ServerProcess, stop: threading.Event, results: list[StreamedCompletion],
                         limit: int = 200) -> None:
    """Stateless streamed completions one after another until `stop`: none touches a session."""
    for index in range(limit):
        if stop.is_set():
            return
        stream = StreamedCompletion(server, KEY_B, {"model": MODEL, "prompt": f"def victim_{index}(", "max_tokens": VICTIM_TOKENS,
                                                    "stream_options": {"include_usage": True}})
        stream.start()
        stream.join(ANSWER_BOUND + 30)
        results.append(stream)


def check_committer(probe: Probe, client: httpx.Client, committer: "Committer", base_version: int,
                    round_number: int) -> float:
    """Check one committer's answers during a Redis pause and what its session holds after;
    returns its slowest answer in seconds."""
    probe.check(committer.failure is None, f"round {round_number}: a client failed: {committer.failure!r}")
    for seen, seconds, _ in committer.answers:
        probe.outcomes[("generate " if committer.generate else "append ") + seen] += 1
        probe.check(seconds <= ANSWER_BOUND, f"round {round_number}: {seen} after {seconds:.1f} s")
        probe.check(clear_answer(seen), f"round {round_number}: not a clear answer: {seen}")
    answers = [seen for seen, _, _ in committer.answers]
    probe.check("200" in answers, f"round {round_number}: no commit of {committer.session_id} succeeded")
    # every 200 made one version; a commit whose outcome the server could not learn (503
    # commit_outcome_unknown) may have made one too; nothing else did
    made, maybe = answers.count("200"), sum(seen.endswith("commit_outcome_unknown") for seen in answers)
    described = session_info(client, committer.session_id)
    probe.check(base_version + made <= described["version"] <= base_version + made + maybe,
                f"round {round_number}: {committer.session_id} reads at version {described['version']} after "
                f"{made} commits answered 200 and {maybe} of unknown outcome, from version {base_version}")
    last_words = [version for seen, _, version in committer.answers
                  if seen == "200" or seen.endswith("commit_outcome_unknown")]
    if last_words and last_words[-1] is not None:  # the last word on an append was a 200 with its version
        probe.check(described["version"] == last_words[-1],
                    f"round {round_number}: {committer.session_id} reads at version {described['version']}, "
                    f"its last append was answered {last_words[-1]}")
    state = client.get(f"/v1/sessions/{committer.session_id}/state")
    probe.check(state.status_code == 200, f"round {round_number}: its state is unreadable: {state.text:.200}")
    return max((seconds for _, seconds, _ in committer.answers), default=0.0)


def probe_redis_pause(server: ServerProcess, redis: RedisServer) -> Probe:
    probe = Probe("redis pause during commits")
    slowest = 0.0
    with server.client(headers=bearer(KEY_A)) as client:
        for round_number in range(ROUNDS):
            probe.rounds += 1
            sessions = [create_session(client) for _ in range(4)]
            for index, session in enumerate(sessions):
                client.post(f"/v1/sessions/{session}/append", json={"text": document(round_number * 10 + index)}
                            ).raise_for_status()
            base_versions = {session: session_info(client, session)["version"] for session in sessions}
            stop = threading.Event()
            committers = [Committer(server, session, generate=index % 2 == 1, stop=stop)
                          for index, session in enumerate(sessions)]
            victims: list[StreamedCompletion] = []
            victim_loop = threading.Thread(target=victim_streams_until, args=(server, stop, victims), daemon=True)
            for worker in [*committers, victim_loop]:
                worker.start()
            try:
                time.sleep(0.5)  # commits are flowing
                os.kill(redis.process.pid, signal.SIGSTOP)
                time.sleep(REDIS_PAUSE)
            finally:
                os.kill(redis.process.pid, signal.SIGCONT)
            time.sleep(COMMIT_SETTLE + STORE_TIMEOUT)  # commits flow again, after the ones that waited
            stop.set()
            for worker in [*committers, victim_loop]:
                worker.join(ANSWER_BOUND + 60)
                probe.check(not worker.is_alive(), f"round {round_number}: a request was still waiting past the bound")

            felt = [seen for committer in committers for seen, seconds, _ in committer.answers
                    if seen != "200" or seconds >= STORE_TIMEOUT]
            probe.check(bool(felt), f"round {round_number}: no commit was in flight while Redis was paused")
            for committer in committers:
                slowest = max(slowest, check_committer(probe, client, committer, base_versions[committer.session_id],
                                                       round_number))
            for victim in victims:
                problem = victim.problem()
                if problem is None and victim.completion_tokens() != VICTIM_TOKENS:
                    problem = f"got {victim.completion_tokens()} of {VICTIM_TOKENS} tokens"
                probe.outcomes["victim finished" if problem is None else "victim cut"] += 1
                probe.check(problem is None, f"round {round_number}: a victim stream: {problem}")
                if victim.ended_at is not None and victim.first_event_at is not None:
                    slowest = max(slowest, victim.ended_at - victim.first_event_at)
    probe.measure = f"slowest answer {slowest:.2f} s (bound {ANSWER_BOUND:.0f} s)"
    return probe


def probe_engine_kill(server: ServerProcess) -> Probe:
    probe = Probe("engine kill beside streams")
    heal_times = []
    with server.client(headers=bearer(KEY_A)) as client:
        for round_number in range(ROUNDS):
            probe.rounds += 1
            sessions = [create_session(client) for _ in range(3)]
            for index, session in enumerate(sessions):
                client.post(f"/v1/sessions/{session}/append", json={"text": document(100 + index)}).raise_for_status()
            generated = client.post("/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4,
                                                             "session_id": sessions[0]})
            generated.raise_for_status()
            committed = {}
            for session in sessions:
                described = session_info(client, session)
                committed[session] = (described["version"], described["tokens"],
                                      committed_content(client.get(f"/v1/sessions/{session}/state").content))

            endless = {"model": MODEL, "prompt": "def main(", "max_tokens": ENDLESS}
            streams = [StreamedCompletion(server, KEY_A, endless), StreamedCompletion(server, KEY_B, endless),
                       StreamedCompletion(server, KEY_A, {**endless, "session_id": sessions[1]})]
            for stream in streams:
                stream.start()
            if not probe.check(all(stream.started.wait(REQUEST_TIMEOUT) and stream.first_event_at for stream in streams),
                               f"round {round_number}: a stream did not start: {[s.problem() for s in streams]}"):
                probe.outcomes["streams did not start"] += 1  # killed anyway: they end with the engine
            dead = engine_pid(server)
            os.kill(dead, signal.SIGKILL)
            killed_at = time.monotonic()
            for stream in streams:
                stream.join(REQUEST_TIMEOUT)
                error = stream.error()
                if stream.is_alive():
                    seen = "hung"
                elif stream.failure is not None:
                    seen = f"client failed: {type(stream.failure).__name__}"
                else:
                    seen = f"error event {error['code']}" if error else "ended without an error"
                probe.outcomes[seen] += 1
                probe.check(seen == "error event engine_restarting",
                            f"round {round_number}: a stream beside the kill: {seen} {stream.failure or ''}")
            try:
                replaced(server, dead, timeout=HEAL_BOUND)
                heal_times.append(time.monotonic() - killed_at)
            except AssertionError as error:
                probe.check(False, f"round {round_number}: {error}")
                probe.outcomes["not healed"] += 1
                continue
            probe.check(gone_within(dead, 10), f"round {round_number}: the killed engine process {dead} lingers")
            for session, (version, tokens, content) in committed.items():
                described = session_info(client, session)
                intact = ((described["version"], described["tokens"]) == (version, tokens)
                          and committed_content(client.get(f"/v1/sessions/{session}/state").content) == content)
                probe.outcomes["session intact" if intact else "session changed"] += 1
                probe.check(intact, f"round {round_number}: {session} was (version {version}, {tokens} tokens), "
                                    f"now {described}")
            continued = client.post("/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 3,
                                                             "session_id": sessions[1]})
            stateless = client.post("/v1/completions", json={"model": MODEL, "prompt": "z", "max_tokens": 3})
            for answer in (continued, stateless):
                probe.outcomes[f"after: {outcome(answer)}"] += 1
                probe.check(answer.status_code == 200, f"round {round_number}: a request after healing: {answer.text:.200}")
    if heal_times:
        probe.measure = f"/ready 200 within {max(heal_times):.2f} s of the kill (bound {HEAL_BOUND:.0f} s)"
    return probe


def test_chaos(chaos_server, redis_server):
    started = time.monotonic()
    probes: list[Probe] = []
    runs = [("fairness", lambda: probe_fairness(chaos_server)),
            ("disconnect mid-prefill", lambda: probe_disconnect(chaos_server)),
            ("poison imports", lambda: probe_poison_imports(chaos_server)),
            ("redis pause during commits", lambda: probe_redis_pause(chaos_server, redis_server)),
            ("engine kill beside streams", lambda: probe_engine_kill(chaos_server))]
    try:
        for name, run in runs:
            probe_started = time.monotonic()
            try:
                probe = run()
            except Exception as error:  # a probe that broke is a failed row, and the others still run
                probe = Probe(name, problems=[f"raised {error!r}"])
            probe.seconds = time.monotonic() - probe_started
            probes.append(probe)
    finally:
        print(f"\nchaos: {ROUNDS} round(s) per probe, {time.monotonic() - started:.1f} s\n{table(probes)}")
    failed = [probe.name for probe in probes if not probe.passed]
    assert not failed, f"probes failed: {failed} (the table above says why)"
