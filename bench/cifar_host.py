"""The CIFAR recipe's host work per update, by phase: the aten ops each phase dispatches (each a kernel launch on a
GPU) and the host time it takes, with a net so narrow that its compute is small. One JSON line.

    python bench/cifar_host.py [--preset default|muon] [--updates 100] [--widths 8,16,16] [--batch 64]

Phases, as the Trainer runs them for this recipe (its own pieces: DeviceLoader, CifarNet, build_optimizer and
build_scheduler of recipes/cifar.py; fp32, one thread, the CPU):

  loader     next(batch): the recipe's DeviceLoader (augmentation, normalization), amortised over the epoch
  forward    the recipe's loss and its backward
  optimizer  the optimizer step (SGD + lookahead, or Muon + SGD), the scheduler step, zero_grad

Ops are counted with a TorchDispatchMode over --updates updates after a warm-up epoch, a whole number of epochs
and of lookahead periods (5 updates), and do not move with the machine's load. Times are this thread's CPU time
(time.thread_time; torch runs one thread here), the median over blocks of 10 updates: the host's work, which other
processes on a shared machine disturb less than the wall clock. docs/cifar.md has the numbers.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import cifar  # noqa: E402
from cifar_data import DeviceLoader  # noqa: E402


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not name.startswith("_record_function"):  # the optimizer's profiler markers: no kernel
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def pieces(preset: str, widths: str, batch: int, updates: int):
    """The recipe's loader, net, optimizer and scheduler for a run of `updates` updates, as build_* make them."""
    args = cifar.Args(preset=preset, widths=widths, batch_size=batch)
    for key, value in cifar.PRESETS[preset].items():  # what configure() sets from the preset, where Args has it
        if hasattr(args, key) and key not in ("widths", "batch_size"):
            setattr(args, key, value)
    n = batch * 10  # 10 updates an epoch
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    loader = DeviceLoader(images, labels, batch, train=True, drop_last=True, flip=args.flip, translate=args.translate)
    torch.manual_seed(0)
    net = cifar.CifarNet(tuple(int(w) for w in widths.split(",")), bn_momentum=args.bn_momentum)
    net.init_whitening(cifar.normalize(images[:256]))
    net = net.to(memory_format=torch.channels_last)
    lr = cifar.PRESETS[preset].get("learning_rate", cifar.defaults["learning_rate"])
    wd = cifar.PRESETS[preset].get("weight_decay", cifar.defaults["weight_decay"])
    ctx = SimpleNamespace(args=args, targs=SimpleNamespace(weight_decay=wd), learning_rate=lr,
                          global_batch_size=batch, num_training_steps=updates,
                          accelerator=SimpleNamespace(device=torch.device("cpu"), distributed_type="NO"))  # fmt: skip
    opt = cifar.build_optimizer(net, ctx)
    sched = cifar.build_scheduler(opt, ctx)
    return loader, net, opt, sched


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--updates", type=int, default=100, help="counted and timed updates (a multiple of 10)")
    p.add_argument("--widths", default="8,16,16")
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    warm = 10
    loader, net, opt, sched = pieces(a.preset, a.widths, a.batch, warm + a.updates)
    phases = ("loader", "forward", "optimizer")
    ops = {k: Ops() for k in phases}
    times = {k: [] for k in phases}

    def batches():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    it = batches()

    def update(count: bool):
        stamps = [time.thread_time()]
        with ops["loader"] if count else _nothing():
            batch = next(it)
        stamps.append(time.thread_time())
        with ops["forward"] if count else _nothing():
            loss, _ = cifar.loss(net, batch)
            loss.backward()
        stamps.append(time.thread_time())
        with ops["optimizer"] if count else _nothing():
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        stamps.append(time.thread_time())
        return [b - a for a, b in zip(stamps, stamps[1:])]

    net.train()
    for _ in range(warm):
        update(False)
    for _ in range(a.updates):  # counted
        update(True)
    # timed, without the dispatch mode: a second run of the same length, from a fresh state
    loader, net, opt, sched = pieces(a.preset, a.widths, a.batch, warm + a.updates)
    it = batches()
    net.train()
    for _ in range(warm):
        update(False)
    per = [update(False) for _ in range(a.updates)]
    for k, phase in enumerate(phases):
        blocks = [sum(t[k] for t in per[i : i + 10]) / 10 for i in range(0, len(per), 10)]
        times[phase] = statistics.median(blocks) * 1e6
    result = {
        "preset": a.preset,
        "widths": a.widths,
        "batch": a.batch,
        "updates": a.updates,
        "aten_ops_per_update": {k: sum(ops[k].counts.values()) / a.updates for k in phases},
        "us_per_update": {k: round(times[k], 1) for k in phases},
        "optimizer_ops": {k: v / a.updates for k, v in ops["optimizer"].counts.most_common(12)},
        "loader_ops": {k: v / a.updates for k, v in ops["loader"].counts.most_common(12)},
        "torch": torch.__version__,
    }
    result["aten_ops_per_update"]["total"] = sum(result["aten_ops_per_update"].values())
    result["us_per_update"]["total"] = round(sum(times.values()), 1)
    print(json.dumps(result))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
