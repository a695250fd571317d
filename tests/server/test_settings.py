"""Settings grouped by concern (server/settings.py): one environment variable per setting, as
before the grouping; flat names for overrides; each layer handed its group; the engine process
rebuilt from the groups it is sent, never with the API keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from xlserve.server.settings import (
    CacheSettings,
    EngineSettings,
    PrefixCacheSettings,
    SecuritySettings,
    ServerSettings,
    Settings,
)

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in Settings.environment_variables():
        monkeypatch.delenv(name, raising=False)


def test_every_setting_has_one_flat_name_and_one_group():
    names = Settings.flat_names()
    assert len(names) == len(set(names)), "two groups define the same setting"
    for name in names:
        group, field = Settings.locate(name)
        assert field in Settings.GROUPS[group].model_fields


def test_the_readme_lists_exactly_the_environment_variables():
    listed = set(re.findall(r"^\| `(XLSERVE_[A-Z_]+)` \|", README.read_text(), flags=re.MULTILINE))
    assert listed == set(Settings.environment_variables())


def test_environment_variables_reach_their_group(monkeypatch):
    monkeypatch.setenv("XLSERVE_DEVICE", "cpu")
    monkeypatch.setenv("XLSERVE_PREFIX_CACHE_BYTES", "0")
    monkeypatch.setenv("XLSERVE_PREFIX_CACHE_BLOCK_TOKENS", "32")
    monkeypatch.setenv("XLSERVE_DEVICE_STATE_BYTES", "1024")
    monkeypatch.setenv("XLSERVE_API_KEYS", " one,two ")
    monkeypatch.setenv("XLSERVE_MAX_TOKENS_LIMIT", "7")
    settings = Settings()
    assert settings.engine.device == "cpu"
    assert (settings.prefix_cache.bytes, settings.prefix_cache.block_tokens) == (0, 32)
    assert settings.cache.device_state_bytes == 1024
    assert settings.security.api_key_list() == ["one", "two"]
    assert settings.server.max_tokens_limit == 7
    # a group read on its own reads the same variables
    assert PrefixCacheSettings().block_tokens == 32 and EngineSettings().device == "cpu"


def test_overrides_by_flat_name_beat_the_environment(monkeypatch):
    monkeypatch.setenv("XLSERVE_MAX_BATCH_SIZE", "3")
    settings = Settings(max_batch_size=9, prefix_cache_host_bytes=5, metrics_require_key=True)
    assert settings.engine.max_batch_size == 9
    assert settings.prefix_cache.host_bytes == 5
    assert settings.security.metrics_require_key is True
    assert settings.flat()["prefix_cache_host_bytes"] == 5


def test_an_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="no setting named 'max_batch'; the settings are: .*max_batch_size"):
        Settings(max_batch=4)


def test_an_invalid_value_is_reported_by_its_flat_name():
    with pytest.raises(ValidationError) as refused:
        Settings(prefix_cache_bytes="lots")
    assert refused.value.errors()[0]["loc"] == ("prefix_cache_bytes",)
    with pytest.raises(ValidationError) as refused:
        Settings(device="tpu")
    assert refused.value.errors()[0]["loc"] == ("device",)


def test_a_refused_secret_is_never_quoted():
    with pytest.raises(ValueError) as refused:
        Settings(redis_url="redis+sentinel://:hunter2@sentinel")
    assert "hunter2" not in str(refused.value)
    assert refused.value.errors()[0]["loc"] == ("redis_url",)


def test_the_engine_process_gets_every_group_but_security(tmp_path, monkeypatch):
    settings = Settings(api_keys="secret-key", state_dir=tmp_path, device="cpu", prefix_cache_block_tokens=8,
                        engine_restart_limit=1)
    sent = settings.for_engine_process()
    assert set(sent) == {"server", "engine", "cache", "prefix_cache"}
    assert "secret-key" not in repr(sent)
    # the engine process's own environment does not leak into what it was sent
    monkeypatch.setenv("XLSERVE_DEVICE", "cuda")
    monkeypatch.setenv("XLSERVE_API_KEYS", "from-the-engine-environment")
    rebuilt = Settings.from_engine_process_frame(sent)
    assert rebuilt.engine.device == "cpu"
    assert rebuilt.cache.state_dir == tmp_path
    assert rebuilt.prefix_cache.block_tokens == 8
    assert rebuilt.server.engine_restart_limit == 1
    assert rebuilt.security.api_keys == ""


def test_the_engine_process_checks_what_it_is_sent():
    sent = Settings().for_engine_process()
    sent["engine"]["device"] = "tpu"
    with pytest.raises(ValidationError):
        Settings.from_engine_process_frame(sent)


@pytest.mark.parametrize("group", [ServerSettings, EngineSettings, CacheSettings, PrefixCacheSettings,
                                   SecuritySettings])
def test_each_group_says_what_it_is_for(group):
    assert group.__doc__ and group.__doc__.strip()
    assert group in Settings.GROUPS.values()
