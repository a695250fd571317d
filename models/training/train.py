"""The training loop: the standard recipe of docs/design.md section 5, resumable.

Every shipped `*-stdlib` checkpoint is trained with `STANDARD_RECIPE` (same corpus, split, byte
budget and optimiser schedule) and a preset of about 1-3M parameters, so held-out bits per byte
compare architectures rather than effort. Progress (weights, optimiser moments, the carried
memory, the step) is saved as safetensors + JSON under OUT/.resume every `save_every` steps; a
rerun of the same command continues from there.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xlserve.models.checkpoint import save_checkpoint
from xlserve.models.interface import LanguageModel
from xlserve.models.registry import build_model
from xlserve.models.training.data import SegmentStream, stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte
from xlserve.models.training.presets import preset_config


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient was not finite: the run stops before applying it."""


class ResumeRefused(ValueError):
    """A run's saved progress that cannot be resumed as asked (another architecture, preset or
    shape of lanes, a budget it has passed), or that is not there to copy; the message names what
    was saved and what was asked, and nothing has been trained or written."""


@dataclass
class Recipe:
    train_bytes: int = 20_000_000  # the token budget: bytes of training text consumed
    batch_size: int = 16  # parallel lanes of the stream
    segment_len: int = 128  # bytes per lane per step
    learning_rate: float = 2e-3
    warmup_steps: int = 200
    final_lr_fraction: float = 0.1  # cosine decay ends at this fraction of the peak
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    seed: int = 0
    eval_every: int = 1000  # steps between quick held-out evaluations
    quick_eval_bytes: int = 200_000  # held-out bytes scored by a quick evaluation
    eval_window_stride: int = 32  # fixed-context models only: see models/training/evaluate.py
    save_every: int = 200  # steps between resumable saves
    lane_layout: str = "files"  # each file starts a segment from an empty state (models/training/data.py)

    @property
    def total_steps(self) -> int:
        return self.train_bytes // (self.batch_size * self.segment_len)

    def learning_rate_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.learning_rate * (self.final_lr_fraction + (1 - self.final_lr_fraction) * cosine)


STANDARD_RECIPE = Recipe()

# a quick evaluation this far (bits per byte) above the training loss is logged as a warning:
# on the held-out split a healthy run is within a few tenths of its training loss
HELD_OUT_GAP_WARNING_BITS = 1.0

def _save_progress(resume_dir: Path, model, optimizer, state, progress: dict) -> None:
    resume_dir.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, value in model.state_dict().items():
        if value.data_ptr() not in seen:  # tied weights once
            seen.add(value.data_ptr())
            tensors[f"model.{name}"] = value.detach().contiguous()
    opt_state = optimizer.state_dict()
    for index, values in opt_state["state"].items():
        for key, value in values.items():
            tensors[f"optimizer.{index}.{key}"] = value.detach().contiguous()
    for name, value in state.to_tensors().items():
        tensors[f"memory.{name}"] = value
    progress = {**progress, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]}
    _write_progress(resume_dir, tensors, progress)


def _write_progress(directory: Path, tensors: dict, progress: dict) -> None:
    """The step and the rest of `progress` go into the tensor file's own metadata, so that the
    two always match: a run killed between the two renames still resumes from a consistent
    save. progress.json is the same record, for people and scripts to read."""
    save_file(tensors, str(directory / "progress.safetensors.tmp"), metadata={"progress": json.dumps(progress)})
    (directory / "progress.json.tmp").write_text(json.dumps(progress, indent=2))
    os.replace(directory / "progress.safetensors.tmp", directory / "progress.safetensors")
    os.replace(directory / "progress.json.tmp", directory / "progress.json")


def _read_progress(directory: Path, tensors: bool = True) -> tuple[dict, dict]:
    """(progress, tensors) of a save; the tensor file's own record when it has one (saves from
    before it had one use progress.json). `tensors=False` reads the record alone ({} for them)."""
    with safe_open(str(directory / "progress.safetensors"), framework="pt") as opened:  # one file, even mid-save
        recorded = (opened.metadata() or {}).get("progress")
        read = {name: opened.get_tensor(name) for name in opened.keys()} if tensors else {}
    progress = json.loads(recorded) if recorded is not None else json.loads((directory / "progress.json").read_text())
    return progress, read


# the recipe's fields that shape what a run saves: the lanes' memory has batch_size rows, each
# lane's place in its file is counted in segments of segment_len, and the seed and layout decide
# which file each lane reads. A resume with others would carry the memory into lanes it does not
# belong to (or fail on its shape); train_bytes may change (see `_check_resume`)
RECIPE_FIELDS_OF_THE_LANES = ("batch_size", "segment_len", "seed", "lane_layout")


def _check_resume(out: Path, progress: dict, architecture: str, preset: str, config: dict, recipe: Recipe) -> None:
    """Refuse to resume the run saved in `progress` as another one: its weights and optimiser
    moments fit only its own architecture and preset (another one failed loading them, with a
    size mismatch or a missing state tensor), its lanes' memory only its own lanes. A field a save
    from an older xlserve lacks is not compared."""
    saved_architecture, saved_preset = progress.get("architecture", architecture), progress.get("preset", preset)
    run = f"{out} holds a {saved_architecture}/{saved_preset} run at step {progress['step']}"
    if (saved_architecture, saved_preset) != (architecture, preset):
        raise ResumeRefused(f"{run}; resuming it as {architecture}/{preset} would not fit its weights: continue it "
                            f"with --arch {saved_architecture} --preset {saved_preset}, or train into another --out")
    saved_config = progress.get("config")
    asked_config = json.loads(json.dumps(config))  # as the save holds it (tuples as lists)
    if saved_config is not None and saved_config != asked_config:
        # the preset was edited since the run began
        changed = sorted(k for k in saved_config.keys() | asked_config.keys()
                         if saved_config.get(k) != asked_config.get(k))
        field, more = changed[0], f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise ResumeRefused(f"{run}, built with {field} {saved_config.get(field)!r}; the {preset} preset of "
                            f"{architecture} now has {field} {asked_config.get(field)!r}{more}, which would not fit "
                            "its weights: train into another --out")
    saved_recipe = progress.get("recipe", {})
    for field in RECIPE_FIELDS_OF_THE_LANES:
        if field in saved_recipe and saved_recipe[field] != getattr(recipe, field):
            raise ResumeRefused(f"{run}, trained with {field} {saved_recipe[field]!r}; this one has "
                                f"{getattr(recipe, field)!r}, and the run's lanes (their memory, their place in "
                                "their files) cannot be resumed so: resume it with its own recipe")
    step_bytes = recipe.batch_size * recipe.segment_len
    if recipe.total_steps < progress["step"]:  # a smaller budget would record less training than the run had
        raise ResumeRefused(f"{run}, past the {recipe.total_steps} steps of {recipe.train_bytes:,} training bytes "
                            f"({step_bytes:,} a step): give at least {progress['step'] * step_bytes:,} to continue it")


def _load_progress(resume_dir: Path, model, optimizer):
    progress, tensors = _read_progress(resume_dir)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False)
    opt_state = optimizer.state_dict()
    restored: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            restored.setdefault(int(index), {})[key] = value
    opt_state["state"] = restored
    for group, saved in zip(opt_state["param_groups"], progress["param_groups"]):
        group.update(saved)
    optimizer.load_state_dict(opt_state)
    memory = {k[7:]: v for k, v in tensors.items() if k.startswith("memory.")}
    if not memory:  # exported by export_progress(lane_memory=False): the lanes go on from an empty state
        progress.setdefault("lane_memory_emptied_at_steps", []).append(progress["step"])
        return progress, None
    state = model.state_class.from_tensors(memory)
    return progress, state


def export_progress(run_dir: str | Path, destination: str | Path, lane_memory: bool = True) -> dict:
    """Copy a run's resume state (`run_dir/.resume/`) to `destination`, to keep it somewhere else
    and resume from it later (never in git: docs/design.md section 5). With `lane_memory=False`
    the lanes' carried memory is left out: that is most of the file for a model whose state grows with its history
    (the Reformer's 16 lanes hold up to 2,048 positions of keys and values per LSH layer, about
    110 of its 132 MB). A run resumed from such a copy empties every lane's memory at that step,
    as if each lane began a file there, and records the step in `lane_memory_emptied_at_steps`:
    the weights, the optimiser's moments and the data order are still exactly the run's."""
    source = Path(run_dir) / ".resume"
    if not (source / "progress.safetensors").is_file():
        raise ResumeRefused(f"{run_dir} holds no training progress to export ({source / 'progress.safetensors'} does "
                            f"not exist; a run saves it every {STANDARD_RECIPE.save_every} steps)")
    progress, tensors = _read_progress(source)
    destination = Path(destination)
    if not lane_memory:
        tensors = {name: value for name, value in tensors.items() if not name.startswith("memory.")}
    destination.mkdir(parents=True, exist_ok=True)
    _write_progress(destination, tensors, progress)
    return progress


def _progress_line(step: int, total: int, loss: float, bytes_per_s: float, elapsed: float) -> str:
    width = 30
    filled = int(width * step / total)
    eta = (total - step) * (elapsed / max(step, 1))
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} loss {loss:.3f} "
        f"({loss / math.log(2):.3f} bits/byte) {bytes_per_s:,.0f} B/s "
        f"elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min"
    )


def held_out_documents(corpus, limit_bytes: int | None = None) -> list[bytes]:
    documents, used = [], 0
    for path in corpus.held_out:
        data = corpus.read(path)
        if limit_bytes is not None:
            data = data[: limit_bytes - used]
            if not data:
                break
        documents.append(data)
        used += len(data)
    return documents


def train(
    architecture: str,
    preset: str,
    out: str | Path,
    recipe: Recipe = STANDARD_RECIPE,
    log=print,
) -> LanguageModel:
    out = Path(out)
    resume_dir = out / ".resume"
    torch.manual_seed(recipe.seed)
    config = preset_config(architecture, preset)
    resuming = (resume_dir / "progress.json").is_file()
    if resuming:  # before anything is built or read: a rerun over a run of another kind is refused at once
        _check_resume(out, _read_progress(resume_dir, tensors=False)[0], architecture, preset, config, recipe)
    model = build_model(architecture, config)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "bias" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate, betas=(0.9, 0.98), eps=1e-8,
    )
    corpus = stdlib_corpus()
    stream = SegmentStream(corpus, recipe.batch_size, recipe.segment_len, recipe.seed, recipe.lane_layout)
    quick_docs = held_out_documents(corpus, recipe.quick_eval_bytes)

    state = model.init_state(recipe.batch_size)
    progress = {"step": 0, "elapsed_s": 0.0, "evaluations": [], "recipe": asdict(recipe), "preset": preset,
                "architecture": architecture, "config": config, "parameters": params}
    if resuming:
        progress, state = _load_progress(resume_dir, model, optimizer)
        saved_budget = progress.setdefault("recipe", asdict(recipe)).get("train_bytes")
        if saved_budget != recipe.train_bytes:
            # "rerun to continue", with a larger budget too (README): training.json and the card
            # then give the budget the run was trained to, and when it changed
            progress["recipe"]["train_bytes"] = recipe.train_bytes
            progress.setdefault("notes", []).append(
                f"the byte budget changed from {saved_budget:,} to {recipe.train_bytes:,} training bytes at step "
                f"{progress['step']:,}, where the run was resumed; the learning rate's cosine decay follows the new "
                "total from there")
        if state is None:
            state = model.init_state(recipe.batch_size)
            log(f"resuming {architecture}/{preset} from step {progress['step']} ({resume_dir}); its progress was "
                "kept without the lanes' memory, so every lane goes on from an empty state")
        else:
            log(f"resuming {architecture}/{preset} from step {progress['step']} ({resume_dir})")
    else:
        log(f"training {architecture}/{preset}: {params:,} parameters, {recipe.total_steps} steps of "
            f"{recipe.batch_size}x{stream.segment_len} bytes; corpus {stream.total_bytes:,} training bytes "
            f"({len(corpus.train)} files, {stream.read_bytes:,} in the '{recipe.lane_layout}' lanes), {corpus.size(corpus.held_out):,} held-out bytes ({len(corpus.held_out)} files)")

    model.train()
    started = time.time() - progress["elapsed_s"]
    window_loss, window_steps, window_start = 0.0, 0, time.time()
    recent_losses: list[float] = []
    tty = sys.stderr.isatty()
    total = recipe.total_steps
    while progress["step"] < total:
        step = progress["step"]
        inputs, targets, starts = stream.segment(step)
        state = empty_rows(model, state, starts)
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate_at(step)
        loss, state = training_loss(model, inputs, targets, state, step / total)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gradient_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip))
        loss_value = loss.item()  # read once: on a GPU each read waits for the device
        if not (math.isfinite(loss_value) and math.isfinite(gradient_norm)):
            # one non-finite gradient turns every weight to NaN at the optimiser step, and the run would go on
            # for hours saving NaN: stop before it, with the last save (at most save_every steps ago) intact
            last_save = step - step % recipe.save_every  # saves happen at multiples of save_every
            saved = (f"the last save in {resume_dir} is from step {last_save} (a rerun resumes there)" if last_save
                     else "nothing was saved yet (a rerun starts from step 0)")
            raise TrainingDiverged(
                f"{architecture}/{preset}: step {step} has loss {loss_value} and gradient norm "
                f"{gradient_norm}; nothing of this step was applied; {saved}")
        optimizer.step()
        progress["step"] = step + 1
        window_loss += loss_value
        window_steps += 1
        recent_losses = (recent_losses + [loss_value])[-50:]

        if progress["step"] % 20 == 0 or progress["step"] == total:
            elapsed = time.time() - started
            rate = window_steps * recipe.batch_size * stream.segment_len / (time.time() - window_start)
            line = _progress_line(progress["step"], total, window_loss / window_steps, rate, elapsed)
            if tty:
                print("\r" + line, end="", file=sys.stderr, flush=True)
            if not tty or progress["step"] % 200 == 0:
                log(line)
            window_loss, window_steps, window_start = 0.0, 0, time.time()
        if progress["step"] % recipe.eval_every == 0 or progress["step"] == total:
            bpb = bits_per_byte(model, quick_docs, window_stride=recipe.eval_window_stride)
            progress["evaluations"].append({"step": progress["step"], "held_out_bits_per_byte_quick": round(bpb, 4)})
            log(f"\nstep {progress['step']}: quick held-out bits per byte {bpb:.4f} (first {recipe.quick_eval_bytes:,} held-out bytes)")
            training_bits = sum(recent_losses) / len(recent_losses) / math.log(2)
            if bpb > training_bits + HELD_OUT_GAP_WARNING_BITS:
                log(f"warning: held-out {bpb:.2f} bits/byte against {training_bits:.2f} on the last training steps: "
                    "the model does much worse from an empty state than on its lanes, so it relies on state a "
                    "served document never has (docs/design.md section 5)")
        if progress["step"] % recipe.save_every == 0 or progress["step"] == total:
            progress["elapsed_s"] = time.time() - started
            _save_progress(resume_dir, model, optimizer, state, progress)

    progress["elapsed_s"] = time.time() - started
    model.eval()
    save_checkpoint(model, out, extra={"training": {k: progress[k] for k in ("preset", "step", "elapsed_s", "parameters")}})
    (out / "training.json").write_text(json.dumps(progress, indent=2) + "\n")
    log(f"saved {out} after {progress['step']} steps, {progress['elapsed_s'] / 60:.1f} min")
    return model


def empty_rows(model: LanguageModel, state, starts: torch.Tensor):
    """`state` with the rows where `starts` is True replaced by an empty state: those lanes
    begin a file at this step (models/training/data.py)."""
    if bool(starts.all()):
        return model.init_state(len(starts))
    if not bool(starts.any()):
        return state
    rows = state.split()
    empty = model.init_state(1)
    for lane in torch.nonzero(starts).flatten().tolist():
        rows[lane] = empty
    return model.state_class.concat(rows)


def training_loss(model: LanguageModel, inputs, targets, state, fraction_done: float):
    """Mean next-byte negative log-likelihood; an architecture with auxiliary losses defines
    `training_loss(inputs, targets, state, fraction_done)` itself."""
    if hasattr(model, "training_loss"):
        return model.training_loss(inputs, targets, state, fraction_done)
    log_probs, state = model(inputs, state)
    return -log_probs.gather(-1, targets[..., None]).mean(), state


def machine_summary() -> str:
    return f"Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPU cores ({platform.machine()})"
