import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.training import card
from xlserve.models.training import train as train_module
from xlserve.models.training.data import Corpus, SegmentStream, is_held_out, stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte
from xlserve.models.training.train import STANDARD_RECIPE, train
from xlserve.server import cli


def test_split_rule_is_the_design_rule():
    corpus = stdlib_corpus()
    assert corpus.held_out and corpus.train
    assert all(is_held_out(p) for p in corpus.held_out)
    assert not any(is_held_out(p) for p in corpus.train)
    assert not any("site-packages" in p for p in corpus.train + corpus.held_out)


def test_training_resumes_where_it_stopped(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 6, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    train("transformer-xl", "tiny", tmp_path / "a", replace(recipe, train_bytes=4 * 32 * 3), log=lambda s: None)
    resumed = train("transformer-xl", "tiny", tmp_path / "a", recipe, log=lambda s: None)
    straight = train("transformer-xl", "tiny", tmp_path / "b", recipe, log=lambda s: None)
    # resuming restores weights, optimiser moments and memory: the same model as one run
    for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    loaded = load_checkpoint(tmp_path / "a")
    docs = [b"def f(x):\n    return x + 1\n" * 4]
    assert abs(bits_per_byte(loaded, docs) - bits_per_byte(straight, docs)) < 1e-5


def test_a_save_resumes_at_its_own_step_even_beside_a_stale_progress_json(tmp_path):
    """A run killed between the save's two renames leaves the new tensors beside the old
    progress.json; the tensor file's own record of the step wins."""
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 6, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    train("transformer-xl", "tiny", tmp_path / "a", replace(recipe, train_bytes=4 * 32 * 3), log=lambda s: None)
    progress_json = tmp_path / "a" / ".resume" / "progress.json"
    stale = json.loads(progress_json.read_text())
    stale["step"] = 0
    progress_json.write_text(json.dumps(stale))
    lines = []
    train("transformer-xl", "tiny", tmp_path / "a", recipe, log=lines.append)
    assert lines[0].startswith("resuming transformer-xl/tiny from step 3 ")


def test_progress_kept_without_lane_memory_resumes_with_empty_lanes(tmp_path, monkeypatch):
    """export_progress(lane_memory=False) keeps weights, optimiser moments and step; the resumed
    run equals one that empties every lane's memory at that step, and says so in training.json."""
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 6, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    train("transformer-xl", "tiny", tmp_path / "a", replace(recipe, train_bytes=4 * 32 * 3), log=lambda s: None)
    kept = tmp_path / "kept"
    progress = train_module.export_progress(tmp_path / "a", kept, lane_memory=False)
    assert progress["step"] == 3
    full = load_file(str(tmp_path / "a" / ".resume" / "progress.safetensors"))
    lean = load_file(str(kept / "progress.safetensors"))
    assert any(name.startswith("memory.") for name in full)
    assert set(lean) == {name for name in full if not name.startswith("memory.")}
    assert all(torch.equal(lean[name], full[name]) for name in lean)
    cli.main(["train", "--arch", "transformer-xl", "--out", str(tmp_path / "a"),  # the command line does the same
              "--export-progress", str(tmp_path / "by-cli"), "--without-lane-memory"])
    assert load_file(str(tmp_path / "by-cli" / "progress.safetensors")).keys() == lean.keys()
    with pytest.raises(SystemExit, match="--without-lane-memory applies only to --export-progress"):
        cli.main(["train", "--arch", "transformer-xl", "--out", str(tmp_path / "unused"), "--without-lane-memory"])
    assert not (tmp_path / "unused").exists()  # refused before anything was trained or written

    (tmp_path / "b" / ".resume").mkdir(parents=True)
    for name in ("progress.json", "progress.safetensors"):
        (tmp_path / "b" / ".resume" / name).write_bytes((kept / name).read_bytes())
    lines = []
    resumed = train("transformer-xl", "tiny", tmp_path / "b", recipe, log=lines.append)
    assert "without the lanes' memory" in lines[0]
    assert json.loads((tmp_path / "b" / "training.json").read_text())["lane_memory_emptied_at_steps"] == [3]
    checkpoint = load_checkpoint(tmp_path / "b")
    record = json.loads((tmp_path / "b" / "training.json").read_text())
    record["notes"] = ["at step 3 something about the run changed"]  # a progress file's own record of changes
    (tmp_path / "b" / "training.json").write_text(json.dumps(record))
    evaluations = [{"memory": "trained", "state": card.describe(checkpoint), "mem_len": None, "chunk_len": 512,
                    "window_stride": None, "scored_bytes": 1_000, "bits_per_byte": 6.25, "seconds": 0.1}]
    card.write_card(tmp_path / "b", checkpoint, evaluations, "sample")
    assert ("Resumed at step 3 from progress kept without the lanes' memory: every lane's memory was emptied "
            "there") in (tmp_path / "b" / "card.md").read_text()
    assert "- At step 3 something about the run changed.\n" in (tmp_path / "b" / "card.md").read_text()

    # the same run by hand: the first three steps, then every lane emptied at step 3
    real_empty_rows, calls = train_module.empty_rows, []

    def emptied_at_step_3(model, state, starts):
        calls.append(None)
        return real_empty_rows(model, state, torch.ones_like(starts) if len(calls) == 4 else starts)

    monkeypatch.setattr(train_module, "empty_rows", emptied_at_step_3)
    by_hand = train("transformer-xl", "tiny", tmp_path / "c", recipe, log=lambda s: None)
    monkeypatch.undo()
    for a, b in zip(resumed.state_dict().values(), by_hand.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    straight = train("transformer-xl", "tiny", tmp_path / "d", recipe, log=lambda s: None)
    assert any(not torch.allclose(a, b, atol=1e-6)  # the emptied memory did change the run
               for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()))


def _small_corpus(root, sizes):
    """Files whose bytes say which file and which offset they are: file i holds bytes
    (i * 7 + offset) % 256, so any window read back names its file and position."""
    root.mkdir()
    names = []
    for i, size in enumerate(sizes):
        name = f"file{i:02d}.py"
        (root / name).write_bytes(bytes((i * 7 + offset) % 256 for offset in range(size)))
        names.append(name)
    return Corpus(root=root, train=names, held_out=[])


def test_every_lane_starts_each_file_at_a_segment_from_an_empty_state(tmp_path):
    segment_len, sizes = 8, [3, 9, 17, 40, 25, 8, 64, 33, 12, 50, 19, 70]
    corpus = _small_corpus(tmp_path / "corpus", sizes)
    stream = SegmentStream(corpus, batch_size=3, segment_len=segment_len, seed=1)
    files = {corpus.read(name) for name in corpus.train}
    seen = []
    for lane in range(3):
        current = None
        for step in range(stream.steps_per_epoch):
            inputs, targets, starts = stream.segment(step)
            window = bytes(inputs[lane].tolist()) + bytes(targets[lane, -1:].tolist())
            assert bytes(inputs[lane, 1:].tolist()) == bytes(targets[lane, :-1].tolist())
            if starts[lane]:
                # a file's first segment, and the lane's state is emptied before it
                if current is not None:
                    seen.append(current)
                current = window
            else:
                assert current[-1:] == window[:1], "segments of one file overlap by one byte"
                current += window[1:]
            # everything the lane has read since its last start is a prefix of one file
            assert any(f.startswith(current) for f in files)
        seen.append(current)
    # no file is read twice; files too short for one segment are not read
    assert len(seen) == len(set(seen))
    assert not any(len(f) <= segment_len for f in seen)
    assert all(stream.segment(0)[2])
    # the old layout runs one state across files: it starts a file only at step 0
    old = SegmentStream(corpus, batch_size=3, segment_len=segment_len, seed=1, layout="concatenated")
    assert all(old.segment(0)[2]) and not any(old.segment(1)[2])


def test_the_training_loop_gives_an_empty_state_to_lanes_that_start_a_file(tmp_path, monkeypatch):
    corpus = _small_corpus(tmp_path / "corpus", [40, 70, 33, 100, 45, 90, 38, 60])
    corpus.held_out = corpus.train[:1]
    monkeypatch.setattr(train_module, "stdlib_corpus", lambda: corpus)
    seen, standard_loss = [], train_module.training_loss

    def recording_loss(model, inputs, targets, state, fraction_done):
        seen.append(state.clone())
        return standard_loss(model, inputs, targets, state, fraction_done)

    monkeypatch.setattr(train_module, "training_loss", recording_loss)
    recipe = replace(STANDARD_RECIPE, train_bytes=2 * 16 * 12, batch_size=2, segment_len=16, eval_every=1000,
                     save_every=1000, quick_eval_bytes=40, warmup_steps=2)
    model = train("performer", "tiny", tmp_path / "out", recipe, log=lambda s: None)
    stream = SegmentStream(corpus, 2, 16, recipe.seed)
    assert len(seen) == recipe.total_steps <= stream.steps_per_epoch
    empty = model.init_state(1).to_tensors()
    checked = {True: 0, False: 0}
    for step, state in enumerate(seen):
        starts = stream.segment(step)[2]
        for lane, row in enumerate(state.split()):
            is_empty = all(torch.equal(row.to_tensors()[n], t) for n, t in empty.items())
            # a lane that starts a file gets an empty state; any other carries its file's memory
            assert is_empty == bool(starts[lane]), (step, lane)
            checked[bool(starts[lane])] += 1
    assert checked[True] > 2 and checked[False] > 2  # a restart after step 0 and carried memory were both seen


@pytest.mark.parametrize("nan_step, said", [(3, "the last save in .* is from step 2 "),
                                             (1, "nothing was saved yet .a rerun starts from step 0.")])
def test_a_step_with_a_non_finite_loss_stops_the_run_before_it_is_applied(tmp_path, monkeypatch, nan_step, said):
    """A NaN step would turn every weight to NaN and the run would go on saving NaN for hours
    (mamba-stdlib's first run did): the loop stops at that step, naming it and the save a rerun
    resumes from, and that save still holds finite weights."""
    corpus = _small_corpus(tmp_path / "corpus", [40, 70, 33, 100, 45, 90, 38, 60])
    corpus.held_out = corpus.train[:1]
    monkeypatch.setattr(train_module, "stdlib_corpus", lambda: corpus)
    standard_loss, calls = train_module.training_loss, []

    def loss_going_nan(model, inputs, targets, state, fraction_done):
        calls.append(1)
        loss, state = standard_loss(model, inputs, targets, state, fraction_done)
        return (loss * float("nan") if len(calls) == nan_step + 1 else loss), state

    monkeypatch.setattr(train_module, "training_loss", loss_going_nan)
    recipe = replace(STANDARD_RECIPE, train_bytes=2 * 16 * 6, batch_size=2, segment_len=16, eval_every=1000,
                     save_every=2, quick_eval_bytes=40, warmup_steps=2)
    with pytest.raises(train_module.TrainingDiverged, match=f"step {nan_step} has loss nan.*; {said}"):
        train("performer", "tiny", tmp_path / "out", recipe, log=lambda s: None)
    if nan_step < recipe.save_every:
        assert not (tmp_path / "out" / ".resume" / "progress.json").exists()
        return
    progress, tensors = train_module._read_progress(tmp_path / "out" / ".resume")
    assert progress["step"] == 2
    assert all(torch.isfinite(value).all() for name, value in tensors.items() if name.startswith("model."))


# a run of a few steps of 4 lanes x 32 bytes, saved at its end
SHORT_RECIPE = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                       save_every=3, quick_eval_bytes=2000, warmup_steps=2)


@pytest.mark.parametrize("argv, expected", [
    # another architecture: "state tensor missing" ValueError, or a size-mismatch RuntimeError
    (["--arch", "mamba", "--preset", "tiny"], "holds a transformer-xl/tiny run at step 3; "
                                              "resuming it as mamba/tiny"),
    (["--arch", "transformer-xl", "--preset", "small"], "holds a transformer-xl/tiny run at step 3; "
                                                        "resuming it as transformer-xl/small"),
])
def test_a_rerun_with_another_architecture_or_preset_is_refused(tmp_path, monkeypatch, argv, expected):
    """`xlserve train --out RUN` resumes RUN: with another --arch or --preset its saved weights do
    not fit the model built, and the rerun is refused naming both, before anything is trained."""
    run = tmp_path / "run"
    train("transformer-xl", "tiny", run, SHORT_RECIPE, log=lambda s: None)
    saved = (run / ".resume" / "progress.safetensors").read_bytes()
    monkeypatch.setattr(train_module, "STANDARD_RECIPE", SHORT_RECIPE)  # what `xlserve train` trains by
    with pytest.raises(SystemExit) as refused:
        cli.main(["train", *argv, "--out", str(run), "--train-bytes", str(4 * 32 * 6)])
    message = str(refused.value.code)
    assert message.startswith(f"xlserve train: {run} holds ") and expected in message and "\n" not in message, message
    assert "--arch transformer-xl --preset tiny" in message
    assert (run / ".resume" / "progress.safetensors").read_bytes() == saved  # nothing was trained


def test_a_resume_with_lanes_of_another_shape_is_refused(tmp_path):
    """The lanes' saved memory has the run's batch of lanes and its segments their length: a
    resume that would cut them otherwise is refused, naming both values."""
    train("transformer-xl", "tiny", tmp_path / "run", SHORT_RECIPE, log=lambda s: None)
    with pytest.raises(ValueError, match=r"trained with batch_size 4; this one has 8"):  # ResumeRefused, a ValueError
        train("transformer-xl", "tiny", tmp_path / "run", replace(SHORT_RECIPE, batch_size=8), log=lambda s: None)


def test_a_rerun_with_a_larger_byte_budget_records_it(tmp_path, monkeypatch):
    """README: "resumable: rerun to continue", --train-bytes N included: a rerun with a larger budget
    continues the run up to it, and training.json (the card's source) records the budget the run
    has now, with the step it changed at (the learning rate's decay follows the new total from there)."""
    run = tmp_path / "run"
    train("transformer-xl", "tiny", run, SHORT_RECIPE, log=lambda s: None)
    monkeypatch.setattr(train_module, "STANDARD_RECIPE", SHORT_RECIPE)
    cli.main(["train", "--arch", "transformer-xl", "--preset", "tiny", "--out", str(run), "--train-bytes",
              str(4 * 32 * 5)])
    record = json.loads((run / "training.json").read_text())
    assert record["step"] == 5 and record["recipe"]["train_bytes"] == 4 * 32 * 5
    assert record["notes"] == ["the byte budget changed from 384 to 640 training bytes at step 3, where the run "
                               "was resumed; the learning rate's cosine decay follows the new total from there"]
    with pytest.raises(SystemExit, match=r"^xlserve train: .* run at step 5, past the 3 steps of 384 training "
                                         r"bytes \(128 a step\): give at least 640 to continue it$"):
        cli.main(["train", "--arch", "transformer-xl", "--preset", "tiny", "--out", str(run), "--train-bytes",
                  str(4 * 32 * 3)])


def test_exporting_the_progress_of_no_run_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as refused:  # was a FileNotFoundError traceback
        cli.main(["train", "--arch", "transformer-xl", "--out", str(tmp_path / "no-run"),
                  "--export-progress", str(tmp_path / "copy")])
    message = str(refused.value.code)
    assert message.startswith(f"xlserve train: {tmp_path / 'no-run'} holds no training progress to export") \
        and "\n" not in message, message
    assert not (tmp_path / "copy").exists()
