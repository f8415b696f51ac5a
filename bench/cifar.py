"""Benchmark recipes/cifar.py: accuracy, time (two ways), images/s and memory, over several seeds in one process.

    python bench/cifar.py --dataset ../shared/data/cifar10 --seeds 5 --warmup        # default preset (a GPU)
    python bench/cifar.py --preset muon --dataset ../shared/data/cifar10 --seeds 5 --warmup
    python bench/cifar.py --preset small --dataset ../shared/data/cifar10 --seeds 2  # the CPU preset
    python bench/cifar.py --seeds 5 --torch_compile --warmup                         # compile warm-up excluded
    python bench/cifar.py --seeds 2 --launch_wall ...                               # and `accelerate launch` once

Every flag after the bench's own is passed to the recipe (any TrainingArguments or recipe flag).

Time, each saying what it includes:
  airbench_s   as airbench times itself: CUDA events around the whitening init (CifarNet.init_whitening), the
               training (fit_start to each epoch's last update, then from the end of that epoch's evaluation on)
               and the final test-time augmentation (the recipe's on_evaluate_end), read after a synchronize; on a
               CPU perf_counter at the same boundaries. Excluded: reading and uploading the data, building the model,
               optimizer and Trainer, the per-epoch and the final plain evaluations, saving the model, and (with
               --warmup, a short throwaway run first) torch.compile's and cuDNN's warm-up.
  train_s      the time of Trainer.fit() minus the per-epoch evaluations: training, the final save and the final
               evaluation with TTA (the curve's time axis).
  wall_s       one run: building the Trainer (data onto the device, model, optimizer) plus fit() with all evals.
  launch       --launch_wall: `accelerate launch recipes/cifar.py` with the same flags, once, in a fresh process:
               from its start to its last line of output (and to its exit), imports, data loading, compile and
               everything else included; with the precision that run used (run_config.json: `accelerate launch`
               without a config sets ACCELERATE_MIXED_PRECISION=no, which the recipe takes as the user's choice).
  process_s    this bench process from its first line, imports included.

Memory: each run's peak (GPU max allocated; CPU peak RSS) and what the process holds before each run's Trainer is
built (GPU: allocated; CPU: resident memory), which is flat when a dropped Trainer frees what it held.
"""

import time

PROCESS_START = time.perf_counter()

import os  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as recipes/cifar.py does, before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import cifar  # noqa: E402
import harness  # noqa: E402  (bench/, this script's folder)

from accel_trainer import Trainer, resolve_args, throughput  # noqa: E402
from accel_trainer.recipe import load_recipe  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock:
    """The sum of timed intervals, as airbench times itself: on a GPU, CUDA events recorded at the start and the
    end of each interval and read after a synchronize (the GPU's time between them); on a CPU, perf_counter."""

    def __init__(self):
        self.seconds, self.started = 0.0, None
        self.cuda = torch.cuda.is_available()

    def start(self):
        if self.cuda:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = time.perf_counter()

    def stop(self):
        if self.started is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            self.seconds += 1e-3 * self.started.elapsed_time(end)
        else:
            self.seconds += time.perf_counter() - self.started
        self.started = None


CLOCKS: dict = {}  # the current run's airbench-style clocks: "whitening", "training", "tta"


def timed_whitening(init_whitening):
    def timed(self, *args, **kwargs):
        clock = CLOCKS.get("whitening")
        if clock is not None:
            clock.start()
        out = init_whitening(self, *args, **kwargs)
        if clock is not None:
            clock.stop()
        return out

    return timed


def timed_tta(on_evaluate_end):
    def timed(trainer, metrics, final):
        clock = CLOCKS.get("tta") if final else None
        if clock is not None:
            clock.start()
        out = on_evaluate_end(trainer, metrics, final)
        if clock is not None:
            clock.stop()
        return out

    return timed


# Before the recipe is loaded (load_recipe reads its on_evaluate_end): the airbench-style boundaries, in the
# recipe's own code, for this process only.
cifar.CifarNet.init_whitening = timed_whitening(cifar.CifarNet.init_whitening)
cifar.on_evaluate_end = timed_tta(cifar.on_evaluate_end)


def resident_mb() -> float | None:
    """This process's resident memory now (Linux /proc), in MB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


def peak_memory_mb(trainer):
    """The run's peak: GPU max allocated, else the process's peak RSS. The Trainer resets the peak at each log row
    (each row carries its window's peak), so the run's is the largest logged one or the peak since the last row."""
    logged = []
    path = os.path.join(trainer.args.output_dir, "metrics.jsonl")
    if os.path.exists(path):  # written by the main process
        with open(path) as f:
            logged = [row["peak_memory_mb"] for row in map(json.loads, filter(str.strip, f)) if "peak_memory_mb" in row]
    return max([throughput.peak_memory_mb(trainer.accelerator.device), *logged])


def one_run(recipe, recipe_argv, seed, target, out_root):
    out = os.path.join(out_root, f"seed{seed}")
    argv = recipe_argv + ["--seed", str(seed), "--output_dir", out, "--overwrite_output_dir", "--disable_tqdm"]
    resolved = resolve_args(recipe, argv)  # the same resolution as `python recipes/cifar.py ...`
    sync()
    # What the process still holds before this run's Trainer is built: the runs before it were dropped, so near what
    # the first run found (GPU: allocated, the CUDA context's own not counted; CPU: resident memory). And each run's
    # peak its own.
    held = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else resident_mb()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    CLOCKS.clear()
    CLOCKS.update(whitening=Clock(), training=Clock(), tta=Clock())
    t_wall = time.perf_counter()
    trainer = Trainer(recipe, resolved, quiet=True)

    # The per-epoch evals are taken out of the training time (and give the accuracy curve), timed through the
    # Trainer's events: an eval runs between an epoch's last update_end and its evaluate_end.
    curve, eval_time, marks = [], [0.0], {}

    training = CLOCKS["training"]

    def on_fit_start(trainer):
        training.start()

    def on_update_end(trainer):
        ended = trainer.data.batch_in_epoch == 0  # an epoch ended: the eval follows (trainer.data: the data position)
        if trainer.global_step >= trainer.total_steps or (
            trainer.eval_loader is not None and trainer.args.evaluates_after(trainer.global_step, ended)
        ):
            training.stop()  # an evaluation or the run's end follows: airbench's training timer stops here
        if ended:
            sync()
            marks["epoch_end"] = time.perf_counter()

    def on_evaluate_end(trainer, results, final):
        if final:
            return
        if trainer.global_step < trainer.total_steps:
            training.start()
        sync()
        now = time.perf_counter()
        # training time so far = time since fit() began minus the earlier evals
        curve.append((marks["epoch_end"] - marks["fit"] - eval_time[0], trainer.epoch, results.get("eval_accuracy")))
        eval_time[0] += now - marks["epoch_end"]

    trainer.on("fit_start", on_fit_start)
    trainer.on("update_end", on_update_end)
    trainer.on("evaluate_end", on_evaluate_end)
    sync()
    marks["fit"] = time.perf_counter()
    final = trainer.fit()
    sync()
    end = time.perf_counter()
    train_s = end - marks["fit"] - eval_time[0]
    acc, tta = final.get("eval_accuracy"), final.get("eval_tta_accuracy")
    best = tta if tta is not None else acc
    curve.append((train_s, trainer.epoch, best))
    reached = next((t for t, _, a in curve if a is not None and a >= target), None)
    # Images trained on: epochs done x split size (the last batch of an epoch may be short).
    n_images = trainer.total_steps / trainer.updates_per_epoch * len(trainer.train_loader.labels)
    parts = {k: c.seconds for k, c in CLOCKS.items()}
    return {
        "seed": seed,
        "accuracy": acc,
        "tta_accuracy": tta,
        "airbench_s": sum(parts.values()),
        "airbench_parts_s": parts,
        "train_s": train_s,
        "time_to_target_s": reached,
        "images_per_s": n_images / train_s,
        "wall_s": end - t_wall,
        "peak_memory_mb": peak_memory_mb(trainer),
        "held_before_mb": held,
        "curve": [(round(t, 2), e, a) for t, e, a in curve],
        "is_main": trainer.accelerator.is_main_process,
    }


def launch_wall(recipe_argv, out) -> dict:
    """`accelerate launch recipes/cifar.py` with the recipe flags, as the README runs it, in a fresh process: the
    seconds from its start to its last line of output and to its exit. Its output goes to OUT.log."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", os.path.join(ROOT, "recipes", "cifar.py"), *recipe_argv]
    cmd += ["--output_dir", out, "--overwrite_output_dir", "--disable_tqdm"]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    start = last = time.perf_counter()
    with open(f"{out}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=harness.child_env(threads=None), cwd=ROOT)  # fmt: skip
        for line in proc.stdout:
            last = time.perf_counter()
            log.write(line)
        rc = proc.wait()
    end = time.perf_counter()
    if rc != 0:
        raise SystemExit(f"error: `accelerate launch recipes/cifar.py` exited {rc}: see {out}.log")
    with open(os.path.join(out, "run_config.json")) as f:
        precision = json.load(f)["topology"]["mixed_precision"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tta = [r["eval_tta_accuracy"] for r in rows if "eval_tta_accuracy" in r]
    return {"cmd": cmd, "last_line_s": last - start, "exit_s": end - start, "mixed_precision": precision,
            "tta_accuracy": tta[-1] if tta else None}  # fmt: skip


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.mean(values):.4g} +- {statistics.stdev(values):.2g} (min {min(values):.4g}, max {max(values):.4g})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5, help="runs, with seeds 0..N-1")
    p.add_argument("--first_seed", type=int, default=0)
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="accuracy for time-to-target (default: 0.94, or 0.87 for --preset small)",
    )
    p.add_argument("--warmup", action="store_true", help="a short untimed run first (torch.compile, autotuning)")
    p.add_argument("--out", default="runs/bench_cifar", help="output folders of the runs; a JSON summary too")
    p.add_argument(
        "--launch_wall", action="store_true", help="then `accelerate launch recipes/cifar.py` once: its wall time"
    )
    own, recipe_argv = p.parse_known_args()
    target = own.target or (0.87 if "small" in recipe_argv else 0.94)
    recipe = load_recipe(cifar)

    if any(a.startswith("--torch_compile") for a in recipe_argv):
        # Each run here builds a new Accelerator, and torch.compile guards on the identity of its autocast wrapper:
        # every seed compiles its graphs (train, eval) again, and at dynamo's default limit of 8 per function the
        # later seeds silently ran eager (seen on an H100: 8 graphs, no speed-up). A process of one run (the recipe)
        # compiles 2-3. The compile row compares epochs after the first, where the compiling is done.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * (own.seeds + 1))
    if own.warmup:
        one_run(recipe, recipe_argv + ["--max_steps", "3"], 12345, 2.0, own.out)
    runs = []
    for seed in range(own.first_seed, own.first_seed + own.seeds):
        r = one_run(recipe, recipe_argv, seed, target, own.out)
        runs.append(r)
        if r["is_main"]:
            tta = "n/a" if r["tta_accuracy"] is None else f"{r['tta_accuracy']:.4f}"
            hit = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}s"
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["airbench_parts_s"].items())
            print(
                f"seed {seed}: acc {r['accuracy']:.4f}  tta {tta}  airbench-style {r['airbench_s']:.3f}s ({parts})  "
                f"train {r['train_s']:.2f}s  to {target:.2%}: {hit}  {r['images_per_s']:.0f} img/s  "
                f"wall {r['wall_s']:.1f}s  peak {r['peak_memory_mb']:.0f} MB"
                + ("" if r["held_before_mb"] is None else f" (held before {r['held_before_mb']:.0f} MB)"),
                flush=True,
            )
            print(
                "  curve (train_s, epoch, accuracy): "
                + ", ".join(f"({t}, {e}, {a:.4f})" for t, e, a in r["curve"] if a is not None),
                flush=True,
            )
    if not runs or not runs[0]["is_main"]:
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU x{torch.get_num_threads()} threads"
    print(f"\n{len(runs)} run(s) on {device}, recipe flags: {' '.join(recipe_argv)}")
    print(f"  accuracy        {summary([r['accuracy'] for r in runs])}")
    print(f"  tta accuracy    {summary([r['tta_accuracy'] for r in runs])}")
    clock = "CUDA events" if torch.cuda.is_available() else "perf_counter"
    print(f"  airbench-style  {summary([r['airbench_s'] for r in runs])}  (whitening + training + TTA, {clock})")
    print(f"  train_s         {summary([r['train_s'] for r in runs])}  (fit() minus the per-epoch evaluations)")
    reached = [r["time_to_target_s"] for r in runs]
    print(f"  time to {target:.2%}  {summary(reached)}  ({sum(t is not None for t in reached)}/{len(runs)} reached)")
    print(f"  images/s        {summary([r['images_per_s'] for r in runs])}")
    print(f"  wall_s per run  {summary([r['wall_s'] for r in runs])}")
    print(f"  peak memory MB  {max(r['peak_memory_mb'] for r in runs):.0f}")
    held = [r["held_before_mb"] for r in runs]
    if all(h is not None for h in held):
        kind = "allocated" if torch.cuda.is_available() else "resident"
        print(f"  held before MB  {', '.join(f'{h:.0f}' for h in held)}  ({kind}, before each run's Trainer)")
    launch = launch_wall(recipe_argv, os.path.join(own.out, "launch")) if own.launch_wall else None
    if launch is not None:
        print(
            f"  launch wall     {launch['last_line_s']:.1f}s to the last line, {launch['exit_s']:.1f}s to exit "
            f"(`accelerate launch recipes/cifar.py`, precision {launch['mixed_precision']}, tta "
            f"{launch['tta_accuracy']})"
        )
    print(f"  process_s       {time.perf_counter() - PROCESS_START:.1f}")
    os.makedirs(own.out, exist_ok=True)
    with open(os.path.join(own.out, "summary.json"), "w") as f:
        json.dump(
            {
                "device": device,
                "argv": recipe_argv,
                "target": target,
                "runs": runs,
                "launch": launch,
                "process_s": time.perf_counter() - PROCESS_START,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
