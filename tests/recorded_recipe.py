"""Any shipped recipe, recording what each rank trains on: `python tests/recorded_recipe.py <recipe> ARGS...` runs
recipes/<recipe>.py with ARGS. With RECORD_DIR set, every rank appends one line per optimizer update to
RECORD_DIR/rank<R>.txt: `step epoch <ids of micro-batch 1> | <ids of micro-batch 2> ...`, where a sample's id is
a hash of its rows in every tensor of the batch (a packed block of tokens, an image, a sentence pair). A resumed
run appends to the same file; a later line of a step replaces the earlier one (see `read_records`).
STEP_DELAY=<seconds> slows every update down (a test's window to kill the run); it changes no number."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample_ids(batch) -> list[str]:
    tensors = [batch[k] for k in sorted(batch)] if isinstance(batch, dict) else list(batch)
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.ndim >= 1]
    n = len(tensors[0])
    ids = []
    for i in range(n):
        h = hashlib.sha1()
        for t in tensors:
            if len(t) == n:
                h.update(t[i].detach().cpu().contiguous().numpy().tobytes())
        ids.append(h.hexdigest()[:12])
    return ids


def read_records(path) -> dict[int, tuple[int, list[list[str]]]]:
    """{step: (epoch, [ids of each micro-batch])}; the last line of a step wins (a resumed run re-did it)."""
    out = {}
    with open(path) as f:
        for line in f:
            step, epoch, *ids = line.split(" ", 2)
            batches = [b.split() for b in ids[0].split("|")] if ids else []
            out[int(step)] = (int(epoch), batches)
    return out


def recorded(recipe):
    """The recipe with its loss recording the ids of each micro-batch and an update_end handler writing them."""
    record_dir, delay = os.environ.get("RECORD_DIR"), float(os.environ.get("STEP_DELAY", "0"))
    pending: list[list[str]] = []
    epoch = [0]  # the epoch the next window comes from (trainer.epoch after an epoch's last window is the next one)

    def on_fit_start(trainer):
        epoch[0] = trainer.epoch

    def loss(model, batch):
        if (
            torch.is_grad_enabled()
        ):  # not the recipe check's no_grad call (accel_trainer/preflight.py): it trains nothing
            pending.append(sample_ids(batch))
        return recipe.loss(model, batch)

    def on_update_end(trainer):
        if record_dir:
            path = os.path.join(record_dir, f"rank{trainer.accelerator.process_index}.txt")
            with open(path, "a") as f:
                f.write(f"{trainer.global_step} {epoch[0]} " + " | ".join(" ".join(b) for b in pending) + "\n")
        pending.clear()
        epoch[0] = trainer.epoch
        if delay:
            time.sleep(delay)

    events = dict(recipe.events)
    for name, handler in (("fit_start", on_fit_start), ("update_end", on_update_end)):
        inner = events.get(name)
        events[name] = (lambda t, inner=inner, handler=handler: (inner(t), handler(t))) if inner else handler
    return dataclasses.replace(recipe, loss=loss, events=events)


if __name__ == "__main__":
    from accel_trainer import run
    from accel_trainer.recipe import load_recipe

    name = sys.argv.pop(1)
    run(recorded(load_recipe(os.path.join(REPO, "recipes", f"{name}.py"))))
