"""A real EngineProcess in the test's own process, serving a tiny Transformer-XL, for the tests
that drive its handlers directly (tests/server/test_engine_*.py, test_memory_returner.py,
test_prefix_cache.py, test_state_directory_lock.py): its frames go over a real socket pair."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def tiny_settings(tmp_path: Path, **overrides):
    """Settings serving a freshly saved tiny Transformer-XL ("tiny") from `tmp_path`, sessions
    under `tmp_path / "state"`, one torch thread, memory never handed back."""
    import torch

    from xlserve.models.checkpoint import save_checkpoint
    from xlserve.models.registry import build_model
    from xlserve.models.training.presets import preset_config
    from xlserve.server.settings import Settings

    if not (tmp_path / "tiny").exists():
        torch.manual_seed(0)
        save_checkpoint(build_model("transformer-xl", preset_config("transformer-xl", "tiny")).eval(), tmp_path / "tiny")
    options = {"models": str(tmp_path / "tiny"), "state_dir": tmp_path / "state", "return_memory": False,
               "torch_threads": 1, **overrides}
    return Settings(**options)


@contextmanager
def engine_process(tmp_path: Path, **overrides) -> Iterator[tuple[object, socket.socket]]:
    """(the EngineProcess, the API process's end of its socket), closed after the block."""
    from xlserve.server.engine.process import EngineProcess

    ours, theirs = socket.socketpair()
    process = EngineProcess(tiny_settings(tmp_path, **overrides), theirs)
    try:
        yield process, ours
    finally:
        process.close()
        ours.close()
        theirs.close()
