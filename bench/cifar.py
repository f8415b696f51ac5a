"""Benchmark recipes/cifar.py: time to target accuracy, images/s, peak memory and accuracy, over several seeds.

    python bench/cifar.py --dataset ../shared/data/cifar10 --seeds 5                 # default preset (a GPU)
    python bench/cifar.py --preset small --dataset ../shared/data/cifar10 --seeds 2  # the CPU preset
    python bench/cifar.py --seeds 5 --torch_compile --warmup                         # compile warm-up excluded

Every flag after the bench's own is passed to the recipe (any TrainingArguments or recipe flag).

Timing, the airbench way: `train_s` is the time of Trainer.fit() -- training plus the final eval with TTA --
minus the per-epoch evals (which are only there to draw the accuracy curve), with the data already on the device
and the model built (whitening init included: it is part of the method). `--warmup` first runs a short throwaway
run so that torch.compile / cuDNN autotuning are not timed. `wall_s` is everything for one run: building the
Trainer (data onto the device, model, optimizer) plus fit() with all evals. `process_s` is the whole bench process
from its first line, imports included. GPU timings are taken after torch.cuda.synchronize().
"""

import time

PROCESS_START = time.perf_counter()

import os  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as recipes/cifar.py does, before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import cifar  # noqa: E402

from accel_trainer import Trainer, resolve_args, throughput  # noqa: E402
from accel_trainer.recipe import load_recipe  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    # What the process still holds on the GPU before this run's Trainer is built: the runs before it were dropped,
    # so near what the first run found (the CUDA context's own is not counted). And each run's peak its own.
    held = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_wall = time.perf_counter()
    trainer = Trainer(recipe, resolved, quiet=True)

    # The per-epoch evals are taken out of the training time (and give the accuracy curve), timed through the
    # Trainer's events: an eval runs between an epoch's last update_end and its evaluate_end.
    curve, eval_time, marks = [], [0.0], {}

    def on_update_end(trainer):
        if trainer.data.batch_in_epoch == 0:  # an epoch ended: the eval follows (trainer.data: the data position)
            sync()
            marks["epoch_end"] = time.perf_counter()

    def on_evaluate_end(trainer, results, final):
        if final:
            return
        sync()
        now = time.perf_counter()
        # training time so far = time since fit() began minus the earlier evals
        curve.append((marks["epoch_end"] - marks["fit"] - eval_time[0], trainer.epoch, results.get("eval_accuracy")))
        eval_time[0] += now - marks["epoch_end"]

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
    return {
        "seed": seed,
        "accuracy": acc,
        "tta_accuracy": tta,
        "train_s": train_s,
        "time_to_target_s": reached,
        "images_per_s": n_images / train_s,
        "wall_s": end - t_wall,
        "peak_memory_mb": peak_memory_mb(trainer),
        "held_before_mb": held,
        "curve": [(round(t, 2), e, a) for t, e, a in curve],
        "is_main": trainer.accelerator.is_main_process,
    }


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
    own, recipe_argv = p.parse_known_args()
    target = own.target or (0.87 if "small" in recipe_argv else 0.94)
    recipe = load_recipe(cifar)

    if "--torch_compile" in recipe_argv:
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
            print(
                f"seed {seed}: acc {r['accuracy']:.4f}  tta {tta}  train {r['train_s']:.2f}s  to {target:.2%}: {hit}  "
                f"{r['images_per_s']:.0f} img/s  wall {r['wall_s']:.1f}s  peak {r['peak_memory_mb']:.0f} MB"
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
    print(f"  train_s         {summary([r['train_s'] for r in runs])}")
    reached = [r["time_to_target_s"] for r in runs]
    print(f"  time to {target:.2%}  {summary(reached)}  ({sum(t is not None for t in reached)}/{len(runs)} reached)")
    print(f"  images/s        {summary([r['images_per_s'] for r in runs])}")
    print(f"  wall_s per run  {summary([r['wall_s'] for r in runs])}")
    print(f"  peak memory MB  {max(r['peak_memory_mb'] for r in runs):.0f}")
    print(f"  process_s       {time.perf_counter() - PROCESS_START:.1f}")
    os.makedirs(own.out, exist_ok=True)
    with open(os.path.join(own.out, "summary.json"), "w") as f:
        json.dump(
            {
                "device": device,
                "argv": recipe_argv,
                "target": target,
                "runs": runs,
                "process_s": time.perf_counter() - PROCESS_START,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
