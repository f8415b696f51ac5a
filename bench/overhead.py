"""What does the Trainer cost per step? Times, in one process on the same model and data:

  plain     a hand-written PyTorch loop (DataLoader, forward, backward, AdamW step, LR schedule, zero_grad)
  accel     the same loop written on bare Accelerate (prepare, accelerator.backward, prepared optimizer/scheduler)
  trainer   accel_trainer.Trainer.fit on a recipe with the same model, data, optimizer and schedule, logging once
  plain+    the hand-written loop as a user runs it: clipping at 1.0, a tqdm bar and a printed `loss.item()` every
            10 updates, on a terminal
  defaults  the Trainer with the same user's defaults: clipping at 1.0, a metrics.jsonl + console row every 10
            updates (throughput, step time, data wait, memory), its progress bar, on a terminal

"On a terminal": stdout and stderr are a pseudo-terminal (pty) for those two rows, read by another process (`cat`,
as a terminal emulator would), so tqdm draws its bar as it would for a user (the Trainer draws none when stderr is
not a terminal).

Model: MLP 256-512-512-10, batch 64, AdamW, linear LR decay, fp32, one CPU thread. The five are run interleaved
for --rounds rounds of --steps steps each (each round starting with the next row); we report the median ms/step,
the ratios of the medians, and the median over rounds of each round's own ratio (paired). All run on the device
Accelerate picks (a GPU where there is one; --cpu for the CPU), with the same data path: a DataLoader over CPU
tensors, shuffled by a generator seeded with the Trainer's --seed, each batch moved to the device. A run's time
ends after a device sync. From the same run it also prints:

  final weights   the trainer's vs the plain loop's, and the defaults' vs plain+'s, after the same number of
                  updates: on a CPU in fp32 they do the same arithmetic, so they must be bit-identical
  peak memory     plain+ vs defaults, each in a fresh process (--_memory), with the MLP 4096 wide (17 M
                  parameters, ~270 MB with gradients and AdamW state) for 30 updates: on a GPU the peak of
                  torch.accelerator.max_memory_allocated; on a CPU, which has no allocator statistics, the peak
                  resident memory (sampled every 0.5 ms) above the resident memory before the model is built,
                  in a second run after a first one of 5 updates on an 8-wide MLP (so that
                  neither counts its lazy imports, e.g. torch._dynamo's at the first optimizer, and the
                  second cannot reuse the first's freed memory), both with glibc's own malloc thresholds
                  (ACCEL_TRAINER_CPU_MALLOC=0). Goal: defaults <= 1.05x.

    python bench/overhead.py                # ~2 minutes on a 2-core CPU
    python bench/overhead.py --cpu          # the CPU on a GPU machine
    python bench/overhead.py --width 1 --rounds 8 --steps 1000   # the loops' own cost in us per update
    python bench/overhead.py --instructions --width 1  # the same in CPU instructions (callgrind), ~2 minutes
    python bench/overhead.py --launch_bound --rounds 3 --steps 2000   # the launch-bound case, below
    python bench/overhead.py --launch_bound --instructions            # its rows in CPU instructions

--instructions counts, instead of timing, the CPU instructions of 100 updates of plain, trainer, plain+ and defaults
(after 10 updates of warm-up), each row in its own process under valgrind's callgrind, started and stopped by
client requests at update ends (a 2-function C helper built with gcc). A count does not move with the machine's
speed: on this project's noisy VMs the width-512 times move between rounds by more than the 1% to resolve. tqdm
redraws on a timer, which valgrind's much slower clock would multiply: the rows run with TQDM_MININTERVAL=1e9 (the
bar is redrawn by each log row's write only). Needs valgrind (with its headers) and gcc; user-space instructions only.
At the default width 512 the kernels run under valgrind too (over 5 minutes a row here), and valgrind's CPU has no
AVX-512, so their instructions are not this CPU's: --width 1 is the measure of the loops' own cost.

--launch_bound: the host's share of an update. At --width 1 the kernels take almost no time, so what a loop adds
per update is host work (Python, dispatch, allocations) that a fast GPU would wait for too. Four rows with a user's
features (clipping at 1.0, a log row every 10 updates, a progress bar, on a terminal), on the same model, optimizer
and schedule: plain+ (the hand-written loop), defaults (the Trainer), accel+ (the loop on bare Accelerate, clipping
through the Accelerator) and hf (transformers.Trainer, given the same optimizer and schedule). Timed in lockstep
(Lockstep: the four loops in one process, one update each in turn), so that every update of a row is paired with
its neighbours of the others under the same load; then, each row in a run of its own, the aten ops and the Python
calls per update, and which ops a row dispatches more often than plain+. With --instructions, each row's CPU
instructions per update instead (callgrind). Lockstep times a CPU run: on a GPU the rows share the device's stream,
so a row that waits for the GPU (a read, a copy from pageable memory) waits for the kernels the row before it
queued; there the counts stand, and the default mode (whole runs in turn) gives the times.

The last line, `RESULT {...}`, is the same as JSON (bench/gpu.py's overhead row reads it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import gc
import json
import os
import pty
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from harness import hand_written_loop
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accel_trainer import Recipe, Trainer, TrainingArguments, cpu_allocator
from accel_trainer.precision import training_device

BATCH, SAMPLES, LR = 64, 64 * 64, 1e-3  # samples per step, samples per epoch, AdamW learning rate
SEED = TrainingArguments.seed  # the Trainer's default --seed: its DataLoader shuffles with a generator seeded by it
CLIP, EVERY = 1.0, 10  # a user's defaults: clipping at 1.0, a log row every 10 updates
CPU = False  # --cpu
ON_UPDATE = None  # --instructions' child: called with the update count after each update (plain loops and Trainer)
WIDTH = 512  # hidden width; the memory runs use MEMORY_WIDTH
MEMORY_WIDTH, MEMORY_STEPS = 4096, 30  # 17 M parameters: ~270 MB of weights, gradients and AdamW state, so that
# the comparison is of what the loops keep, not of malloc's few-MB noise between runs at width 512


def sync(device):
    if device.type != "cpu":  # queued kernels are part of the run's time
        torch.accelerator.synchronize()


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def per_step(t0: tuple[float, float], steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step since `t0`. The CPU time of this process is robust to other processes and to
    a VM's stolen time, which this noisy machine's wall times are not (one thread: it is the loop's time)."""
    t1 = clock()
    return (t1[0] - t0[0]) / steps, (t1[1] - t0[1]) / steps


def make_model():
    torch.manual_seed(0)
    h = WIDTH
    return nn.Sequential(nn.Linear(256, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))


def make_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 256, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))


def linear_decay(opt, total):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))


def cross_entropy(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def shuffled(data):
    """Shuffled as a hand-written distributed loop does (the hand-written loop calls set_epoch): the order of
    epoch e is torch.randperm seeded with SEED + e, the Trainer's order on one process (Accelerate's seedable
    sampler)."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    return DataLoader(data, batch_size=BATCH, sampler=sampler)


def plain(steps: int, user: bool = False):
    """(seconds per step, the trained model). `user`: clipping, a tqdm bar and a printed loss every 10 updates."""
    from tqdm.auto import tqdm

    device = training_device(CPU)
    model, data = make_model().to(device), make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = linear_decay(opt, steps)
    bar = tqdm(total=steps, disable=not user)

    def after_update(step, loss):
        if user:
            bar.update(1)
            if step % EVERY == 0:
                bar.write(f"step {step} loss {loss.item():.4f}")
        if ON_UPDATE is not None:
            ON_UPDATE(step)

    t0 = clock()
    # The batch moves to the device in the loss, as Accelerate's prepared loader does for the other two.
    loss = lambda m, b: cross_entropy(m, [t.to(device) for t in b])  # noqa: E731
    hand_written_loop(model, shuffled(data), loss, opt, sched, steps, max_grad_norm=CLIP if user else 0.0,
                      after_update=after_update if user or ON_UPDATE else None)  # fmt: skip
    sync(device)
    t = per_step(t0, steps)
    bar.close()
    return t, model


def bare_accelerate(steps: int, user: bool = False):
    """(seconds per step, the trained model). `user`: clipping through the Accelerator, a tqdm bar and a printed
    loss every 10 updates, as a bare-Accelerate user writes them."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    acc = Accelerator(cpu=CPU)
    model, data = make_model(), make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, sched, loader = acc.prepare(model, opt, linear_decay(opt, steps), shuffled(data))
    bar = tqdm(total=steps, disable=not user)

    def backward(loss):
        acc.backward(loss)
        if user:
            acc.clip_grad_norm_(model.parameters(), CLIP)

    def after_update(step, loss):
        if user:
            bar.update(1)
            if step % EVERY == 0:
                bar.write(f"step {step} loss {loss.item():.4f}")
        if ON_UPDATE is not None:
            ON_UPDATE(step)

    t0 = clock()
    hand_written_loop(model, loader, cross_entropy, opt, sched, steps, backward=backward,
                      after_update=after_update if user or ON_UPDATE else None)  # fmt: skip
    sync(acc.device)
    t = per_step(t0, steps)
    bar.close()
    return t, model


def hf_trainer(steps: int):
    """(seconds per step, the trained model): transformers.Trainer with the same user's defaults (clipping at 1.0,
    a log row every 10 updates, its progress bar), on the same model, optimizer and schedule (given to it)."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback
    from transformers import TrainingArguments as HFArguments

    class WithLoss(nn.Module):  # transformers.Trainer reads the loss from the model's output
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def forward(self, x, labels):
            return {"loss": nn.functional.cross_entropy(self.net(x), labels)}

    class Samples(torch.utils.data.Dataset):  # its collator batches dicts
        def __init__(self, data):
            self.x, self.y = data.tensors

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class OnUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ON_UPDATE(state.global_step)

    model = WithLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with tempfile.TemporaryDirectory() as out:
        t = HFTrainer(
            model=model,
            args=HFArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps, max_grad_norm=CLIP,
                             logging_steps=EVERY, save_strategy="no", report_to="none", use_cpu=CPU, seed=SEED),
            train_dataset=Samples(make_data()),
            optimizers=(opt, linear_decay(opt, steps)),
            callbacks=[OnUpdate()] if ON_UPDATE is not None else [],
        )  # fmt: skip
        t0 = clock()
        t.train()
        return per_step(t0, steps), model.net


def trainer(steps: int, user: bool = False):
    """(seconds per step, the trained model). `user`: the Trainer's defaults as a user runs it (clipping, a row
    every 10 updates on the console and in metrics.jsonl, the progress bar)."""
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
                max_grad_norm=CLIP if user else 0.0,
                logging_steps=EVERY if user else 10**9,
                save_steps=0,
                disable_tqdm=not user,
                use_cpu=CPU,
                seed=SEED,
            ),
            quiet=not user,
        )
        if ON_UPDATE is not None:
            t.on("update_end", lambda trainer: ON_UPDATE(trainer.global_step))
        t0 = clock()
        t.fit()  # includes one final log line and writing model.safetensors (small against the steps timed)
        return per_step(t0, steps), t.accelerator.unwrap_model(t.model)


@contextlib.contextmanager
def on_a_terminal():
    """stdout and stderr are a pseudo-terminal while inside (what a user watching the run has), read by another
    process that throws the text away, as a terminal emulator is. (A reader thread in this process, as this bench
    had, takes the GIL whenever text arrives, and so slowed whichever loop released the GIL more often.)"""
    leader, follower = pty.openpty()
    reader = subprocess.Popen(["cat"], stdin=leader, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(follower, 1), os.dup2(follower, 2)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(follower)  # the reader sees EOF (EIO) and ends
        reader.wait(timeout=5)
        os.close(leader), os.close(saved[0]), os.close(saved[1])


LOOPS = {
    "plain": lambda n: plain(n),
    "accel": bare_accelerate,
    "trainer": lambda n: trainer(n),
    "plain+": lambda n: plain(n, user=True),
    "defaults": lambda n: trainer(n, user=True),
}
ON_A_TERMINAL = {"plain+", "defaults", "accel+", "hf"}


def run(name, steps):
    with on_a_terminal() if name in ON_A_TERMINAL else contextlib.nullcontext():
        return LOOPS[name](steps) if name in LOOPS else LAUNCH_ROWS[name](steps)


# ------------------------------------------------------------------------------------ the launch-bound case
# --launch_bound: the hand-written loop as a user runs it against the Trainer's defaults, bare Accelerate and
# transformers.Trainer with the same features, on a model whose kernels take almost no time (--width 1): what each
# adds per update is host work (Python, dispatch, allocations) that a fast GPU would wait for too.
LAUNCH_ROWS = {
    "plain+": lambda n: plain(n, user=True),
    "defaults": lambda n: trainer(n, user=True),  # first after plain+: its set-up resets Accelerate's singletons
    "accel+": lambda n: bare_accelerate(n, user=True),
    "hf": hf_trainer,
}
WARM, BLOCK = 10, EVERY  # updates before the measured ones; updates per block (one log row each)


class Lockstep:
    """The rows' loops side by side in one process, one update at a time in turn: each in a thread of its own (the
    Trainer's in the main thread, which its signal handlers need), the turn passed at each update's end. Each update
    is timed in its own thread's CPU time, from its row's turn coming back to its end: neighbouring updates of the
    rows run microseconds apart, under the same load, where whole runs in turn (the other mode) ran seconds apart,
    and on this shared VM a round's CPU time moved by +-40% (stolen time is counted as the guest's). Set-up runs
    in a row's first turn, so that no row's set-up overlaps another's updates."""

    def __init__(self, names, n: int):
        self.order, self.n = list(names), n  # rows still running, in turn order
        self.turn = {name: threading.Event() for name in names}
        self.lock, self.local, self.resumed = threading.Lock(), threading.local(), {}
        self.times = {name: [] for name in names}  # thread CPU seconds of updates WARM+1 .. WARM+n

    def on_update(self, step: int):  # ON_UPDATE, called in the row's own thread
        name, t = self.local.name, time.thread_time()
        if WARM < step <= WARM + self.n:
            self.times[name].append(t - self.resumed[name])
        self._hand_on(name, done=False)
        self._wait(name)

    def _wait(self, name):
        self.turn[name].wait()
        self.turn[name].clear()
        self.resumed[name] = time.thread_time()

    def _hand_on(self, name, done: bool):
        with self.lock:
            i = self.order.index(name)
            if done:
                self.order.remove(name)
            following = self.order[(i + (not done)) % len(self.order)] if self.order else None
        if following is not None:
            self.turn[following].set()

    def _row(self, name, failed: list):
        self.local.name = name
        self._wait(name)
        try:
            LAUNCH_ROWS[name](WARM + self.n + 1)  # + 1: the run's last update (its final row, saves) is not timed
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            failed.append(e)
        finally:
            self._hand_on(name, done=True)

    def run(self) -> dict:
        global ON_UPDATE
        failed, main = [], "defaults"
        threads = [threading.Thread(target=self._row, args=(n, failed)) for n in self.order if n != main]
        ON_UPDATE = self.on_update
        try:
            with on_a_terminal():
                for thread in threads:
                    thread.start()
                self.turn[self.order[0]].set()
                self._row(main, failed)
                for thread in threads:
                    thread.join()
        finally:
            ON_UPDATE = None
        if failed:
            raise failed[0]
        return self.times


class Stretch:
    """ON_UPDATE counting over updates WARM+1 .. WARM+n of one run: the aten ops dispatched there ("ops": a
    TorchDispatchMode, which sees the backward too), or the Python calls made there ("calls": sys.setprofile's
    'call' events, functions and each resumption of a generator; in a run of its own, as the mode's own Python
    would count). Counts do not move with the machine's load."""

    def __init__(self, n: int, what: str):
        self.n, self.what = n, what
        self.ops, self.calls, self.mode = collections.Counter(), 0, None

    def __call__(self, step: int):
        if step == WARM:
            if self.what == "ops":
                self.mode = _Ops(self.ops)
                self.mode.__enter__()
            else:
                sys.setprofile(self._profile)
        elif step == WARM + self.n:
            if self.what == "ops":
                self.mode.__exit__(None, None, None)
            else:
                sys.setprofile(None)

    def _profile(self, frame, event, arg):
        if event == "call":
            self.calls += 1


class _Ops(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not name.startswith("_record_function"):  # the optimizer's profiler markers: no kernel
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count_stretch(name: str, n: int, what: str) -> Stretch:
    global ON_UPDATE
    ON_UPDATE = stretch = Stretch(n, what)
    try:
        with on_a_terminal():
            LAUNCH_ROWS[name](WARM + n + 1)
    finally:
        ON_UPDATE = None
    return stretch


def launch_bound(rounds: int, steps: int, counted: int) -> dict:
    """`rounds` lockstep runs of `steps` timed updates per row (Lockstep), in blocks of BLOCK updates (one log row
    each): a row's cost is the median block, what it adds the median of its blocks' differences to plain+'s block
    of the same updates; then each row's ops, and its Python calls, per update over `counted` updates, each in a
    run of its own."""
    steps -= steps % BLOCK
    blocks = {name: [] for name in LAUNCH_ROWS}  # us per update of each block, over all rounds
    per_round = {name: [] for name in LAUNCH_ROWS}  # each round's median added us per update
    for _ in range(rounds):
        times = Lockstep(LAUNCH_ROWS, steps).run()
        mine = {
            name: [sum(t[i : i + BLOCK]) / BLOCK * 1e6 for i in range(0, steps, BLOCK)] for name, t in times.items()
        }
        for name, b in mine.items():
            blocks[name] += b
            per_round[name].append(statistics.median(x - y for x, y in zip(b, mine["plain+"])))
    ops = {name: count_stretch(name, counted, "ops").ops for name in LAUNCH_ROWS}
    ops = {name: {k: v / counted for k, v in c.items()} for name, c in ops.items()}
    calls = {name: count_stretch(name, counted, "calls").calls / counted for name in LAUNCH_ROWS}
    rows = {}
    for name in LAUNCH_ROWS:
        added = [x - y for x, y in zip(blocks[name], blocks["plain+"])]  # paired: the same updates' turn
        beyond = {op: round(v - ops["plain+"].get(op, 0.0), 2) for op, v in ops[name].items()
                  if v > ops["plain+"].get(op, 0.0) + 1e-9}  # fmt: skip
        rows[name] = {
            "us_per_update": statistics.median(blocks[name]),
            "us_quartiles": statistics.quantiles(blocks[name], n=4)[::2],
            "added_us_per_update": statistics.median(added),
            "added_us_quartiles": statistics.quantiles(added, n=4)[::2],
            "added_us_per_round": per_round[name],
            "aten_ops_per_update": sum(ops[name].values()),
            "python_calls_per_update": calls[name],
            "ops_beyond_plain+": beyond,
        }
    return rows


def print_launch_bound(rows: dict, rounds: int, steps: int, counted: int):
    print(
        f"launch-bound: torch {torch.__version__}, {training_device(CPU).type}, 1 thread, MLP 256-{WIDTH}-{WIDTH}-10, "
        f"batch {BATCH}, AdamW, clipping at {CLIP}, a log row every {EVERY} updates, on a terminal; {rounds} lockstep "
        f"run(s) x {steps} updates per row, thread CPU time in blocks of {BLOCK} updates (median [quartiles]; added: "
        f"of each block's difference to plain+'s); ops and Python calls over {counted} updates"
    )
    print(
        f"  {'':9s} {'us/update':>9s} {'[quartiles]':>18s} {'added':>8s} {'[quartiles]':>18s} {'aten ops':>9s} {'Py calls':>9s}"
    )
    for name, r in rows.items():
        lo, hi = r["us_quartiles"]
        alo, ahi = r["added_us_quartiles"]
        print(
            f"  {name:9s} {r['us_per_update']:9.1f} {f'[{lo:.1f} .. {hi:.1f}]':>18s} "
            f"{r['added_us_per_update']:+8.1f} {f'[{alo:+.1f} .. {ahi:+.1f}]':>18s} "
            f"{r['aten_ops_per_update']:9.1f} {r['python_calls_per_update']:9.1f}"
        )
    for name, r in rows.items():
        if name != "plain+":
            each = ", ".join(f"{x:+.1f}" for x in r["added_us_per_round"])
            beyond = ", ".join(f"{op} +{v:g}" for op, v in sorted(r["ops_beyond_plain+"].items())) or "none"
            print(f"  {name}: added per run {each}; ops per update beyond plain+'s: {beyond}")


def identical(a: nn.Module, b: nn.Module) -> str:
    sa, sb = a.state_dict(), b.state_dict()
    diff = max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
    return "bit-identical" if all(torch.equal(sa[k], sb[k]) for k in sa) else f"DIFFERENT (max |diff| {diff:.3g})"


def peak_memory_mb(name: str, steps: int) -> float:
    """The peak memory of one run of `name` in a fresh process (see the module docstring), in MB."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory", name, "--steps", str(steps)]
    # glibc's own thresholds in both (the Trainer's keep freed memory in the process, so that a second run would
    # reuse the first one's instead of showing its own peak)
    env = dict(os.environ, ACCEL_TRAINER_CPU_MALLOC="0")
    out = subprocess.run(cmd + (["--cpu"] if CPU else []), check=True, capture_output=True, text=True, env=env).stdout
    return float(out.split("PEAK_MB ")[-1])


def _measure_memory(name: str, steps: int):
    import accelerate  # noqa: F401  (both processes import the same packages before the baseline)
    import tqdm  # noqa: F401

    global WIDTH
    device = training_device(CPU)
    if device.type != "cpu":
        WIDTH = MEMORY_WIDTH
        torch.accelerator.reset_peak_memory_stats()
        run(name, steps)
        print(f"PEAK_MB {torch.accelerator.max_memory_allocated() / 2**20:.3f}")
        return

    WIDTH = 8  # a tiny model for the first run: its freed blocks are not there for the measured run to reuse
    run(name, 5)  # first-call costs (lazy imports: torch._dynamo at the optimizer) are not the loop's
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap memory goes back to the OS: not reused unseen
    # The peak resident memory, sampled every 0.5 ms by a thread. Not VmHWM after clear_refs: in this child it gave
    # the Trainer's row far less than the sampler saw (docs/benchmarks.md); why, is not known.
    page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
    peak, done = [0.0], threading.Event()

    def sample():
        with open("/proc/self/statm") as f:
            while not done.is_set():
                f.seek(0)
                peak[0] = max(peak[0], int(f.read().split()[1]) * page_mb)
                time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(0.01)
    before = peak[0]
    WIDTH = MEMORY_WIDTH
    run(name, steps)
    done.set()
    sampler.join()
    print(f"PEAK_MB {peak[0] - before:.3f}")


CALLGRIND_HELPER = """
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void count_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("counted"); }
"""
COUNTED_ROWS, WARM_UPDATES, COUNTED_UPDATES = ("plain", "trainer", "plain+", "defaults"), 10, 100


def _count(name: str, helper: str):
    """--instructions' child, under callgrind: a first run (imports, first calls), then a run whose updates
    WARM_UPDATES+1 .. WARM_UPDATES+COUNTED_UPDATES are counted, from one update's end to another's."""
    global ON_UPDATE
    lib = ctypes.CDLL(helper)
    run(name, 30)

    def tick(step):
        if step == WARM_UPDATES:
            lib.count_start()
        elif step == WARM_UPDATES + COUNTED_UPDATES:
            lib.count_stop()

    ON_UPDATE = tick
    run(name, WARM_UPDATES + COUNTED_UPDATES + 10)


def count_instructions(threads: int, rows=COUNTED_ROWS) -> dict:
    """{row: instructions per update}, each row in its own process under callgrind."""
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"--instructions needs {' and '.join(missing)} (Debian: apt-get install valgrind gcc).")
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        helper = os.path.join(tmp, "count.so")
        gcc = ["gcc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", helper]
        built = subprocess.run(gcc, input=CALLGRIND_HELPER, capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"--instructions: building the callgrind helper failed (valgrind's headers?):\n{built.stderr}")
        env = dict(os.environ, TQDM_MININTERVAL="1e9", PYTHONHASHSEED="0", OMP_NUM_THREADS=str(threads))
        for name in rows:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.%p",
                   sys.executable, os.path.abspath(__file__), "--_count", name, "--_helper", helper,
                   "--width", str(WIDTH), "--threads", str(threads)] + (["--cpu"] if CPU else [])  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = re.search(r"Collected : (\d+)", out.stderr)
            if out.returncode != 0 or not found:
                sys.exit(f"--instructions: the {name} row failed under valgrind:\n{out.stderr[-3000:]}")
            counts[name] = int(found.group(1)) / COUNTED_UPDATES
    return counts


def main():
    global CPU, WIDTH
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="steps per timed run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--width",
        type=int,
        default=WIDTH,
        help="the MLP's hidden width; --width 1 leaves almost no kernel time, so the differences printed in us "
        "per update are the loops' own cost, with less of the kernels' run-to-run noise",
    )
    p.add_argument("--cpu", action="store_true", help="the CPU even where there is a GPU")
    p.add_argument("--instructions", action="store_true", help="count CPU instructions per update (callgrind)")
    p.add_argument(
        "--launch_bound",
        action="store_true",
        help="the launch-bound case: plain+, defaults, bare Accelerate and transformers.Trainer with the same "
        "features, us per update added over plain+, aten ops and Python calls per update (width 1 unless given)",
    )
    p.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_count", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_helper", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    CPU, WIDTH = a.cpu, 1 if a.launch_bound and "--width" not in sys.argv else a.width
    torch.set_num_threads(a.threads)
    # The Trainer fixes glibc's malloc thresholds for a CPU run (accel_trainer/cpu_allocator.py), and they are the
    # process's: set here, before any row, every row runs under the same allocator settings, so that the ratios
    # are of loop code (bench/text.py, one process per contestant, shows what the settings themselves are worth).
    cpu_allocator.keep_freed_memory(training_device(CPU).type)
    if a._memory:
        _measure_memory(a._memory, a.steps)
        return
    if a._count:
        with on_a_terminal() if a._count in ON_A_TERMINAL else contextlib.nullcontext():
            _count(a._count, a._helper)
        return
    if a.instructions:
        n = count_instructions(a.threads, LAUNCH_ROWS if a.launch_bound else COUNTED_ROWS)
        print(
            f"torch {torch.__version__}, {training_device(CPU).type}, {a.threads} thread(s), "
            f"MLP 256-{WIDTH}-{WIDTH}-10, CPU instructions per update (callgrind, user space, updates "
            f"{WARM_UPDATES + 1}-{WARM_UPDATES + COUNTED_UPDATES})"
        )
        pairs = (("plain", None), ("trainer", "plain"), ("plain+", "plain"), ("defaults", "plain+"))
        if a.launch_bound:
            pairs = (("plain+", None), ("defaults", "plain+"), ("accel+", "plain+"), ("hf", "plain+"))
        for name, base in pairs:
            vs = f"  {n[name] - n[base]:+10,.0f} = {n[name] / n[base]:.4f}x {base}" if base else ""
            print(f"  {name:8s} {n[name]:12,.0f}{vs}")
        print("RESULT " + json.dumps({"width": WIDTH, "instructions_per_update": n}), flush=True)
        return
    if a.launch_bound:
        counted = 100
        rows = launch_bound(a.rounds, a.steps, counted)
        print_launch_bound(rows, a.rounds, a.steps, counted)
        print("RESULT " + json.dumps({"launch_bound": rows, "width": WIDTH, "rounds": a.rounds, "steps": a.steps}))
        return
    for name in LOOPS:  # warm-up: imports, allocator, first-call costs
        run(name, 50)
    times, models = {name: [] for name in LOOPS}, {}  # name -> [(wall, CPU) ms per step per round]
    names = list(LOOPS)
    for r in range(a.rounds):
        # Each round starts with the next row: no row always runs first, or right after the same other row.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t, models[name] = run(name, a.steps)
            times[name].append((t[0] * 1e3, t[1] * 1e3))
    wall = {name: statistics.median(w for w, _ in v) for name, v in times.items()}
    cpu = {name: statistics.median(c for _, c in v) for name, v in times.items()}
    memory = {name: peak_memory_mb(name, MEMORY_STEPS) for name in ("plain+", "defaults")}
    device = training_device(CPU)
    print(
        f"torch {torch.__version__}, {device.type}, {a.threads} thread(s), MLP 256-{WIDTH}-{WIDTH}-10, {a.rounds} "
        f"rounds x {a.steps} steps, median ms/step, wall and CPU time of this process"
    )
    print(f"  {'':8s} {'wall':>7s} {'(spread)':>20s} {'ratio':>6s}   {'CPU':>7s} {'(spread)':>20s} {'ratio':>6s}")
    for name in LOOPS:
        base = "plain+" if name == "defaults" else "plain"
        cols = []
        for k, med in ((0, wall), (1, cpu)):
            v = [t[k] for t in times[name]]
            cols.append(f"{med[name]:7.3f} {f'[{min(v):.3f} .. {max(v):.3f}]':>20s} {med[name] / med[base]:6.3f}")
        print(f"  {name:8s} {cols[0]}   {cols[1]}   (ratio: x {base})")
    for what, med in (("wall", wall), ("CPU", cpu)):
        print(
            f"{what:4s}: trainer / plain = {med['trainer'] / med['plain']:.3f}; accel / plain = "
            f"{med['accel'] / med['plain']:.3f}; defaults / plain+ = {med['defaults'] / med['plain+']:.3f} "
            "(goal <= 1.01)"
        )
    # The ratio within each round (the rows ran seconds apart), then its median over rounds: less moved by one slow
    # round than the ratio of the medians above.
    for name, base in (("trainer", "plain"), ("defaults", "plain+")):
        per_round = [t[1] / b[1] for t, b in zip(times[name], times[base])]
        extra_us = statistics.median((t[1] - b[1]) * 1e3 for t, b in zip(times[name], times[base]))
        print(
            f"CPU : {name} / {base} per round: {', '.join(f'{x:.3f}' for x in per_round)}; "
            f"median {statistics.median(per_round):.3f} ({extra_us:+.0f} us per update)"
        )
    weights = {
        "trainer vs plain": identical(models["trainer"], models["plain"]),
        "defaults vs plain+": identical(models["defaults"], models["plain+"]),
    }
    print("final weights after", a.steps, "updates:", "; ".join(f"{k}: {v}" for k, v in weights.items()))
    what = "max_memory_allocated" if device.type != "cpu" else "resident memory above the pre-model baseline"
    print(
        f"peak memory ({what}): plain+ {memory['plain+']:.1f} MB, defaults {memory['defaults']:.1f} MB, "
        f"defaults / plain+ = {memory['defaults'] / max(memory['plain+'], 1e-9):.3f} (goal <= 1.05)"
    )
    result = {
        "device": device.type,
        "rounds": a.rounds,
        "steps": a.steps,
        "ms_per_step": wall,
        "cpu_ms_per_step": cpu,
        "final_weights": weights,
        "peak_memory_mb": memory,
        "width": WIDTH,
        "paired_cpu_ratio": {
            f"{n} / {b}": statistics.median(t[1] / u[1] for t, u in zip(times[n], times[b]))
            for n, b in (("trainer", "plain"), ("defaults", "plain+"))
        },
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
