"""The log window: the updates since the last metrics row, and the row made of them.

A row is the loop's only host sync: the window's losses (and, with --nan_policy stop, what each update measured of its
gradients: the norm, or a flag without clipping) are read in one call (throughput.host_floats). With --nan_policy stop the window also keeps which batch each update
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
        self.updates: list = []  # (loss, checked, grad norm, step, stepped) per update since the last row
        self.flags = False  # the updates' `checked` are flags (1.0: not finite), not norms (update.Result)
        self.batches = nan_batch.Tracker(keep_batches=data.per_rank)  # --nan_policy stop: which batch

    def record(self, done, window: list, micro_losses, micro_batches_per_epoch: int | None):
        """One update's result (update.py's); with --nan_policy stop, the batch it saw, should the row find a
        non-finite value."""
        self.updates.append((done.loss, done.checked, done.grad_norm, self.progress.global_step, done.stepped))
        self.flags = done.checked_is_flag
        if self.args.nan_policy == "stop":
            self.batches.record(micro_losses, window, self.data, micro_batches_per_epoch)

    def row(self) -> dict | None:
        """The row's training metrics (loss, learning rate, grad norm, loss scale, skipped steps) over the updates
        since the last row, which it then forgets; None when there were none. --nan_policy stop: raises
        NonFiniteLossError at the first non-finite update."""
        if not self.updates:
            return None
        window, args = self.updates, self.args
        # --nan_policy stop checks what each update measured of its gradients with its loss (none under fp16).
        checked = [i for i, update in enumerate(window) if update[1] is not None] if args.nan_policy == "stop" else []
        last_stepped = window[-1][4]  # a device flag where only the device knew (fp16, --nan_policy skip)
        pending = [] if isinstance(last_stepped, bool) else [last_stepped]
        # The window's values as Python floats in one call (no host sync per value on an accelerator); the
        # finiteness tests and the mean are arithmetic on the list, not tensor ops.
        values = host_floats([update[0] for update in window] + [window[i][1] for i in checked] + pending)
        losses, n = values[: len(window)], len(window)
        checks = zip(checked, values[n : n + len(checked)])
        bad_gradients = {i: v for i, v in checks if (v != 0.0 if self.flags else not math.isfinite(v))}
        all_finite = all(map(math.isfinite, losses))
        if checked and (bad_gradients or not all_finite):
            self._stop_if_not_finite(losses, bad_gradients)
        finite = losses if all_finite else [v for v in losses if math.isfinite(v)]  # --nan_policy skip: those
        metrics = {
            "loss": sum(finite) / len(finite) if finite else math.nan,
            "learning_rate": self.scheduler.get_last_lr()[0],
        }
        stepped = bool(values[-1]) if pending else last_stepped
        if args.max_grad_norm > 0 and window[-1][2] is not None and stepped:  # the last update's norm, when clipping
            metrics["grad_norm"] = float(window[-1][2])
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

    def _stop_if_not_finite(self, losses, bad_gradients: dict):
        """--nan_policy stop: the first update of the window whose loss, or whose gradients (`bad_gradients`: index
        in the window -> the norm, or the flag; a finite loss can have NaN/inf gradients, which the step turns into
        NaN weights), are not finite stops the run."""
        for first, loss in enumerate(losses):
            if math.isfinite(loss) and first not in bad_gradients:
                continue
            if not math.isfinite(loss):
                what = f"Loss is {loss}"
            elif self.flags:
                what = f"A gradient is not finite (loss {loss:.4g})"
            else:
                what = f"The gradient norm is {bad_gradients[first]} (loss {loss:.4g})"
            step = self.updates[first][3]
            where = nan_batch.describe(
                self.batches, first, step, loader=self.train_loader, stream=self.data.per_rank,
                accelerator=self.accelerator, output_dir=self.args.output_dir,
            )  # fmt: skip
            raise NonFiniteLossError(
                f"{what} at step {step}; the run stops (no checkpoint is written over the last good one). The batch: "
                f"{where}. Replay it with the recipe's loss (docs/fault-tolerance.md, When it fails), lower the "
                "learning rate, check the data, or pass --nan_policy skip."
            )
