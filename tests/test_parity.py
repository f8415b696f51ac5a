"""Gradient accumulation and world size do not change the numbers: real launches, world size asserted.

1 process x batch 16 x accumulation 1 == 1 process x batch 8 x accumulation 2 == 2 processes x batch 4 x
accumulation 2, with a loss whose item count varies per micro-batch (masked targets). A trainer that averaged
per-micro-batch means (the 2024 transformers bug) or per-rank means fails this. 250 samples leave a last global
batch of 10: on 2 processes Accelerate fills rank 0's last micro-batch (2 samples) and rank 1's (none) up with
repeats of the epoch's first samples, which a trainer that trained on them would weigh as items.
"""

import pytest
from helpers import assert_same_weights, metrics, run, run_config, weights

# 250 samples / global batch 16 = 16 updates per epoch, the last of 10 samples: 20 updates cross an epoch boundary.
COMMON = [
    "--num_train_samples",
    "250",
    "--mask_prob",
    "0.5",
    "--max_steps",
    "20",
    "--logging_steps",
    "1",
    "--learning_rate",
    "0.05",
    "--lr_scheduler_type",
    "linear",
    "--warmup_steps",
    "3",
    "--num_eval_samples",
    "37",
    "--per_device_eval_batch_size",
    "4",
    "--eval_steps",
    "6",
    "--save_steps",
    "0",
    "--disable_tqdm",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, nproc, bs, acc in (("1x16x1", 1, 16, 1), ("1x8x2", 1, 8, 2), ("2x4x2", 2, 4, 2)):
        d = str(tmp_path_factory.mktemp(name))
        proc = run(
            "regression.py",
            ["--output_dir", d, "--per_device_train_batch_size", bs, "--gradient_accumulation_steps", acc] + COMMON,
            nproc=nproc,
        )
        out[name] = (d, proc)
    return out


@pytest.mark.slow
def test_world_size_is_what_was_launched(runs):
    for name, (d, _) in runs.items():
        assert run_config(d)["num_processes"] == int(name[0])
        assert run_config(d)["global_train_batch_size"] == 16


@pytest.mark.slow
def test_final_weights_equal_across_accumulation_and_world_size(runs):
    ref = weights(runs["1x16x1"][0])
    assert_same_weights(weights(runs["1x8x2"][0]), ref)
    assert_same_weights(weights(runs["2x4x2"][0]), ref)


@pytest.mark.slow
def test_logged_loss_is_the_global_item_weighted_mean(runs):
    ref = [m["loss"] for m in metrics(runs["1x16x1"][0]) if "loss" in m]
    for name in ("1x8x2", "2x4x2"):
        got = [m["loss"] for m in metrics(runs[name][0]) if "loss" in m]
        assert got == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
def test_scheduler_steps_once_per_update_on_any_world_size(runs):
    def lrs(d):
        return [(m["step"], m["learning_rate"]) for m in metrics(d) if "learning_rate" in m]

    ref = lrs(runs["1x16x1"][0])
    assert [s for s, _ in ref] == list(range(1, 21))
    assert ref[2][1] == pytest.approx(0.05)  # end of warm-up (3 updates) at the peak
    got = lrs(runs["2x4x2"][0])
    # Same update numbers, same rates (pytest.approx takes flat sequences only, not a list of tuples).
    assert [s for s, _ in got] == [s for s, _ in ref]
    assert [lr for _, lr in got] == pytest.approx([lr for _, lr in ref])


@pytest.mark.slow
def test_eval_counts_every_sample_once(runs):
    # 37 samples over 2 ranks x batch 4: Accelerate pads the last batches with repeats; none may count.
    evals = {name: [m for m in metrics(d) if "eval_loss" in m] for name, (d, _) in runs.items()}
    for name, ev in evals.items():
        assert [m["eval_samples"] for m in ev] == [37, 37, 37, 37], name  # steps 6, 12, 18, 20
    for a, b in zip(evals["2x4x2"], evals["1x16x1"]):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
        assert a["eval_mse"] == pytest.approx(b["eval_mse"], rel=1e-5)


@pytest.mark.slow
def test_only_the_main_process_prints_and_logs(runs):
    d, proc = runs["2x4x2"]
    steps = [m["step"] for m in metrics(d) if "loss" in m]
    assert steps == list(range(1, 21))  # each log event once, not once per rank
    printed = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith("step=") and "loss=" in line and "eval_loss" not in line
    ]
    assert len(printed) == 20


NOTEBOOK = """
import json, sys
sys.path.insert(0, {recipes!r})
import regression
from accelerate import notebook_launcher
from accel_trainer import Trainer, TrainingArguments

def train(out):
    Trainer(regression, TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=8,
            save_steps=0, disable_tqdm=True), regression.Args()).fit()

notebook_launcher(train, args=({out!r},), num_processes=2)
"""


@pytest.mark.slow
def test_notebook_launcher_forms_a_world_of_two(tmp_path):
    import subprocess
    import sys

    from helpers import RECIPES, env

    out = str(tmp_path / "nb")
    proc = subprocess.run(
        [sys.executable, "-c", NOTEBOOK.format(recipes=RECIPES, out=out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_config(out)["num_processes"] == 2
    # the recipe's logging_steps (5) applies in a notebook as on the command line, and the last update is logged
    assert [m["step"] for m in metrics(out) if "loss" in m] == [5, 6]


@pytest.mark.slow
def test_fp16_comm_hook_with_many_items_per_window_stays_finite(tmp_path):
    # --ddp_comm_hook fp16 casts each rank's gradient to fp16 before the all-reduce. With a summed loss (mean x
    # items) that gradient is item-count times too large: 2 x 256 samples x 4 targets = 2048 items per rank and a
    # mean gradient ~200 (targets near 100) give ~4e5, above fp16's 65504 -> inf. The communicated gradient must
    # be of mean size, and the run close to the same run without compression.
    import json

    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3072, 16, generator=g)
    y = 100 + torch.tanh(x @ torch.randn(16, 4, generator=g))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"x": a, "y": b}) + "\n" for a, b in zip(x.tolist(), y.tolist())))
    args = ["--train_file", data, "--per_device_train_batch_size", 256, "--gradient_accumulation_steps", 2,
            "--max_steps", 3, "--logging_steps", 1, "--learning_rate", 0.01, "--save_steps", 0, "--disable_tqdm"]  # fmt: skip
    out = {}
    for hook in ("none", "fp16"):
        out[hook] = tmp_path / hook
        run("regression.py", args + ["--output_dir", out[hook], "--ddp_comm_hook", hook], nproc=2)
        assert run_config(out[hook])["num_processes"] == 2
    rows = {h: [m for m in metrics(o) if "loss" in m] for h, o in out.items()}
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows["fp16"])
    # fp16 keeps ~3 significant digits of each gradient coordinate
    assert [r["grad_norm"] for r in rows["fp16"]] == pytest.approx([r["grad_norm"] for r in rows["none"]], rel=1e-3)
    assert_same_weights(weights(out["fp16"]), weights(out["none"]), rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_eval_loss_of_a_scalar_eval_step_is_exact_on_two_processes(tmp_path):
    # An eval_step returning the batch's mean loss: on 2 processes Accelerate completes the last batches with
    # repeated samples (37 = 4 + 4 + ... + 5 over 2 x 4); their losses must not leak into eval_loss.
    import os

    recipe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scalar_eval_recipe.py")
    args = ["--mask_prob", "0.5", "--max_steps", "4", "--eval_steps", "2", "--num_eval_samples", "37"]
    args += ["--per_device_eval_batch_size", "4", "--save_steps", "0", "--disable_tqdm"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(recipe, ["--output_dir", one, "--per_device_train_batch_size", "16"] + args, nproc=1)
    run(recipe, ["--output_dir", two, "--per_device_train_batch_size", "8"] + args, nproc=2)
    assert run_config(two)["num_processes"] == 2
    ev1, ev2 = ([m for m in metrics(d) if "eval_loss" in m] for d in (one, two))
    assert [m["eval_samples"] for m in ev2] == [37, 37] and len(ev1) == 2
    for a, b in zip(ev1, ev2):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
        assert b["eval_mse"] == pytest.approx(a["eval_mse"], rel=1e-5)


@pytest.mark.parametrize("n", [1, 3, 5, 16, 17, 33, 250])
@pytest.mark.parametrize("ranks,batch", [(1, 4), (2, 4), (2, 16), (3, 4), (4, 3)])
def test_the_samples_in_each_ranks_last_batch_are_where_accelerate_puts_them(n, ranks, batch):
    """loaders.last_batch_rows, the arithmetic that keeps Accelerate's repeats out of the last update, against the
    batches Accelerate's prepare_data_loader gives each rank: the epoch's last global batch lays its real samples
    end to end over the ranks' last batches, rank 0's first (a sample i at row j of rank r is i = first + r*b + j),
    then repeats of the epoch's first samples; the real ones are the leading rows, as many as it says."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from accel_trainer.loaders import last_batch_rows

    data = list(range(n))
    got, seen = [], []
    for rank in range(ranks):
        loader = prepare_data_loader(DataLoader(data, batch_size=batch), num_processes=ranks, process_index=rank)
        batches = [b.tolist() for b in loader]
        first = (len(batches) - 1) * ranks * batch  # the first sample of the epoch's last global batch
        real = [i == first + rank * batch + j for j, i in enumerate(batches[-1])]
        assert real == sorted(real, reverse=True)  # the real samples lead
        got.append(last_batch_rows(loader))
        seen.append(sum(real))
    expected = None if all(k == batch for k in seen) else seen
    assert got == [expected] * ranks


TEXT_RECIPE = """
import sys

import datasets
import torch
from torch import nn

defaults = {"learning_rate": 0.01, "lr_scheduler_type": "constant", "weight_decay": 0.0}


def build_model(ctx):
    torch.manual_seed(0)
    return nn.EmbeddingBag(256, 1, mode="sum", padding_idx=0)  # a sample's output does not depend on its padding


def build_data(ctx):  # a text column that loss tokenizes itself, no collate: each batch holds a list of strings
    texts = [f"sample {i} " + "ab" * (i % 5) for i in range(37)]
    return {"train": datasets.Dataset.from_dict({"text": texts, "label": [float(i % 3) for i in range(37)]})}


def loss(model, batch):
    ids = nn.utils.rnn.pad_sequence([torch.tensor(list(t.encode())) for t in batch["text"]], batch_first=True)
    y = torch.as_tensor(batch["label"]).float()
    return nn.functional.mse_loss(model(ids).squeeze(1), y), len(y)


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
"""


@pytest.mark.slow
def test_a_batch_with_a_text_column_trains_and_its_last_batch_is_cut_like_its_tensors(tmp_path):
    """A batch {"text": [strings], "label": tensor} (a datasets column the loss tokenizes itself): the sample count
    is the label's, not Accelerate's find_batch_size's TypeError on the strings, and the last batch of an epoch
    (37 samples, global batch 16) is cut to its real samples in both columns, so 2 processes give 1 process's
    weights and losses."""
    script = tmp_path / "text_column.py"
    script.write_text(TEXT_RECIPE)
    args = ["--max_steps", "6", "--logging_steps", "1", "--save_steps", "0", "--disable_tqdm"]
    for nproc, batch in ((1, 16), (2, 8)):
        run(str(script), ["--output_dir", tmp_path / str(nproc), "--per_device_train_batch_size", batch] + args,
            nproc=nproc, timeout=300)  # fmt: skip
        assert run_config(tmp_path / str(nproc))["num_processes"] == nproc
    assert_same_weights(weights(tmp_path / "2"), weights(tmp_path / "1"))
    losses = [[r["loss"] for r in metrics(tmp_path / str(n)) if "loss" in r] for n in (1, 2)]
    assert len(losses[0]) == 6 and losses[1] == pytest.approx(losses[0], rel=1e-5)
