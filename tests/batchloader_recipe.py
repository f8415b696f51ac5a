"""A test recipe whose data is a batch loader of its own (the protocol in docs/architecture.md), not a Dataset:
the regression recipe's model and loss over tensors held by the loader, sharded by rank without padding."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import regression  # noqa: E402
from regression import Args, build_model, eval_step, loss  # noqa: E402,F401

defaults = dict(regression.defaults, save_steps=0)


class ShardLoader:
    """Global batches of batch_size x world_size, each split into per-rank parts of unequal size (no padding)."""

    def __init__(self, tensors, batch_size, rank, world, seed, shuffle):
        self.t, self.bs, self.rank, self.world, self.seed, self.shuffle = (
            tensors,
            batch_size,
            rank,
            world,
            seed,
            shuffle,
        )
        self.n = len(tensors["x"])
        self.epoch = 0

    def __len__(self):
        return -(-self.n // (self.bs * self.world))

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = (
            torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            if self.shuffle
            else torch.arange(self.n)
        )
        for start in range(0, self.n, self.bs * self.world):
            part = order[start : start + self.bs * self.world].tensor_split(self.world)[self.rank]
            yield {k: v[part] for k, v in self.t.items()}


def build_data(args, targs, accelerator):
    r, w = accelerator.process_index, accelerator.num_processes
    train = regression._synthetic(args, args.num_train_samples, args.data_seed + 1)
    evald = regression._synthetic(args, args.num_eval_samples, args.data_seed + 2)
    return {
        "train": ShardLoader(train, targs.per_device_train_batch_size, r, w, targs.seed, True),
        "eval": ShardLoader(evald, targs.per_device_eval_batch_size, r, w, targs.seed, False),
    }


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
