"""Importers for other people's checkpoints: `xlserve convert HF_DIR OUT_DIR`.

A Hugging Face model directory (config.json + model.safetensors, or a `pytorch_model.bin` of
plain tensors, its pickle parsed as data by torch_file.py, never unpickled) becomes an xlserve checkpoint (config.json +
model.safetensors + tokenizer files) that `models.checkpoint.load_checkpoint` and the server load
like any other.

The work splits in two:
- here, what every importer shares: reading the source directory without running its code
  (no pickle is ever run, nothing downloaded), choosing the importer by the config's
  `model_type`, and writing the result all at once (into a temporary sibling directory renamed
  into place, so a failed conversion leaves nothing behind);
- state-spaces' own Mamba and Mamba-2 format (no `model_type`) is translated into transformers'
  first (models/convert/mamba_ssm.py), then imported as that;
- in `models/convert/<name>.py`, one module per source architecture with two functions:
  `translate_config(config, where)` checks the source config and returns ours (raising
  ConversionError), and `import_checkpoint(source, symbols)` maps the tensors onto one of our
  models and says which tokenizer files go with it. Adding an importer (XLNet next) is one
  module and one line in IMPORTERS. Importers take the tensors through SourceTensors (checked
  by name, shape and value) and hand them to `load_placed`, which refuses a model left
  partly uninitialised or a source tensor left unplaced.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from xlserve.models.interface import LanguageModel, all_finite

# Hugging Face `model_type` -> module under models.convert implementing `import_checkpoint`
IMPORTERS: dict[str, str] = {
    "transfo-xl": "xlserve.models.convert.transfo_xl",
    "xlnet": "xlserve.models.convert.xlnet",
    "reformer": "xlserve.models.convert.reformer",
    "mamba": "xlserve.models.convert.mamba",
    "mamba2": "xlserve.models.convert.mamba2",
    "rwkv": "xlserve.models.convert.rwkv",
}
# state-spaces' own Mamba and Mamba-2 format (no model_type), translated into transformers' first
ORIGINAL_MAMBA = "xlserve.models.convert.mamba_ssm"


class ConversionError(ValueError):
    """A source checkpoint that cannot be converted; the message names the file or tensor."""


@dataclass
class SourceCheckpoint:
    """What an importer gets: the source directory, its parsed config.json and its tensors."""

    directory: Path
    config: dict
    tensors: Mapping[str, Tensor]  # read when taken, from safetensors (SafetensorsFiles)
    weights_file: str  # the file the tensors came from, for messages


@dataclass
class Imported:
    """What an importer returns: a model with every weight placed, plus what goes beside it."""

    model: LanguageModel
    config_extra: dict = field(default_factory=dict)  # merged into our config.json (tokenizer, provenance)
    files: dict[str, bytes] = field(default_factory=dict)  # further files for OUT_DIR, e.g. symbols.json
    notes: list[str] = field(default_factory=list)  # what the user should know (printed by the CLI)


class SourceTensors:
    """The source tensors, handed out by name with shape and value checks; remembers what was used."""

    def __init__(self, source: SourceCheckpoint):
        self.tensors = source.tensors
        self.where = source.directory / source.weights_file
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in self.tensors:
            raise ConversionError(f"{self.where}: tensor '{name}' is missing")
        try:
            tensor = self.tensors[name]
        except Exception as e:  # noqa: BLE001 (read from its file now: the library's own errors)
            raise ConversionError(f"{self.where}: tensor '{name}' cannot be read: {e}") from None
        if tensor is None:
            raise ConversionError(f"{self.where}: tensor '{name}' was taken twice (an importer's mistake)")
        if isinstance(self.tensors, dict):
            # a source read into memory (a .bin, parsed as data) lets each tensor go once taken,
            # keeping its name: the model it becomes is then the one copy, not a second one
            # beside the whole source (a legacy torch.save's storages are copies of the file)
            self.tensors[name] = None
        self.used.add(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ConversionError(
                f"{self.where}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        if not tensor.is_floating_point():
            raise ConversionError(f"{self.where}: tensor '{name}' has dtype {tensor.dtype}, expected floating point")
        tensor = tensor.to(torch.float32)
        if not all_finite(tensor):
            raise ConversionError(f"{self.where}: tensor '{name}' contains NaN or infinity")
        return tensor

    def first_of(self, *names: str) -> str:
        """The first of `names` the file has (a tensor some checkpoints save under an older
        name), else the first: `take` then says it is missing under its current name."""
        return next((name for name in names if name in self.tensors), names[0])

    def ignore(self, name: str) -> None:
        """A tensor the model does not need (a copy of a tied one), if the file has it."""
        if name in self.tensors:
            self.used.add(name)

    def check_all_used(self) -> None:
        left = sorted(set(self.tensors) - self.used)
        if left:
            more = f" ({len(left)} in all: {left[:5]})" if len(left) > 1 else ""
            raise ConversionError(f"{self.where}: cannot place tensor '{left[0]}'{more}")


def skeleton(model_class, config):
    """`model_class(config)` without random weights to overwrite: built on the meta device, so a
    conversion holds the weights it places and not a second, random copy of the model (2.8 B
    parameters are 11 GB in float32), which `load_placed` then fills. A model that computes
    buffers when it is built (the Reformer's rotations) is built as usual: nothing would fill them."""
    try:
        with torch.device("meta"):
            model = model_class(config)
    except Exception:  # noqa: BLE001 (an initialisation that needs real values: built as usual)
        return model_class(config)
    if next(model.buffers(), None) is not None:
        return model_class(config)
    return model


def load_placed(model: LanguageModel, placed: dict[str, Tensor], source: SourceTensors) -> LanguageModel:
    """Put `placed` (our parameter name -> value) into `model`, once every parameter has a value
    and every source tensor was used; returns the model in eval mode. A `skeleton`'s parameters
    are made here, one at a time, each value let go once it is in: a tied parameter is made once,
    and every name it has points to it."""
    parameters = dict(model.named_parameters())  # tied parameters appear once, under their first name
    missing = sorted(set(parameters) - set(placed))
    if missing:  # a mapping the importer forgot; never load a model with uninitialised weights
        raise ConversionError(f"no source tensor for parameter '{missing[0]}'")
    source.check_all_used()
    names: dict[int, list[str]] = {}  # every name of each parameter (tied ones have several)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    with torch.no_grad():
        for name in list(placed):
            value, parameter = placed.pop(name), parameters[name]
            if not parameter.is_meta:
                parameter.copy_(value)
                continue
            made = torch.nn.Parameter(torch.empty(parameter.shape, dtype=parameter.dtype), parameter.requires_grad)
            made.copy_(value)
            del value
            for alias in names[id(parameter)]:
                owner, _, attribute = alias.rpartition(".")
                setattr(model.get_submodule(owner), attribute, made)
    return model.eval()


def read_source_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not directory.is_dir():
        raise ConversionError(f"{directory} is not a directory")
    if not path.is_file():
        raise ConversionError(f"{path} does not exist: a Hugging Face model directory needs config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # JSON in UTF-8, as json.load reads it
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConversionError(f"{path} nests deeper than a JSON parser reads") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return config


def read_source_tensors(directory: Path) -> tuple[Mapping[str, Tensor], str]:
    """All tensors of a Hugging Face directory, from safetensors (single file or shards) or,
    failing that, from pytorch_model.bin (single file or shards), whose pickle is parsed as data,
    never run (torch_file.py)."""
    from safetensors import SafetensorError

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    pickled = directory / "pytorch_model.bin"
    pickled_index = directory / "pytorch_model.bin.index.json"
    try:
        if single.is_file():
            return SafetensorsFiles(_not_lfs_pointers([single])), single.name
        if index.is_file():
            return SafetensorsFiles(_not_lfs_pointers([directory / shard for shard in _shards(index)])), index.name
    except ConversionError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise ConversionError(f"{directory}: the safetensors weights cannot be read: {e}") from None
    if pickled.is_file():
        return _load_pickled_tensors(*_not_lfs_pointers([pickled])), pickled.name
    if pickled_index.is_file():  # larger checkpoints saved before safetensors (e.g. RWKV-4 Pile 1.5B and up)
        tensors = {}
        for shard in _not_lfs_pointers([directory / shard for shard in _shards(pickled_index)]):
            for name, tensor in _load_pickled_tensors(shard).items():
                if name in tensors:  # as the safetensors shards refuse it: which copy is the model's?
                    raise ConversionError(f"{directory}: tensor '{name}' is in two shards")
                tensors[name] = tensor
        return tensors, pickled_index.name
    present = sorted(p.name for p in directory.iterdir())
    raise ConversionError(
        f"{directory} holds no weights xlserve can read (model.safetensors, model.safetensors.index.json, "
        f"pytorch_model.bin or pytorch_model.bin.index.json); found {present}"
    )


class SafetensorsFiles(Mapping):
    """The tensors of safetensors files, each read from its file when an importer takes it (the
    files stay mapped, not read whole into memory): with `skeleton` and `load_placed`, a
    conversion holds about one copy of the model, not the source, the placed weights and the
    model at once."""

    def __init__(self, paths: list[Path]):
        from safetensors import safe_open

        self.files = {}  # tensor name -> the open file holding it
        for path in paths:
            opened = safe_open(str(path), framework="pt")
            for name in opened.keys():
                if name in self.files:
                    raise ValueError(f"tensor '{name}' is in two shards")
                self.files[name] = opened

    def __getitem__(self, name: str) -> Tensor:
        return self.files[name].get_tensor(name)

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _not_lfs_pointers(paths: list[Path]) -> list[Path]:
    """`paths`, refused when one is a Git LFS pointer: a `git clone` of a hub repository without
    git-lfs leaves a text file of about 130 bytes in place of each large file, which would
    otherwise be reported as a damaged safetensors header or pickle."""
    for path in paths:
        try:
            with open(path, "rb") as handle:
                start = handle.read(len(LFS_POINTER))
        except OSError:
            continue  # the reader says what is wrong with it
        if start == LFS_POINTER:
            raise ConversionError(
                f"{path} is a Git LFS pointer ({path.stat().st_size} bytes), not the weights: the repository was "
                "cloned without its LFS files. Fetch them (`git lfs install && git lfs pull` in the directory) or "
                "download the files themselves, then convert again")
    return paths


def _shards(index: Path) -> list[str]:
    """The shard files a Hugging Face index (`weight_map`: tensor name -> file) names: plain
    file names beside it, each once."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{index} is not a weights index (a JSON object with a weight_map): {e}") from None
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{index}: weight_map is not an object of tensor name -> file")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise ConversionError(f"{index} names {shard!r}, not a file beside it")
        if not (index.parent / shard).is_file():
            raise ConversionError(f"{index} names {shard}, which is not in {index.parent}")
    return shards


def _load_pickled_tensors(path: Path) -> dict[str, Tensor]:
    """A torch.save file's tensors, its pickle read as data, never run (torch_file.py)."""
    from xlserve.models.convert.torch_file import NotATensorFile, read_tensors

    try:
        return read_tensors(path)
    except NotATensorFile as e:
        raise ConversionError(
            f"{path}: not read ({e}). Only the plain tensors of a state dict are read, its pickle "
            "parsed as data and never run. Re-save the weights as safetensors in an environment you "
            "trust (see docs/convert.md)."
        ) from None
    except OSError as e:
        raise ConversionError(f"{path} cannot be read: {e}") from None


def importer_for(config: dict, config_path: Path):
    model_type = config.get("model_type")
    if config.get("format") == "xlserve-checkpoint":  # models/checkpoint.py FORMAT
        raise ConversionError(f"{config_path.parent} is an xlserve checkpoint already: serve it as it is "
                              f"(xlserve serve --models {config_path.parent})")
    if model_type not in IMPORTERS:
        raise ConversionError(
            f"{config_path} describes a model of type {model_type!r} "
            f"(architectures {config.get('architectures')}); xlserve convert imports: {sorted(IMPORTERS)}, "
            "and state-spaces' own Mamba and Mamba-2 directories (d_model, n_layer, ssm_cfg)"
        )
    return importlib.import_module(IMPORTERS[model_type])


def convert(source_dir: str | Path, out_dir: str | Path, symbols: str | Path | None = None) -> dict:
    """Convert `source_dir` into a new xlserve checkpoint at `out_dir`; returns a summary.

    `out_dir` must not exist or be empty. Everything is checked and written into a temporary
    directory beside it first, so on any error `out_dir` is untouched.
    """
    from safetensors import SafetensorError  # what a write that fails raises (a full disk)

    from xlserve.models.checkpoint import save_checkpoint

    mamba_ssm = importlib.import_module(ORIGINAL_MAMBA)  # as the importers: by name, after this module

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConversionError(f"{out_dir} already exists and is not an empty directory")
    config = read_source_config(source_dir)
    original_mamba = mamba_ssm.describes(config)  # state-spaces' own format, not transformers'
    try:  # refuse a bad config before reading weights
        if original_mamba:
            config = mamba_ssm.as_hugging_face(config, source_dir / "config.json")
        importer = importer_for(config, source_dir / "config.json")
        translated = importer.translate_config(config, source_dir / "config.json")
        translated = translated[0] if isinstance(translated, tuple) else translated
        # the checks a served checkpoint's config gets (each field's type, sizes at least 1): a
        # translator builds its config directly, and "n_layer": 2.5 failed inside the model's
        # constructor with a traceback, "mem_len": 8.0 converted into a checkpoint the server refuses
        type(translated).from_dict(translated.to_dict())
    except ConversionError:
        raise
    except (TypeError, ValueError, KeyError, ArithmeticError) as error:  # a value of a type no field takes ("null")
        raise ConversionError(f"{source_dir / 'config.json'}: a value it gives cannot be used ({type(error).__name__}: "
                              f"{error})") from None
    tensors, weights_file = read_source_tensors(source_dir)
    if original_mamba:
        tensors = mamba_ssm.renamed(tensors)
    source = SourceCheckpoint(source_dir, config, tensors, weights_file)
    imported: Imported = importer.import_checkpoint(source, Path(symbols) if symbols else None)
    if original_mamba:
        imported.config_extra["converted_from"]["format"] = "mamba_ssm"
        if "tokenizer.json" not in imported.files:
            imported.notes.append("state-spaces' models use EleutherAI/gpt-neox-20b's tokenizer: put its "
                                  "tokenizer.json and tokenizer_config.json (its eos_token ends a generation) in the "
                                  "output directory, or in the source directory before converting")

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:  # a parent that is a file, or that this user cannot write
        raise ConversionError(f"cannot write {out_dir}: {e}") from None
    try:
        save_checkpoint(imported.model, staging, extra=imported.config_extra)
        for name, content in imported.files.items():
            (staging / name).write_bytes(content)
        os.chmod(staging, 0o755)  # mkdtemp makes it private
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename needs the name free
        os.rename(staging, out_dir)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):  # a full disk (a 2.8B model writes 11 GB of float32)
            raise ConversionError(f"cannot write {out_dir}: {e}") from None
        raise
    n_params = sum(p.numel() for p in imported.model.parameters())
    return {
        "source": str(source_dir),
        "weights_file": weights_file,
        "out": str(out_dir),
        "architecture": imported.model.architecture,
        "parameters": n_params,
        "tokenizer": imported.config_extra.get("tokenizer", "bytes"),
        "files": sorted(p.name for p in out_dir.iterdir()),
        "notes": imported.notes,
    }
