"""Server settings, grouped by concern and composed in one `Settings` object (as vLLM's config
package composes its model, cache and scheduler configs), read from the environment by
pydantic-settings.

Each group is what one part of the server reads, and is handed only that part:

| group | class | read by |
|---|---|---|
| `settings.server` | `ServerSettings` | the API process: request limits, shutdown, engine restarts |
| `settings.engine` | `EngineSettings` | the engine process: which models, device, threads, batching |
| `settings.cache` | `CacheSettings` | the session cache: tiers' budgets, the disk and Redis stores |
| `settings.prefix_cache` | `PrefixCacheSettings` | the prefix-state cache |
| `settings.security` | `SecuritySettings` | authentication (never sent to the engine process) |

Every setting keeps one flat name, which is its environment variable less the `XLSERVE_` prefix
(`XLSERVE_PREFIX_CACHE_BYTES` is `prefix_cache.bytes`); `Settings(**flat)` takes those names,
so a test or the CLI sets any of them without knowing its group.

Each setting is also an `xlserve serve` flag (server/cli.py makes them from these classes: the
field's description is its help; `Settings.flags` gives its names, vLLM's first where vLLM has one).
Reading the environment warns about an XLSERVE_ variable that names no setting, naming the closest
one, since pydantic-settings would silently ignore a misspelling.

Created in the app factory (or by `xlserve serve`), never at import time, so tests build apps
with their own settings. The engine process gets the API process's settings as JSON (without the
security group) in the first frame over its socket, never on its command line (which `ps` shows
to every user), and rebuilds them; every setting is listed in the README.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from xlserve.server.redis_urls import parse_redis_url

# Data directories are relative to the working directory (where `make serve` runs: the
# repository), never to this file: an installed package lives in site-packages.
WEIGHTS_DIR = Path("weights")
STATE_DIR = Path("state")
BENCH_RESULTS_DIR = Path("bench-results")
ENVIRONMENT_PREFIX = "XLSERVE_"


def checkpoint_dir(name_or_path: str, weights_dir: Path = WEIGHTS_DIR) -> Path:
    """A checkpoint named on the command line or in settings: an existing directory as given,
    otherwise the directory of that name under `weights_dir` (which may not exist)."""
    path = Path(name_or_path)
    return path if path.is_dir() else weights_dir / name_or_path


def _group_config(prefix: str = "") -> SettingsConfigDict:
    # extra="ignore": the environment holds the other groups' XLSERVE_ variables too;
    # hide_input_in_errors: a refused value may be a secret (an API key, a Redis URL's password);
    # env_ignore_empty: a variable set to nothing (a compose or Kubernetes template's `XLSERVE_STATE_DIR=`)
    # is unset, not the path "." (the working directory as the state directory)
    return SettingsConfigDict(env_prefix=ENVIRONMENT_PREFIX + prefix, extra="ignore", hide_input_in_errors=True,
                              env_ignore_empty=True)


# `xlserve serve` flags named as vLLM names its flag for the same thing; every other setting's flag is
# `--` and its flat name with dashes, which these keep as an alias (`--max-batch-size` still works)
VLLM_FLAG_NAMES = {
    "max_batch_size": "--max-num-seqs",
    "api_keys": "--api-key",
}
# flags this project had before every setting had one, kept so that scripts using them still work
EARLIER_FLAG_NAMES = {
    "shutdown_grace_seconds": ("--grace-seconds",),
}
# XLSERVE_-prefixed environment variables that are not settings, and so are not warned about.
# Every other XLSERVE_ name in this repository (tests, Makefile, docker/, deploy/) is a setting,
# which tests/server/test_settings.py checks; a helper variable with the prefix belongs here.
# XLSERVE_TEST_CRASH_AT: the kill -9 tests' crash point in a session log write or compaction
# (server/cache/stores.py), never set in production.
# XLSERVE_TEST_HANG_STEP_FILE: the hung-step test's file, whose presence makes the next engine
# step never return (server/engine/scheduler.py), never set in production.
NON_SETTING_ENVIRONMENT_VARIABLES: frozenset[str] = frozenset({"XLSERVE_TEST_CRASH_AT",
                                                               "XLSERVE_TEST_HANG_STEP_FILE"})

# the variables Kubernetes gives a pod for every Service in its namespace unless the pod spec sets
# `enableServiceLinks: false` (deploy/kubernetes does): the Services xlserve and xlserve-redis give
# XLSERVE_SERVICE_HOST=10.0.0.1, XLSERVE_PORT_8000_TCP_ADDR=10.0.0.1, XLSERVE_REDIS_PORT=tcp://...
# No setting has such a name, and a pod spec of the operator's own must not make each one a
# warning; told apart by name and value, so that the prefix with _PORT=9000 (a guess at the port, which
# only --port sets) is still warned about
_LINK_ADDRESS = r"[0-9a-fA-F.:]+"
_LINK_URL = rf"(?:tcp|udp|sctp)://(?:{_LINK_ADDRESS}|\[{_LINK_ADDRESS}\]):\d+"
KUBERNETES_SERVICE_LINKS = [(re.compile(name), re.compile(value)) for name, value in (
    (r"[A-Z0-9_]+_SERVICE_HOST", _LINK_ADDRESS),
    (r"[A-Z0-9_]+_SERVICE_PORT(?:_[A-Z0-9_]+)?", r"\d+"),
    (r"[A-Z0-9_]+_PORT(?:_\d+_(?:TCP|UDP|SCTP))?", _LINK_URL),
    (r"[A-Z0-9_]+_PORT_\d+_(?:TCP|UDP|SCTP)_ADDR", _LINK_ADDRESS),
    (r"[A-Z0-9_]+_PORT_\d+_(?:TCP|UDP|SCTP)_PORT", r"\d+"),
    (r"[A-Z0-9_]+_PORT_\d+_(?:TCP|UDP|SCTP)_PROTO", r"(?:tcp|udp|sctp)"),
)]


def is_kubernetes_service_link(name: str, value: str) -> bool:
    upper = name.upper()
    return any(pattern.fullmatch(upper) and shape.fullmatch(value.strip()) for pattern, shape in KUBERNETES_SERVICE_LINKS)


log = logging.getLogger("xlserve.settings")
_warned_environment_variables: set[str] = set()


def _unknown_with_closest(environment: Mapping[str, str] | None) -> list[tuple[str, str | None]]:
    """(name, the closest setting's variable or None) for each XLSERVE_ variable in `environment`
    (default: this process's) that no setting reads. Matched without regard to case, as
    pydantic-settings reads them."""
    environment = os.environ if environment is None else environment
    known = Settings.environment_variables()
    found = []
    for name in sorted(environment):
        upper = name.upper()
        if (not upper.startswith(ENVIRONMENT_PREFIX) or upper in known or upper in NON_SETTING_ENVIRONMENT_VARIABLES
                or is_kubernetes_service_link(upper, environment[name])):
            continue
        # compared without the prefix, which every name shares and which would make any two look alike
        closest = difflib.get_close_matches(upper.removeprefix(ENVIRONMENT_PREFIX),
                                            [variable.removeprefix(ENVIRONMENT_PREFIX) for variable in known],
                                            n=1, cutoff=0.6)
        found.append((name, ENVIRONMENT_PREFIX + closest[0] if closest else None))
    return found


def unknown_environment_variables(environment: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each XLSERVE_ variable in `environment` (default: this process's) that no
    setting reads, naming the closest setting's variable: a misspelt one is otherwise silently
    ignored and its default used."""
    return [f"{name} is not an xlserve setting and is ignored; "
            + (f"did you mean {closest}?" if closest else "`xlserve serve --help` lists the settings")
            for name, closest in _unknown_with_closest(environment)]


def meant_api_keys(environment: Mapping[str, str] | None = None) -> list[str]:
    """XLSERVE_ variables no setting reads that look like XLSERVE_API_KEYS (the singular, as
    the flag `--api-key` suggests): ignored, they would leave the API open when a key was meant."""
    return [name for name, closest in _unknown_with_closest(environment)
            if closest == f"{ENVIRONMENT_PREFIX}API_KEYS"]


def environment_checked_elsewhere() -> None:
    """This process's environment was checked by the process that started it (the engine process
    by the API process): its unknown variables are not warned about a second time."""
    _warned_environment_variables.update(unknown_environment_variables())


def warn_about_unknown_environment_variables() -> None:
    """Log `unknown_environment_variables()`, each once per process (settings are read many times).
    Without logging configured, Python's last-resort handler prints a warning as a bare line."""
    for warning in unknown_environment_variables():
        if warning not in _warned_environment_variables:
            _warned_environment_variables.add(warning)
            log.warning(warning)


class SettingsGroup(BaseSettings):
    """One concern's settings. `flat_prefix` is what its flat names (and environment variables,
    after XLSERVE_) put before each field's name."""

    flat_prefix: ClassVar[str] = ""

    def __init__(self, **values: Any):
        # every read of the environment (a group alone, or all of them through Settings) checks it;
        # the engine process rebuilds its settings with model_validate, which reads no environment
        warn_about_unknown_environment_variables()
        super().__init__(**values)

    @classmethod
    def flat_names(cls) -> dict[str, str]:
        """Flat name -> field name: {"prefix_cache_bytes": "bytes", ...}."""
        return {cls.flat_prefix + field: field for field in cls.model_fields}


class ServerSettings(SettingsGroup):
    """The API process: what a request may ask, how it shuts down, how often the engine may restart."""

    model_config = _group_config()

    max_prompt_bytes: int = Field(1_000_000, ge=1, description="longest prompt: UTF-8 bytes of a text prompt, "
                                  "or the number of token ids")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_request_body_bytes: int = Field(8_000_000, ge=1, description="larger request bodies get 413")
    # a stream's client that stops reading fills its socket, and the server's next write waits:
    # after this long the client counts as gone (its generation cancelled, its session let go),
    # where it would otherwise hold its session, and its request's events, for as long as it
    # keeps the connection open
    stream_send_timeout_seconds: float = Field(60, gt=0, description="a streamed answer (SSE or websocket) whose "
                                               "client has not taken a write for this long is ended")
    # a session state's body (PUT /v1/sessions/{id}/state, POST /v1/sessions/import) is binary,
    # read in chunks and never parsed as JSON, and at real size hundreds of MB (237 MB for a
    # transfo-xl-wt103 session in float32): its own limit, so that taking whole states does not
    # mean taking 237 MB JSON bodies too. 0: sized to the served models (deps.py state_body_limit)
    max_state_body_bytes: int = Field(0, ge=0, description="larger session-state bodies (import, PUT state) get "
                                      "413; 0: the largest served model's full state in float32 plus 1 MiB, and "
                                      "at least XLSERVE_MAX_REQUEST_BODY_BYTES")
    shutdown_grace_seconds: float = Field(30, ge=0, description="on SIGTERM, how long running requests may finish")
    # the engine process is restarted when it dies; more than this many restarts within the window
    # and the server exits non-zero instead, so a supervisor (systemd, Kubernetes) takes over
    engine_restart_limit: int = Field(3, ge=0, description="restarts of a dead engine process allowed within the "
                                      "window (0: the first death stops the server)")
    engine_restart_window_seconds: float = Field(600, gt=0, description="the window the restart limit counts in")
    # an engine process that sends nothing (not even its heartbeat) for this long while work waits
    # is frozen (SIGSTOP, a debugger): it is killed and restarted like a dead one
    engine_stall_seconds: float = Field(60, ge=2, description="an engine process silent this long while work "
                                        "waits is killed and restarted")
    # a model's step (one prefill chunk, one decode token for the batch) still running after this
    # long never returns (a hung GPU kernel or driver call): the heartbeat, from its own thread,
    # says so, and the engine process is killed and restarted like a dead one. Generous: a step of
    # a real-size model on a slow CPU takes seconds, never minutes
    engine_step_seconds: float = Field(300, ge=1, description="a model step still running after this long is "
                                       "hung: its engine process is killed and restarted")
    # a new engine process (the first or a restart) that has not said it is ready after this long
    # (loading hung on storage, say) is killed and counted as a failed start, instead of leaving
    # the server `loading` or `restarting` for good; generous: a real-size checkpoint loads cold
    engine_start_seconds: float = Field(900, gt=0, description="a new engine process not ready after this long "
                                        "is killed and counted as a failed start")
    # read by the API process, which renders chat prompts (server/api/chat.py)
    chat_template: Path | None = Field(None, description="a Jinja chat template file for checkpoints that "
                                       "carry none (a checkpoint's own template is kept)")


QUANTIZE_MODES = ("none", "int8")  # models/quantize.py's, which settings may not import (layers)


def parse_quantize(value: str) -> dict[str, str]:
    """XLSERVE_QUANTIZE -> {model name: mode}, the key "" holding the mode of every model not
    named: "int8" -> {"": "int8"}; "a=int8,b=none" -> {"a": "int8", "b": "none"}."""
    value = value.strip()
    if value in QUANTIZE_MODES or not value:
        return {"": value or "none"}
    modes = {}
    for entry in value.split(","):
        name, equals, mode = (part.strip() for part in entry.partition("="))
        if not equals or not name or mode not in QUANTIZE_MODES:
            raise ValueError(f"quantize entry {entry.strip()!r} is not name=mode with a mode of "
                             f"{', '.join(QUANTIZE_MODES)} (or the whole value one mode for every model)")
        modes[name] = mode
    return modes


class EngineSettings(SettingsGroup):
    """The engine process: which checkpoints, on what, with how many threads and rows."""

    model_config = _group_config()

    models: str = Field("", description="comma list of checkpoint names under the weights directory or "
                        "checkpoint paths; empty: every checkpoint there")
    weights_dir: Path = Field(WEIGHTS_DIR, description="where named checkpoints live")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when torch sees it")
    # auto: float32 (bfloat16 is opt-in on CUDA)
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: float32; bfloat16 on "
                                                          "CUDA only")
    # weight-only int8 at load (models/quantize.py): "none", "int8" for every model, or per model
    # a comma list "name=int8,other=none" (a model it does not name stays float)
    quantize: str = Field("none", description="weight-only int8 linear layers on CPU: none, int8 (every "
                          "model) or a comma list name=int8,...")
    # 0 = the cores less one (the API process's), shared by the models
    torch_threads: int = Field(0, ge=0, description="intra-op threads of the engines' forwards (0: the cores "
                               "less one; cores: at most the container's CPU limit)")
    prompt_threads: int = Field(0, ge=0, description="intra-op threads of forwards of 256 tokens or more, and of "
                                "every forward of a model of 64 MiB of weights or more (0: every core, at most the "
                                "container's CPU limit)")
    prefill_chunk_tokens: int = Field(512, ge=1, description="prompts are fed to the model in chunks of this size")
    max_batch_size: int = Field(64, ge=1, description="rows decoded together per model step (a request with n "
                                "choices takes n)")
    max_queued_requests: int = Field(256, ge=0, description="requests waiting for a batch slot per model; beyond "
                                     "that 429")
    max_queued_per_key: int = Field(0, ge=0, description="requests one API key may have waiting for a batch slot "
                                    "per model; beyond that 429 for that key alone, so that one key cannot fill the "
                                    "queue for every other (0: no bound of its own)")
    # structured output (server/engine/constraints.py): compiled constraints kept per model, the
    # limits past which a schema or grammar is refused with 400 grammar_too_large, and the time a
    # row's parser may take per token, past which its request ends with 400 constraint_too_slow
    structured_cache_size: int = Field(256, ge=0, description="compiled structured-output constraints "
                                       "(schemas, regexes, grammars) kept per model, least recently used dropped")
    structured_compile_seconds: float = Field(5.0, gt=0, description="longest a constraint may take to compile, "
                                              "from when a thread takes it; beyond it 400 grammar_too_large; no "
                                              "thread free within it, 429 constraint_compiler_busy")
    structured_max_bytes: int = Field(65536, ge=1, description="largest constraint text (a schema, regex, "
                                      "grammar, choice list or the tools) in bytes; beyond it 400 grammar_too_large")
    structured_token_milliseconds: float = Field(5.0, ge=0, description="parser (CPU) time one constrained row may "
                                                 "take for one token; beyond it for 3 tokens in a row, or on average "
                                                 "by more than 200 tokens' worth, its request ends with 400 "
                                                 "constraint_too_slow (0: no limit)")
    # the engine process hands freed memory back to the system when idle (server/engine/memory.py)
    return_memory: bool = Field(True, description="hand freed memory back to the system once the engines "
                                "are idle")

    @field_validator("quantize")
    @classmethod
    def _quantize(cls, value: str) -> str:
        """A value naming no mode stops the server at once, saying what it may be."""
        value = value.strip()
        parse_quantize(value)
        return value

    def quantize_for(self, model: str) -> str:
        """The quantize mode of the served model named `model` (its directory's name)."""
        return parse_quantize(self.quantize).get(model, parse_quantize(self.quantize).get("", "none"))

    def model_dirs(self) -> list[Path]:
        """Checkpoint directories to load: named ones, or every one under weights_dir."""
        if not self.models.strip():
            if not self.weights_dir.is_dir():
                return []
            return sorted(p for p in self.weights_dir.iterdir() if (p / "config.json").is_file())
        return [checkpoint_dir(m.strip(), self.weights_dir) for m in self.models.split(",") if m.strip()]


class CacheSettings(SettingsGroup):
    """The session cache: each tier's budget, where the disk tier lives, the shared Redis store."""

    model_config = _group_config()

    state_dir: Path = Field(STATE_DIR, description="where sessions are written down (the disk tier)")
    device_state_bytes: int = Field(1 << 30, ge=0, description="budget of session state on the model's device")
    host_state_bytes: int = Field(4 << 30, ge=0, description="budget of session state in host RAM")
    disk_state_bytes: int = Field(64 << 30, ge=0, description="budget of session state on disk")
    # every tier holds and counts states in this dtype (server/cache/codec.py); requests still
    # compute in the model's own dtype, converting the state when they start and when they commit
    state_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype session states are kept in on every tier: bfloat16 or float16 halve "
        "their bytes (bfloat16 keeps float32's range; float16 saturates at 65,504)")
    # redis://, rediss://, unix:// (one server), redis+sentinel://sentinel:26379[,...]/<master>[/db],
    # redis+cluster://node:6379[,...] (server/cache/redis_client.py; README)
    redis_url: str = Field("", description="share sessions between replicas through Redis (redis://, "
                           "redis+sentinel://, redis+cluster://; see the README)")
    store_timeout_seconds: float = Field(5.0, gt=0, description="each call to the session store (Redis) gives up "
                                         "after this long")
    # a store write that timed out: how long to keep asking the store whether it landed before
    # answering 503 commit_outcome_unknown
    commit_settle_seconds: float = Field(15.0, ge=0, description="after a store write timed out, how long to ask "
                                         "whether it landed before answering 503")
    # a key's sessions are counted where they are listed from: the books, or with Redis a scan of
    # its sessions there (server/cache/session_cache.py _check_quota)
    max_sessions_per_key: int = Field(0, ge=0, description="sessions one API key may hold at once, over every "
                                      "replica; a create, import or fork past it gets 403 session_quota_exceeded "
                                      "(0: no bound; without API keys every client is one key)")
    # a session whose model's state grows or slides by appending commits only what changed, as
    # blocks appended to a log per session (server/cache/durable.py); the log is compacted into a
    # new whole copy once it would hold more than this times the whole copy's bytes (the cache's
    # own default, durable.py DEFAULT_COMPACT_RATIO, says why 1.5; a test keeps the two equal)
    compact_ratio: float = Field(1.5, gt=0, description="compact a session's log of delta commits into a whole "
                                 "copy once it outgrows this times the copy's bytes")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        """A URL that names no Redis deployment stops the server at once, saying why."""
        value = value.strip()
        if value:
            parse_redis_url(value)  # its ValueError's message never quotes credentials
        return value


class PrefixCacheSettings(SettingsGroup):
    """The prefix-state cache (server/cache/prefix_cache.py): requests without a session resume
    from the longest cached prefix of their prompt. It shares the session cache's tiers, and its
    Redis unless `redis_url` says otherwise."""

    model_config = _group_config("PREFIX_CACHE_")
    flat_prefix: ClassVar[str] = "prefix_cache_"

    # and on every tier, never more than sessions leave
    bytes: int = Field(256 << 20, ge=0, description="the prefix-state cache's cap on the device (0 switches it off)")
    host_bytes: int = Field(1 << 30, ge=0, description="its cap in host RAM (0: no host tier for entries)")
    disk_bytes: int = Field(8 << 30, ge=0, description="its cap on disk, under the state directory (0: none)")
    block_tokens: int = Field(16, ge=1, description="tokens per block of the prefix hash chain")
    redis_ttl_seconds: int = Field(24 * 3600, ge=1, description="with Redis: entries shared there expire after "
                                   "this long unused")
    redis_url: str = Field("", description="where entries are shared between replicas: empty, the sessions' "
                           "XLSERVE_REDIS_URL; `none`, nowhere (each replica keeps its own); or another Redis's URL. "
                           "Entries are a cache of up to a whole state each: a Redis that fsyncs every write for "
                           "the sessions (appendfsync always) would stall every commit behind them")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        value = value.strip()
        if value and value != "none":
            parse_redis_url(value)  # its ValueError's message never quotes credentials
        return value


class SecuritySettings(SettingsGroup):
    """Who may call: API keys. Stays in the API process."""

    model_config = _group_config()

    api_keys: str = Field("", description="comma list of keys, or @/path/to/file with one per line; "
                          "empty: open")
    metrics_require_key: bool = Field(False, description="put /metrics behind the API keys")
    allowed_origins: str = Field("", description="comma list of web origins (https://app.example.com) whose "
                                 "pages may open the websocket /v1/stream besides the server's own; * for any")

    def allowed_origin_list(self) -> list[str]:
        return [origin.strip().rstrip("/").lower() for origin in self.allowed_origins.split(",") if origin.strip()]

    @field_validator("api_keys")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    @model_validator(mode="after")
    def _no_secret_set_to_nothing(self) -> "SecuritySettings":
        # an empty variable is unset (env_ignore_empty), but not one of these: a template's unset
        # secret (`XLSERVE_API_KEYS=${KEYS}`) would leave the API, or /metrics, open without a word
        for name in ("api_keys", "metrics_require_key"):
            variable = ENVIRONMENT_PREFIX + name.upper()
            if name not in self.model_fields_set and os.environ.get(variable) == "":
                raise ValueError(f"{variable} is set to nothing (a template's unset variable?), which would leave "
                                 f"the server open: give it a value, or unset it for the default")
        return self

    def api_key_list(self) -> list[str]:
        """The keys; [] when none is set (the API is open). Keys set that hold no key (",", an
        empty key file: a secret written from unset variables) are a ValueError, not an open API."""
        if not self.api_keys:
            return []
        if self.api_keys.startswith("@"):
            lines = Path(self.api_keys[1:]).read_text().splitlines()
            keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        else:
            keys = [key.strip() for key in self.api_keys.split(",") if key.strip()]
        if not keys:
            raise ValueError(f"--api-key / XLSERVE_API_KEYS is set ({self.api_keys!r}) but holds no key; it would "
                             "leave the API open. Unset it for an open API")
        for number, key in enumerate(keys, 1):
            # an HTTP header is read as Latin-1 and a browser's fetch sends nothing past U+00FF: a
            # key of other characters would match only on the websocket's subprotocol
            if not (key.isascii() and key.isprintable()):
                raise ValueError(f"API key {number} of --api-key / XLSERVE_API_KEYS holds a character that is not "
                                 "printable ASCII (not quoted: it is a secret); an Authorization header cannot "
                                 "carry it. Use keys of printable ASCII, e.g. `openssl rand -hex 32`")
        return keys


def _by_flat_name(error: ValidationError, group_class: type[SettingsGroup]) -> ValidationError:
    """`error` with each location a flat name ("prefix_cache_bytes", not "bytes"), so that a message
    names the setting as its environment variable and the README do."""
    located = []
    for detail in error.errors():
        # a group's own check (a model validator) has no field: its message names the variables
        loc = (group_class.flat_prefix + str(detail["loc"][0]), *detail["loc"][1:]) if detail["loc"] else ()
        located.append({"type": detail["type"], "loc": loc, "input": detail["input"], "ctx": detail.get("ctx", {})})
    return ValidationError.from_exception_data(error.title, located, hide_input=True)


class Settings:
    """Every group, composed. `Settings()` reads the environment; `Settings(device="cpu",
    prefix_cache_bytes=0)` overrides by flat name (see the module's docstring)."""

    GROUPS: ClassVar[dict[str, type[SettingsGroup]]] = {
        "server": ServerSettings,
        "engine": EngineSettings,
        "cache": CacheSettings,
        "prefix_cache": PrefixCacheSettings,
        "security": SecuritySettings,
    }
    # the groups the engine process gets (the API keys stay in the API process)
    ENGINE_PROCESS_GROUPS: ClassVar[tuple[str, ...]] = ("server", "engine", "cache", "prefix_cache")

    server: ServerSettings
    engine: EngineSettings
    cache: CacheSettings
    prefix_cache: PrefixCacheSettings
    security: SecuritySettings

    def __init__(self, **overrides: Any):
        by_group: dict[str, dict[str, Any]] = {group: {} for group in self.GROUPS}
        for flat_name, value in overrides.items():
            group, field = self.locate(flat_name)
            by_group[group][field] = value
        for group, group_class in self.GROUPS.items():
            try:
                setattr(self, group, group_class(**by_group[group]))
            except ValidationError as error:
                raise _by_flat_name(error, group_class) from None

    @classmethod
    def locate(cls, flat_name: str) -> tuple[str, str]:
        """(group, field) of a flat name; ValueError naming the known ones for any other."""
        for group, group_class in cls.GROUPS.items():
            field = group_class.flat_names().get(flat_name)
            if field is not None:
                return group, field
        raise ValueError(f"no setting named '{flat_name}'; the settings are: {', '.join(sorted(cls.flat_names()))}")

    @classmethod
    def flat_names(cls) -> list[str]:
        return [name for group_class in cls.GROUPS.values() for name in group_class.flat_names()]

    @classmethod
    def environment_variables(cls) -> list[str]:
        return [ENVIRONMENT_PREFIX + name.upper() for name in cls.flat_names()]

    @staticmethod
    def environment_variable(flat_name: str) -> str:
        return ENVIRONMENT_PREFIX + flat_name.upper()

    @staticmethod
    def flags(flat_name: str) -> list[str]:
        """The `xlserve serve` flags of a setting, the one shown first: vLLM's name where vLLM has
        one, then `--` and the flat name with dashes, then any earlier flag of this project."""
        own = "--" + flat_name.replace("_", "-")
        names = [VLLM_FLAG_NAMES.get(flat_name, own), own, *EARLIER_FLAG_NAMES.get(flat_name, ())]
        return list(dict.fromkeys(names))  # without repeats, in order

    @classmethod
    def field(cls, flat_name: str):
        """The pydantic FieldInfo of a flat name (its type, default and description)."""
        group, field = cls.locate(flat_name)
        return cls.GROUPS[group].model_fields[field]

    def flat(self) -> dict[str, Any]:
        """Flat name -> value, every setting (the secrets included)."""
        values = {}
        for group, group_class in self.GROUPS.items():
            for flat_name, field in group_class.flat_names().items():
                values[flat_name] = getattr(getattr(self, group), field)
        return values

    def for_engine_process(self) -> dict[str, dict[str, Any]]:
        """The groups the engine process needs, as JSON values (never the API keys)."""
        return {group: getattr(self, group).model_dump(mode="json") for group in self.ENGINE_PROCESS_GROUPS}

    @classmethod
    def from_engine_process_frame(cls, groups: dict[str, dict[str, Any]]) -> "Settings":
        """Rebuilt from `for_engine_process`: these values, not the engine process's environment."""
        settings = cls.__new__(cls)
        for group, group_class in cls.GROUPS.items():
            # model_validate checks the values without reading the environment again
            setattr(settings, group, group_class.model_validate(groups.get(group, {})) if group in groups
                    else group_class.model_construct())
        return settings

    def __repr__(self) -> str:
        groups = ", ".join(f"{group}={getattr(self, group)!r}" for group in self.GROUPS)
        return f"Settings({groups})"
