"""Time from command to first optimizer update: `python recipes/regression.py` vs a plain script doing the same.

Method: each command is started fresh with --logging_steps 1 (the plain script writes the same kind of row itself,
after its first update); this bench polls the run's metrics.jsonl every 2 ms and stops the clock when the first
row is complete. So "first update" = process start, imports, data, model, optimizer, one forward/backward/step,
and one JSON line written. CPU seconds of the process at that moment come from /proc/PID/stat (10 ms ticks;
robust to other processes sharing the cores). Floors for comparison: `python -c "import torch"` and
`python -c "import accel_trainer"` to exit. Rows are interleaved over --rounds rounds; medians are printed.

  plain          `python bench/startup.py --_plain OUT`: the regression recipe's synthetic data (same sizes and
                 seeds), MLP, DataLoader, AdamW, linear schedule and clipping, hand-written, no accel_trainer,
                 no accelerate
  trainer        `python recipes/regression.py --logging_steps 1 ...`
  trainer 2proc  `accelerate launch` of the same with 2 CPU processes (rank 0 writes the row after the first
                 update of the 2-process world; no CPU column: several processes)

    python bench/startup.py               # ~1 minute
    python bench/startup.py --rounds 5 --json runs/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import harness
from harness import ROOT

STEPS = 3


def plain_script(out: str) -> None:
    """What a user would write by hand for the regression recipe's defaults (see recipes/regression.py)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    t0 = time.perf_counter()
    features, targets, hidden, n = 16, 4, 32, 256
    torch.manual_seed(42)
    w = torch.randn(features, targets, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, features, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, targets, generator=g)

    class Data(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"x": x[i], "y": y[i]}

    model = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Dropout(0.0), nn.Linear(hidden, targets))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / STEPS))
    os.makedirs(out, exist_ok=True)

    def log_row(step, loss):
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            row = {"step": step, "elapsed_s": time.perf_counter() - t0, "loss": loss.item()}
            f.write(json.dumps(row) + "\n")

    mse = lambda model, batch: ((model(batch["x"]) - batch["y"]) ** 2).mean()  # noqa: E731
    loader = DataLoader(Data(), batch_size=16, shuffle=True)
    harness.hand_written_loop(model, loader, mse, opt, sched, STEPS, max_grad_norm=1.0, after_update=log_row)


def time_to_first_row(cmd: list[str], out: str, timeout: float, cpu: bool) -> tuple[float, float | None, float]:
    """(seconds from start to the first complete metrics.jsonl row, CPU seconds then, seconds to exit)."""
    rc, stamps, end = harness.watch(cmd, out, timeout, env=harness.child_env(), cwd=ROOT, rows=1)
    if rc != 0 or not stamps:
        harness.exit_with_log(f"{' '.join(cmd)} (first row: {'yes' if stamps else 'none'})", rc, out + ".log")
    first, first_cpu = stamps[0]
    return first, first_cpu if cpu else None, end


def time_to_exit(cmd: list[str], timeout: float) -> tuple[float, float, float]:
    def children_cpu():
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    c0, t0 = children_cpu(), time.perf_counter()
    subprocess.run(cmd, check=True, env=harness.child_env(), cwd=ROOT, timeout=timeout, capture_output=True)
    t = time.perf_counter() - t0
    return t, children_cpu() - c0, t


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are printed")
    p.add_argument("--no_2proc", action="store_true", help="leave out the 2-process accelerate launch")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--_plain", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._plain:
        plain_script(a._plain)
        return

    py = sys.executable
    recipe = os.path.join(ROOT, "recipes", "regression.py")
    recipe_args = ["--logging_steps", "1", "--max_steps", str(STEPS), "--save_steps", "0", "--disable_tqdm"]
    rows = {
        'python -c "import torch"': lambda out: time_to_exit([py, "-c", "import torch"], a.timeout),
        'python -c "import accel_trainer"': lambda out: time_to_exit([py, "-c", "import accel_trainer"], a.timeout),
        "plain script": lambda out: time_to_first_row(
            [py, os.path.abspath(__file__), "--_plain", out], out, a.timeout, True
        ),
        "trainer (recipes/regression.py)": lambda out: time_to_first_row(
            [py, recipe, "--output_dir", out, *recipe_args], out, a.timeout, True
        ),
    }
    if not a.no_2proc:
        rows["trainer, accelerate launch 2 procs"] = lambda out: time_to_first_row(
            harness.launch_cmd(2) + [recipe, "--output_dir", out, *recipe_args],
            out,
            a.timeout,
            False,
        )
    results = {k: [] for k in rows}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for r in range(a.rounds):
            for i, (name, fn) in enumerate(rows.items()):
                results[name].append(fn(os.path.join(tmp, f"r{r}_{i}")))
    load = harness.loadavg()

    def med(name, k):
        vals = [t[k] for t in results[name] if t[k] is not None]
        return statistics.median(vals) if vals else None

    import torch

    print(
        f"median of {a.rounds} round(s), torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS=1, "
        f"load average at the end {load}"
    )
    print(f"  {'':36s} {'to first update':>15s} {'CPU s then':>10s} {'to exit':>8s}")
    for name in rows:
        first, cpu, end = med(name, 0), med(name, 1), med(name, 2)
        what = "(exit)" if name.startswith("python -c") else ""
        cpu_s = f"{cpu:10.2f}" if cpu is not None else f"{'':10s}"
        print(f"  {name:36s} {first:13.2f} s{cpu_s} {end:7.2f}s {what}")
    plain, trainer = "plain script", "trainer (recipes/regression.py)"
    print(
        f"  trainer / plain to first update: {med(trainer, 0) / med(plain, 0):.2f}x wall, "
        f"{(med(trainer, 1) or 0) / (med(plain, 1) or 1):.2f}x CPU; difference {med(trainer, 0) - med(plain, 0):+.2f} s"
    )
    harness.write_json(a.json, {"rounds": results, "loadavg_end": load})


if __name__ == "__main__":
    main()
