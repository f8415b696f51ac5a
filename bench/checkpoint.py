"""How long does a checkpoint stop training, synchronous vs --save_async? A ~100M-parameter GPT-2 (bench/memory.py's
build_model: 12 layers, width 768, vocab 16384; AdamW fp32; its size on disk in docs/benchmarks.md) trained by
the Trainer on random tokens, one process, a checkpoint every --every updates; three runs in one invocation:

  none    --save_steps 0 (the final checkpoint is off too)
  sync    --save_steps N
  async   --save_steps N --save_async

    python bench/checkpoint.py                         # full size; minutes and ~4 GB of RAM on a 2-core CPU
    python bench/checkpoint.py --layers 4 --steps 12   # a quicker look

The child runs are this file as a recipe; an update_end event stamps every update. The stall of a checkpoint is
the time fit() is blocked in save_checkpoint (timed around it). Also printed: the gap between the update a
checkpoint follows and the next one, minus the median gap between other updates (the stall plus the slowdown of
that next update by a background write sharing the cores). The total is fit()'s time from the first update to its end (the final checkpoint and, with
--save_async, the wait for it included), over the `none` run's. Printed as ratios: this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import harness

ROOT = harness.ROOT
name = "checkpoint-bench"


# --------------------------------------------------------------------------------- the child: a recipe
@dataclass
class Args:
    layers: int = 12
    width: int = 768
    vocab: int = 16384
    seq: int = 64
    samples: int = 4096
    stamps: str = ""  # where the update stamps go (JSON)


defaults = {"learning_rate": 1e-4, "per_device_train_batch_size": 2, "logging_steps": 1000, "disable_tqdm": True}


def build_model(ctx):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import memory

    return memory.build_model(ctx.args)


def build_data(ctx):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ctx.args.vocab, (ctx.args.samples, ctx.args.seq), generator=g)
    return {"train": [{"input_ids": row} for row in ids], "eval": None, "collate": _collate}


def _collate(examples):
    import torch

    ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": ids}


def loss(model, batch):
    ids = batch["input_ids"]
    out = model(input_ids=ids, labels=ids)
    return out.loss, (ids[:, 1:] >= 0).sum()


_STAMPS: list = []
_SAVES: list = []  # (step, seconds the loop was blocked in save_checkpoint)


def on_fit_start(trainer):
    save = trainer.save_checkpoint

    def timed():  # fit() calls self.save_checkpoint(): this instance attribute
        t = time.perf_counter()
        path = save()
        _SAVES.append((trainer.global_step, time.perf_counter() - t))
        return path

    trainer.save_checkpoint = timed


def on_update_end(trainer):
    _STAMPS.append((trainer.global_step, time.perf_counter()))


def on_fit_end(trainer, metrics):
    with open(trainer.recipe_args.stamps, "w") as f:
        json.dump({"updates": _STAMPS, "saves": _SAVES, "end": time.perf_counter()}, f)


# ------------------------------------------------------------------------------------------- the bench
def measure(stamps: dict, every: int) -> dict:
    steps, times = zip(*stamps["updates"])
    gaps = {steps[i]: times[i] - times[i - 1] for i in range(1, len(steps))}  # update s-1 -> s
    after = [s for s in gaps if every and (s - 1) % every == 0]  # the gap that holds the checkpoint of s-1
    normal = statistics.median(g for s, g in gaps.items() if s not in after)
    blocked = [t for s, t in stamps["saves"] if s < steps[-1]]  # the final save's wait is in the total
    return {
        "update_s": normal,
        "stall_s": statistics.mean(blocked) if blocked else 0.0,
        "gap_excess_s": statistics.mean(gaps[s] - normal for s in after) if after else 0.0,
        "checkpoints": len(after),
        "total_s": stamps["end"] - times[0],
    }


def run(mode: str, args, work: str) -> dict:
    out = os.path.join(work, mode)
    stamps = out + ".stamps.json"
    extra = {"none": ["--save_steps", "0"], "sync": ["--save_steps", str(args.every)]}
    extra["async"] = extra["sync"] + ["--save_async"]
    cmd = [sys.executable, os.path.abspath(__file__), "--output_dir", out, "--max_steps", str(args.steps),
           "--save_total_limit", "1", "--layers", str(args.layers), "--width", str(args.width), "--vocab",
           str(args.vocab), "--seq", str(args.seq), "--stamps", stamps, *extra[mode]]  # fmt: skip
    rc, _, _ = harness.watch(cmd, out, args.timeout, env=harness.child_env(args.threads), cwd=ROOT)
    if rc != 0:
        harness.exit_with_log(f"the {mode} run", rc, out + ".log")
    with open(stamps) as f:
        return measure(json.load(f), 0 if mode == "none" else args.every)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=21, help="updates per run")
    p.add_argument("--every", type=int, default=5, help="a checkpoint every N updates")
    p.add_argument("--threads", type=int, default=1, help="OMP threads of the run")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    print(f"load before: {harness.loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=os.environ.get("BENCH_DIR")) as work:
        res = {mode: run(mode, args, work) for mode in ("none", "sync", "async")}
        size = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(os.path.join(work, "sync", "checkpoints"))
            for f in files
        )
    print(f"load after: {harness.loadavg()}")
    print(f"GPT-2 {args.layers} layers, width {args.width}, vocab {args.vocab}; checkpoint {size / 2**30:.2f} GiB")
    for mode, r in res.items():
        print(f"{mode:6s} update {r['update_s'] * 1e3:7.1f} ms  stall/checkpoint {r['stall_s']:6.2f} s "
              f"(gap excess {r['gap_excess_s']:6.2f} s) "
              f"({r['checkpoints']} checkpoints)  total {r['total_s']:6.1f} s = "
              f"{r['total_s'] / res['none']['total_s']:.3f}x no checkpoints")  # fmt: skip
    ratio = res["async"]["stall_s"] / res["sync"]["stall_s"] if res["sync"]["stall_s"] > 0 else float("nan")
    print(f"async stall / sync stall: {ratio:.3f} (goal <= 0.20)")
    harness.write_json(args.json, {"args": vars(args), "results": res, "async_over_sync_stall": ratio})


if __name__ == "__main__":
    if "--output_dir" in sys.argv:  # a child run: this file is the recipe
        sys.path.insert(0, ROOT)
        from accel_trainer import run as run_recipe

        run_recipe(sys.modules[__name__])
    else:
        main()
