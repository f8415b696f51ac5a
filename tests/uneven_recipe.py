"""A test recipe whose own batch loader (build_data's "loader") gives rank 1 one training batch more per epoch than
rank 0: its __len__ and __iter__ agree on each rank, but the ranks do not agree with each other."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batchloader_recipe  # noqa: E402
from batchloader_recipe import Args, Tensors, build_model, eval_step, loss  # noqa: E402,F401

defaults = batchloader_recipe.defaults


class UnevenLoader(batchloader_recipe.ShardLoader):
    def __init__(self, *a, extra: int = 0, **kw):
        super().__init__(*a, **kw)
        self.extra = extra

    def __len__(self):
        return super().__len__() + self.extra

    def __iter__(self):
        batch = None
        for batch in super().__iter__():
            yield batch
        for _ in range(self.extra):  # the last batch again
            yield batch


def build_data(ctx):
    data = batchloader_recipe.build_data(ctx)
    r, w = ctx.process_index, ctx.world_size

    def loader(dataset, *, batch_size, train, drop_last):
        extra = 1 if train and r == 1 else 0
        return UnevenLoader(dataset.tensors, batch_size, r, w, ctx.targs.seed, shuffle=train, drop_last=drop_last,
                            extra=extra)  # fmt: skip

    return dict(data, loader=loader)


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
