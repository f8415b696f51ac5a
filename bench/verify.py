"""How long does a resume spend verifying a checkpoint before loading it? A checkpoint of about --gib GiB (an MLP of
4096-wide layers trained one update with AdamW: weights + two moments, fp32), written by the Trainer in this
process, then verify_checkpoint timed --repeat times (the first read may come from the disk, the others from the
page cache; both are printed), and the bytes it reads per second.

    python bench/verify.py                # ~1 GiB; about a minute and ~4 GB of RAM on a 2-core CPU
    python bench/verify.py --gib 0.25     # a quicker look

It runs against any checkout (the verify_checkpoint of the package it imports), so the same command measures a
change: run it in a worktree of the commit before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

WIDTH = 4096


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the checkpoint (model + AdamW state)")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)

    import torch

    from accel_trainer import Trainer, TrainingArguments
    from accel_trainer.checkpointing.verify import verify_checkpoint
    from accel_trainer.recipe import Recipe

    layers = max(1, round(a.gib * (1 << 30) / (3 * 4 * WIDTH * WIDTH)))  # 3 copies (weights, exp_avg, exp_avg_sq)
    x = torch.randn(64, WIDTH)
    data = torch.utils.data.TensorDataset(x, x)

    def build_model(ctx):
        return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))

    def loss(model, batch):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets), len(inputs)

    recipe = Recipe(build_model=build_model, build_data=lambda ctx: {"train": data}, loss=loss, name="verify-bench")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
        args = TrainingArguments(output_dir=out, max_steps=1, save_steps=1, per_device_train_batch_size=64,
                                 disable_tqdm=True, logging_steps=1)  # fmt: skip
        Trainer(recipe, args, quiet=True).fit()
        path = os.path.join(out, "checkpoints", "step_1")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        entries = len(os.listdir(path))
        times = []
        for _ in range(a.repeat):
            start = time.perf_counter()
            verify_checkpoint(path)
            times.append(time.perf_counter() - start)
    print(f"checkpoint: {size / (1 << 30):.3f} GiB in {entries} entries ({layers} layers of {WIDTH}x{WIDTH})")
    print(f"verify_checkpoint: {', '.join(f'{t:.2f}' for t in times)} s; median {statistics.median(times):.2f} s, "
          f"{size / (1 << 30) / statistics.median(times):.2f} GiB/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
