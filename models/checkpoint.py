"""Checkpoints on disk: a directory with config.json and model.safetensors (and card.md).

config.json = {"format": "xlserve-checkpoint", "version": 1, "architecture": ..., "config": {...},
"tokenizer": "bytes"}, plus "storage_dtype" when the floating-point weights are stored in a
narrower type than the model computes in (float16 keeps a shipped checkpoint under its size
budget; loading widens them back, and every computation stays in the model's dtype). Loading checks the architecture name and every tensor's name, shape and
dtype against a freshly built model before copying anything in, so a bad file fails with a
message that names the tensor and never leaves a half-loaded model behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from xlserve.models.interface import LanguageModel
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
            if not torch.isfinite(stored).all():
                raise CheckpointError(f"tensor '{name}' does not fit {storage_dtype} (largest |x| {tensor.abs().max():.3g})")
            tensor = stored
        tensors[name] = tensor
    _atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    _atomic_write(directory / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def _atomic_write(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: a checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an xlserve checkpoint (format {config.get('format')!r})")
    if config.get("architecture") not in ARCHITECTURES:
        raise CheckpointError(
            f"{path} names architecture {config.get('architecture')!r}; known: {sorted(ARCHITECTURES)}"
        )
    return config


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu") -> LanguageModel:
    directory = Path(directory)
    config = read_config(directory)
    try:
        model = build_model(config["architecture"], config["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: bad model config: {e}") from None
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path} does not exist")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path} is not a readable safetensors file: {e}") from None

    storage = config.get("storage_dtype")
    if storage is not None and storage not in STORAGE_DTYPES:
        raise CheckpointError(f"{directory / CONFIG_FILE}: storage_dtype {storage!r} is not one of {sorted(STORAGE_DTYPES)}")
    expected = model.state_dict()
    # tied parameters are stored once, under the first name that refers to them
    first_name = {}
    for name, tensor in expected.items():
        first_name.setdefault(tensor.data_ptr(), name)
    required = {name for name in expected if first_name[expected[name].data_ptr()] == name}
    missing = sorted(required - set(tensors))
    if missing:
        raise CheckpointError(f"{weights_path}: tensor '{missing[0]}' is missing ({len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{weights_path}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all)")
    for name, tensor in tensors.items():
        want = expected[name]
        if tensor.shape != want.shape:
            raise CheckpointError(
                f"{weights_path}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}"
            )
        if storage is not None and tensor.dtype == STORAGE_DTYPES[storage] and want.is_floating_point():
            tensor = tensors[name] = tensor.to(want.dtype)  # widened back: the model computes in its own dtype
        if tensor.dtype != want.dtype:
            raise CheckpointError(f"{weights_path}: tensor '{name}' has dtype {tensor.dtype}, expected {want.dtype}")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{weights_path}: tensor '{name}' contains NaN or infinity")
    model.load_state_dict(tensors, strict=False)  # names already checked; tied copies share storage
    use_batched_products(model)  # a decode batch's products through the faster kernel (models/linear.py)
    return model.to(device).eval()
