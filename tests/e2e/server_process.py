"""Start a real xlserve server (uvicorn on 127.0.0.1, a free port) in a subprocess.

Checkpoints are written by `xlserve new` in the test process (`new_checkpoints`); everything
else is HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(directory: Path, arch: str = "transformer-xl", preset: str = "tiny", seed: int = 0,
                    config: dict | None = None) -> Path:
    """A random checkpoint of `arch`'s `preset`, its `config` fields replaced by those given."""
    new_checkpoints([["new", "--arch", arch, "--preset", preset, "--out", str(directory), "--seed", str(seed),
                      "--config", json.dumps(config or {})]])
    return directory


def make_checkpoints(directory: Path, architectures: dict[str, str], preset: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """`make_checkpoint` for each name -> architecture."""
    new_checkpoints([["new", "--arch", arch, "--preset", preset, "--out", str(directory / name), "--seed", str(seed)]
                     for name, arch in architectures.items()])
    return {name: directory / name for name in architectures}


def new_checkpoints(calls: list[list[str]]) -> None:
    """`xlserve new` with each argv, in this process: a test worker imports torch once (most have
    already, for the model tests), where a subprocess per checkpoint paid 2-3 s for its own import.
    The global random generator is left as it was: `--seed` seeds it for the weights."""
    import torch

    from xlserve.server.cli import main

    with torch.random.fork_rng():  # the CPU generator's state and, with CUDA, the devices' (seeded too)
        for argv in calls:
            main(argv)


class ServerProcess:
    def __init__(self, models: list[Path | str], env: dict | None = None, port: int | None = None, log_path: Path | None = None,
                 log_level: str = "warning"):
        self.port = port or free_port()
        self.log_level = log_level  # "info" writes the start-up block into log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.models = models
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "XLSERVE_TORCH_THREADS": "1", **(env or {})}
        if "XLSERVE_STATE_DIR" not in (env or {}):  # sessions are written down: never into the repo's state/
            self.env["XLSERVE_STATE_DIR"] = tempfile.mkdtemp(prefix="xlserve-state-")
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "ServerProcess":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xlserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--models", ",".join(str(m) for m in self.models), "--log-level", self.log_level],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} (log: {self.log_path})")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become ready within {timeout}s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def openai_client(self, api_key: str = "not-needed", **options):
        """The openai package's client of this server's /v1, which never retries (a test sees
        every answer as the server gave it); `options` (timeout, ...) as OpenAI takes them."""
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **options)
