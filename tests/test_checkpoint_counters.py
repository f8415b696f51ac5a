"""A checkpoint whose counters contradict each other is refused (checkpointing/counters.py), in-process, 1 process:
each case edits the values of the step_8 checkpoint by hand (json, struct: not the project's writers) and re-hashes
the manifest by hand, as whoever edits a checkpoint can. Resuming that folder is one line naming the file and the
field; `latest` falls back to step_4. Legitimate runs that really skipped updates, or accumulated, still resume."""

import hashlib
import json
import os
import shutil
import struct
import sys
import types

import pytest
import torch
from helpers import RECIPES

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments  # noqa: E402
from accel_trainer.checkpointing.folder import CheckpointError  # noqa: E402
from accel_trainer.checkpointing.verify import verify_checkpoint  # noqa: E402


def make(out, recipe=regression, **kw):
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("disable_tqdm", True)
    kw.setdefault("logging_steps", 2)
    return Trainer(recipe, TrainingArguments(output_dir=str(out), **kw), regression.Args(), quiet=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run with checkpoints at steps 4, 8, 12."""
    out = tmp_path_factory.mktemp("counters") / "run"
    make(out, max_steps=12, save_steps=4).fit()
    return out


# ---------------------------------------------------------------------------------------- editing by hand
def read_json(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def write_json(folder, name, doc):
    with open(os.path.join(folder, name), "w") as f:
        json.dump(doc, f, indent=1)


def rehash(folder):
    """The manifest made to match the edited files: each listed file's size and sha256, computed here."""
    manifest = read_json(folder, "manifest.json")
    for name, meta in manifest["files"].items():
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        meta["size"], meta["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    write_json(folder, "manifest.json", manifest)


def edit_safetensors(file, edit):
    """`edit(header, data)` on a safetensors file's parsed header and its bytes (a bytearray), written back."""
    with open(file, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), bytearray(raw[8 + n :])
    edit(header, data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(data))


def set_steps(value):
    def edit(header, data):
        for name, meta in header.items():
            if name.endswith(".step"):
                assert meta["dtype"] == "F32" and meta["shape"] == []
                start = meta["data_offsets"][0]
                data[start : start + 4] = struct.pack("<f", value)

    return edit


def copied_from_step_4(*names):
    """Files of step_4 given step_8's step (the JSON files' "step", the safetensors' metadata): past the check that
    each file is of this checkpoint's step, only its counters tell."""

    def craft(ckpt):
        for name in names:
            shutil.copy(os.path.join(ckpt, "..", "step_4", name), ckpt)
            if name.endswith(".json"):
                doc = read_json(ckpt, name)
                doc["step"] = 8
                write_json(ckpt, name, doc)
            else:
                edit_safetensors(os.path.join(ckpt, name), lambda h, d: h["__metadata__"].update(step="8"))

    return craft


def edit_json(name, change, manifest=None):
    def craft(ckpt):
        doc = read_json(ckpt, name)
        change(doc)
        write_json(ckpt, name, doc)
        if manifest:  # the manifest's copy of the trainer state's position, edited the same way
            m = read_json(ckpt, "manifest.json")
            m.update(manifest)
            write_json(ckpt, "manifest.json", m)

    return craft


def _optimizer_steps(ckpt, value):
    edit_safetensors(os.path.join(ckpt, "optimizer.safetensors"), set_steps(value))


CASES = {
    "sched_last6": (
        edit_json("scheduler.json", lambda d: d["state"].update(last_epoch=6, _step_count=7)),
        r"scheduler\.json holds last_epoch 6 \(8 scheduler steps expected\)",
    ),
    "sched_step_count": (
        edit_json("scheduler.json", lambda d: d["state"].update(_step_count=4)),
        r"scheduler\.json holds _step_count 4 \(9 expected\)",
    ),
    "opt_stepcount": (
        lambda ckpt: _optimizer_steps(ckpt, 2.0),
        r"optimizer\.safetensors holds state\.[\w.]+\.step 2 \(8 optimizer steps, the largest of any parameter\)",
    ),
    "opt_step_above": (
        lambda ckpt: _optimizer_steps(ckpt, 9.0),
        r"optimizer\.safetensors holds state\.[\w.]+\.step 9 \(8 optimizer steps, at most\)",
    ),
    "copy4_opt": (
        copied_from_step_4("optimizer.json", "optimizer.safetensors"),
        r"optimizer\.safetensors holds state\.[\w.]+\.step 4 \(8 optimizer steps",
    ),
    "copy4_sched": (copied_from_step_4("scheduler.json"), r"scheduler\.json holds last_epoch 4 \(8 scheduler steps"),
    "pos6": (
        edit_json("trainer_state.json", lambda d: d.update(batch_in_epoch=6), {"batch_in_epoch": 6}),
        r"trainer_state\.json holds batch_in_epoch 6 in epoch 0 \(8 expected\)",
    ),
    "epoch1": (
        edit_json("trainer_state.json", lambda d: d.update(epoch=1), {"epoch": 1}),
        r"trainer_state\.json holds epoch 1, batch_in_epoch 8 \(each epoch takes an update at least\)",
    ),
    "skipped3": (
        edit_json("trainer_state.json", lambda d: d.update(skipped_steps=3)),
        r"scheduler\.json holds last_epoch 8 \(5 scheduler steps expected\)",
    ),
    "microbatch": (
        edit_json("trainer_state.json", lambda d: d.update(micro_batch_size=8)),
        r"trainer_state\.json holds micro_batch_size 8 \(only auto_micro_batch=True sets one, halving the per-device "
        r"batch 16\), which a run with auto_micro_batch False \(\S+/run_args\.json\) cannot have",
    ),
    "accum_runargs": (
        edit_json(
            "run_args.json",
            lambda d: d["state"]["training"].update(per_device_train_batch_size=8, gradient_accumulation_steps=2),
        ),
        r"run_args\.json holds per_device_train_batch_size 8, which the run at per_device_train_batch_size 16, "
        r"gradient_accumulation_steps 1",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_whose_counters_contradict_each_other_is_refused_and_latest_falls_back(
    trained, tmp_path, capsys, case
):
    craft, message = CASES[case]
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "checkpoints" / "step_12")  # step_8, edited, is the newest
    ckpt = out / "checkpoints" / "step_8"
    craft(str(ckpt))
    rehash(ckpt)
    with pytest.raises(CheckpointError, match=message) as refused:
        make(out, max_steps=16, save_steps=4, resume_from_checkpoint=str(ckpt))
    assert str(refused.value).startswith(f"Checkpoint {ckpt}: ") and "\n" not in str(refused.value)
    t = make(out, max_steps=16, save_steps=4, resume_from_checkpoint="latest")
    assert t.global_step == 4
    err = capsys.readouterr().err
    assert f"skipping checkpoint {ckpt}" in err and "resuming from" in err


# ------------------------------------------------------------------------------------- no false refusal
def test_every_checkpoint_of_the_run_passes_as_written(trained):
    for step in (4, 8, 12):
        verify_checkpoint(str(trained / "checkpoints" / f"step_{step}"))


def _nan_recipe(updates: set, own_optimizer: bool):
    """regression with the loss of these updates (1-based) NaN; with the recipe's own AdamW (not fused: a skipped
    update never calls its step), or the Trainer's default (fused on a CPU: skipped on the device)."""
    calls = {"n": 0}

    def loss(model, batch):
        value, n = regression.loss(model, batch)
        calls["n"] += torch.is_grad_enabled()  # updates only: the recipe check's call is no_grad
        return (value * float("nan") if calls["n"] in updates else value), n

    names = ["Args", "build_model", "build_data", "eval_step", "build_metrics", "defaults"]
    rec = types.SimpleNamespace(**{k: getattr(regression, k) for k in names + ["build_optimizer"] * own_optimizer})
    rec.loss, rec.name = loss, "regression_nan"
    return rec


@pytest.mark.parametrize("own_optimizer", [False, True])
def test_a_run_that_really_skipped_updates_resumes(tmp_path, own_optimizer):
    """Updates 1, 2 and 5 skipped: the checkpoint at 2 is written before any update applied (torch's zero-lr step
    builds the optimizer's state there, counting one), the one at 6 after 3 applied."""
    out = tmp_path / "run"
    make(out, _nan_recipe({1, 2, 5}, own_optimizer), max_steps=6, save_steps=2, nan_policy="skip").fit()
    for step, skipped in ((2, 2), (4, 2), (6, 3)):
        ckpt = out / "checkpoints" / f"step_{step}"
        assert read_json(ckpt, "trainer_state.json")["skipped_steps"] == skipped
        verify_checkpoint(str(ckpt))
    t = make(out, _nan_recipe(set(), own_optimizer), max_steps=8, save_steps=2, nan_policy="skip",
             resume_from_checkpoint=str(out / "checkpoints" / "step_6"))  # fmt: skip
    assert t.global_step == 6 and t.progress.skipped_steps == 3
    t.fit()
    verify_checkpoint(str(out / "checkpoints" / "step_8"))


def test_a_run_with_accumulation_resumes_across_epochs(tmp_path):
    """256 samples in batches of 16, 2 per update: 8 updates per epoch; checkpoints in epoch 0, at its end and in
    epoch 1."""
    out = tmp_path / "run"
    make(out, max_steps=12, save_steps=4, gradient_accumulation_steps=2).fit()
    positions = {}
    for step in (4, 8, 12):
        s = read_json(out / "checkpoints" / f"step_{step}", "trainer_state.json")
        positions[step] = (s["epoch"], s["batch_in_epoch"])
    assert positions == {4: (0, 8), 8: (1, 0), 12: (1, 8)}
    t = make(out, max_steps=16, save_steps=4, gradient_accumulation_steps=2, resume_from_checkpoint="latest")
    assert t.global_step == 12
    t.fit()
    verify_checkpoint(str(out / "checkpoints" / "step_16"))
