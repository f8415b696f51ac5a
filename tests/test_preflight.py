"""A recipe is checked on its first batch before the first update (accel_trainer/preflight.py): a loss or eval_step
that breaks the contract, or a metric that cannot take eval_step's predictions, is one line naming the hook, what
it returned and what is expected, on every rank, before any weight changes; a bare 0-d loss is accepted, weighed by
the batch's sample count, with the same numbers as (loss, batch size)."""

import json
import os
import re

import pytest
import torch
from helpers import run, weights

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

TESTS = os.path.dirname(os.path.abspath(__file__))
RECIPE = os.path.join(TESTS, "preflight_recipe.py")
SHORT = ["--max_steps", "4", "--disable_tqdm", "--logging_steps", "1"]


def rows(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(r) for r in path.read_text().splitlines()] if path.exists() else []


def refused(proc, out) -> str:
    """The one line of a run refused before its first update (no update row, no model), as every rank printed it."""
    # (no frame of ours or the recipe's; a launcher reports its failed workers with a traceback of its own)
    assert proc.returncode != 0 and not re.search(r'File ".*(accel_trainer|tests)/', proc.stderr), proc.stderr[-3000:]
    lines = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
    assert len(lines) == 1, proc.stderr[-3000:]
    assert not [r for r in rows(out) if "loss" in r] and not (out / "model.safetensors").exists()
    return lines.pop()


@pytest.mark.parametrize(
    "mode, message",
    [
        ("vector", "error: loss must return (mean loss, number of items); got a tensor of shape [16]: "),
        ("triple", "error: loss must return (mean loss, number of items); got a tuple of 3: (a 0-d tensor, an int, "),
        ("float", "error: loss must return (mean loss, number of items); its first element is a float: "),
        ("eval_keys", "error: eval_step must return a dict with 'loss' and 'n_items' "),
    ],
)
def test_a_hook_that_breaks_the_contract_is_one_line_before_the_first_update(tmp_path, mode, message):
    out = tmp_path / "o"
    line = refused(run(RECIPE, ["--output_dir", out, "--mode", mode] + SHORT, check=False), out)
    assert line.startswith(message), line
    if mode == "eval_keys":
        assert "got the keys ['labels', 'logits']" in line, line


def test_per_token_predictions_with_accuracy_are_refused_before_the_first_update(tmp_path):
    # The run: [batch, tokens] predictions with the built-in accuracy trained all its updates, then died at
    # the final evaluation. Now: refused before the first update, naming the metric and the shapes.
    out = tmp_path / "o"
    script = os.path.join(TESTS, "token_accuracy_recipe.py")
    line = refused(run(script, ["--output_dir", out, "--num_train_epochs", "1", "--disable_tqdm"], check=False), out)
    assert line.startswith("error: metric 'accuracy' cannot take eval_step's predictions of shape [16, 4] and "
                           "references of shape [16, 4] (ValueError: Predictions and/or references"), line  # fmt: skip


def test_a_refusal_stops_every_rank_of_two(tmp_path):
    out = tmp_path / "o"
    script = os.path.join(TESTS, "token_accuracy_recipe.py")
    args = ["--output_dir", out, "--num_train_epochs", "1", "--disable_tqdm"]
    line = refused(run(script, args, nproc=2, check=False, timeout=300), out)
    assert line.startswith("error: metric 'accuracy' cannot take eval_step's predictions of shape [16, 4]"), line
    # A hook that fails on one rank only: the other rank stops too (it does not wait in the first update's
    # all-reduce), with the same line naming the failing rank.
    out = tmp_path / "one_rank"
    args = ["--output_dir", out, "--mode", "vector_on_rank1"] + SHORT
    line = refused(run(RECIPE, args, nproc=2, check=False, timeout=300), out)
    assert line.startswith("error: loss must return (mean loss, number of items); got a tensor of shape [16]"), line
    assert line.endswith("(on rank 1)"), line


def test_a_bare_loss_is_weighed_by_sample_count_like_loss_and_batch_size(tmp_path):
    # Accumulation weighs micro-batches by their counts, evaluation spreads a mean loss over the batch's samples: the
    # bare loss must give exactly the numbers of (loss, batch size). 100 samples, batches of 16: the last is 4.
    runs = {}
    # eval_step gives no loss here: evaluation takes it from `loss` too.
    for mode in ("explicit_preds", "bare_preds"):
        out = tmp_path / mode
        args = ["--output_dir", out, "--mode", mode, "--num_train_samples", "100", "--num_train_epochs", "1"]
        proc = run(RECIPE, args + ["--gradient_accumulation_steps", "2", "--logging_steps", "1", "--disable_tqdm"])
        runs[mode] = (rows(out), weights(out))
        notes = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "bare 0-d" in line]
        assert len(notes) == (mode == "bare_preds"), proc.stdout[-2000:]
    keys = ("step", "loss", "grad_norm", "eval_loss", "eval_samples")
    (explicit, w_explicit), (bare, w_bare) = runs["explicit_preds"], runs["bare_preds"]
    assert [{k: r.get(k) for k in keys} for r in bare] == [{k: r.get(k) for k in keys} for r in explicit]
    assert any("eval_loss" in r for r in bare) and len([r for r in bare if "loss" in r]) == 4
    assert all(torch.equal(w_bare[k], w_explicit[k]) for k in w_explicit)


def test_the_check_leaves_a_good_runs_numbers_bit_identical(tmp_path):
    # Dropout draws random numbers and batch-norm statistics move in the check's train-mode forward: the RNG states
    # and the buffers are restored, so the run is the run without the check (ACCEL_TRAINER_RECIPE_CHECK=0).
    runs = {}
    for check in ("1", "0"):
        out = tmp_path / check
        args = ["--output_dir", out, "--dropout", "0.3", "--batch_norm"] + SHORT
        run(RECIPE, args, extra_env={"ACCEL_TRAINER_RECIPE_CHECK": check})
        runs[check] = ([r["loss"] for r in rows(out) if "loss" in r], weights(out))
    assert runs["1"][0] == runs["0"][0]
    assert all(torch.equal(runs["1"][1][k], runs["0"][1][k]) for k in runs["0"][1])


def test_a_model_that_cannot_train_on_the_epochs_last_single_sample_is_refused_before_the_first_update(tmp_path):
    # BatchNorm over [batch, features] raises on one sample in train mode; 33 samples in batches of 16 end each
    # epoch with one (on 2 processes: rank 0's, after Accelerate's repeats are cut off). Without the check: a
    # traceback at update 3, an epoch into the run.
    bn = ["--batch_norm", "--num_train_samples", "33", "--per_device_train_batch_size", "16"] + SHORT
    expected = (
        "error: the last training batch of each epoch holds 1 sample{}, and loss fails on one sample (ValueError: "
        "Expected more than 1 value per channel when training"
    )
    for nproc, where in ((1, ""), (2, " on rank 0")):
        out = tmp_path / f"o{nproc}"
        line = refused(run(RECIPE, ["--output_dir", out] + bn, nproc=nproc, check=False, timeout=300), out)
        assert line.startswith(expected.format(where)) and line.endswith(
            ": pass --dataloader_drop_last, or a --per_device_train_batch_size or --max_train_samples that leaves "
            "more than one."
        ), line
    out = tmp_path / "dropped"
    run(RECIPE, ["--output_dir", out, "--dataloader_drop_last"] + bn)  # the fix it names trains
    assert [r["step"] for r in rows(out) if "loss" in r] == [1, 2, 3, 4]
