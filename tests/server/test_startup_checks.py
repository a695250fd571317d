"""What `xlserve serve` checks before it opens its port, how a Redis URL is shown, and where the
version comes from. Plain functions of the API process (no torch, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xlserve.server.app import StartupRefused, checkpoints_to_serve
from xlserve.server.redis_urls import masked_url
from xlserve.server.settings import Settings
from xlserve.server.version import package_version, pyproject_version


def checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("rediss://user:s3cret@redis.example:6380/2", "rediss://user:***@redis.example:6380/2"),
    ("redis://:p%40ss@[::1]:6379", "redis://:***@[::1]:6379"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing to hide
    ("redis://user@host/0", "redis://user@host/0"),
    ("redis://:s3cret@host:notaport/0", "redis://***@host:notaport/0"),  # unparseable port: hide it all
])
def test_masked_url_hides_only_the_password(url, shown):
    assert masked_url(url) == shown


def test_every_checkpoint_under_the_weights_dir_when_none_is_named(tmp_path):
    first, second = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b")
    (tmp_path / "notes").mkdir()  # not a checkpoint: ignored
    assert checkpoints_to_serve(Settings(weights_dir=tmp_path, models="")) == [first, second]


def test_no_checkpoint_at_all_is_refused(tmp_path):
    with pytest.raises(StartupRefused, match="no checkpoint to serve.*has no checkpoint directory"):
        checkpoints_to_serve(Settings(weights_dir=tmp_path, models=""))
    with pytest.raises(StartupRefused, match="does not exist"):
        checkpoints_to_serve(Settings(weights_dir=tmp_path / "missing", models=""))


def test_a_named_checkpoint_must_exist_by_name_or_path(tmp_path):
    served = checkpoint(tmp_path / "weights" / "txl")
    elsewhere = checkpoint(tmp_path / "elsewhere" / "other")
    settings = Settings(weights_dir=tmp_path / "weights", models=f"txl, {elsewhere}")
    assert checkpoints_to_serve(settings) == [served, elsewhere]
    with pytest.raises(StartupRefused, match=r"no checkpoint 'txll'.*checkpoints in .*: txl$"):
        checkpoints_to_serve(Settings(weights_dir=tmp_path / "weights", models="txl,txll"))
    (tmp_path / "weights" / "empty").mkdir()  # a directory without config.json is not a checkpoint
    with pytest.raises(StartupRefused, match="no checkpoint 'empty'"):
        checkpoints_to_serve(Settings(weights_dir=tmp_path / "weights", models="empty"))


def test_two_checkpoints_with_one_name_are_refused(tmp_path):
    checkpoint(tmp_path / "weights" / "txl")
    other = checkpoint(tmp_path / "other" / "txl")
    with pytest.raises(StartupRefused, match="two checkpoints would be served as 'txl'"):
        checkpoints_to_serve(Settings(weights_dir=tmp_path / "weights", models=f"txl,{other}"))


def test_the_version_comes_from_the_metadata_or_else_pyproject(tmp_path):
    from importlib import metadata

    assert package_version() == metadata.version("xlserve")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "xlserve"\nversion = "9.8.7"\n')
    assert pyproject_version(tmp_path / "pyproject.toml") == "9.8.7"
    assert pyproject_version(tmp_path / "missing.toml") == "unknown"


def test_the_start_up_log_says_which_models_run_every_forward_on_the_prompt_threads(caplog):
    """The engine process's Ready frame marks a model whose decode steps read 64 MiB of weights
    or more (server/engine/threads.py); its line in the start-up block says so, the others'
    lines do not."""
    import logging
    from types import SimpleNamespace

    from xlserve.server.app import log_startup

    def described(name: str, large: bool) -> dict:
        return {"name": name, "directory": f"/weights/{name}", "device": "cpu", "dtype": "float32",
                "load_seconds": 1.0, "checkpoint_config": {"tokenizer": "bytes"},
                "card": {"architecture": "transformer-xl", "parameters": 1000, "state_bytes_per_session": 10},
                "every_forward_on_prompt_threads": large}

    engine = SimpleNamespace(models=[described("small", False), described("large", True)],
                             ready_frame={"pid": 1, "threads": {"forward": 1, "prompt": 2, "cores": 2},
                                          "session_store": {"device_bytes": 100, "host_bytes": 100, "disk_bytes": 100}})
    with caplog.at_level(logging.INFO):
        log_startup(SimpleNamespace(settings=Settings(), api_keys=[]), engine, 1.0)
    lines = {line.split(":")[0].strip(): line for line in caplog.messages
             if line.startswith("  model ") and " parameters, " in line}  # each model's first line
    assert "every forward on the prompt threads" in lines["model large"]
    assert "every forward on the prompt threads" not in lines["model small"]
