"""The log window: the updates since the last metrics row, and the row made of them.

A row is the loop's only host sync: the window's losses (and, with --nan_policy stop, the gradient norms it checks)
are read in one call (throughput.host_floats). With --nan_policy stop the window also keeps which batch each update
saw (nan_batch.Tracker), so that the first non-finite update stops the run with one line naming its batch.
"""

from __future__ import annotations

import math

from . import nan_batch
from .errors import UserError
from .throughput import host_floats


class NonFiniteLossError(UserError):
    pass


class LogWindow:
    """Owns the updates since the last row; the Trainer records each update and asks for a row when one is due."""

    def __init__(self, args, accelerator, data, train_loader, scheduler, progress):
        self.args, self.accelerator, self.data = args, accelerator, data
        self.train_loader, self.scheduler, self.progress = train_loader, scheduler, progress
        self.updates: list = []  # (loss tensor, grad norm, step, stepped) per update since the last row
        self.batches = nan_batch.Tracker(keep_batches=data.per_rank)  # --nan_policy stop: which batch

    def record(self, done, window: list, micro_losses, micro_batches_per_epoch: int | None):
        """One update's result (update.py's); with --nan_policy stop, the batch it saw, should the row find a
        non-finite value."""
        self.updates.append((done.loss, done.grad_norm, self.progress.global_step, done.stepped))
        if self.args.nan_policy == "stop":
            self.batches.record(micro_losses, window, self.data, micro_batches_per_epoch)

    def row(self) -> dict | None:
        """The row's training metrics (loss, learning rate, grad norm, loss scale, skipped steps) over the updates
        since the last row, which it then forgets; None when there were none. --nan_policy stop: raises
        NonFiniteLossError at the first non-finite update."""
        if not self.updates:
            return None
        window, args = self.updates, self.args
        # --nan_policy stop checks the updates' gradient norms with their losses.
        stop = args.nan_policy == "stop"
        checked = [i for i, (_, g, _, stepped) in enumerate(window) if g is not None and stepped] if stop else []
        # The window's values as Python floats in one call (no host sync per value on an accelerator); the
        # finiteness test and the mean are arithmetic on the list, not tensor ops.
        values = host_floats([v for v, *_ in window] + [window[i][1] for i in checked])
        losses = values[: len(window)]
        all_finite = all(map(math.isfinite, values))
        if not all_finite and stop:
            self._stop_if_not_finite(losses, dict(zip(checked, values[len(window) :])))
        finite = losses if all_finite else [v for v in losses if math.isfinite(v)]  # --nan_policy skip: those
        metrics = {
            "loss": sum(finite) / len(finite) if finite else math.nan,
            "learning_rate": self.scheduler.get_last_lr()[0],
        }
        if args.max_grad_norm > 0 and window[-1][1] is not None:  # the last update's norm, when clipping
            metrics["grad_norm"] = float(window[-1][1])
        scaler = self.accelerator.scaler
        if scaler is not None:
            metrics["loss_scale"] = scaler.get_scale()
        if self.progress.skipped_steps or scaler is not None or args.nan_policy == "skip":
            metrics["skipped_steps"] = self.progress.skipped_steps
        self.clear()
        return metrics

    def clear(self):
        """Forget the updates since the last row (also for updates that are undone, not logged)."""
        self.updates = []
        self.batches.clear()

    def _stop_if_not_finite(self, losses, norms: dict):
        """--nan_policy stop: the first update of the window whose loss, or whose gradient norm (`norms`: index in
        the window -> norm; a finite loss can have NaN/inf gradients, which the step turns into NaN weights), is not
        finite stops the run."""
        for first, loss in enumerate(losses):
            norm = norms.get(first, 0.0)
            if math.isfinite(loss) and math.isfinite(norm):
                continue
            what = f"Loss is {loss}" if not math.isfinite(loss) else f"The gradient norm is {norm} (loss {loss:.4g})"
            step = self.updates[first][2]
            where = nan_batch.describe(
                self.batches, first, step, loader=self.train_loader, stream=self.data.per_rank,
                accelerator=self.accelerator, output_dir=self.args.output_dir,
            )  # fmt: skip
            raise NonFiniteLossError(
                f"{what} at step {step}; the run stops (no checkpoint is written over the last good one). The batch: "
                f"{where}. Replay it with the recipe's loss (docs/fault-tolerance.md, When it fails), lower the "
                "learning rate, check the data, or pass --nan_policy skip."
            )
