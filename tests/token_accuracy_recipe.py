"""The regression recipe as a new user might adapt it for per-token classification: its eval_step returns
predictions and references of shape [batch, tokens] (one per target), and build_metrics asks for the built-in
`accuracy`, which takes one value per sample. Training works; the metric fails at the first evaluation.
`--flatten` is the fix: one row per token."""

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import regression  # noqa: E402
from regression import build_data, build_model, configure, defaults, loss  # noqa: E402,F401

from accel_trainer import load_metric  # noqa: E402

name = "regression"


@dataclass
class Args(regression.Args):
    flatten: bool = False  # one prediction per token (what accuracy takes) instead of [batch, tokens]


def eval_step(model, batch):
    out = regression.eval_step(model, batch)
    pred = model(batch["x"].float())
    predictions, references = (pred > 0).long(), (batch["y"] > 0).long()  # [batch, tokens]
    if _flatten:
        predictions, references = predictions.flatten(), references.flatten()
    return dict(out, predictions=predictions, references=references)


_flatten = False  # --flatten, set by build_metrics (eval_step sees no arguments)


def build_metrics(ctx):
    global _flatten
    _flatten = ctx.args.flatten
    return {"accuracy": load_metric("accuracy")}


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
