"""What a new user meets in the first hour (issue 40, item 4): each case run as a user runs it, with a recipe written
the way people write them. Every test here failed before its fix."""

import pytest
from helpers import metrics, run

RUN_IT = """
if __name__ == "__main__":
    import sys

    from accel_trainer import run

    run(sys.modules[__name__])
"""


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


IMAGES = """
import datasets
import PIL.Image
import torch
from torch import nn

# A dataset of PIL images as `datasets` gives them (CIFAR-10's `img` column), handed over without a transform.
images = [PIL.Image.new("RGB", (4, 4), (i, 0, 0)) for i in range(32)]
data = datasets.Dataset.from_dict({"img": images, "label": [i % 10 for i in range(32)]})


def build_model(ctx):
    return nn.Linear(48, 10)


def build_data(ctx):
    return {"train": data}


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch["img"].flatten(1)), batch["label"]), len(batch["label"])
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_pil_images_without_a_transform_are_one_line_naming_the_transform(workers, tmp_path):
    """Before: torch's default collate failed in a 63-line traceback ("batch must contain tensors, numpy arrays,
    numbers, dicts or lists; found <class 'PIL.PngImagePlugin.PngImageFile'>")."""
    recipe = tmp_path / "pictures.py"
    recipe.write_text(IMAGES + RUN_IT)
    args = ["--output_dir", tmp_path / "o", "--dataloader_num_workers", workers, "--disable_tqdm"]
    proc = run(str(recipe), args, check=False, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = error_lines(proc)
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr
    assert errors[0].startswith("error: Recipe pictures: its samples hold PIL images (PIL."), errors[0]
    assert "with_transform" in errors[0] and "AutoImageProcessor" in errors[0], errors[0]
    assert not (tmp_path / "o" / "model.safetensors").exists()


SORTED = """
import torch
from torch import nn

# An eval split sorted by label, as CIFAR-10's test split is: 10 labels x 20 samples.
x = torch.zeros(200, 1)
y = torch.arange(200).div(20, rounding_mode="floor").float().unsqueeze(1)
data = torch.utils.data.TensorDataset(x, y)


def build_model(ctx):
    return nn.Linear(1, 1)


def build_data(ctx):
    return {"train": data, "eval": data}


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y), len(x)
"""


def test_max_eval_samples_draws_from_the_whole_split_the_same_on_any_world_size(tmp_path):
    """--max_eval_samples took the first N: of a label-sorted split, the first label alone (CIFAR-10's test split:
    all airplanes, accuracy 0.0). It draws N with --seed, the same N on 1 and 2 processes and in every evaluation."""
    recipe = tmp_path / "sorted_eval.py"
    recipe.write_text(SORTED + RUN_IT)
    common = ["--max_eval_samples", 20, "--learning_rate", 0, "--max_steps", 2, "--eval_steps", 1, "--save_steps", 0]
    common += ["--disable_tqdm", "--per_device_eval_batch_size", 3, "--seed", 7]
    evals = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        batch = ["--per_device_train_batch_size", 8 // world]
        run(str(recipe), ["--output_dir", out] + common + batch, nproc=world, timeout=300)
        evals[world] = [(r["eval_samples"], r["eval_loss"]) for r in metrics(str(out)) if "eval_loss" in r]
    assert len(evals[1]) == len(evals[2]) == 2, evals  # after update 1, and the final one
    assert evals[2] == [(n, pytest.approx(loss, rel=1e-6)) for n, loss in evals[1]], evals
    samples, eval_loss = evals[1][0]
    # The model predicts its bias, the same for every sample: the eval loss is the spread of the drawn labels
    # around it. The first 20 samples are all label 0 (a loss near 0); a draw over the ten labels spreads over them.
    assert samples == 20 and eval_loss > 2.0, evals
    assert all(e == evals[1][0] for e in evals[1]), evals  # every evaluation the same samples
