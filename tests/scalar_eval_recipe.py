"""The regression recipe with an `eval_step` that returns one loss for the batch (its mean over the counted
targets) and the count, as a recipe written for one process does, with predictions for the metrics. eval_loss
must still be exact on any world size, where Accelerate pads the last batches with repeated samples."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from regression import (  # noqa: E402,F401
    Args,
    build_data,
    build_metrics,
    build_model,
    build_optimizer,
    build_scheduler,
    configure,
    defaults,
    loss,
)

name = "regression_scalar_eval"


def eval_step(model, batch):
    mean, n = loss(model, batch)
    return {
        "loss": mean,
        "n_items": n,
        "predictions": model(batch["x"].float())[:, 0],
        "references": batch["y"][:, 0].float(),
    }


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
