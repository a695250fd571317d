"""Settings grouped by concern (server/settings.py): one environment variable per setting, as
before the grouping; flat names for overrides; each layer handed its group; the engine process
rebuilt from the groups it is sent, never with the API keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from xlserve.server import settings as settings_module
from xlserve.server.settings import (
    NON_SETTING_ENVIRONMENT_VARIABLES,
    CacheSettings,
    EngineSettings,
    PrefixCacheSettings,
    SecuritySettings,
    ServerSettings,
    Settings,
    is_kubernetes_service_link,
    unknown_environment_variables,
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


def test_a_variable_set_to_nothing_is_unset(monkeypatch):
    """`XLSERVE_STATE_DIR=` (a compose or Kubernetes template's empty value) made the working
    directory the state directory (the path "."), and `XLSERVE_CHAT_TEMPLATE=` refused to start
    reading "." as a template file."""
    defaults = Settings()
    for name in ("XLSERVE_STATE_DIR", "XLSERVE_CHAT_TEMPLATE", "XLSERVE_WEIGHTS_DIR", "XLSERVE_MAX_TOKENS_LIMIT",
                 "XLSERVE_DEVICE"):
        monkeypatch.setenv(name, "")
    settings = Settings()
    assert settings.cache.state_dir == defaults.cache.state_dir != Path(".")
    assert settings.server.chat_template is None
    assert settings.engine.weights_dir == defaults.engine.weights_dir
    assert settings.server.max_tokens_limit == defaults.server.max_tokens_limit
    assert settings.engine.device == "auto"


@pytest.mark.parametrize("variable", ["XLSERVE_API_KEYS", "XLSERVE_METRICS_REQUIRE_KEY"])
def test_a_security_variable_set_to_nothing_is_refused_not_taken_as_open(monkeypatch, variable):
    """An empty variable is unset, but a secret's is not: `XLSERVE_METRICS_REQUIRE_KEY=` (a
    template's unset variable) left /metrics open without a word."""
    monkeypatch.setenv(variable, "")
    with pytest.raises(ValueError, match=f"{variable} is set to nothing"):
        Settings()
    monkeypatch.setenv(variable, "true" if "METRICS" in variable else "k1")
    Settings()


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


def test_every_setting_says_what_it_is_for():
    """Its description is the help of its `xlserve serve` flag."""
    for name in Settings.flat_names():
        assert (Settings.field(name).description or "").strip(), name


def test_the_readme_names_each_setting_s_flags():
    rows = re.findall(r"^\| `XLSERVE_([A-Z_]+)` \|([^|]*)\|", README.read_text(), flags=re.MULTILINE)
    assert rows
    for variable, flags_cell in rows:
        name = variable.lower()
        listed = re.findall(r"`(--[a-z-]+)`", flags_cell)
        if Settings.field(name).annotation is bool:  # listed as --name / --no-name
            listed = [flag for flag in listed if not flag.startswith("--no-")]
        assert listed == Settings.flags(name), variable


def test_flags_are_named_as_vllm_names_them_and_keep_the_setting_s_name():
    assert Settings.flags("max_batch_size") == ["--max-num-seqs", "--max-batch-size"]
    assert Settings.flags("api_keys") == ["--api-key", "--api-keys"]
    assert Settings.flags("shutdown_grace_seconds") == ["--shutdown-grace-seconds", "--grace-seconds"]
    assert Settings.flags("chat_template") == ["--chat-template"]
    assert Settings.flags("prefix_cache_block_tokens") == ["--prefix-cache-block-tokens"]
    every_flag = [flag for name in Settings.flat_names() for flag in Settings.flags(name)]
    assert len(every_flag) == len(set(every_flag)), "two settings share a flag"


def test_a_misspelt_variable_is_warned_about_naming_the_closest_setting():
    found = unknown_environment_variables({"XLSERVE_DEVCE": "cpu", "XLSERVE_DEVICE": "cpu", "HOME": "/root",
                                           "xlserve_max_batch": "3", "XLSERVE_ZZZZZZ": "1"})
    assert found == [
        "XLSERVE_DEVCE is not an xlserve setting and is ignored; did you mean XLSERVE_DEVICE?",
        "XLSERVE_ZZZZZZ is not an xlserve setting and is ignored; `xlserve serve --help` lists the settings",
        "xlserve_max_batch is not an xlserve setting and is ignored; did you mean XLSERVE_MAX_BATCH_SIZE?",
    ]
    assert unknown_environment_variables({name: "1" for name in Settings.environment_variables()}) == []


def test_kubernetes_service_links_are_not_warned_about():
    """A pod spec without `enableServiceLinks: false` gets variables for every Service of its
    namespace: the shipped Services' 16 each read as a misspelt setting ("XLSERVE_REDIS_PORT ...
    did you mean XLSERVE_REDIS_URL?"), burying a real misspelling."""
    links = {"XLSERVE_SERVICE_HOST": "10.0.0.1", "XLSERVE_SERVICE_PORT": "8000", "XLSERVE_SERVICE_PORT_HTTP": "8000",
             "XLSERVE_PORT": "tcp://10.0.0.1:8000", "XLSERVE_PORT_8000_TCP": "tcp://10.0.0.1:8000",
             "XLSERVE_PORT_8000_TCP_ADDR": "10.0.0.1", "XLSERVE_PORT_8000_TCP_PORT": "8000",
             "XLSERVE_PORT_8000_TCP_PROTO": "tcp", "XLSERVE_REDIS_SERVICE_HOST": "10.0.0.2",
             "XLSERVE_REDIS_PORT": "tcp://10.0.0.2:6379", "XLSERVE_REDIS_PORT_6379_TCP_ADDR": "10.0.0.2"}
    assert unknown_environment_variables(links) == []
    assert unknown_environment_variables({**links, "XLSERVE_MAX_BATCH": "8"}) == [
        "XLSERVE_MAX_BATCH is not an xlserve setting and is ignored; did you mean XLSERVE_MAX_BATCH_SIZE?"]
    # told apart by value too: a guess at the port (which only --port sets) is still a mistake to say
    guesses = {"XLSERVE_PORT": "9000", "XLSERVE_REDIS_PORT": "6380", "XLSERVE_SERVICE_HOST": "my-host"}
    assert [warning.split(" ")[0] for warning in unknown_environment_variables(guesses)] == sorted(guesses)
    assert is_kubernetes_service_link("XLSERVE_PORT", "tcp://[fd00::1]:8000")


def test_reading_the_environment_warns_once_per_variable(monkeypatch, caplog):
    monkeypatch.setenv("XLSERVE_PREFIX_CACHE_BYTE", "0")
    monkeypatch.setattr(settings_module, "_warned_environment_variables", set())
    with caplog.at_level("WARNING", logger="xlserve.settings"):
        Settings()
        EngineSettings()
    warned = [record.getMessage() for record in caplog.records if record.name == "xlserve.settings"]
    assert warned == ["XLSERVE_PREFIX_CACHE_BYTE is not an xlserve setting and is ignored; "
                      "did you mean XLSERVE_PREFIX_CACHE_BYTES?"]


def test_every_xlserve_variable_the_repository_uses_is_a_setting_or_listed_as_none():
    """Tests, the Makefile, images and deployment files may set XLSERVE_ variables; each must be a
    setting or in NON_SETTING_ENVIRONMENT_VARIABLES, or every server they start warns about it.
    (Not the docs, nor the tests of the warning, which misspell names on purpose.)"""
    repository = README.parent
    misspelling_on_purpose = {Path(__file__).resolve(), repository / "tests" / "test_cli.py",
                              repository / "tests" / "e2e" / "test_startup_and_shutdown.py"}
    used = set()
    for directory in ("Makefile", "tests", "docker", "deploy", "server", "models"):
        root = repository / directory
        files = [root] if root.is_file() else [path for path in root.rglob("*") if path.is_file()] if root.exists() else []
        for path in files:
            if path.suffix in {".safetensors", ".png", ".pyc"} or path.resolve() in misspelling_on_purpose:
                continue
            used |= set(re.findall(r"XLSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore")))
    assert used, "the search found no XLSERVE_ variable at all"
    unknown = used - set(Settings.environment_variables()) - NON_SETTING_ENVIRONMENT_VARIABLES
    unknown -= {"XLSERVE_SERVICE_HOST", "XLSERVE_PORT_8000_TCP_ADDR", "XLSERVE_REDIS_PORT"}  # deploy/'s comments name them
    assert not unknown, f"XLSERVE_ variables that are not settings: add them to NON_SETTING_ENVIRONMENT_VARIABLES: {unknown}"


def test_a_key_an_authorization_header_cannot_carry_is_refused_at_start():
    """A key with a character past ASCII was taken: HTTP reads headers as Latin-1 (and a
    browser's fetch sends nothing past U+00FF), so it matched only on the websocket, whose
    sessions then belonged to an owner no HTTP request could present."""
    for keys in ("k1,clé2", "k1,\u0001x"):
        with pytest.raises(ValueError, match="not printable ASCII") as refused:
            SecuritySettings(api_keys=keys).api_key_list()
        assert "clé2" not in str(refused.value)
    assert SecuritySettings(api_keys="k1, k2 ").api_key_list() == ["k1", "k2"]
