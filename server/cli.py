"""`xlserve serve | train | new | store | eval | bench | convert`, and `xlserve --version`.

`serve` refuses settings that cannot work (no checkpoint to serve, a named one missing, an
invalid value) in one line before it opens the port, and exits non-zero when the engine process
cannot be started or restarted (server/engine/client.py), so that a supervisor takes over."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _resolve_model_dir(name_or_path: str) -> Path:
    from xlserve.server.settings import EngineSettings, checkpoint_dir

    weights_dir = EngineSettings().weights_dir  # XLSERVE_WEIGHTS_DIR, as `serve` uses it
    path = checkpoint_dir(name_or_path, weights_dir)
    if not path.is_dir():
        raise SystemExit(f"no checkpoint directory '{name_or_path}' (looked in . and {weights_dir})")
    return path


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

    from xlserve.server.app import StartupRefused, build_app, checkpoints_to_serve, cut_streams, drain
    from xlserve.server.settings import Settings

    overrides = {}
    if args.models:
        overrides["models"] = args.models
    if args.device:
        overrides["device"] = args.device
    if args.weights_dir:
        overrides["weights_dir"] = args.weights_dir
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    # refuse what cannot work in one line, before the port opens (no traceback: nothing is broken)
    try:
        settings = Settings(**overrides)
        checkpoints_to_serve(settings)
        settings.security.api_key_list()  # a key file that cannot be read
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise SystemExit(f"xlserve serve: setting {field} (XLSERVE_{field.upper()}): {first['msg']}") from None
    except StartupRefused as error:
        raise SystemExit(f"xlserve serve: {error}") from None
    except OSError as error:
        raise SystemExit(f"xlserve serve: XLSERVE_API_KEYS names a file that cannot be read: {error}") from None
    _log_to_stderr(args.log_level)

    grace = settings.server.shutdown_grace_seconds if args.grace_seconds is None else args.grace_seconds
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
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config)
    server.run()
    if failure:
        raise SystemExit(f"xlserve serve: {failure[0]}")


def cmd_train(args) -> None:
    from dataclasses import replace

    from xlserve.models.training.train import STANDARD_RECIPE, train

    if args.without_lane_memory and not args.export_progress:
        # a training run always saves the lanes' memory; accepting the flag here would promise otherwise
        raise SystemExit("xlserve train: --without-lane-memory applies only to --export-progress DIR "
                         "(a copy of the resume state); nothing was trained")
    if args.export_progress:
        from xlserve.models.training.train import export_progress

        progress = export_progress(args.out, args.export_progress, lane_memory=not args.without_lane_memory)
        print(f"copied the resume state of {args.out} at step {progress['step']} to {args.export_progress}"
              + (" (without the lanes' memory)" if args.without_lane_memory else ""))
        return
    recipe = STANDARD_RECIPE
    if args.train_bytes:
        recipe = replace(recipe, train_bytes=args.train_bytes)
    train(args.arch, args.preset, args.out, recipe, log=lambda s: print(s, flush=True))


def cmd_new(args) -> None:
    import torch

    from xlserve.models.checkpoint import save_checkpoint
    from xlserve.models.registry import build_model
    from xlserve.models.training.train import preset_config

    torch.manual_seed(args.seed)
    model = build_model(args.arch, {**preset_config(args.arch, args.preset), **json.loads(args.config)})
    save_checkpoint(model.eval(), args.out)
    print(f"wrote a randomly initialised {args.arch}/{args.preset} to {args.out}")


def cmd_store(args) -> None:
    from xlserve.models.checkpoint import load_checkpoint, read_config, save_checkpoint

    directory = _resolve_model_dir(args.model)
    config = read_config(directory)
    model = load_checkpoint(directory)
    extra = {k: v for k, v in config.items()
             if k not in ("format", "version", "architecture", "config", "tokenizer", "storage_dtype")}
    dtype = None if args.dtype == "float32" else args.dtype
    save_checkpoint(model, directory, extra=extra, storage_dtype=dtype)
    size = (directory / "model.safetensors").stat().st_size
    print(f"rewrote {directory} with weights stored as {args.dtype}: {size:,} bytes")


def cmd_eval(args) -> None:
    from xlserve.models.checkpoint import load_checkpoint
    from xlserve.models.training.data import stdlib_corpus
    from xlserve.models.training.evaluate import bits_per_byte
    from xlserve.models.training.train import held_out_documents

    directory = _resolve_model_dir(args.model)
    model = load_checkpoint(directory)
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

    if args.name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark '{args.name}' (have: {', '.join(sorted(BENCHMARKS))})")
    missing = missing_packages(args.name)
    if missing:
        raise SystemExit(f"xlserve bench {args.name} needs {', '.join(missing)}, from the bench extra: "
                         f"pip install \"xlserve[bench]\"")
    importlib.import_module(f"xlserve.server.bench.{BENCHMARKS[args.name]}").main(args.args)


def cmd_convert(args) -> None:
    from xlserve.models.convert import ConversionError, convert

    try:
        summary = convert(args.source, args.out, symbols=args.symbols)
    except ConversionError as e:
        raise SystemExit(f"xlserve convert: {e}") from None
    for note in summary["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps(summary))


def main(argv: list[str] | None = None) -> None:
    from xlserve.server.version import package_version

    parser = argparse.ArgumentParser(prog="xlserve")
    parser.add_argument("--version", action="version", version=f"xlserve {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--models", default=None,
                       help="comma list of names under weights/ or checkpoint paths (default: all under weights/)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    serve.add_argument("--weights-dir", default=None,
                       help="where checkpoints named by --models live (default XLSERVE_WEIGHTS_DIR, ./weights)")
    serve.add_argument("--state-dir", default=None,
                       help="where sessions are written down (default XLSERVE_STATE_DIR, ./state)")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--grace-seconds", type=float, default=None,
                       help="how long running requests may finish on shutdown (default XLSERVE_SHUTDOWN_GRACE_SECONDS, 30)")
    serve.set_defaults(func=cmd_serve)

    train = commands.add_parser("train", help="train a checkpoint on the stdlib corpus (resumable)")
    train.add_argument("--arch", required=True)
    train.add_argument("--preset", default="small")
    train.add_argument("--out", required=True)
    train.add_argument("--train-bytes", type=int, default=None, help="override the standard byte budget")
    train.add_argument("--export-progress", metavar="DIR", default=None,
                       help="do not train: copy OUT's resume state to DIR (to resume from it later)")
    train.add_argument("--without-lane-memory", action="store_true",
                       help="with --export-progress: leave the lanes' memory out; a resume empties it")
    train.set_defaults(func=cmd_train)

    new = commands.add_parser("new", help="write a randomly initialised checkpoint (for tests and deployment checks)")
    new.add_argument("--arch", required=True)
    new.add_argument("--preset", default="tiny")
    new.add_argument("--out", required=True)
    new.add_argument("--seed", type=int, default=0)
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
    evaluate.add_argument("--mem-len", type=int, default=None, help="evaluate with another memory length")
    evaluate.add_argument("--chunk-len", type=int, default=512, help="bytes fed per forward call")
    evaluate.add_argument("--max-bytes", type=int, default=None, help="score only the first N held-out bytes")
    evaluate.add_argument("--write-card", action="store_true",
                          help="evaluate with the trained memory and with none, then write card.md")
    evaluate.add_argument("--segment-len", type=int, default=128, help="chunk length for the no-memory evaluation")
    evaluate.set_defaults(func=cmd_eval)

    bench = commands.add_parser("bench", help="run a benchmark (JSON + plot under bench-results/)")
    bench.add_argument("name")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    bench.set_defaults(func=cmd_bench)

    convert = commands.add_parser("convert", help="import a local Hugging Face checkpoint (see docs/convert.md)")
    convert.add_argument("source", metavar="HF_DIR", help="directory with config.json and model.safetensors")
    convert.add_argument("out", metavar="OUT_DIR", help="new xlserve checkpoint directory (must not exist or be empty)")
    convert.add_argument("--symbols", default=None, help="word list for the tokenizer (.json list or one per line)")
    convert.set_defaults(func=cmd_convert)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
