"""A tiny regression recipe: the smallest complete example of the recipe contract, and what the tests train.

    python recipes/regression.py --output_dir out/reg --max_steps 50
    accelerate launch recipes/regression.py --output_dir out/reg --max_steps 50

Each sample is a feature vector x and `num_targets` targets y, of which a mask selects the ones that count
(like the target tokens of a language model): with `--mask_prob > 0` every sample has its own number of
counted targets, so micro-batches carry different numbers of items. The loss is the mean squared error over
counted targets and returns that count, which the Trainer uses to weight micro-batches and ranks.

Data: synthetic from `--data_seed` (default), or JSON lines files via `datasets` with fields `x`, `y` and
optionally `mask` (`--train_file`, `--eval_file`).

It is also the recipe that shows every hook of the contract (docs/architecture.md): Args, defaults, configure,
build_model, build_data (with its collate), loss, eval_step, build_metrics, build_optimizer, build_scheduler, and
an event (on_evaluate_end). Every builder takes the read-only context `ctx` (accel_trainer.RecipeContext).
"""

import math
import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

from accel_trainer import UserError, load_metric


@dataclass
class Args:
    train_file: str | None = None  # JSON lines with x, y (and mask); default: synthetic data
    eval_file: str | None = None
    num_train_samples: int = 256  # synthetic train set size (samples)
    num_eval_samples: int = 64  # synthetic eval set size (samples)
    num_features: int = 16  # width of x
    num_targets: int = 4  # width of y
    hidden_size: int = 32  # MLP hidden width
    mask_prob: float = 0.0  # chance that a target is masked out (not counted) in the synthetic data
    noise: float = 0.1  # std of the noise added to synthetic targets
    dropout: float = 0.0  # dropout after the hidden layer
    data_seed: int = 0  # seed of the synthetic data (independent of --seed)
    global_batch_size: int | None = None  # samples per update, all processes; sets the per-device batch


# The recipe's own defaults for TrainingArguments fields (the Trainer's suit transformers, not this MLP).
defaults = {"learning_rate": 1e-2, "per_device_train_batch_size": 16, "num_train_epochs": 5, "logging_steps": 5}


def configure(ctx):
    """After parsing, before anything is built: --global_batch_size sets the per-device batch for this world
    size, unless the user also set --per_device_train_batch_size (ctx.given), which then wins."""
    args, targs = ctx.args, ctx.targs
    if args.global_batch_size is None or "per_device_train_batch_size" in ctx.given:
        return
    per_update = ctx.world_size * targs.gradient_accumulation_steps
    if args.global_batch_size % per_update:
        raise UserError(
            f"--global_batch_size {args.global_batch_size} does not split over {ctx.world_size} processes x "
            f"{targs.gradient_accumulation_steps} accumulation steps: pass a multiple of {per_update}."
        )
    targs.per_device_train_batch_size = args.global_batch_size // per_update


def build_model(ctx) -> nn.Module:
    args = ctx.args
    return nn.Sequential(
        nn.Linear(args.num_features, args.hidden_size),
        nn.Tanh(),
        nn.Dropout(args.dropout),
        nn.Linear(args.hidden_size, args.num_targets),
    )


def _synthetic(args: Args, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(args.num_features, args.num_targets, generator=torch.Generator().manual_seed(args.data_seed))
    x = torch.randn(n, args.num_features, generator=g)
    y = torch.tanh(x @ w) + args.noise * torch.randn(n, args.num_targets, generator=g)
    mask = (torch.rand(n, args.num_targets, generator=g) >= args.mask_prob).float()
    return {"x": x, "y": y, "mask": mask}


def _from_file(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Data file {path} does not exist. Pass --train_file/--eval_file with JSON lines "
            "holding x, y (and mask), or leave them out for synthetic data."
        )
    import datasets

    ds = datasets.load_dataset("json", data_files=path, split="train")
    if "mask" not in ds.column_names:
        ds = ds.map(lambda ex: {"mask": [1.0] * len(ex["y"])})
    return ds.with_format("torch", columns=["x", "y", "mask"])


class TensorDict(torch.utils.data.Dataset):
    def __init__(self, tensors: dict):
        self.tensors = tensors

    def __len__(self):
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}


def collate(examples: list[dict]) -> dict:
    return {k: torch.stack([torch.as_tensor(e[k]) for e in examples]) for k in examples[0]}


def build_data(ctx) -> dict:
    args = ctx.args
    if args.train_file:
        train = _from_file(args.train_file)
        evald = _from_file(args.eval_file) if args.eval_file else None
    else:
        train = TensorDict(_synthetic(args, args.num_train_samples, args.data_seed + 1))
        evald = (
            TensorDict(_synthetic(args, args.num_eval_samples, args.data_seed + 2)) if args.num_eval_samples else None
        )
    return {"train": train, "eval": evald, "collate": collate}


def loss(model, batch):
    err = (model(batch["x"].float()) - batch["y"].float()) ** 2 * batch["mask"]
    n = batch["mask"].sum()
    return err.sum() / n.clamp(min=1), n  # the mean over counted targets, and their count


def eval_step(model, batch):
    pred = model(batch["x"].float())
    err = (pred - batch["y"].float()) ** 2 * batch["mask"]
    # Per-sample sums and counts: exact eval_loss however samples fall into batches and ranks.
    return {
        "loss": err.sum(1),
        "n_items": batch["mask"].sum(1),
        "predictions": pred[:, 0],
        "references": batch["y"][:, 0].float(),
    }


def build_metrics(ctx) -> dict:
    return {"mse": load_metric("mse")}


def build_optimizer(model, ctx):
    # Plain AdamW over every parameter: the Trainer's default also exempts biases from weight decay.
    t = ctx.targs
    return torch.optim.AdamW(
        model.parameters(), lr=ctx.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon,
        weight_decay=t.weight_decay,
    )  # fmt: skip


def build_scheduler(optimizer, ctx):
    # The Trainer's own default (--lr_scheduler_type, --warmup_steps/ratio), called here to show where a recipe builds
    # its own schedule (e.g. torch.optim.lr_scheduler.OneCycleLR). ctx.num_training_steps: the optimizer updates of
    # the whole run, known once the data is built.
    from accel_trainer.optim import default_scheduler

    return default_scheduler(optimizer, ctx.num_training_steps, ctx.targs)


def on_evaluate_end(trainer, metrics, final) -> dict | None:
    """An event: runs after every evaluation; what it returns is logged with the evaluation's metrics."""
    if "eval_mse" in metrics:
        return {"eval_rmse": math.sqrt(metrics["eval_mse"])}
    return None


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
