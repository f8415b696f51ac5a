"""Streaming (iterable) training data: a recipe's build_data may return an iterable dataset for "train" (e.g.
`datasets.load_dataset(..., streaming=True)`, already split across ranks with
`datasets.distributed.split_dataset_by_node`). Its length is unknown, so the run length is --max_steps.

Each rank reads its own part of the stream through torchdata's `StatefulDataLoader`, whose `state_dict()` holds
the position of the stream in every worker (the dataset's own `state_dict()`, which `datasets` >= 3 provides) at
the last batch handed out. A checkpoint stores it per rank (`data_state_rank<R>.pt`), with the rank's epoch and
batch counters, so a killed run continues each rank's stream exactly where it was. See docs/data.md.

Why not Accelerate's data loader: for an iterable dataset it either reads the whole stream on the main process
and sends every batch to the others (dispatch_batches, the default), or has every rank read the whole stream and
keep its slice (IterableDatasetShard); and its StatefulDataLoader support fails with several processes and
num_workers > 1 (accelerate #3080). A stream already split per rank needs none of that: a plain per-rank loader.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import send_to_device

from .errors import UserError

STATE_FILE = "data_state_rank{rank}.pt"


class StreamError(UserError):
    pass


def is_iterable_dataset(dataset) -> bool:
    """A dataset read by iterating (torch or `datasets` IterableDataset, or any object with __iter__ and no
    __getitem__/__len__), as opposed to a map-style one."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return True
    except ImportError:
        pass
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
        pin_memory=torch.cuda.is_available(),
        # Own generator: creating an iterator must not draw from the global RNG (dropout's).
        generator=torch.Generator().manual_seed(seed),
    )


def set_epoch(loader, epoch: int):
    # datasets' IterableDataset reshuffles per epoch (when shuffled) and restores a saved position only into the
    # epoch it was saved in, so the dataset's epoch is always ours.
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


def stream_windows(loader, accumulation: int, device, progress, rank: int):
    """Yield lists of `accumulation` micro-batches (on `device`) forever, from the loader's current position:
    an epoch is one pass over this rank's stream (its last window may be shorter), then the next one begins.
    `progress.epoch` / `progress.batch_in_epoch` are this rank's counters (ranks' streams may differ in length,
    so their epochs need not end together); they move as windows are handed out, and to the next epoch only
    when the loader says the stream has ended, so that a checkpoint's counters always match the loader state
    saved with them."""
    while True:
        set_epoch(loader, progress.epoch)
        fresh, window = progress.batch_in_epoch == 0, []
        for batch in loader:
            window.append(send_to_device(batch, device))
            if len(window) == accumulation:
                progress.batch_in_epoch += len(window)
                yield window
                window = []
        if window:  # the epoch's last, shorter window
            progress.batch_in_epoch += len(window)
            yield window
        if fresh and progress.batch_in_epoch == 0:
            raise StreamError(
                f"The training stream gave no batch in epoch {progress.epoch} on rank {rank}: fewer examples "
                "than per_device_train_batch_size there? Add data (or shards), or lower the batch size."
            )
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0


def save_state(folder: str, rank: int, loader, progress):
    """This rank's position: its epoch and batch counters and the loader's state (pickled tensors/ints only, so
    the checkpoint check test-loads it with weights_only)."""
    state = {"epoch": progress.epoch, "batch_in_epoch": progress.batch_in_epoch, "loader": loader.state_dict()}
    torch.save(state, os.path.join(folder, STATE_FILE.format(rank=rank)))


def load_state(folder: str, rank: int, loader, progress):
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    if not os.path.isfile(path):
        raise StreamError(
            f"Checkpoint {folder} has no {os.path.basename(path)}: it was not written by a streaming run of this "
            "world size, so this rank's position in the stream is unknown. Resume with the same data and number "
            "of processes, or start anew (--overwrite_output_dir)."
        )
    state = torch.load(path, weights_only=True)
    progress.epoch, progress.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
    set_epoch(loader, state["epoch"])
    loader.load_state_dict(state["loader"])
