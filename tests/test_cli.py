"""The command line explains itself: `--help` lists each command's choices, `serve` has a flag for
every setting (flag > environment > default, each flag's help naming its variable and default), a
misspelt XLSERVE_ variable is warned about, and a user's mistake is one line and a non-zero exit,
never a traceback (run as a user runs it, in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xlserve.server.bench import BENCHMARKS
from xlserve.server.cli import build_parser, serve_overrides
from xlserve.server.settings import Settings

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith("XLSERVE_"):
            monkeypatch.delenv(name)


def xlserve(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if not name.upper().startswith("XLSERVE_")}
    return subprocess.run([sys.executable, "-m", "xlserve.server.cli", *args], cwd=REPOSITORY, capture_output=True,
                          text=True, timeout=timeout, env={**environment, "OMP_NUM_THREADS": "1", **(env or {})})


def serve_settings(*argv: str) -> Settings:
    return Settings(**serve_overrides(build_parser().parse_args(["serve", *argv])))


def test_flag_beats_environment_beats_default(monkeypatch):
    assert serve_settings().engine.max_batch_size == 64
    monkeypatch.setenv("XLSERVE_MAX_BATCH_SIZE", "3")
    assert serve_settings().engine.max_batch_size == 3
    assert serve_settings("--max-num-seqs", "9").engine.max_batch_size == 9
    assert serve_settings("--max-batch-size", "7").engine.max_batch_size == 7  # the setting's own name


def test_every_setting_is_a_serve_flag(tmp_path):
    template = tmp_path / "chat.jinja"
    settings = serve_settings(
        "--max-prompt-bytes", "11", "--api-key", "a,b", "--no-return-memory", "--metrics-require-key",
        "--dtype", "bfloat16", "--prefix-cache-block-tokens", "32", "--grace-seconds", "2.5",
        "--state-dir", str(tmp_path), "--chat-template", str(template), "--redis-url", "redis://localhost:1/0")
    assert settings.server.max_prompt_bytes == 11
    assert settings.security.api_key_list() == ["a", "b"]
    assert settings.engine.return_memory is False and settings.security.metrics_require_key is True
    assert settings.engine.dtype == "bfloat16"
    assert settings.prefix_cache.block_tokens == 32
    assert settings.server.shutdown_grace_seconds == 2.5
    assert settings.cache.state_dir == tmp_path and settings.server.chat_template == template
    assert settings.cache.redis_url == "redis://localhost:1/0"
    # a flag not given leaves the setting to the environment: nothing else was overridden
    parsed = build_parser().parse_args(["serve", "--max-num-seqs", "5"])
    assert serve_overrides(parsed) == {"max_batch_size": "5"}


def test_serve_help_names_each_flag_s_variable_and_default():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "flag > environment > default" in help_text
    for name in Settings.flat_names():
        assert Settings.flags(name)[0] in help_text, name
        assert f"(env {Settings.environment_variable(name)}; default" in help_text, name
    assert "(env XLSERVE_MAX_BATCH_SIZE; default 64)" in help_text
    assert "--device {auto,cpu,cuda}" in help_text


def test_bench_help_lists_the_benchmarks():
    done = xlserve("bench", "--help")
    assert done.returncode == 0
    listed = " ".join(done.stdout.split()).replace("- ", "-")  # argparse may wrap a name at its dash
    for name in BENCHMARKS:
        assert name in listed, name


@pytest.mark.parametrize("command", ["new", "train"])
def test_new_and_train_help_list_architectures_and_presets(command):
    from xlserve.models.training.presets import PRESETS

    done = xlserve(command, "--help")
    assert done.returncode == 0, done.stderr
    for architecture, presets in PRESETS.items():
        assert f"  {architecture}: {', '.join(sorted(presets))}" in done.stdout


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("argv, env, expected", [
    (["new", "--arch", "nope", "--out", "unused"], {}, "xlserve new: unknown architecture 'nope' (have: adaptive-span"),
    (["new", "--arch", "vanilla", "--preset", "huge", "--out", "unused"], {}, "no preset 'huge' for vanilla (have: small, tiny)"),
    (["new", "--arch", "vanilla", "--config", "{", "--out", "unused"], {}, "xlserve new: --config is not JSON"),
    (["eval", "--model", "no-such-model"], {}, "xlserve eval: no checkpoint 'no-such-model'"),
    (["serve", "--models", "no-such-model"], {}, "xlserve serve: no checkpoint 'no-such-model'"),
    (["serve", "--max-num-seqs", "lots"], {},
     "xlserve serve: setting max_batch_size (--max-num-seqs / XLSERVE_MAX_BATCH_SIZE): Input should be a valid integer"),
    (["serve"], {"XLSERVE_PREFIX_CACHE_BYTES": "lots"},
     "setting prefix_cache_bytes (--prefix-cache-bytes / XLSERVE_PREFIX_CACHE_BYTES)"),
    (["serve", "--device", "tpu"], {}, "xlserve serve: argument --device: invalid choice: 'tpu'"),
    (["serve", "--chat-template", "/no/such/template.jinja"], {},
     "xlserve serve: --chat-template / XLSERVE_CHAT_TEMPLATE: cannot read the chat template file"),
    (["bench", "no-such-benchmark"], {}, "xlserve bench: unknown benchmark 'no-such-benchmark' (have: continuation"),
    (["serve", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["serve"], {"XLSERVE_API_KEYS": ","}, "XLSERVE_API_KEYS is set (',') but holds no key; it would leave the API open"),
    (["serve", "--max-num-seqs", "0"], {},
     "setting max_batch_size (--max-num-seqs / XLSERVE_MAX_BATCH_SIZE): Input should be greater than or equal to 1"),
    (["serve"], {"XLSERVE_ENGINE_STALL_SECONDS": "0"}, "XLSERVE_ENGINE_STALL_SECONDS): Input should be greater than or equal to 2"),
    (["serve"], {"XLSERVE_ENGINE_RESTART_WINDOW_SECONDS": "-1"}, "Input should be greater than 0"),
    # uvicorn took 99999 and listened on 34463 (99999 mod 65536)
    (["serve", "--port", "99999"], {}, "argument --port: 99999 is not a port number (0 to 65535)"),
    (["serve", "--state-dir", "README.md/state"], {}, "xlserve serve: XLSERVE_STATE_DIR "),
    (["bench"], {}, "xlserve bench: name a benchmark (one of: continuation"),
    (["bench", "sessions", "--models", "no-such-model"], {}, "xlserve bench sessions: "),
    (["new", "--arch", "vanilla", "--out", "README.md/x"], {}, "xlserve new: cannot write README.md/x: [Errno 20] Not a directory"),
])
def test_a_user_error_is_one_line_and_a_non_zero_exit(argv, env, expected):
    assert expected in one_line_error(xlserve(*argv, env=env))


@pytest.mark.parametrize("argv", [
    ["new", "--arch", "nope", "--out", "unused"],
    ["new", "--arch", "vanilla", "--preset", "huge", "--out", "unused"],
    ["new", "--arch", "vanilla", "--config", "{", "--out", "unused"],
    ["new", "--arch", "vanilla", "--out", "README.md"],  # a file where the checkpoint would go
    ["train", "--arch", "nope", "--out", "unused"],
    ["train", "--arch", "vanilla", "--preset", "huge", "--out", "unused"],
    ["bench"],
    ["bench", "no-such-benchmark"],
    ["new", "--help"],
    ["train", "--help"],
])
def test_mistakes_and_help_are_answered_without_importing_torch(argv):
    """A mistyped --arch, --preset, --config, output or benchmark name (new, train, bench), and
    the help that lists the presets, are answered before torch is imported: at once, not after
    the 2-3 s it takes."""
    script = ("import sys\nfrom xlserve.server.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "sys.stdout.flush()\nprint('torch loaded' if 'torch' in sys.modules else 'torch not loaded', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPOSITORY, capture_output=True, text=True,
                          timeout=120)
    assert done.stderr.strip().endswith("torch not loaded"), done.stderr[-2000:]


def test_a_chat_template_that_does_not_compile_stops_serve(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}never closed")
    line = one_line_error(xlserve("serve", "--chat-template", str(broken)))
    assert "does not compile" in line and str(broken) in line


def test_a_misspelt_variable_is_warned_about_at_serve_start():
    # the unknown checkpoint stops serve right after the settings are read
    done = xlserve("serve", "--models", "no-such-model", env={"XLSERVE_DEVCE": "cpu"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "XLSERVE_DEVCE is not an xlserve setting and is ignored; did you mean XLSERVE_DEVICE?" in done.stderr


def test_keys_meant_but_not_read_stop_serve(tmp_path):
    """An API left open by a mistake in its keys is refused at start: a key file holding no key
    (a secret written from unset variables), and XLSERVE_API_KEY for XLSERVE_API_KEYS."""
    empty = tmp_path / "keys"
    empty.write_text("# keys, one per line\n\n")
    line = one_line_error(xlserve("serve", "--api-key", f"@{empty}"))
    assert f"XLSERVE_API_KEYS is set ('@{empty}') but holds no key" in line
    done = xlserve("serve", env={"XLSERVE_API_KEY": "secret"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert ("XLSERVE_API_KEY is not an xlserve setting, and without XLSERVE_API_KEYS the API would be open; "
            "did you mean XLSERVE_API_KEYS?") in done.stderr


def test_new_refuses_a_directory_that_holds_files_unless_forced(tmp_path):
    """`new` wrote random weights into a shipped checkpoint's directory, beside its card and
    evaluations, and `make serve` then served them under its name; `convert` refuses the same."""
    existing = tmp_path / "model"
    existing.mkdir()
    (existing / "card.md").write_text("bits per byte 1.34")
    line = one_line_error(xlserve("new", "--arch", "vanilla", "--out", str(existing)))
    assert f"xlserve new: {existing} exists and is not an empty directory" in line and "--force" in line
    assert sorted(p.name for p in existing.iterdir()) == ["card.md"]
    done = xlserve("new", "--arch", "vanilla", "--out", str(existing), "--force")
    assert done.returncode == 0, done.stderr
    assert (existing / "model.safetensors").is_file()


def test_checkpoint_files_are_readable_as_the_umask_allows(tmp_path):
    """safetensors writes its files 0600: a checkpoint made by one user (new, convert, store) could
    not be read by a server running as another, the Docker image's."""
    done = subprocess.run(["sh", "-c", f"umask 022 && {sys.executable} -m xlserve.server.cli new --arch vanilla "
                           f"--out {tmp_path / 'model'}"], cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "model" / name).stat().st_mode & 0o777 == 0o644, name


def test_a_setting_in_milliseconds_is_shown_as_such():
    help_text = xlserve("serve", "--help").stdout
    assert "--structured-token-milliseconds MS" in help_text


def test_store_rewrites_the_weights_and_keeps_everything_else_the_config_says(tmp_path):
    """`xlserve store` narrows a checkpoint's weights and leaves its tokenizer as it was: a
    converted model's config names its own (words, sentencepiece, tokenizer.json), and a store
    that wrote the default ("bytes") served a word vocabulary as bytes without an error."""
    import json

    from xlserve.models.checkpoint import load_checkpoint, read_config, save_checkpoint
    from xlserve.models.registry import build_model
    from xlserve.models.tokenizer import WordTokenizer, tokenizer_for_checkpoint
    from xlserve.models.training.presets import preset_config

    config = {**preset_config("transformer-xl", "tiny"), "vocab_size": 40}
    symbols = [f"w{i}" for i in range(39)] + ["<eos>"]
    directory = tmp_path / "words-model"
    save_checkpoint(build_model("transformer-xl", config).eval(), directory,
                    extra={"tokenizer": "words", "tokenizer_file": "symbols.json", "source": "test"})
    (directory / "symbols.json").write_text(json.dumps(symbols))
    before = load_checkpoint(directory)

    stored = xlserve("store", "--model", str(directory), "--dtype", "bfloat16")
    assert stored.returncode == 0, stored.stderr
    after = read_config(directory)
    assert (after["tokenizer"], after["tokenizer_file"], after["source"], after["storage_dtype"]) == (
        "words", "symbols.json", "test", "bfloat16")
    assert isinstance(tokenizer_for_checkpoint(after, directory), WordTokenizer)
    reloaded = load_checkpoint(directory)
    for name, weight in before.state_dict().items():
        assert reloaded.state_dict()[name].equal(weight.to(torch.bfloat16).float()), name

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    refused = xlserve("store", "--model", str(broken), "--dtype", "float16")
    assert refused.returncode != 0 and refused.stderr.startswith("xlserve store:") and "Traceback" not in refused.stderr


def test_a_benchmarks_flags_list_without_the_bench_extra(monkeypatch, capsys):
    """`xlserve bench NAME --help` is the first thing a user runs after `make serve`, which does
    not install the bench extra: the flags list, and running it says what to install."""
    import xlserve.server.bench as bench
    from xlserve.server.cli import main

    monkeypatch.setattr(bench, "missing_packages", lambda name: ["matplotlib"])
    with pytest.raises(SystemExit) as listed:
        main(["bench", "models", "--help"])
    assert listed.value.code == 0 and "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["bench", "models"])
    assert "needs matplotlib, from the bench extra" in str(refused.value.code)


def tiny_checkpoint(directory: Path, architecture: str = "mamba", extra: dict | None = None, **replaced) -> Path:
    """A randomly initialised tiny checkpoint of `architecture`, its preset's fields `replaced`."""
    from xlserve.models.checkpoint import save_checkpoint
    from xlserve.models.registry import build_model
    from xlserve.models.training.presets import preset_config

    torch.manual_seed(0)
    save_checkpoint(build_model(architecture, {**preset_config(architecture, "tiny"), **replaced}).eval(), directory,
                    extra=extra)
    return directory


@pytest.mark.parametrize("tokenizer, vocab_size, expected", [
    # a converted Mamba with its own BPE: its bytes read as token ids scored 8.8 bits per byte, without a word
    ("tokenizers", 400, "uses tokenizer.json (the tokenizers library) as its tokenizer"),
    ("words", 100, "uses symbols.json (a word list) as its tokenizer"),  # was an IndexError
    ("bytes", 100, "has 100 token ids, fewer than the 256 byte values"),  # `new --config '{"vocab_size": 100}'`
])
def test_eval_refuses_a_checkpoint_that_does_not_read_bytes(tmp_path, tokenizer, vocab_size, expected):
    """`xlserve eval` feeds the held-out files' bytes as token ids: a checkpoint with a tokenizer of
    its own is refused, pointing at the server's scoring, which tokenizes as the model does."""
    extra = {} if tokenizer == "bytes" else {"tokenizer": tokenizer}
    model = tiny_checkpoint(tmp_path / "model", extra=extra, vocab_size=vocab_size)
    line = one_line_error(xlserve("eval", "--model", str(model), "--max-bytes", "300"))
    assert line.startswith("xlserve eval: ") and expected in line, line
    if tokenizer != "bytes":
        assert "eval scores byte-level checkpoints" in line and '/v1/sessions/{id}/append with "score": true' in line


def test_eval_refuses_a_memory_length_for_a_model_without_one(tmp_path):
    model = tiny_checkpoint(tmp_path / "model")  # was: AttributeError: 'Mamba' object has no attribute 'with_mem_len'
    line = one_line_error(xlserve("eval", "--model", str(model), "--mem-len", "64", "--max-bytes", "300"))
    assert line.startswith("xlserve eval: --mem-len") and "mamba" in line, line


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--chunk-len", "0"], "argument --chunk-len: 0 is not a whole number of at least 1"),  # was a ValueError
    (["eval", "--max-bytes", "0"], "argument --max-bytes: 0 is not a whole number of at least 1"),  # printed 0.0
    (["eval", "--mem-len", "-5"], "argument --mem-len: -5 is not a whole number of at least 0"),
    (["eval", "--segment-len", "0"], "argument --segment-len: 0 is not a whole number of at least 1"),
    (["eval", "--chunk-len", "many"], "argument --chunk-len: 'many' is not a whole number"),
    # a negative budget trained no step and saved the random weights as a trained checkpoint
    (["train", "--arch", "vanilla", "--out", "unused", "--train-bytes", "-1"],
     "argument --train-bytes: -1 is not a whole number of at least 1"),
])
def test_lengths_that_cannot_be_are_refused(argv, expected, capsys):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args([*argv, "--model", "unused"] if argv[0] == "eval" else argv)
    assert refused.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and expected in lines[0], lines


def test_eval_of_a_corrupt_checkpoint_is_one_line(tmp_path):
    model = tiny_checkpoint(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"not a safetensors file")  # was a CheckpointError traceback
    line = one_line_error(xlserve("eval", "--model", str(model)))
    assert line.startswith("xlserve eval: ") and "is not a readable safetensors file" in line, line


def test_eval_write_card_needs_a_training_record_before_it_evaluates(tmp_path, monkeypatch):
    """A checkpoint from `xlserve new` or `xlserve convert` has no training.json: --write-card ran
    the whole evaluation, minutes at real size, then failed with a FileNotFoundError."""
    from xlserve.models.training import card
    from xlserve.server.cli import main

    model = tiny_checkpoint(tmp_path / "model")

    def evaluated(*args, **kwargs):
        raise AssertionError("the held-out set was evaluated before the refusal")

    monkeypatch.setattr(card, "evaluate_for_card", evaluated)
    with pytest.raises(SystemExit) as refused:
        main(["eval", "--model", str(model), "--write-card"])
    message = str(refused.value.code)
    assert message.startswith("xlserve eval: --write-card needs ") and "training.json" in message, message
    assert "\n" not in message and not (model / "card.md").exists()


def test_new_reports_a_config_torch_refuses_like_the_other_config_errors():
    # Transformer-XL's constructor takes n_layer -1 and torch refused its first tensor: a RuntimeError traceback
    line = one_line_error(xlserve("new", "--arch", "transformer-xl", "--config", '{"n_layer": -1}', "--out", "unused"))
    assert line.startswith("xlserve new: --config does not make a transformer-xl config: "), line
    assert not (REPOSITORY / "unused").exists()
