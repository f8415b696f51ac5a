"""--nan_policy stop names the batch that gave the first non-finite loss (update, micro-batch, rank, sample indices)
and saves it, so that it replays to the same non-finite loss through the recipe's loss (accel_trainer/nan_batch.py).

The fault recipe's `nan_sample=I` writes NaN into training sample I's features: a bad row in the data. The run checks
at log rows only (every 5 updates here), so the bad update is found after the fact, several updates back."""

import math
import os
import re
import types

import datasets
import fault_recipe
import pytest
import regression
import torch
from helpers import flags, run

from accel_trainer import Trainer, TrainingArguments
from accel_trainer.logwindow import NonFiniteLossError

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_recipe.py")
B, ACCUM, SEED, POSITION = 8, 2, 7, 37  # the bad sample is the 38th of epoch 0's order: batch 4, update 3


def _bad_sample(nproc: int) -> tuple[int, int, int, int]:
    """(sample index, update, micro-batch, rank) of the order's POSITION-th sample: the order is torch.randperm
    seeded with seed + epoch (loaders.train_sampler), and Accelerate hands rank r the batches r, r + W, ..."""
    order = torch.randperm(256, generator=torch.Generator().manual_seed(SEED)).tolist()
    batch = POSITION // B
    rank, local = batch % nproc, batch // nproc
    return order[POSITION], local // ACCUM + 1, local % ACCUM + 1, rank


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_nan_stop_names_the_bad_sample_and_its_saved_batch_replays_to_nan(tmp_path, nproc):
    sample, update, micro, rank = _bad_sample(nproc)
    out = tmp_path / "run"
    args = ["--output_dir", out, "--faults", f"nan_sample={sample}", "--seed", SEED, "--data_seed", 3]
    args += flags(max_steps=12, save_steps=0, logging_steps=5, per_device_train_batch_size=B, disable_tqdm=True)
    args += ["--gradient_accumulation_steps", ACCUM]
    r = run(SCRIPT, args, nproc=nproc, check=False, timeout=180)
    log = r.stdout + r.stderr
    lines = [x for x in log.splitlines() if x.startswith(f"error: Loss is nan at step {update}; ")]
    # One line from each rank; on 2 processes torchrun adds its own ChildFailedError traceback, none of ours.
    assert r.returncode != 0 and len(lines) == nproc and "accel_trainer" not in log.replace(str(out), ""), log
    line = lines[0]
    saved = out / f"nan_batch_rank{rank}.pt"
    named = re.search(
        rf"update {update}, rank {rank}, micro-batch {micro} of {ACCUM} \(batch \d+ of epoch 0, sample indices "
        rf"\[([0-9, ]+)\]\); saved to {re.escape(str(saved))}\. Replay it",
        line,
    )
    assert named, line
    indices = [int(i) for i in named.group(1).split(",")]
    assert sample in indices and len(indices) == B, line
    assert sorted(f for f in os.listdir(out) if f.startswith("nan_batch")) == [saved.name]  # the bad rank's only

    # The notebook replay (docs/fault-tolerance.md, "When it fails"): load the file, call the recipe's loss on it.
    batch = torch.load(saved, weights_only=True)
    assert batch["x"].shape[0] == B and torch.isnan(batch["x"]).any(dim=1).sum() == 1
    targs = TrainingArguments(output_dir=str(tmp_path / "replay"), max_steps=1, disable_tqdm=True)
    trainer = Trainer(fault_recipe, targs, fault_recipe.Args(), quiet=True)
    loss, _ = trainer.recipe.loss(trainer.model, batch)
    assert math.isnan(float(loss.detach()))


def test_nan_stop_in_a_stream_names_its_position_and_saves_the_batch(tmp_path):
    # A stream cannot be read again: the log row's micro-batches stay referenced; the line names the stream position.
    bad, b = 45, 4  # micro-batch 11 (0-based) of the stream's first epoch: update 6, micro-batch 2 of 2

    def build_data(ctx):
        tensors = regression.build_data(ctx)["train"].tensors
        tensors["x"][bad] = float("nan")
        rows = {"id": list(range(len(tensors["x"])))} | {k: v.tolist() for k, v in tensors.items()}
        return {"train": datasets.Dataset.from_dict(rows).to_iterable_dataset(), "collate": regression.collate}

    rec = types.SimpleNamespace(**{k: getattr(regression, k) for k in ("Args", "build_model", "loss", "defaults")})
    rec.build_data, rec.name = build_data, "regression_stream_nan"
    targs = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=12, save_steps=0, logging_steps=10,
        per_device_train_batch_size=b, gradient_accumulation_steps=2, disable_tqdm=True,
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError) as e:
        Trainer(rec, targs, regression.Args(), quiet=True).fit()
    saved = tmp_path / "run" / "nan_batch_rank0.pt"
    expected = f"update 6, rank 0, micro-batch 2 of 2 (stream position 11 of epoch 0 on this rank); saved to {saved}."
    assert "Loss is nan at step 6; " in str(e.value) and expected in str(e.value), e.value
    batch = torch.load(saved, weights_only=True)
    assert bad in batch["id"].tolist()
    model = regression.build_model(types.SimpleNamespace(args=regression.Args()))
    assert math.isnan(float(regression.loss(model, batch)[0].detach()))


def test_nan_stop_after_train_step_saves_the_batch_it_was_given(tmp_path):
    # A notebook's train_step() does not move the run's position: the batch is named as given, and saved as it was.
    targs = TrainingArguments(output_dir=str(tmp_path / "nb"), max_steps=4, disable_tqdm=True)
    trainer = Trainer(regression, targs, regression.Args(), quiet=True)
    trainer.train_step()
    batch = trainer.fetch_batch()
    batch["x"][2] = float("nan")
    trainer.train_step(batch)
    with pytest.raises(NonFiniteLossError, match=r"at step 2; .*update 2, rank 0, micro-batch 1 of 1 \(a batch given"):
        trainer.log()
    assert torch.isnan(torch.load(tmp_path / "nb" / "nan_batch_rank0.pt", weights_only=True)["x"][2]).all()
