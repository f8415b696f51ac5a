"""A recipe's own batch loader (data on the device, sharded by the recipe) goes through the same Trainer:
eval counts every sample once on 2 processes even when ranks hold shards of different sizes."""

import os

import pytest
from helpers import flags, metrics, run, run_config

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batchloader_recipe.py")
ARGS = flags(max_steps=6, num_eval_samples=37, per_device_eval_batch_size=4, disable_tqdm=True, eval_steps=3)


def test_batch_loader_eval_exact_on_two_processes(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(RECIPE, ["--output_dir", one, "--per_device_train_batch_size", "16"] + ARGS, nproc=1)
    run(RECIPE, ["--output_dir", two, "--per_device_train_batch_size", "8"] + ARGS, nproc=2)
    assert run_config(two)["num_processes"] == 2
    ev1 = [m for m in metrics(one) if "eval_loss" in m]
    ev2 = [m for m in metrics(two) if "eval_loss" in m]
    assert [m["eval_samples"] for m in ev2] == [37, 37]
    for a, b in zip(ev1, ev2):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
