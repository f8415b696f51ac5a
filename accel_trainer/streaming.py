"""Streaming (iterable) training data: a recipe's build_data may return an iterable dataset for "train" (e.g.
`datasets.load_dataset(..., streaming=True)`, already split across ranks with
`datasets.distributed.split_dataset_by_node`). Its length is unknown, so the run length is --max_steps.

Each rank reads its own part of the stream through torchdata's `StatefulDataLoader`, whose `state_dict()` holds
the position of the stream in every worker (the dataset's own `state_dict()`, which `datasets` >= 3 provides)
after the last window handed out. A checkpoint stores it per rank (`data_state_rank<R>.pt`), with the rank's epoch and
batch counters, so a killed run continues each rank's stream exactly where it was. See docs/data.md.

Why not Accelerate's data loader: for an iterable dataset it either reads the whole stream on the main process
and sends every batch to the others (dispatch_batches, the default), or has every rank read the whole stream and
keep its slice (IterableDatasetShard); and its StatefulDataLoader support fails with several processes and
num_workers > 1 (accelerate #3080). A stream already split per rank needs none of that: a plain per-rank loader.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate.utils import send_to_device

from .errors import UserError

STATE_FILE = "data_state_rank{rank}.json"


class StreamError(UserError):
    pass


def is_iterable_dataset(dataset) -> bool:
    """A dataset read by iterating (torch or `datasets` IterableDataset, or any object with __iter__ and no
    __getitem__/__len__), as opposed to a map-style one."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    # Only if `datasets` is already imported: a dataset cannot be one of its classes otherwise, and importing it
    # here would slow every run's start-up (docs/benchmarks.md, "Choices the numbers decided").
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(dataset, datasets.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))


def stream_loader(dataset, *, batch_size: int, collate, num_workers: int, drop_last: bool, seed: int):
    """This rank's loader over its part of the stream; its state_dict() is the position in it."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise StreamError(
            "Streaming (iterable) training data needs torchdata's StatefulDataLoader to resume exactly: "
            "pip install torchdata"
        ) from None
    for method in ("state_dict", "load_state_dict"):
        if not hasattr(dataset, method):
            raise StreamError(
                f"The iterable training dataset ({type(dataset).__name__}) has no {method}(), so a checkpoint "
                "cannot hold its position: use a datasets.IterableDataset (datasets >= 3) or implement it."
            )
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),  # then Stream.windows copies to the GPU with non_blocking
        # Own generator: creating an iterator must not draw from the global RNG (dropout's).
        generator=torch.Generator().manual_seed(seed),
    )


def epoch_group(accelerator, timeout_s: int):
    """The gloo group on which the ranks agree on epoch ends (Stream); None on one process. Its own group: a CPU
    all-reduce beside the device's collectives, bounded by --ddp_timeout. Every rank calls it at the same point."""
    if accelerator.num_processes == 1:
        return None
    from datetime import timedelta

    return torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def set_epoch(loader, epoch: int):
    # datasets' IterableDataset reorders its shards at every epoch after the first (seeded by the epoch) and
    # restores a saved position only into the epoch it was saved in, so the dataset's epoch is always ours.
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


_END = object()


class Stream:
    """This rank's stream of training windows and its position (the data position of loaders.MapPosition's
    interface): `epoch` and `batch_in_epoch` are this rank's counters, `state` the loader's state_dict() right after
    the last window handed out (None: the start of `epoch`).

    Why we look one batch ahead: a loader whose state was saved after its last batch, before it said the epoch
    had ended, does not end that epoch when restored: with workers, torchdata's StatefulDataLoader starts it over
    (seen in tests/test_streaming.py). So each window is handed out only once the next batch is known, an epoch's
    end is recorded as (next epoch, batch 0, no state), and the state saved is the one taken before the look ahead.

    Why the ranks end each epoch together: `datasets` hands each rank its files after reordering them by the epoch,
    so a rank in epoch e+1 reads files that a rank still in epoch e is reading too (measured: rank 1's second epoch
    began with rank 0's first block), and others go unread. With several processes every window's look ahead is
    agreed on (`group`, a gloo group of its own): when any rank's stream has ended, every rank ends the epoch after
    this window (the rest of a longer stream's epoch is not read). One all-reduce of one number on the host per
    update, beside the data wait; it never waits for the device.
    """

    per_rank = True  # each rank reads its own part: the position cannot move to another world size

    def __init__(self, loader, rank: int, group=None, device=None):
        self.loader, self.rank, self.state, self.group, self.device = loader, rank, None, group, device
        self.epoch = self.batch_in_epoch = 0

    def run_length(self, args, eval_loader, recipe_name: str) -> tuple[None, None, int]:
        """A stream's length is unknown: the run length is --max_steps, an epoch ends when the stream does."""
        return None, None, args.max_steps

    def epoch_float(self) -> float:
        return float(self.epoch)  # the stream's length is unknown: whole epochs of this rank only

    def epoch_just_ended(self) -> bool:
        return False  # no evaluation at an epoch's end: a stream's epochs end at other updates on each rank

    def _any_ended(self, ended: bool) -> bool:
        if self.group is None:
            return ended
        flag = torch.tensor([int(ended)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.item())  # a CPU tensor: no device sync

    def windows(self, accumulation: int):
        """Yield lists of `accumulation` micro-batches (on the device) forever: an epoch is one pass over this
        rank's stream (its last window may be shorter), then the next begins. With several processes every rank
        ends an epoch when the first rank's stream ends."""
        while True:
            set_epoch(self.loader, self.epoch)
            it, fresh = iter(self.loader), self.batch_in_epoch == 0
            ended = False

            def pull():
                nonlocal ended
                batch = _END if ended else next(it, _END)
                ended = batch is _END
                return batch

            batch = pull()
            if batch is _END and fresh:
                raise StreamError(
                    f"The training stream gave no batch in epoch {self.epoch} on rank {self.rank}: fewer "
                    "examples than per_device_train_batch_size there? Add data (or shards), or lower the batch size."
                )
            while batch is not _END:
                window = [batch]
                while len(window) < accumulation and (batch := pull()) is not _END:
                    window.append(batch)
                state = self.loader.state_dict()  # the position right after this window
                batch = pull()  # look ahead: does the epoch end with this window (on any rank)?
                if self._any_ended(batch is _END):
                    batch = _END  # this rank's unread rest of the epoch is dropped with its iterator
                    self.epoch, self.batch_in_epoch, self.state = self.epoch + 1, 0, None
                else:
                    self.batch_in_epoch, self.state = self.batch_in_epoch + len(window), state
                yield [send_to_device(b, self.device, non_blocking=self.loader.pin_memory) for b in window]

    def batches(self, epoch: int, skip: int = 0):
        """fetch_batch(): the stream from its current position (which is the loader's; `skip` is not needed)."""
        set_epoch(self.loader, epoch)
        return (send_to_device(b, self.device, non_blocking=self.loader.pin_memory) for b in self.loader)

    def state_dict(self) -> dict:
        """For trainer_state.json (the main process's counters); each rank's own are its per-rank file."""
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict):
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]

    def save_rank_files(self, folder: str, step: int):
        """This rank's position: its epoch and batch counters and the loader's state (plain containers, numbers and
        tensors: a JSON state file, checkpointing/codec.py)."""
        from .checkpointing.state import write_json

        state = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "loader": self.state}
        write_json(folder, STATE_FILE.format(rank=self.rank), step, state)

    def load_rank_files(self, folder: str, saved: dict):
        """This rank's position from its file, checked against the checkpoint's trainer state (`saved`): the
        same epoch and batch, a loader state exactly where the epoch has begun; the loader takes it or the
        checkpoint is refused in one line."""
        from .checkpointing.folder import CheckpointError
        from .checkpointing.verify import read_state_file
        from .errors import why

        path = os.path.join(folder, STATE_FILE.format(rank=self.rank))
        if not os.path.isfile(path):
            raise StreamError(
                f"Checkpoint {folder} has no {os.path.basename(path)}: it was not written by a streaming run of "
                "this world size, so this rank's position in the stream is unknown. Resume with the same data and "
                "number of processes, or start anew (--overwrite_output_dir)."
            )
        state = read_state_file(folder, path, saved["global_step"])
        ok = isinstance(state, dict) and set(state) == {"epoch", "batch_in_epoch", "loader"}
        ok = ok and (state["epoch"], state["batch_in_epoch"]) == (saved["epoch"], saved["batch_in_epoch"])
        ok = ok and (state["loader"] is None) == (state["batch_in_epoch"] == 0) and state["loader"] != {}
        if not ok:
            raise CheckpointError(
                f"Checkpoint {folder}: {path} does not hold this rank's position in the stream at the checkpoint's "
                f"epoch {saved['epoch']}, batch {saved['batch_in_epoch']}. Resume from another checkpoint."
            )
        # the loader's own state, fresh, is the template (torchdata applies a state only when the next epoch's
        # iterator starts: a state of another make failed there, after "Resumed from", in a traceback)
        if state["loader"] is not None and not _same_make(state["loader"], self.loader.state_dict()):
            raise CheckpointError(
                f"Checkpoint {folder}: {path} holds a loader state of another make than this stream's "
                "(torchdata's StatefulDataLoader). Resume from another checkpoint."
            )
        self.epoch, self.batch_in_epoch, self.state = state["epoch"], state["batch_in_epoch"], state["loader"]
        set_epoch(self.loader, self.epoch)
        if self.state is not None:
            try:
                self.loader.load_state_dict(self.state)
            except Exception as e:  # noqa: BLE001 - torchdata's or the dataset's refusal of a state it did not write
                raise CheckpointError(
                    f"Checkpoint {folder}: {path} holds a loader state the stream cannot take ({why(e)}). Resume from "
                    "another checkpoint."
                ) from None


def _same_make(saved, template) -> bool:
    """`saved` has `template`'s make: dicts with the same keys, all the way down; values of its kinds where both
    are set (a mid-epoch state fills what a fresh one leaves None; lists may have other lengths)."""
    if saved is None or template is None:
        return True
    if isinstance(template, dict):
        return (
            isinstance(saved, dict)
            and set(saved) == set(template)
            and all(_same_make(saved[k], template[k]) for k in template)
        )
    if isinstance(template, bool) or isinstance(saved, bool):
        return type(saved) is type(template)
    if isinstance(template, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(template, (list, tuple)):
        return isinstance(saved, (list, tuple))
    return type(saved) is type(template)
