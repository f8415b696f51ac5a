"""fit() after a notebook's debugging updates (train_step, overfit_batch) trains the whole run from the state the
Trainer was built with, as the README's cell order expects: debug, then fit.

Those updates are real ones (they move the weights, the optimizer, the schedule and the step count), so without
this fit() would continue from the overfit model and, past the run length, train nothing and return its metrics.
The first debugging update keeps a copy of everything an update changes (in host memory: a notebook-sized model);
fit() puts it back and says so in one line. A run resumed from a checkpoint rewinds to that checkpoint's state.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _cpu_copy(state):
    """A deep copy of a state dict with its tensors on the host (the live ones are updated in place)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _cpu_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu_copy(v) for v in state)
    return copy.deepcopy(state)


class DebugStart:
    """The Trainer's state before its first debugging update; `rewind` puts it back before fit()."""

    def __init__(self):
        self.saved: dict | None = None
        self.updates = 0

    def before_update(self, trainer):
        """Called by train_step (overfit_batch too) before its update."""
        self.updates += 1
        if self.saved is not None:
            return
        acc = trainer.accelerator
        self.saved = {
            "model": _cpu_copy(trainer.unwrapped_model.state_dict()),
            "optimizer": _cpu_copy(trainer.optimizer.state_dict()),
            "scheduler": _cpu_copy(trainer.scheduler.state_dict()),
            "scaler": _cpu_copy(acc.scaler.state_dict()) if acc.scaler is not None else None,
            "ema": _cpu_copy(trainer.ema.state_dict()) if trainer.ema is not None else None,
            "progress": trainer.progress.state_dict(),
            "data": _cpu_copy(trainer.data.state_dict()),
            "items_per_rank": trainer.updater.reference,  # K of update.py; None until the first DDP update
            "rng": _rng_state(),
        }

    def rewind(self, trainer):
        """Before fit(): the state before the debugging updates, if there were any; says so in one line."""
        if self.saved is None:
            return
        s, n = self.saved, self.updates
        self.saved, self.updates = None, 0
        trainer.unwrapped_model.load_state_dict(s["model"])
        trainer.optimizer.load_state_dict(s["optimizer"])
        trainer.scheduler.load_state_dict(s["scheduler"])
        if s["scaler"] is not None:
            trainer.accelerator.scaler.load_state_dict(s["scaler"])
        if s["ema"] is not None:
            trainer.ema.load_state_dict(s["ema"])
        trainer.progress.load_state_dict(s["progress"])
        trainer.data.load_state_dict(s["data"])
        trainer.updater.reference = s["items_per_rank"]
        _set_rng_state(s["rng"])
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer._train_iter = None  # fetch_batch's position
        trainer.log_window.clear()  # the debug updates' rows
        trainer.reporter.print(
            f"fit(): the {n} debugging update(s) (train_step, overfit_batch) are undone; training starts from the "
            f"state the Trainer was built with (step {trainer.global_step})."
        )
