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

    def __init__(self, tensors, batch_size, rank, world, seed, shuffle, drop_last=False):
        self.t, self.bs, self.rank, self.world, self.seed, self.shuffle = (
            tensors,
            batch_size,
            rank,
            world,
            seed,
            shuffle,
        )
        # drop_last: no short global batch at the end (the samples past the last full one are not seen)
        self.total = len(tensors["x"])
        self.n = self.total // (batch_size * world) * (batch_size * world) if drop_last else self.total
        self.epoch = 0

    def __len__(self):
        return -(-self.n // (self.bs * self.world))

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = (
            torch.randperm(self.total, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            if self.shuffle
            else torch.arange(self.total)
        )[: self.n]
        for start in range(0, self.n, self.bs * self.world):
            part = order[start : start + self.bs * self.world].tensor_split(self.world)[self.rank]
            yield {k: v[part] for k, v in self.t.items()}


class Tensors(regression.TensorDict):
    def select(self, indices):  # lets the Trainer cut it (--max_train_samples)
        idx = torch.as_tensor(list(indices))
        return Tensors({k: v[idx] for k, v in self.tensors.items()})


def build_data(ctx):
    args, r, w = ctx.args, ctx.process_index, ctx.world_size

    def loader(dataset, *, batch_size, train, drop_last):
        return ShardLoader(dataset.tensors, batch_size, r, w, ctx.targs.seed, shuffle=train, drop_last=drop_last)

    return {
        "train": Tensors(regression._synthetic(args, args.num_train_samples, args.data_seed + 1)),
        "eval": Tensors(regression._synthetic(args, args.num_eval_samples, args.data_seed + 2)),
        "loader": loader,
    }


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
