"""--nan_policy stop: the batch that gave the first non-finite loss or gradient, found after the fact and saved.

The check runs at log rows (every --logging_steps), on the host, so the bad update may be several updates back.
Per update we keep only what costs nothing: each micro-batch's detached loss (a device scalar the update computes
anyway; no host read) and where the window started (epoch, micro-batch position: host ints). Once a row sees a
non-finite value, the first bad micro-batch is found from those losses (one host read, on the way out), and the
batch is read again: map-style data by its position (the sampler's order is a function of seed and epoch; Accelerate
skips the batches before it by index, reading none of them), with the sample indices the sampler gave it. A stream
cannot be re-read, so under streaming the log window's micro-batches stay referenced until the row is written.

Every rank takes part (the loss and gradient norm checked are global, so every rank stops at the same row): each
names its own bad micro-batch, and the descriptions are gathered so the one line names every rank's. The batch is
saved as `nan_batch_rank<r>.pt` in output_dir (tensors and plain containers: `torch.load(path, weights_only=True)`),
on the device-independent CPU, to replay with the recipe's loss (docs/fault-tolerance.md, "When it fails").
"""

from __future__ import annotations

import itertools
import math
import os

import torch
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader

from . import loaders
from .throughput import host_floats


class Tracker:
    """The log window's per-update record: (micro-batch losses, window start (epoch, position), the micro-batches
    themselves under streaming, else None)."""

    def __init__(self, keep_batches: bool):
        self.keep_batches = keep_batches
        self.updates: list = []
        self._next = None  # (epoch, position) where the next window starts: where the last one ended

    def record(self, micro_losses: list, window: list, position, per_epoch: int | None):
        n, end = len(window), (position.epoch, position.batch_in_epoch)
        if end == self._next or end == (0, 0):
            # The position did not move: a batch of the notebook's train_step()/overfit_batch(), not of the run's
            # order. Its position is unknown; the batch itself is kept (one update's worth, until the next row).
            self.updates.append((micro_losses, None, list(window)))
            return
        if self._next is not None:
            start = self._next
        elif position.batch_in_epoch >= n or position.epoch == 0 or not per_epoch:  # the run's (or resume's) first
            start = (position.epoch, max(position.batch_in_epoch - n, 0))
        else:  # the first window handed out ended an epoch
            start = (position.epoch - 1, per_epoch - n)
        self._next = end
        self.updates.append((micro_losses, start, list(window) if self.keep_batches else None))

    def clear(self):
        self.updates = []


def describe(tracker: Tracker, first: int, step: int, *, loader, stream: bool, accelerator, output_dir: str) -> str:
    """The sentence naming the bad batch of update `first` of the log window (global step `step`) on every rank,
    after saving this rank's. Collectives when several processes run: every rank calls it at the same row."""
    rank = accelerator.process_index
    micro_losses = tracker.updates[first][0] if first < len(tracker.updates) else []
    values = host_floats(micro_losses) if micro_losses else []
    bad = [j for j, v in enumerate(values) if not math.isfinite(v)]
    # A non-finite gradient norm with finite losses everywhere (the norm is global): no micro-batch stands out,
    # so every rank saves all of that update's micro-batches.
    anywhere = any(_everyone(accelerator, bool(bad)))
    mine = ""
    if bad or not anywhere:
        try:
            mine = _save(tracker, first, step, rank, bad[:1] or list(range(len(micro_losses))), loader, stream,
                         accelerator, output_dir)  # fmt: skip
        except Exception as e:  # naming the batch must not hide the non-finite value itself
            mine = f"update {step}, rank {rank}: its batch could not be read again ({type(e).__name__}: {e})"
    found = [f for f in _everyone(accelerator, mine) if f]
    lead = "" if anywhere else "every micro-batch loss was finite (a non-finite gradient): "
    return lead + "; ".join(found)


def _everyone(accelerator, value) -> list:
    return gather_object([value]) if accelerator.num_processes > 1 else [value]


def _save(tracker, first, step, rank, js, loader, stream, accelerator, output_dir) -> str:
    micro_losses, at, kept = tracker.updates[first]
    batches, where = [], []
    for j in js:
        if at is None:  # a batch given to train_step(): no position in the run's order
            batches.append(kept[j])
            where.append(f"micro-batch {j + 1} of {len(micro_losses)} (a batch given to train_step())")
            continue
        epoch, position = at[0], at[1] + j
        batches.append(kept[j] if kept is not None else _read_again(loader, epoch, position, accelerator, stream))
        indices = None if stream else _sample_indices(loader, epoch, position)
        what = f"stream position {position} of epoch {epoch} on this rank" if stream else (
            f"batch {position} of epoch {epoch}" + (f", sample indices {indices}" if indices is not None else "")
        )  # fmt: skip
        where.append(f"micro-batch {j + 1} of {len(micro_losses)} ({what})")
    path = os.path.join(output_dir, f"nan_batch_rank{rank}.pt")
    os.makedirs(output_dir, exist_ok=True)
    cpu = [send_to_device(b, torch.device("cpu")) for b in batches]
    torch.save(cpu[0] if len(cpu) == 1 else cpu, path)  # several: the list of the update's micro-batches
    return f"update {step}, rank {rank}, " + ", ".join(where) + f"; saved to {path}"


def _read_again(loader, epoch: int, position: int, accelerator, stream: bool):
    if stream:
        raise RuntimeError("a stream is not re-read")  # kept batches are used instead
    return next(loaders.epoch_batches(loader, epoch, position, accelerator))


def _sample_indices(loader, epoch: int, position: int) -> list[int] | None:
    """The dataset indices of this rank's batch `position` of `epoch`: the batch sampler's order (after Accelerate
    shards it per rank), a function of the epoch alone. None for a recipe's own loader (no sampler to ask)."""
    if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
        return None
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    got = next(itertools.islice(iter(loader.batch_sampler), position, position + 1), None)
    return None if got is None else [int(i) for i in got]
