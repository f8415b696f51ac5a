"""What does the Trainer cost per step? Times, in one process on the same model and data:

  plain    a hand-written PyTorch loop (DataLoader, forward, backward, AdamW step, LR schedule, zero_grad)
  accel    the same loop written on bare Accelerate (prepare, accelerator.backward, prepared optimizer/scheduler)
  trainer  accel_trainer.Trainer.fit on a recipe with the same model, data, optimizer and schedule, logging once
  logged   the same Trainer logging every 10 updates (metrics.jsonl rows with throughput, step time, data wait,
           memory: the cost of what a run shows about itself)

Model: MLP 256-512-512-10, batch 64, AdamW, linear LR decay, no clipping, fp32, one CPU thread. The four
are run interleaved for --rounds rounds of --steps steps each; we report the median ms/step and the ratios.
All four run on the device Accelerate picks (a GPU where there is one; --cpu for the CPU), with the same data
path: a DataLoader over CPU tensors, each batch moved to the device. A run's time ends after a device sync.

    python bench/overhead.py                # ~1 minute on a 2-core CPU
    python bench/overhead.py --cpu          # the CPU on a GPU machine

The last line, `RESULT {...}`, is the same as JSON (bench/gpu.py's overhead row reads it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from harness import hand_written_loop
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_trainer import Recipe, Trainer, TrainingArguments
from accel_trainer.precision import training_device

BATCH, SAMPLES, LR = 64, 64 * 64, 1e-3  # samples per step, samples per epoch, AdamW learning rate
CPU = False  # --cpu


def sync(device):
    if device.type != "cpu":  # queued kernels are part of the run's time
        torch.accelerator.synchronize()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 256, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))


def linear_decay(opt, total):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))


def cross_entropy(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def plain(steps: int) -> float:
    device = training_device(CPU)
    model, data = make_model().to(device), make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = linear_decay(opt, steps)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    t0 = time.perf_counter()
    # The batch moves to the device in the loss, as Accelerate's prepared loader does for the other two.
    hand_written_loop(model, loader, lambda m, b: cross_entropy(m, [t.to(device) for t in b]), opt, sched, steps)
    sync(device)
    return (time.perf_counter() - t0) / steps


def bare_accelerate(steps: int) -> float:
    from accelerate import Accelerator

    acc = Accelerator(cpu=CPU)
    model, data = make_model(), make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, sched, loader = acc.prepare(
        model, opt, linear_decay(opt, steps), DataLoader(data, batch_size=BATCH, shuffle=True)
    )
    t0 = time.perf_counter()
    hand_written_loop(model, loader, cross_entropy, opt, sched, steps, backward=acc.backward)
    sync(acc.device)
    return (time.perf_counter() - t0) / steps


def trainer(steps: int, logging_steps: int = 10**9) -> float:
    recipe = Recipe(
        name="overhead",
        build_model=lambda ctx: make_model(),
        build_data=lambda ctx: {"train": make_data()},
        loss=lambda model, batch: (nn.functional.cross_entropy(model(batch[0]), batch[1]), len(batch[1])),
        build_optimizer=lambda model, ctx: torch.optim.AdamW(model.parameters(), lr=LR),
        build_scheduler=lambda opt, ctx: linear_decay(opt, ctx.num_training_steps),
    )
    with tempfile.TemporaryDirectory() as out:
        t = Trainer(
            recipe,
            TrainingArguments(
                output_dir=out,
                per_device_train_batch_size=BATCH,
                max_steps=steps,
                max_grad_norm=0.0,
                logging_steps=logging_steps,
                save_steps=0,
                disable_tqdm=True,
                use_cpu=CPU,
            ),
            quiet=True,
        )
        t0 = time.perf_counter()
        t.fit()  # includes one final log line and writing model.safetensors (~1 ms in all)
        return (time.perf_counter() - t0) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="steps per timed run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--cpu", action="store_true", help="the CPU even where there is a GPU")
    a = p.parse_args()
    global CPU
    CPU = a.cpu
    torch.set_num_threads(a.threads)
    loops = {"plain": plain, "accel": bare_accelerate, "trainer": trainer, "logged": lambda n: trainer(n, 10)}
    for fn in loops.values():  # warm-up: imports, allocator, first-call costs
        fn(50)
    times = {name: [] for name in loops}
    for _ in range(a.rounds):
        for name, fn in loops.items():
            times[name].append(fn(a.steps) * 1e3)
    med = {name: statistics.median(v) for name, v in times.items()}
    device = training_device(CPU)
    print(
        f"torch {torch.__version__}, {device.type}, {a.threads} thread(s), {a.rounds} rounds x {a.steps} steps, "
        "median ms/step"
    )
    for name in loops:
        spread = f"[{min(times[name]):.3f} .. {max(times[name]):.3f}]"
        print(f"  {name:8s} {med[name]:7.3f} ms/step {spread:>20s}   x{med[name] / med['plain']:.3f} of plain")
    print(
        f"trainer / plain = {med['trainer'] / med['plain']:.3f}; accel / plain = {med['accel'] / med['plain']:.3f}; "
        f"trainer / accel = {med['trainer'] / med['accel']:.3f}; logged / plain = {med['logged'] / med['plain']:.3f}"
    )
    result = {"device": device.type, "rounds": a.rounds, "steps": a.steps, "ms_per_step": med}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
