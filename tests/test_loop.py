"""The training loop's pieces, in-process: the accumulation windows (no model needed), named events, and
the loop's answers to odd input (a lying loader, a skipped NaN update, data options on a recipe's own loader)."""

import math
import os
import signal
import sys
import types

import pytest
import torch
from helpers import RECIPES

sys.path.insert(0, RECIPES)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batchloader_recipe  # noqa: E402
import regression  # noqa: E402

from accel_trainer import Trainer  # noqa: E402
from accel_trainer.loaders import MapPosition, ShortEpochError, train_sampler  # noqa: E402


class Batches:
    """A recipe-style loader of `n` labelled fake batches per epoch, (epoch, index), whose len() may be another
    number."""

    def __init__(self, n, length=None):
        self.n, self.length, self.epoch = n, n if length is None else length, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.length

    def __iter__(self):
        return iter([(self.epoch, i) for i in range(self.n)])


def position_over(n_batches, length=None, epoch=0, start=0):
    """A MapPosition over Batches on one process, at (epoch, start)."""
    position = MapPosition(Batches(n_batches, length), types.SimpleNamespace(num_processes=1, process_index=0))
    position.batches_per_epoch = len(position.loader)
    position.load_state_dict({"epoch": epoch, "batch_in_epoch": start})
    return position


def take_windows(position, accumulation, n):
    """(epoch, batch_in_epoch after it, indices) of the next n windows."""
    windows = position.windows(accumulation)
    got = []
    for _ in range(n):
        window = next(windows)
        assert all(b[0] == window[0][0] for b in window)  # every batch comes from one epoch
        got.append((window[0][0], position.batch_in_epoch, [i for _, i in window]))
    return got


# ------------------------------------------------------------------------------------------ the windows
def test_windows_are_aligned_to_epochs_and_the_last_may_be_short():
    assert take_windows(position_over(5), 2, 6) == [
        (0, 2, [0, 1]),
        (0, 4, [2, 3]),
        (0, 0, [4]),  # the epoch's last window is shorter; the position moves to the next epoch's start
        (1, 2, [0, 1]),
        (1, 4, [2, 3]),
        (1, 0, [4]),
    ]


def test_the_train_order_is_accelerates_seedable_sampler_order():
    """train_sampler replaces Accelerate's SeedableRandomSampler for speed; the order must stay the one a run with
    Accelerate's sampler reads (earlier runs and checkpoints), epoch by epoch, and only (seed, epoch) decide it."""
    from accelerate.data_loader import SeedableRandomSampler

    for n, seed in ((1, 0), (37, 42), (1000, 7)):
        theirs = SeedableRandomSampler(range(n), generator=torch.Generator().manual_seed(seed), data_seed=seed)
        ours = train_sampler(range(n), seed)
        for epoch in (0, 1, 2, 5, 1):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            torch.manual_seed(epoch)  # the global RNG plays no part
            assert list(ours) == list(theirs), (n, seed, epoch)
        assert len(ours) == n and sorted(ours) == list(range(n))


def test_windows_resume_mid_epoch_at_a_window_boundary():
    position = position_over(5, epoch=3, start=2)
    assert take_windows(position, 2, 3) == [(3, 4, [2, 3]), (3, 0, [4]), (4, 2, [0, 1])]
    assert position.epoch == 4


def test_windows_stop_at_len_when_a_loader_yields_more():
    assert take_windows(position_over(7, length=4), 4, 2) == [(0, 0, [0, 1, 2, 3]), (1, 0, [0, 1, 2, 3])]


def test_a_loader_that_yields_fewer_batches_than_its_len_is_an_error():
    position = position_over(3, length=5)
    windows = position.windows(2)
    next(windows)
    with pytest.raises(ShortEpochError, match=r"yielded 3 batches in epoch 0 but its len\(\) is 5"):
        next(windows)


# ------------------------------------------------------------------------------------------ through the Trainer
@pytest.fixture
def deadline():
    """A hang (the bug this file guards against: an epoch re-entered forever) fails the test instead."""

    def expired(*_):
        raise TimeoutError("the Trainer did not return within 120 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_fit_stops_on_a_lying_loader_instead_of_repeating_the_epoch(tmp_path, deadline):
    def build_data(ctx):
        data = batchloader_recipe.build_data(ctx)
        make = data["loader"]

        return dict(data, loader=lambda dataset, **kw: LyingLoader(make(dataset, **kw)))

    recipe = types.SimpleNamespace(**{k: getattr(batchloader_recipe, k) for k in ("Args", "build_model", "loss")})
    recipe.build_data, recipe.name = build_data, "lying"
    t = Trainer.from_recipe(recipe, output_dir=str(tmp_path / "o"), num_train_epochs=2, quiet=True, disable_tqdm=True)
    with pytest.raises(ShortEpochError, match="len"):
        t.fit()


class LyingLoader:
    """Claims two batches more per epoch than it yields."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner) + 2

    def __iter__(self):
        return iter(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)


def test_data_options_apply_to_a_recipes_own_batch_loader(tmp_path):
    # 40 samples in global batches of 16: 3 batches per epoch, 2 with --dataloader_drop_last. Both options used to
    # be ignored for batch loaders (which got the whole dataset and no drop_last).
    common = dict(quiet=True, disable_tqdm=True, per_device_train_batch_size=16, max_train_samples=40)
    t = Trainer.from_recipe(batchloader_recipe, output_dir=str(tmp_path / "a"), **common)
    assert t.micro_batches_per_epoch == 3
    t = Trainer.from_recipe(batchloader_recipe, output_dir=str(tmp_path / "b"), dataloader_drop_last=True, **common)
    assert t.micro_batches_per_epoch == 2
    assert sum(len(b["x"]) for b in t.train_loader) == 32


def test_loader_workers_a_recipe_cannot_use_are_named_not_ignored(tmp_path, capsys):
    # A recipe that batches its data itself (the CIFAR recipe batches on the device) has no DataLoader to give
    # --dataloader_num_workers to; the flag was silently without effect.
    common = dict(disable_tqdm=True, per_device_train_batch_size=16, max_train_samples=40)
    Trainer.from_recipe(batchloader_recipe, output_dir=str(tmp_path / "a"), dataloader_num_workers=2, **common)
    out = capsys.readouterr().out
    assert "--dataloader_num_workers 2 does nothing here" in out and batchloader_recipe.__name__ in out
    Trainer.from_recipe(regression, output_dir=str(tmp_path / "b"), dataloader_num_workers=2, **common)
    assert "does nothing" not in capsys.readouterr().out  # a DataLoader: the workers read the data


def test_nan_skip_records_the_skipped_update(tmp_path):
    """A skipped update is an update: train_step returns its NaN loss (not the previous loss, and no IndexError
    when it is the first), and the logged grad_norm is not left over from an earlier update."""
    calls = {"n": 0}

    def loss(model, batch):  # NaN in the 1st and 3rd updates
        value, n = regression.loss(model, batch)
        calls["n"] += 1
        return (value * float("nan") if calls["n"] in (1, 3) else value), n

    recipe = types.SimpleNamespace(
        **{k: getattr(regression, k) for k in ("Args", "build_model", "build_data", "defaults")}
    )
    recipe.loss, recipe.name = loss, "nan_first"
    t = Trainer.from_recipe(recipe, output_dir=str(tmp_path / "o"), nan_policy="skip", quiet=True)
    before = [p.detach().clone() for p in t.model.parameters()]
    assert math.isnan(t.train_step())
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))  # nothing changed
    event = t.log()
    assert event["skipped_steps"] == 1 and event["step"] == 1 and "grad_norm" not in event
    assert math.isfinite(t.train_step())
    event = t.log()
    assert event["step"] == 2 and math.isfinite(event["grad_norm"]) and event["skipped_steps"] == 1
    assert math.isnan(t.train_step())  # not update 2's loss
    event = t.log()
    assert event["step"] == 3 and event["skipped_steps"] == 2 and "grad_norm" not in event  # not update 2's


def test_events_fire_in_order_and_evaluate_end_adds_metrics(tmp_path):
    t = Trainer.from_recipe(
        regression, output_dir=str(tmp_path / "o"), max_steps=4, save_steps=2, quiet=True, disable_tqdm=True
    )
    seen = []
    t.on("update_end", lambda tr: seen.append(("update_end", tr.global_step)))
    t.on("checkpoint_staged", lambda tr, folder: seen.append(("staged", os.path.basename(folder))))
    t.on("checkpoint_written", lambda tr, path: seen.append(("written", os.path.basename(path))))
    t.on("evaluate_end", lambda tr, m, final: seen.append(("evaluate_end", final)) or {"eval_extra": 1.0})
    t.on("fit_end", lambda tr, m: seen.append(("fit_end", sorted(m))))
    final = t.fit()
    assert seen[:5] == [
        ("update_end", 1),
        ("update_end", 2),
        ("staged", ".tmp_step_2"),
        ("written", "step_2"),
        ("update_end", 3),
    ]
    # After the last update: the final checkpoint and the model first (nothing after training can lose them),
    # then the final evaluation, then fit_end.
    assert seen[-4:] == [("staged", ".tmp_step_4"), ("written", "step_4"), ("evaluate_end", True),
                         ("fit_end", sorted(final))]  # fmt: skip
    assert final["eval_extra"] == 1.0 and "eval_rmse" in final  # ours and the recipe's on_evaluate_end
    with pytest.raises(ValueError, match="Unknown event 'update_start'"):
        t.on("update_start", print)


def test_nan_skip_logs_the_mean_of_the_finite_losses_of_a_window(tmp_path):
    """--nan_policy skip: a log row over updates some of which were skipped shows the mean of the finite losses
    only (not NaN, not a mean that counts the skipped ones)."""
    calls = {"n": 0}

    def loss(model, batch):  # NaN in the 1st and 3rd updates
        value, n = regression.loss(model, batch)
        calls["n"] += 1
        return (value * float("nan") if calls["n"] in (1, 3) else value), n

    recipe = types.SimpleNamespace(
        **{k: getattr(regression, k) for k in ("Args", "build_model", "build_data", "defaults")}
    )
    recipe.loss, recipe.name = loss, "nan_some"
    t = Trainer.from_recipe(recipe, output_dir=str(tmp_path / "o"), nan_policy="skip", quiet=True)
    losses = [t.train_step() for _ in range(4)]
    assert [math.isnan(v) for v in losses] == [True, False, True, False]
    event = t.log()
    assert event["step"] == 4 and event["skipped_steps"] == 2
    assert event["loss"] == pytest.approx((losses[1] + losses[3]) / 2, rel=1e-6)


@pytest.mark.parametrize("workers, pinned", [(0, False), (2, True)])
def test_on_a_gpu_machine_batches_are_pinned_by_the_workers_only(tmp_path, monkeypatch, workers, pinned):
    # Pinning pays where the DataLoader's pin thread does it beside the workers; without workers it would be one
    # more host copy of every batch on the training thread, before the copy to the GPU.
    from accel_trainer import TrainingArguments, loaders

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    prepared = []
    accelerator = types.SimpleNamespace(
        prepare_data_loader=lambda loader, device_placement: prepared.append(loader) or loader,
        device=torch.device("cpu"), num_processes=1, process_index=0,
    )  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path), dataloader_num_workers=workers)
    data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    loaders.build_loaders({"train": data, "eval": data}, args, accelerator, "pinned")
    assert [loader.pin_memory for loader in prepared] == [pinned, pinned]
