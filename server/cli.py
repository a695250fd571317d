"""`xlserve serve | train | new | store | eval | bench | convert`, and `xlserve --version`.

`serve` has a flag for every setting (server/settings.py), made from the settings classes: each
flag's help names its environment variable and default, and a flag beats the environment, which
beats the default. It refuses settings that cannot work (no checkpoint to serve, a named one
missing, an invalid value, a chat template file that cannot be read) in one line before it opens
the port, and exits non-zero when the engine process cannot be started or restarted
(server/engine/client.py), so that a supervisor takes over.

A user's mistake (an unknown flag or choice, a missing checkpoint, a bad value) is one line on
stderr and exit status 1 or 2, never a traceback: a traceback says the program is broken. `--help`
of each command lists its choices (benchmarks, architectures, presets)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

SERVE_DESCRIPTION = """Start the HTTP server. Each setting below comes from its flag if given, else from its
environment variable (XLSERVE_ and the setting's name), else its default: flag > environment >
default. An XLSERVE_ variable that names no setting is warned about, with the closest one."""


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake in one line (argparse prints the whole usage first, which for
    `serve` is dozens of flags long) and a pointer to --help. `epilog_when_asked`: a function
    giving the help's epilog, called only when help is printed (see `model_choices`)."""

    def __init__(self, *args, epilog_when_asked=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.epilog_when_asked = epilog_when_asked

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        if self.epilog_when_asked is not None:
            self.epilog = self.epilog_when_asked()
        return super().format_help()


def port_number(text: str) -> int:
    """--port: 0 to 65535 (uvicorn would take 99999 and listen on another port, 99999 mod 65536)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def whole_number_at_least(least: int):
    """An argparse type: a whole number of at least `least` (--chunk-len 0 was a ValueError from
    deep in the evaluation, --max-bytes 0 a bits per byte of 0.0 over nothing)."""

    def whole_number(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if number < least:
            raise argparse.ArgumentTypeError(f"{number} is not a whole number of at least {least}")
        return number

    return whole_number


def model_choices() -> str:
    """`train` / `new --help`: the architectures and each one's presets (models/training/presets.py,
    torch-free)."""
    from xlserve.models.training.presets import PRESETS

    rows = [f"  {architecture}: {', '.join(sorted(presets))}" for architecture, presets in sorted(PRESETS.items())]
    return "architectures (--arch) and their presets (--preset):\n" + "\n".join(rows)


def _settings_error_line(command: str, error) -> str:
    """A pydantic ValidationError of the settings as one line naming the setting, its flag and its
    environment variable (never the value: it may be a secret)."""
    from xlserve.server.settings import Settings

    first = error.errors()[0]
    if not first["loc"]:  # a check of several settings at once: its message names them
        return f"xlserve {command}: {first['msg'].removeprefix('Value error, ')}"
    name = str(first["loc"][0])
    where = name
    if name in Settings.flat_names():
        where = f"{name} ({Settings.flags(name)[0]} / {Settings.environment_variable(name)})"
    return f"xlserve {command}: setting {where}: {first['msg']}"


def _resolve_model_dir(name_or_path: str, command: str) -> Path:
    import pydantic

    from xlserve.server.settings import EngineSettings, checkpoint_dir

    try:
        weights_dir = EngineSettings().weights_dir  # XLSERVE_WEIGHTS_DIR, as `serve` uses it
    except pydantic.ValidationError as error:
        raise SystemExit(_settings_error_line(command, error)) from None
    path = checkpoint_dir(name_or_path, weights_dir)
    if not (path / "config.json").is_file():
        raise SystemExit(f"xlserve {command}: no checkpoint '{name_or_path}' (a directory with a config.json; "
                         f"looked in . and {weights_dir})")
    return path


def _check_architecture_and_preset(command: str, architecture: str, preset: str) -> None:
    """An unknown --arch or --preset in one line naming the known ones (before any work)."""
    from xlserve.models.training.presets import PRESETS

    if architecture not in PRESETS:
        raise SystemExit(f"xlserve {command}: unknown architecture '{architecture}' "
                         f"(have: {', '.join(sorted(PRESETS))})")
    if preset not in PRESETS[architecture]:
        raise SystemExit(f"xlserve {command}: no preset '{preset}' for {architecture} "
                         f"(have: {', '.join(sorted(PRESETS[architecture]))})")


def _default_text(value: Any) -> str:
    """A setting's default as its flag's help shows it: sizes in bytes also in GiB / MiB."""
    if value is None:
        return "none"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        unit, size = ("GiB", value >> 30) if value % (1 << 30) == 0 else ("MiB", value >> 20)
        return f"{value} ({size} {unit})"
    return str(value)


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped as the settings classes are, each defaulting to "not given"
    (so that the environment, then the default, decide: pydantic-settings does that)."""
    from xlserve.server.settings import Settings

    for group, group_class in Settings.GROUPS.items():
        flags = parser.add_argument_group(f"{group.replace('_', ' ')} settings", (group_class.__doc__ or "").strip())
        for flat_name in group_class.flat_names():
            field = Settings.field(flat_name)
            help_text = (f"{field.description} (env {Settings.environment_variable(flat_name)}; "
                         f"default {_default_text(field.default)})").replace("%", "%%")
            if flat_name in SECRET_SETTINGS:
                help_text += "; a flag's value is visible to every user in `ps`: prefer the environment"
            options: dict[str, Any] = dict(dest=flat_name, default=argparse.SUPPRESS, help=help_text)
            if field.annotation is bool:
                options["action"] = argparse.BooleanOptionalAction
            elif get_origin(field.annotation) is Literal:
                options["choices"] = list(get_args(field.annotation))
            else:  # pydantic converts and checks the text, naming the setting when it refuses it
                options["metavar"] = _metavar(field.annotation, flat_name)
            flags.add_argument(*Settings.flags(flat_name), **options)


# settings that may hold a password or a key
SECRET_SETTINGS = frozenset({"api_keys", "redis_url", "prefix_cache_redis_url"})
NAMED_METAVARS = {"models": "NAMES", "redis_url": "URL", "prefix_cache_redis_url": "URL", "api_keys": "KEYS"}


def _metavar(annotation, flat_name: str) -> str:
    if flat_name in NAMED_METAVARS:
        return NAMED_METAVARS[flat_name]
    if annotation is int:
        return "N"
    if annotation is float:
        if flat_name.endswith("milliseconds"):
            return "MS"
        return "SECONDS" if flat_name.endswith("seconds") else "X"
    if "dir" in flat_name:
        return "DIR"
    if "template" in flat_name:
        return "FILE"
    return "TEXT"


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as `serve` flags, by flat name (those not given are left out)."""
    from xlserve.server.settings import Settings

    return {name: getattr(args, name) for name in Settings.flat_names() if hasattr(args, name)}


def _log_to_stderr(level: str) -> None:
    """xlserve's own loggers (the start-up block, engine restarts) next to uvicorn's, at its level."""
    import logging

    class UvicornStyle(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            record.levelprefix = f"{record.levelname}:".ljust(9)  # "INFO:     ..." as uvicorn's lines
            return super().format(record)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(UvicornStyle("%(levelprefix)s %(message)s"))
    logger = logging.getLogger("xlserve")
    logger.addHandler(handler)
    number = logging.getLevelName(level.upper())  # uvicorn's "trace" is below logging's levels
    logger.setLevel(number if isinstance(number, int) else logging.DEBUG)
    logger.propagate = False


# uvicorn's HTTP parser (httptools) accepts a handshake with a header line of any length, then hands
# it to the websockets library, which parses it again under limits of its own (8192 bytes a line,
# 128 headers). Its refusal of a longer one (a 431) is never written by uvicorn's websocket
# protocol, so the client waited for an answer that never came. Lifted past anything the HTTP
# parser holds, the handshake reaches /v1/stream, which refuses a bad key with an error frame.
# (Read once, when websockets is imported; an operator's own setting is kept.)
WEBSOCKETS_PARSER_LIMITS = {"WEBSOCKETS_MAX_LINE_LENGTH": str(2**31), "WEBSOCKETS_MAX_NUM_HEADERS": str(2**31)}


def cmd_serve(args) -> None:
    import asyncio
    import os

    for name, value in WEBSOCKETS_PARSER_LIMITS.items():
        os.environ.setdefault(name, value)

    import pydantic
    import uvicorn

    from xlserve.server.api.chat import ChatTemplateError, check_template_file
    from xlserve.server.app import StartupRefused, build_app, checkpoints_to_serve, cut_streams, drain
    from xlserve.server.cache.state_directory import StateDirectoryRefused, check_role, hold_state_directory
    from xlserve.server.settings import Settings, meant_api_keys

    _log_to_stderr(args.log_level)  # first: reading the settings may warn (a misspelt XLSERVE_ variable)
    # refuse what cannot work in one line, before the port opens (no traceback: nothing is broken)
    try:
        settings = Settings(**serve_overrides(args))
        checkpoints_to_serve(settings)
        settings.security.api_key_list()  # a key file that cannot be read, keys set that hold none
        meant = meant_api_keys()
        if meant and not settings.security.api_keys:
            raise SystemExit(f"xlserve serve: {meant[0]} is not an xlserve setting, and without "
                             "XLSERVE_API_KEYS the API would be open; did you mean XLSERVE_API_KEYS?")
        if settings.server.chat_template is not None:
            check_template_file(settings.server.chat_template)
        # a state directory that cannot be written or that another server holds, before the port
        # opens (the engine process takes it for good once it starts)
        hold_state_directory(settings.cache.state_dir).close()
        check_role(settings.cache.state_dir, with_redis=bool(settings.cache.redis_url))  # a spill cache without Redis
    except StateDirectoryRefused as error:
        raise SystemExit(f"xlserve serve: {error}") from None
    except pydantic.ValidationError as error:
        raise SystemExit(_settings_error_line("serve", error)) from None
    except StartupRefused as error:
        raise SystemExit(f"xlserve serve: {error}") from None
    except ChatTemplateError as error:
        raise SystemExit(f"xlserve serve: --chat-template / XLSERVE_CHAT_TEMPLATE: {error}") from None
    except OSError as error:
        raise SystemExit(f"xlserve serve: --api-key / XLSERVE_API_KEYS names a file that cannot be read: "
                         f"{error}") from None
    except ValueError as error:  # keys set that hold none
        raise SystemExit(f"xlserve serve: {error}") from None

    grace = settings.server.shutdown_grace_seconds
    failure: list[str] = []  # why the engine process is gone for good, when it is

    class GracefulServer(uvicorn.Server):
        """The first SIGTERM/SIGINT drains: new requests get 503 while running ones finish (up
        to the grace period) and commit; those still running then get an error event
        `server_shutting_down`; then uvicorn stops and the lifespan closes the engines and the
        cache. A second signal cuts what runs (with the same error) and stops at once. Exits 0
        either way; exits 1 when the engine process cannot be started or restarted."""

        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.started and not self.draining and not self.should_exit:
                self.draining = True
                loop = asyncio.get_running_loop()  # signal handlers run on the event loop's thread

                async def drain_then_exit():
                    try:
                        await drain(app, grace)
                    finally:
                        self.handle_exit(sig, frame)

                self._drain_task = loop.create_task(drain_then_exit())
                return
            if self.started:  # on the loop, not inside this handler: it may have interrupted the loop anywhere
                asyncio.get_running_loop().call_soon_threadsafe(cut_streams, app)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after shutting down; a graceful stop should exit 0
            self._captured_signals.clear()

    def engine_lost(reason: str) -> None:
        """The engine process cannot be (re)started: stop, so that a supervisor takes over."""
        failure.append(reason)
        server.should_exit = True

    app = build_app(settings, load_in_background=True, on_fatal=engine_lost)
    # a websocket frame up to the request body limit gets its answer (an error frame past it): uvicorn
    # closes the connection (1009) on a frame past its own bound, 16 MiB unless raised with the limit
    ws_max_size = max(1 << 24, 2 * settings.server.max_request_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, ws_max_size=ws_max_size)
    server = GracefulServer(config)
    server.run()
    if failure:
        raise SystemExit(f"xlserve serve: {failure[0]}")


def cmd_train(args) -> None:
    from dataclasses import replace

    if args.without_lane_memory and not args.export_progress:
        # a training run always saves the lanes' memory; accepting the flag here would promise otherwise
        raise SystemExit("xlserve train: --without-lane-memory applies only to --export-progress DIR "
                         "(a copy of the resume state); nothing was trained")
    if args.export_progress:
        from xlserve.models.training.train import ResumeRefused, export_progress

        try:
            progress = export_progress(args.out, args.export_progress, lane_memory=not args.without_lane_memory)
        except ResumeRefused as error:  # no run there
            raise SystemExit(f"xlserve train: {error}") from None
        except OSError as error:
            raise SystemExit(f"xlserve train: cannot copy the resume state of {args.out} to {args.export_progress}: "
                             f"{error}") from None
        print(f"copied the resume state of {args.out} at step {progress['step']} to {args.export_progress}"
              + (" (without the lanes' memory)" if args.without_lane_memory else ""))
        return
    _check_architecture_and_preset("train", args.arch, args.preset)
    from xlserve.models.training.train import (  # (torch: after the checks)
        STANDARD_RECIPE, ResumeRefused, TrainingDiverged, train)

    recipe = STANDARD_RECIPE
    if args.train_bytes:
        recipe = replace(recipe, train_bytes=args.train_bytes)
    try:
        train(args.arch, args.preset, args.out, recipe, log=lambda s: print(s, flush=True))
    except (TrainingDiverged, ResumeRefused) as error:  # a NaN step, or a rerun over a run of another kind
        raise SystemExit(f"xlserve train: {error}") from None


def cmd_new(args) -> None:
    # every check of the arguments first, torch-free: a mistake is answered at once, not after
    # the seconds of a torch import
    _check_architecture_and_preset("new", args.arch, args.preset)
    try:
        replaced = json.loads(args.config)
    except ValueError as error:
        raise SystemExit(f"xlserve new: --config is not JSON: {error}") from None
    if not isinstance(replaced, dict):
        raise SystemExit("xlserve new: --config must be a JSON object of config fields")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        # random weights beside another model's card and evaluations, under its name (a shipped one
        # in weights/ included): what `convert` refuses too
        raise SystemExit(f"xlserve new: {out} exists and is not an empty directory; give a new one, or --force to "
                         "overwrite its checkpoint files")
    import torch

    from xlserve.models.checkpoint import save_checkpoint
    from xlserve.models.registry import build_model
    from xlserve.models.training.presets import preset_config

    from xlserve.models.allocation import out_of_memory

    torch.manual_seed(args.seed)
    try:
        model = build_model(args.arch, {**preset_config(args.arch, args.preset), **replaced})
    except (TypeError, ValueError) as error:  # a field the config does not have, or a value it refuses
        raise SystemExit(f"xlserve new: --config does not make a {args.arch} config: {error}") from None
    except (RuntimeError, MemoryError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]  # torch may add lines of its own
        if out_of_memory(error):  # sizes too large for this machine, not a mistake in their form
            raise SystemExit(f"xlserve new: the {args.arch} that --config describes does not fit this machine's "
                             f"memory: {reason}") from None
        # a value the config class let through and torch refused while building the model
        # (Transformer-XL's n_layer -1: "zeros: Dimension size must be non-negative")
        raise SystemExit(f"xlserve new: --config does not make a {args.arch} config: {reason}") from None
    try:
        save_checkpoint(model.eval(), out)
    except OSError as error:
        raise SystemExit(f"xlserve new: cannot write {out}: {error}") from None
    print(f"wrote a randomly initialised {args.arch}/{args.preset} to {out}")


def cmd_store(args) -> None:
    from xlserve.models.checkpoint import CheckpointError, load_checkpoint, read_config, save_checkpoint

    directory = _resolve_model_dir(args.model, "store")
    try:
        config = read_config(directory)
        model = load_checkpoint(directory)
    except CheckpointError as error:
        raise SystemExit(f"xlserve store: {error}") from None
    # everything the config says besides what save_checkpoint writes from the model: the
    # tokenizer a converted model names above all (its default is bytes: a GPT-NeoX vocabulary
    # read as bytes serves garbage without an error), its file, options and end tokens
    extra = {k: v for k, v in config.items() if k not in ("format", "version", "architecture", "config", "storage_dtype")}
    dtype = None if args.dtype == "float32" else args.dtype
    try:
        save_checkpoint(model, directory, extra=extra, storage_dtype=dtype)
    except (CheckpointError, OSError) as error:  # a weight beyond float16's range, a disk that refuses
        raise SystemExit(f"xlserve store: {error}") from None
    size = (directory / "model.safetensors").stat().st_size
    print(f"rewrote {directory} with weights stored as {args.dtype}: {size:,} bytes")


def cmd_eval(args) -> None:
    from xlserve.models.checkpoint import CheckpointError, load_checkpoint, read_config
    from xlserve.models.registry import model_class
    from xlserve.models.tokenizer import describe_tokenizer
    from xlserve.models.training.data import stdlib_corpus
    from xlserve.models.training.evaluate import bits_per_byte
    from xlserve.models.training.train import held_out_documents

    directory = _resolve_model_dir(args.model, "eval")
    # what the config says is refused before the weights load (seconds at real size), and a card
    # before its minutes of evaluation
    try:
        config = read_config(directory)
    except CheckpointError as error:
        raise SystemExit(f"xlserve eval: {error}") from None
    if config.get("tokenizer", "bytes") != "bytes":
        # the held-out files' bytes would be read as ids of another vocabulary: a converted Mamba's
        # BPE scored 8.8 bits per byte without a word, a vocabulary under 256 ids failed on an index
        raise SystemExit(f"xlserve eval: {directory} uses {describe_tokenizer(config)} as its tokenizer; eval scores "
                         "byte-level checkpoints (it feeds the held-out files' bytes as token ids): to score a text "
                         "with the model's own tokenizer, serve it and send the text to "
                         '/v1/sessions/{id}/append with "score": true, which answers its bits per byte')
    if args.write_card and not (directory / "training.json").is_file():
        raise SystemExit(f"xlserve eval: --write-card needs {directory / 'training.json'}, the record of the "
                         "training run `xlserve train` writes (a checkpoint from `xlserve new` or `xlserve convert` "
                         "has none); nothing was evaluated")
    if args.mem_len is not None and not hasattr(model_class(config["architecture"]), "with_mem_len"):
        raise SystemExit(f"xlserve eval: --mem-len sets the memory length of a transformer-xl; {directory} holds a "
                         f"{config['architecture']}, whose memory length cannot be set")
    try:
        model = load_checkpoint(directory)
    except CheckpointError as error:
        raise SystemExit(f"xlserve eval: {error}") from None
    if model.vocab_size < 256:
        raise SystemExit(f"xlserve eval: {directory}'s model has {model.vocab_size} token ids, fewer than the 256 "
                         "byte values eval feeds it")
    if args.write_card:
        from xlserve.models.training.card import evaluate_for_card, sample, write_card

        evaluations = evaluate_for_card(model, segment_len=args.segment_len)
        print(json.dumps(evaluations))
        write_card(directory, model, evaluations, sample(model, "import os\n\n\ndef ", 400))
        print(f"wrote {directory / 'card.md'}")
        return
    if args.mem_len is not None:
        model = model.with_mem_len(args.mem_len)
    corpus = stdlib_corpus()
    documents = held_out_documents(corpus, args.max_bytes)
    bpb = bits_per_byte(model, documents, chunk_len=args.chunk_len)
    result = {
        "model": args.model,
        "held_out_files": len(documents),
        "held_out_bytes": sum(len(d) for d in documents),
        "mem_len": getattr(model.config, "mem_len", None),
        "chunk_len": args.chunk_len,
        "bits_per_byte": round(bpb, 4),
    }
    print(json.dumps(result))


def cmd_bench(args) -> None:
    import importlib

    from xlserve.server.bench import BENCHMARKS, missing_packages

    if args.name is None:
        raise SystemExit(f"xlserve bench: name a benchmark (one of: {', '.join(sorted(BENCHMARKS))}; "
                         "see xlserve bench --help)")
    if args.name not in BENCHMARKS:
        raise SystemExit(f"xlserve bench: unknown benchmark '{args.name}' (have: {', '.join(sorted(BENCHMARKS))})")
    missing = missing_packages(args.name)
    if missing and not {"-h", "--help"} & set(args.args):  # its flags list without the extra
        # (a benchmark imports matplotlib and transformers only once it runs)
        raise SystemExit(f"xlserve bench {args.name} needs {', '.join(missing)}, from the bench extra: make bench "
                         "(or .venv/bin/pip install -c constraints.txt -e '.[bench]') in the checkout")
    from xlserve.models.checkpoint import CheckpointError  # (torch: after the checks above)

    try:
        importlib.import_module(f"xlserve.server.bench.{BENCHMARKS[args.name]}").main(args.args)
    except CheckpointError as error:  # a model named that is not a checkpoint
        raise SystemExit(f"xlserve bench {args.name}: {error}") from None


def cmd_convert(args) -> None:
    from xlserve.models.convert import ConversionError, convert

    try:
        summary = convert(args.source, args.out, symbols=args.symbols)
    except ConversionError as e:
        raise SystemExit(f"xlserve convert: {e}") from None
    for note in summary["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps(summary))


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (`serve`'s made from the settings classes)."""
    from xlserve.server.bench import BENCHMARKS
    from xlserve.server.version import package_version

    parser = Parser(prog="xlserve", description="Serve, train, evaluate and benchmark long-context language "
                                                "models with state kept between requests.")
    parser.add_argument("--version", action="version", version=f"xlserve {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="start the HTTP server (every setting has a flag)",
                                description=SERVE_DESCRIPTION,
                                usage="%(prog)s [-h] [--host HOST] [--port PORT] [--log-level LEVEL] "
                                      "[SETTING FLAGS (below) ...]")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's and xlserve's log level (default info)")
    add_setting_flags(serve)
    serve.set_defaults(func=cmd_serve)

    train = commands.add_parser("train", help="train a checkpoint on the stdlib corpus (resumable)",
                                epilog_when_asked=model_choices, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--arch", required=True, help="the architecture (listed below)")
    train.add_argument("--preset", default="small", help="the architecture's preset (listed below; default small)")
    train.add_argument("--out", required=True)
    train.add_argument("--train-bytes", type=whole_number_at_least(1), default=None,
                       help="override the standard byte budget (a rerun with a larger one continues the run to it)")
    train.add_argument("--export-progress", metavar="DIR", default=None,
                       help="do not train: copy OUT's resume state to DIR (to resume from it later)")
    train.add_argument("--without-lane-memory", action="store_true",
                       help="with --export-progress: leave the lanes' memory out; a resume empties it")
    train.set_defaults(func=cmd_train)

    new = commands.add_parser("new", help="write a randomly initialised checkpoint (for tests and deployment checks)",
                              epilog_when_asked=model_choices, formatter_class=argparse.RawDescriptionHelpFormatter)
    new.add_argument("--arch", required=True, help="the architecture (listed below)")
    new.add_argument("--preset", default="tiny", help="the architecture's preset (listed below; default tiny)")
    new.add_argument("--out", required=True, help="the checkpoint directory to write (new or empty)")
    new.add_argument("--force", action="store_true", help="write into --out even if it holds files")
    new.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    new.add_argument("--config", default="{}", help="a JSON object of config fields that replace the preset's "
                                                   "(e.g. '{\"axial_pos_shape\": [16, 16]}')")
    new.set_defaults(func=cmd_new)

    store = commands.add_parser("store", help="rewrite a checkpoint with its weights stored as float16/bfloat16/float32 "
                                              "(computation stays float32)")
    store.add_argument("--model", required=True, help="name under weights/ or a checkpoint directory")
    store.add_argument("--dtype", required=True, choices=["float16", "bfloat16", "float32"])
    store.set_defaults(func=cmd_store)

    evaluate = commands.add_parser("eval", help="held-out bits per byte, memory carried per document")
    evaluate.add_argument("--model", required=True, help="name under weights/ or a checkpoint directory")
    evaluate.add_argument("--mem-len", type=whole_number_at_least(0), default=None,
                          help="evaluate with another memory length (a model whose memory length can be set: "
                               "transformer-xl)")
    evaluate.add_argument("--chunk-len", type=whole_number_at_least(1), default=512, help="bytes fed per forward call")
    evaluate.add_argument("--max-bytes", type=whole_number_at_least(1), default=None,
                          help="score only the first N held-out bytes")
    evaluate.add_argument("--write-card", action="store_true",
                          help="evaluate with the trained memory and with none, then write card.md (a checkpoint "
                               "`xlserve train` wrote: it reads its training.json)")
    evaluate.add_argument("--segment-len", type=whole_number_at_least(1), default=128,
                          help="chunk length for the no-memory evaluation")
    evaluate.set_defaults(func=cmd_eval)

    bench = commands.add_parser("bench", help="run a benchmark (JSON + plot under bench-results/)",
                                description="Run a benchmark alone on the machine; `xlserve bench NAME --help` "
                                            "gives its own flags (docs/benchmarks.md describes each).")
    bench.add_argument("name", metavar="NAME", nargs="?", help=f"one of: {', '.join(sorted(BENCHMARKS))}")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    bench.set_defaults(func=cmd_bench)

    convert = commands.add_parser("convert", help="import a local Hugging Face checkpoint (see docs/convert.md)")
    convert.add_argument("source", metavar="HF_DIR", help="directory with config.json and the weights "
                                                       "(model.safetensors, sharded safetensors, or pytorch_model.bin)")
    convert.add_argument("out", metavar="OUT_DIR", help="new xlserve checkpoint directory (must not exist or be empty)")
    convert.add_argument("--symbols", default=None, help="word list for the tokenizer (.json list or one per line)")
    convert.set_defaults(func=cmd_convert)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
