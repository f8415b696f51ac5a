"""The regression recipe with sample ids: every rank appends the ids of each micro-batch it trains on to
<record_dir>/rank<R>.txt, one line per micro-batch, so a test can see which samples each update used."""

import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import regression  # noqa: E402
from regression import build_metrics, configure, defaults, eval_step  # noqa: E402,F401

name = "regression"


@dataclass
class Args(regression.Args):
    record_dir: str = ""  # where each rank writes the ids it trains on


def build_model(ctx):
    model = regression.build_model(ctx)
    model.record_file = (
        os.path.join(ctx.args.record_dir, f"rank{ctx.process_index}.txt") if ctx.args.record_dir else None
    )
    return model


def build_data(ctx):
    data = regression.build_data(ctx)
    train = data["train"]
    data["train"] = regression.TensorDict(dict(train.tensors, idx=torch.arange(len(train))))
    return data


def loss(model, batch):
    plain = getattr(model, "module", model)
    if plain.record_file and torch.is_grad_enabled():  # not the recipe check's no_grad call: it trains nothing
        with open(plain.record_file, "a") as f:
            f.write(" ".join(str(i) for i in batch["idx"].tolist()) + "\n")
    return regression.loss(model, batch)


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
