"""Server settings, read from the environment (prefix XLSERVE_) by pydantic-settings.

Created in the app factory (or by `xlserve serve`), never at import time, so tests build apps
with their own settings. The engine process gets the API process's settings as JSON (without the
API keys) in the first frame over its socket, never on its command line (which `ps` shows to
every user), and rebuilds them; every setting is listed in the README.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from xlserve.server.redis_urls import masked_url, parse_redis_url  # noqa: F401  (masked_url: engine/process.py imports it from here)

# Data directories are relative to the working directory (where `make serve` runs: the
# repository), never to this file: an installed package lives in site-packages.
WEIGHTS_DIR = Path("weights")
STATE_DIR = Path("state")
BENCH_RESULTS_DIR = Path("bench-results")


def checkpoint_dir(name_or_path: str, weights_dir: Path = WEIGHTS_DIR) -> Path:
    """A checkpoint named on the command line or in settings: an existing directory as given,
    otherwise the directory of that name under `weights_dir` (which may not exist)."""
    path = Path(name_or_path)
    return path if path.is_dir() else weights_dir / name_or_path


class Settings(BaseSettings):
    # hide_input_in_errors: a refused value may be a secret (an API key, a Redis URL with its password)
    model_config = SettingsConfigDict(env_prefix="XLSERVE_", extra="ignore", hide_input_in_errors=True)

    # what to serve
    models: str = ""  # comma list of names under weights_dir or checkpoint paths; "" = all
    weights_dir: Path = WEIGHTS_DIR
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32 (bfloat16 is opt-in on CUDA)
    torch_threads: int = 0  # intra-op threads of the engines' model work; 0 = the cores less one (the API process's), shared by the models
    prompt_threads: int = 0  # the same for forwards of 256 tokens or more (prompts); 0 = every core, shared by the models

    # access
    api_keys: str = ""  # comma list, or "@/path/to/file" with one key per line; "" = open
    metrics_require_key: bool = False

    # limits
    max_prompt_bytes: int = 1_000_000
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    max_request_body_bytes: int = 8_000_000
    prefill_chunk_tokens: int = 512  # prompts are fed to the model in chunks of this size
    max_batch_size: int = 64  # rows decoded together per model step (a request with n choices takes n)
    max_queued_requests: int = 256  # requests waiting for a batch slot per model; beyond: 429
    shutdown_grace_seconds: float = 30  # on SIGTERM, how long running requests may finish
    # the engine process is restarted when it dies; more than this many restarts within the window
    # and the server exits non-zero instead, so a supervisor (systemd, Kubernetes) takes over
    engine_restart_limit: int = 3  # 0 = never restart: the first death stops the server
    engine_restart_window_seconds: float = 600

    # session state
    state_dir: Path = STATE_DIR  # where sessions are written down
    device_state_bytes: int = 1 << 30
    host_state_bytes: int = 4 << 30
    disk_state_bytes: int = 64 << 30
    # redis://, rediss://, unix:// (one server), redis+sentinel://sentinel:26379[,...]/<master>[/db],
    # redis+cluster://node:6379[,...] (server/cache/redis_client.py; README, Settings)
    redis_url: str = ""
    # the prefix-state cache (server/cache/prefix_cache.py): requests without a session resume
    # from the longest cached prefix of their prompt; 0 bytes switches it off
    prefix_cache_bytes: int = 256 << 20  # its cap on the device; and on every tier, never more than sessions leave
    prefix_cache_host_bytes: int = 1 << 30  # its cap in host RAM (0: no host tier for entries)
    prefix_cache_disk_bytes: int = 8 << 30  # its cap on disk, under state_dir/prefix-cache (0: none)
    prefix_cache_block_tokens: int = 16  # tokens per block of the prefix hash chain
    prefix_cache_redis_ttl_seconds: int = 24 * 3600  # with redis_url: entries shared there expire after this long unused
    store_timeout_seconds: float = 5.0  # each call to the session store (Redis) gives up after this long
    # a store write that timed out: how long to keep asking the store whether it landed before
    # answering 503 commit_outcome_unknown
    commit_settle_seconds: float = 15.0

    # memory: the engine process hands freed memory back to the system when idle (server/engine/memory.py)
    return_memory: bool = True

    @field_validator("api_keys")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        """A URL that names no Redis deployment stops the server at once, saying why."""
        value = value.strip()
        if value:
            parse_redis_url(value)  # its ValueError's message never quotes credentials
        return value

    def api_key_list(self) -> list[str]:
        if not self.api_keys:
            return []
        if self.api_keys.startswith("@"):
            lines = Path(self.api_keys[1:]).read_text().splitlines()
            return [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        return [key.strip() for key in self.api_keys.split(",") if key.strip()]

    def model_dirs(self) -> list[Path]:
        """Checkpoint directories to load: named ones, or every one under weights_dir."""
        if not self.models.strip():
            if not self.weights_dir.is_dir():
                return []
            return sorted(p for p in self.weights_dir.iterdir() if (p / "config.json").is_file())
        return [checkpoint_dir(m.strip(), self.weights_dir) for m in self.models.split(",") if m.strip()]
