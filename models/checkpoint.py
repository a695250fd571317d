"""Checkpoints on disk: a directory with config.json and model.safetensors (and card.md).

config.json = {"format": "xlserve-checkpoint", "version": 1, "architecture": ..., "config": {...},
"tokenizer": "bytes"}, plus "storage_dtype" when the floating-point weights are stored in a
narrower type than the model computes in (float16 keeps a shipped checkpoint under its size
budget; loading widens them back, and every computation stays in the model's dtype). Loading
checks the config's form and hyperparameters, and every tensor's name, shape and dtype against
the model the config describes, before allocating it (`load_checkpoint`), so a bad file fails
with a message that names the field or the tensor and never leaves a half-loaded model behind.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.nn import init
from torch.overrides import TorchFunctionMode

from xlserve.models.allocation import machine_memory_bytes, out_of_memory
from xlserve.models.interface import LanguageModel, all_finite
from xlserve.models.linear import use_batched_products
from xlserve.models.registry import ARCHITECTURES, build_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "xlserve-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says exactly why."""


STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def save_checkpoint(model: LanguageModel, directory: str | Path, extra: dict | None = None,
                    storage_dtype: str | None = None) -> None:
    """Write config.json + model.safetensors; `storage_dtype` ("float16", "bfloat16") stores the
    floating-point weights narrower (a float32 weight beyond float16's range is refused)."""
    directory = Path(directory)
    narrow = None
    if storage_dtype is not None:
        if storage_dtype not in STORAGE_DTYPES:
            raise CheckpointError(f"storage dtype {storage_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        narrow = STORAGE_DTYPES[storage_dtype]
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "format": FORMAT,
        "version": 1,
        "architecture": model.architecture,
        "config": model.config.to_dict(),
        "tokenizer": "bytes",
        **({"storage_dtype": storage_dtype} if storage_dtype else {}),
        **(extra or {}),
    }
    # tied weights appear once in the file; loading re-ties them by building the model
    tensors = {}
    seen = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensor = tensor.detach().contiguous().cpu()
        if narrow is not None and tensor.is_floating_point():
            stored = tensor.to(narrow)
            if not all_finite(stored):
                raise CheckpointError(f"tensor '{name}' does not fit {storage_dtype} (largest |x| {tensor.abs().max():.3g})")
            tensor = stored
        tensors[name] = tensor
    _atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    _atomic_write(directory / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def _atomic_write(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    # as any file this user makes: safetensors writes its file private (0600), which a server
    # running as another user (the Docker image's) could not read
    os.chmod(temporary, 0o666 & ~_umask())
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it to read it, for every
    thread at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: a checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        hint = ""
        if isinstance(config, dict) and ("model_type" in config or "architectures" in config or "d_model" in config):
            hint = f"; it reads as a Hugging Face model's: convert it first (xlserve convert {path.parent} OUT_DIR)"
        raise CheckpointError(f"{path} is not an xlserve checkpoint (format {found!r}){hint}")
    architecture = config.get("architecture")
    if not isinstance(architecture, str) or architecture not in ARCHITECTURES:
        raise CheckpointError(f"{path} names architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    if not isinstance(config.get("config"), dict):
        raise CheckpointError(f"{path}: \"config\" must be an object of the model's hyperparameters, "
                              f"not {config.get('config')!r}")
    return config


# safetensors' names of the dtypes a checkpoint may hold
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> LanguageModel:
    """The model a checkpoint directory holds, on `device`, in eval mode, its floating tensors in
    `dtype` when given (the serving dtype).

    Every tensor's name, shape and dtype is checked against the model its config describes,
    from the file's header and a model built on the meta device, before a byte of weights is
    allocated: a config whose model the file does not hold (a layer count or a width that is
    not the file's) fails naming the field or tensor instead of allocating that model first.
    The model is then built for real without drawing random initial weights (`_NoRandomInit`),
    and the weights are copied one tensor at a time from the mapped file into it, a narrower
    stored dtype widened as it is copied: loading never holds a second, widened copy of every
    weight (a float16 file of a 1.1 GB model peaked 1 GB higher so). The model is built in float32
    on the CPU, then moved to `device` in `dtype` before its weights are copied in (each tensor
    cast and moved as it is copied): a bfloat16 model served on a GPU never holds a float32 copy
    there, which needed twice the served model's GPU memory while loading. A model whose float32
    build is larger than this machine's memory (or its container's limit) is refused before it
    is built, naming both sizes; before, the kernel's OOM killer ended the process without a word."""
    directory = Path(directory)
    config = read_config(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    storage = config.get("storage_dtype")
    if storage is not None and storage not in STORAGE_DTYPES:
        raise CheckpointError(f"{config_path}: storage_dtype {storage!r} is not one of {sorted(STORAGE_DTYPES)}")
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path} does not exist")
    try:
        with safe_open(str(weights_path), framework="pt") as header:
            stored = {name: (tuple(header.get_slice(name).get_shape()), header.get_slice(name).get_dtype())
                      for name in header.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path} is not a readable safetensors file: {e}") from None
    built = sum(4 * math.prod(shape) for shape, _ in stored.values())  # built in float32, whatever the file holds
    memory = machine_memory_bytes()
    if built > memory:
        raise CheckpointError(f"{weights_path}: its model takes {built / 2**30:.1f} GiB in float32 while it is built, "
                              f"more than this machine's memory ({memory / 2**30:.1f} GiB, or its container's limit)")
    layers = config["config"].get("n_layer")
    if isinstance(layers, int) and layers > len(stored):  # each layer holds tensors of its own
        raise CheckpointError(f"{config_path}: n_layer is {layers}, but {weights_path} holds {len(stored)} tensors "
                              "in all")
    try:
        with torch.device("meta"), _NoRandomInit():  # shapes and names only: nothing allocated
            described = build_model(config["architecture"], config["config"])
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - a constructor that computes with its buffers: checked on the real model
        described = None
    else:
        _check_tensors(described, stored, storage, weights_path)
    try:
        with _NoRandomInit():
            model = build_model(config["architecture"], config["config"])
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a constructor raises on values it cannot take
        if out_of_memory(e):  # the allocator's refusal: no fault of the config's
            raise CheckpointError(f"{config_path}: the model could not be built for want of memory ({e})") from None
        raise CheckpointError(f"{config_path}: bad model config: {e}") from None
    if described is None:
        _check_tensors(model, stored, storage, weights_path)
    model.to(device=device, dtype=dtype)  # before the copies: the weights go straight to their place
    try:
        tensors = load_file(str(weights_path))  # the file mapped, not read: each tensor is read as it is copied
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:  # RuntimeError: a map the kernel refused
        raise CheckpointError(f"{weights_path} is not a readable safetensors file: {e}") from None
    expected = model.state_dict(keep_vars=True)
    first_name = _first_names(expected)
    with torch.no_grad():
        for name in sorted(stored, key=lambda name: first_name[name] != name):  # a tied weight's first name first
            tensor = tensors.pop(name)
            if tensor.is_floating_point() and not all_finite(tensor):
                raise CheckpointError(f"{weights_path}: tensor '{name}' contains NaN or infinity")
            target = expected[name]
            if first_name[name] != name:  # a tied weight stored twice: both names must agree
                if not torch.equal(tensor.to(device=target.device, dtype=target.dtype), target):
                    raise CheckpointError(f"{weights_path}: tensors '{first_name[name]}' and '{name}' are one weight "
                                          "in this model (tied by its config), but the file holds two different "
                                          "values")
                continue
            target.copy_(tensor)  # widened as it is copied, where the file holds it narrower
            del tensor
    use_batched_products(model)  # a decode batch's products through the faster kernel (models/linear.py)
    return model.eval()


class _NoRandomInit(TorchFunctionMode):
    """Build a model without drawing its random initial weights (this thread only), for a model
    whose every parameter and persistent buffer is then copied from a file (`load_checkpoint`
    checks that the file holds each one): the draws are thrown away, and they took 3.4 s of
    wt103's 4.3 s load. On the meta device they draw nothing but run through torch's Python
    decompositions, about 10 ms a call. What is left is memory the file's values then fill.
    Non-persistent buffers are computed by other operations, never drawn (a test keeps that
    true of every architecture)."""

    SKIPPED = {torch.Tensor.normal_, torch.Tensor.uniform_, init.normal_, init.uniform_, init.trunc_normal_,
               init.xavier_uniform_, init.xavier_normal_, init.kaiming_uniform_, init.kaiming_normal_,
               init.orthogonal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func in self.SKIPPED and isinstance(target, torch.Tensor):
            return target
        return func(*args, **kwargs)


def _first_names(expected: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each state-dict name -> the first name of its tensor (tied parameters are one object
    under several names, stored once, under the first)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(tensor), name) for name, tensor in expected.items()}


def _check_tensors(model: torch.nn.Module, stored: dict[str, tuple[tuple[int, ...], str]], storage: str | None,
                   weights_path: Path) -> None:
    """The file's tensors (name -> shape, safetensors dtype) against what `model` holds."""
    expected = model.state_dict(keep_vars=True)
    first_name = _first_names(expected)
    required = {name for name in expected if first_name[name] == name}
    missing = sorted(required - set(stored))
    if missing:
        raise CheckpointError(f"{weights_path}: tensor '{missing[0]}' is missing ({len(missing)} missing in all)")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise CheckpointError(f"{weights_path}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all)")
    for name, (shape, stored_dtype) in stored.items():
        want = expected[name]
        if shape != tuple(want.shape):
            raise CheckpointError(f"{weights_path}: tensor '{name}' has shape {shape}, expected {tuple(want.shape)}")
        dtype = STORED_DTYPES.get(stored_dtype, stored_dtype)
        widened = storage is not None and dtype == STORAGE_DTYPES[storage] and want.is_floating_point()
        if dtype != want.dtype and not widened:
            raise CheckpointError(f"{weights_path}: tensor '{name}' has dtype {dtype}, expected {want.dtype}")
