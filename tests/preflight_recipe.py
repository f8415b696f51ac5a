"""The regression recipe with the recipe-contract mistakes a new user makes (`--mode`), for tests/test_preflight.py:
a bare 0-d loss (`return out.loss`), a loss of the wrong kind, an eval_step with other keys. `--mode explicit` is the
bare loss's explicit form, (mean, batch size); `--batch_norm` adds a BatchNorm layer (its statistics move in a
train-mode forward) to the model, which has dropout with `--dropout`."""

import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import regression  # noqa: E402
from regression import build_data, defaults  # noqa: E402,F401

name = "regression"


@dataclass
class Args(regression.Args):
    mode: str = "explicit"  # explicit | bare | explicit_preds | bare_preds (eval_step without a loss) | vector | vector_on_rank1 | triple | float | eval_keys
    batch_norm: bool = False


_mode = "explicit"  # --mode, set by configure (loss and eval_step see no arguments)


def configure(ctx):
    global _mode
    _mode = ctx.args.mode
    regression.configure(ctx)


def build_model(ctx):
    model = regression.build_model(ctx)
    return nn.Sequential(nn.BatchNorm1d(ctx.args.num_features), model) if ctx.args.batch_norm else model


def loss(model, batch):
    err = (model(batch["x"].float()) - batch["y"].float()) ** 2
    mean = err.mean()
    if _mode.startswith("bare"):
        return mean
    if _mode == "vector" or (_mode == "vector_on_rank1" and ctx_rank() == 1):
        return err.mean(1)
    if _mode == "triple":
        return mean, len(batch["x"]), {}
    if _mode == "float":
        return mean.item(), len(batch["x"])
    return mean, len(batch["x"])


def ctx_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def eval_step(model, batch):
    pred = model(batch["x"].float())
    err = ((pred - batch["y"].float()) ** 2).mean(1)
    if _mode == "eval_keys":
        return {"logits": pred, "labels": batch["y"]}
    if _mode.endswith("_preds"):  # no loss: evaluation takes it from `loss`
        return {"predictions": pred[:, 0], "references": batch["y"][:, 0]}
    return {"loss": err, "n_items": torch.ones_like(err), "predictions": pred[:, 0], "references": batch["y"][:, 0]}


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
