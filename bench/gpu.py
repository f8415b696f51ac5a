"""The GPU suite in one command: every GPU check of the project, through the recipes' and benches' command lines,
one table on the screen and the same as JSON. Made to run within 10 minutes on one H100/H200 (docs/cifar.md);
--budget bounds it (bench/gpu_run.sh passes 540 s), so the table and the JSON come out in time whatever it takes.
The rows of issue 41 (cifar, cifar_muon, overhead, peak_memory) have not yet run on a GPU.

    python bench/gpu.py --dataset ../shared/data/cifar10            # a GPU machine: the full suite
    python bench/gpu.py --cpu                                       # reduced mode, any machine (~3 min on 2 cores)
    python bench/gpu.py --json runs/gpu_suite.json --skip torch_compile
    python bench/gpu.py --dataset DIR --budget 540                  # ends within 540 s: rows left are skipped
    python bench/gpu.py --dataset DIR --cifar_compile default       # the cifar rows compiled (once, in the warm-up)
    bench/gpu_run.sh --data DIR --out DIR [--wheels DIR]            # the whole GPU run in one command

Checks (rows), GPU mode / CPU reduced mode:

  cifar           bench/cifar.py --seeds 20 --warmup --launch_wall (recipes/cifar.py default preset = airbench94,
                  bf16; eager unless --cifar_compile): accuracy, TTA accuracy, the airbench-style time (CUDA events
                  around the whitening init, the training and the TTA; bench/cifar.py says what each includes),
                  train_s, images/s, and the wall time of one `accelerate launch recipes/cifar.py` from its start to
                  its last line. The goal is airbench's: the mean TTA accuracy over the seeds >= 94% and the mean
                  airbench-style time <= 2.5 s (airbench94 reports 94.01% in 3.83 s on an A100 this way); beside it,
                  how many seeds reached 94% on their own. CPU: 2 seeds on a tiny generated CIFAR (widths 8,16,16,
                  batch 40, 2 epochs).
  cifar_muon      the same with --preset muon (airbench94_muon), no launch: goal mean TTA accuracy >= 94% and mean
                  airbench-style time <= 2.0 s (airbench94_muon reports 94.01% in 2.59 s on an A100).
  bf16            recipes/cifar.py --mixed_precision bf16 --nan_policy skip, 1 seed, its 8th loss made NaN (a bad
                  batch): accuracy, skipped steps (>= 1, or failed), a finite final loss (bf16 has no loss scale). CPU: the tiny run (bf16 autocast works on a CPU).
  fp16            the same with fp16: loss scale (last and lowest logged), skipped steps: the NaN skipped while the
                  loss scaler had unscaled for clipping. CPU: skipped -- Accelerate
                  runs fp16 on a CPU as plain fp32 (no autocast, no loss scaler), so there is nothing to check.
  fp8             recipes/causal_lm.py --mixed_precision fp8 on a tiny Llama built here (2 layers, width 256: nn.Linear
                  layers with features divisible by 16, which Accelerate's fp8 backends convert), where compute
                  capability >= 8.9 and an fp8 backend is installed, else skipped: the number of layers that ran in
                  fp8 (the Trainer's count in run_config.json); failed when none did or the loss did not go down.
                  Not yet run on a GPU. CPU: skipped.
  torch_compile   bench/cifar.py --torch_compile --warmup, 2 seeds: images/s vs the eager cifar row, accuracy,
                  and the graphs dynamo compiled in that process (failed when none: a model that never compiled
                  trains at eager speed and looks fine). CPU: the tiny run through recipes/cifar.py
                  --torch_compile (inductor; ~30 s of compiling cold on an idle machine).
  overhead        bench/overhead.py on the GPU, 3 rounds x 600 steps: ms per update of the Trainer vs a hand-written
                  loop and bare Accelerate, like for like (the same MLP 256-512-512-10, batch 64, data path and
                  AdamW, no clipping); goal trainer <= 1.02x plain. CPU: bench/overhead.py --cpu, 1 round x 100.
  auto_micro_batch  recipes/regression.py as a wide MLP (activations grow with the micro-batch): a run at micro-batch
                  2048 x 8 accumulated; then micro-batch 16384 with the process's GPU memory capped at 1.5x that
                  run's peak (torch.cuda.set_per_process_memory_fraction, a real CUDA out of memory): without
                  --auto_micro_batch one line and a non-zero exit, with it three halvings to 2048 and the weights of
                  the run started there. CPU: skipped (tests/test_micro_batch.py raises the error on CPUs).
  save_async      recipes/regression.py (width 1024) three times, 8 updates, checkpoints at 4 and 8: synchronous,
                  --save_async, and resumed from the async step 4: the checkpoints' files (size, sha256) and the
                  final weights the same bytes. On a GPU the background write stages through pinned host memory.
                  CPU: the same (tests/test_async_save.py asserts it there).
  peak_memory     the largest peak over the cifar row's runs (torch.cuda.max_memory_allocated; CPU: peak RSS),
                  each seed's, the Trainer's own logged peak_memory_mb when present, and what the process held before
                  each seed's Trainer (GPU: allocated; CPU: resident): the goal (GPU), memory flat over the seeds,
                  that a dropped Trainer freed its GPU memory.

Every row gets a status: "ok", "failed: <one line>" (the log is under --out/logs/), or "skipped: <why>". With
--budget, no command runs past the suite's deadline and the rows left when it passes are skipped: the table and the
JSON come out in time, with what fitted.
Goals are judged only in GPU mode. The exit status is 1 when a row failed, else 0.

Data and wheels: the GPU machine needs the CIFAR-10 folder (`--dataset`, default shared/data/cifar10 or
../shared/data/cifar10) and the project's Python packages; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import harness
from harness import ROOT

ROWS = (  # the goal rows first: with --budget, the rows left when it runs out are the ones skipped
    "cifar",
    "cifar_muon",
    "overhead",
    "peak_memory",
    "bf16",
    "fp16",
    "fp8",
    "torch_compile",
    "auto_micro_batch",
    "save_async",
)
NEEDS_CUDA = "skipped: needs CUDA"
TINY_CIFAR = ["--widths", "8,16,16", "--batch_size", "40", "--eval_batch_size", "30", "--num_train_epochs", "2"]


class CheckFailed(Exception):
    """A check that could not produce its numbers; the message is the row's one-line status."""


# ------------------------------------------------------------------------------------------------ running
class Suite:
    def __init__(self, a):
        self.a = a
        self.gpu = not a.cpu
        self.out = os.path.abspath(a.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.rows: dict[str, dict] = {}
        self.deadline = time.monotonic() + a.budget if a.budget else None
        if self.gpu:
            self.env = harness.child_env(threads=None)
        else:  # the reduced mode is about paths, not speed: one thread, light on a shared CPU
            self.env = harness.child_env(threads=1, CUDA_VISIBLE_DEVICES="")  # --cpu on a GPU machine: the CPU

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def sh(self, name: str, cmd: list[str], timeout: float | None = None) -> str:
        """Run a command; its output goes to logs/<name>.log. A non-zero exit raises CheckFailed with its last line."""
        rc, text = self.run(name, cmd, timeout)
        if rc != 0:
            lines = [line for line in text.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith(("error", "Error")) or "Error:" in line]
            line = (errors or lines or ["no output"])[-1]
            raise CheckFailed(f"exit {rc}: {line[:200]} (log: {os.path.join(self.logs, name)}.log)")
        return text

    def run(self, name: str, cmd: list[str], timeout: float | None = None) -> tuple[int, str]:
        """Run a command; its output goes to logs/<name>.log. Returns (exit status, output)."""
        log = os.path.join(self.logs, f"{name}.log")
        timeout = timeout or self.a.timeout
        if self.deadline is not None:
            timeout = min(timeout, self.time_left())
            if timeout < 1:
                raise CheckFailed(f"no time left in --budget {self.a.budget:.0f} s")
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"timed out after {timeout:.0f} s (log: {log})") from None
        with open(log) as f:
            return rc, f.read()

    def cifar_args(self) -> list[str]:
        args = ["--dataset", self.a.dataset]
        if self.a.cache_dir:
            args += ["--cache_dir", self.a.cache_dir]
        return args + ([] if self.gpu else TINY_CIFAR)


def read_rows(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def last(rows: list[dict], key: str):
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else None


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


# ---------------------------------------------------------------------------------------------------- checks
# The goals (issue 41): airbench-style time (bench/cifar.py's airbench_s: whitening, training and TTA) and the mean
# TTA accuracy over the seeds, per preset.
CIFAR_GOALS = {"default": (0.94, 2.5), "muon": (0.94, 2.0)}


def cifar_goal(preset: str) -> str:
    accuracy, seconds = CIFAR_GOALS[preset]
    return f"mean TTA accuracy >= {accuracy} and mean airbench-style time (whitening + training + TTA) <= {seconds} s"


def check_cifar(s: Suite, preset: str = "default") -> dict:
    """bench/cifar.py over the seeds in one process (a warm-up run first on a GPU), the preset's goal judged on
    the mean TTA accuracy and the mean airbench-style time; the default preset's row also times `accelerate launch
    recipes/cifar.py` once (start to last line)."""
    name = "cifar" if preset == "default" else f"cifar_{preset}"
    out = os.path.join(s.out, name)
    seeds = s.a.seeds if s.a.seeds else (20 if s.gpu else 2)
    cmd = [sys.executable, "bench/cifar.py", "--seeds", str(seeds), "--target", "0.94", "--out", out]
    cmd += (["--warmup"] if s.gpu else []) + (["--launch_wall"] if preset == "default" else [])
    cmd += s.cifar_args() + (["--preset", preset] if preset != "default" else [])
    if getattr(s.a, "cifar_compile", None):
        cmd += ["--torch_compile_mode", s.a.cifar_compile]
    s.sh(name, cmd)
    with open(os.path.join(out, "summary.json")) as f:
        report = json.load(f)
    runs = report["runs"]
    m = cifar_metrics(runs)
    m["launch"] = report.get("launch")
    logged = [last(read_rows(os.path.join(out, f"seed{r['seed']}")), "peak_memory_mb") for r in runs]
    m["logged_peak_memory_mb"] = max((v for v in logged if v is not None), default=None)
    tta = f" (tta {m['tta_accuracy_mean']:.4f})" if m["tta_accuracy_mean"] is not None else ""
    summary = (
        f"acc {m['accuracy_mean']:.4f}{tta}, {m['reached_94']} seeds >= 94%, airbench-style "
        f"{m['airbench_s_mean']:.2f} s (train {m['train_s_mean']:.2f} s), {m['images_per_s_mean']:.0f} img/s"
    )
    if m["launch"]:
        summary += f", accelerate launch {m['launch']['last_line_s']:.1f} s to its last line"
    met = cifar_goal_met(m, preset) if s.gpu else None
    return {"metrics": m, "summary": summary, "goal": cifar_goal(preset), "met": met}


def check_cifar_muon(s: Suite) -> dict:
    return check_cifar(s, "muon")


def cifar_metrics(runs: list[dict]) -> dict:
    """bench/cifar.py's runs as airbench states its result: the mean TTA accuracy over the seeds (the plain accuracy
    where a run had no TTA) and the mean airbench-style time; beside them, the seeds that reached 94% on their own
    (at a mean of 94.01% and sd 0.13, about half of them do), train_s, memory."""
    final = [r["tta_accuracy"] if r["tta_accuracy"] is not None else r["accuracy"] for r in runs]
    return {
        "seeds": len(runs),
        "accuracy_mean": mean(r["accuracy"] for r in runs),
        "accuracy_min": min(r["accuracy"] for r in runs),
        "tta_accuracy_mean": mean(r["tta_accuracy"] for r in runs),
        "final_accuracy_mean": mean(final),
        "reached_94": f"{sum(a >= 0.94 for a in final)}/{len(runs)}",
        "airbench_s_mean": mean(r.get("airbench_s") for r in runs),
        "airbench_parts_s_mean": {
            k: mean(r["airbench_parts_s"][k] for r in runs) for k in (runs[0].get("airbench_parts_s") or {})
        },
        "train_s_mean": mean(r["train_s"] for r in runs),
        "images_per_s_mean": mean(r["images_per_s"] for r in runs),
        "peak_memory_mb": max(r["peak_memory_mb"] for r in runs),
        "peak_memory_mb_per_seed": [round(r["peak_memory_mb"]) for r in runs],
        # what the process held before each seed's Trainer was built (the seeds before it dropped): GPU allocated,
        # CPU resident
        "held_before_mb_per_seed": [
            None if r.get("held_before_mb") is None else round(r["held_before_mb"]) for r in runs
        ],
        "steady_epoch_s_mean": mean(steady_epoch_s(r) for r in runs),
    }


def steady_epoch_s(run: dict) -> float | None:
    """Seconds per epoch after the first (bench/cifar.py's curve: (train_s, epoch, accuracy) at each epoch's eval):
    the speed once compiled and autotuned. The compile row's comparison with eager: its train_s holds each seed's
    compiling (every run builds a new Accelerator, whose autocast wrapper torch.compile guards on), this does not."""
    firsts = {}
    for t, epoch, _ in run.get("curve") or []:
        firsts.setdefault(epoch, t)
    epochs = sorted(firsts)
    if len(epochs) < 3:
        return None
    return (firsts[epochs[-1]] - firsts[epochs[0]]) / (epochs[-1] - epochs[0])


def cifar_goal_met(m: dict, preset: str = "default") -> bool:
    accuracy, seconds = CIFAR_GOALS[preset]
    return m["final_accuracy_mean"] >= accuracy and m["airbench_s_mean"] <= seconds


NAN_LOSS = "--nan_loss"  # bench/gpu.py --nan_loss N RECIPE ARGS...: see nan_loss()
NAN_AT = 8  # the precision rows' poisoned micro-batch (its loss call), early enough for any preset


def nan_loss(argv: list[str]) -> None:
    """`python RECIPE ARGS` with the recipe's Nth loss made NaN (argv: N RECIPE ARGS...): the precision rows' bad
    batch, through the recipe's own contract (`loss` imported and wrapped), as a real NaN would arrive. Under fp16
    it is the path a GPU alone runs: the NaN skipped by --nan_policy skip while the loss scaler has unscaled for
    clipping (once a crash at the next update)."""
    import functools
    import importlib.util

    at, path, args = int(argv[0]), argv[1], argv[2:]
    spec = importlib.util.spec_from_file_location("bench_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python RECIPE` sets it
    spec.loader.exec_module(recipe)
    calls, original = [0], recipe.loss

    @functools.wraps(original)
    def loss(*a, **k):
        out = original(*a, **k)
        calls[0] += 1
        if calls[0] == at:
            value, *rest = out if isinstance(out, tuple) else (out,)
            out = (value * float("nan"), *rest) if rest else value * float("nan")
            print(f"bench/gpu.py: loss call {at} made NaN", flush=True)
        return out

    recipe.loss = loss
    from accel_trainer import run

    run(recipe, args)


def _precision_run(s: Suite, name: str, precision: str) -> dict:
    out = os.path.join(s.out, name)
    cmd = [sys.executable, "bench/gpu.py", NAN_LOSS, str(NAN_AT), "recipes/cifar.py", *s.cifar_args()]
    cmd += ["--mixed_precision", precision, "--nan_policy", "skip"]
    cmd += ["--seed", "0", "--logging_steps", "5", "--output_dir", out, "--overwrite_output_dir", "--disable_tqdm"]
    s.sh(name, cmd)
    rows = read_rows(out)
    with open(os.path.join(out, "run_config.json")) as f:
        used = json.load(f)["topology"]["mixed_precision"]
    if used != precision:
        raise CheckFailed(f"asked for --mixed_precision {precision}, the run used {used!r}")
    scales = [r["loss_scale"] for r in rows if "loss_scale" in r]
    m = {
        "mixed_precision": used,
        "accuracy": last(rows, "eval_accuracy"),
        "tta_accuracy": last(rows, "eval_tta_accuracy"),
        "skipped_steps": last(rows, "skipped_steps"),
        "loss_scale_last": scales[-1] if scales else None,
        "loss_scale_min": min(scales) if scales else None,
        "final_loss": last(rows, "loss"),
    }
    if precision == "fp16" and not scales:
        raise CheckFailed("fp16 ran without a loss scaler (no loss_scale in metrics.jsonl)")
    if not m["skipped_steps"]:
        raise CheckFailed(f"the NaN loss at loss call {NAN_AT} was not skipped (skipped_steps {m['skipped_steps']})")
    if m["final_loss"] is None or not math.isfinite(m["final_loss"]):
        raise CheckFailed(f"the run did not recover from the NaN batch: final loss {m['final_loss']}")
    scale = f", loss scale {m['loss_scale_last']:g} (min {m['loss_scale_min']:g})" if scales else ""
    summary = f"acc {m['accuracy']:.4f}, skipped steps {m['skipped_steps']}{scale}"
    return {"metrics": m, "summary": summary}


def check_bf16(s: Suite) -> dict:
    return _precision_run(s, "bf16", "bf16")


def check_fp16(s: Suite) -> dict:
    return _precision_run(s, "fp16", "fp16")


def tiny_llama(out: str) -> tuple[str, str]:
    """The fp8 row's model and text, made here (nothing downloaded): a 2-layer, 256-wide Llama config whose 14
    projections are nn.Linear with features that are multiples of 16 (tests/text_fixtures.py), a BPE tokenizer,
    and 4000 lines of generated sentences. Returns (model folder, text file)."""
    folder, text = os.path.join(out, "tiny_llama"), os.path.join(out, "tiny_llama.txt")
    if not os.path.isfile(text):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from text_fixtures import make_tiny_llama, sentences

        lines = sentences(4000)
        make_tiny_llama(folder, lines)
        with open(text, "w") as f:
            f.write("\n".join(lines) + "\n")
    return folder, text


def fp8_command(s: Suite, precision: str, steps: int = 60) -> tuple[list[str], str]:
    """recipes/causal_lm.py on the tiny Llama: the command of the fp8 row, and its output folder."""
    folder, text = tiny_llama(s.out)
    out = os.path.join(s.out, f"llama_{precision}")
    cmd = [sys.executable, "recipes/causal_lm.py", "--config_name", folder, "--tokenizer_name", folder]
    cmd += ["--train_file", text, "--block_size", "128", "--per_device_train_batch_size", "16"]
    cmd += ["--max_steps", str(steps), "--learning_rate", "1e-3", "--logging_steps", "10", "--save_steps", "0"]
    cmd += ["--sample_max_new_tokens", "0", "--mixed_precision", precision, "--seed", "0"]
    cmd += ["--output_dir", out, "--overwrite_output_dir", "--disable_tqdm"]
    return cmd, out


def check_fp8(s: Suite) -> dict:
    # Not the CIFAR net: its only Linear (256 -> 10) is one no fp8 backend converts, so an fp8 "run" of it was bf16.
    # The Trainer counts the converted layers (run_config.json "fp8_layers") and refuses a run with none.
    cmd, out = fp8_command(s, "fp8")
    s.sh("fp8", cmd)
    with open(os.path.join(out, "run_config.json")) as f:
        config = json.load(f)
    used, layers = config["topology"]["mixed_precision"], config.get("fp8_layers") or {}
    if used != "fp8":
        raise CheckFailed(f"asked for --mixed_precision fp8, the run used {used!r}")
    if not layers.get("converted"):
        raise CheckFailed(f"no layer ran in fp8 (run_config.json fp8_layers: {layers or 'absent'}): a bf16 run")
    losses = [r["loss"] for r in read_rows(out) if "loss" in r]
    if not losses or not all(map(math.isfinite, losses)) or losses[-1] >= losses[0]:
        raise CheckFailed(f"fp8 training did not lower the loss: {losses}")
    m = {"fp8_layers": layers["converted"], "linear_layers": layers["linear"], "backend": layers.get("backend"),
         "loss_first": losses[0], "loss_last": losses[-1]}  # fmt: skip
    summary = (
        f"{m['fp8_layers']} of {m['linear_layers']} Linear layers in fp8 ({m['backend']}), tiny Llama loss "
        f"{m['loss_first']:.3f} -> {m['loss_last']:.3f}"
    )
    return {"metrics": m, "summary": summary}


COUNT_GRAPHS = "--count_graphs"  # bench/gpu.py --count_graphs SCRIPT ARGS...: see count_graphs()


def count_graphs(argv: list[str]) -> None:
    """SCRIPT ARGS run as `python SCRIPT ARGS`, then one line `GRAPHS {...}`: dynamo's counts for the process (the
    compile row's proof that torch.compile compiled something; under a FLOP-counting dispatch mode it once
    compiled nothing and the run just trained at eager speed)."""
    import runpy

    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        from torch._dynamo.utils import counters  # private: torch has no public count of the graphs it compiled

        print("GRAPHS " + json.dumps({k: int(v) for k, v in counters["stats"].items()}), flush=True)


def compiled_graphs(log_text: str) -> int:
    lines = [line for line in log_text.splitlines() if line.startswith("GRAPHS ")]
    return json.loads(lines[-1][7:]).get("unique_graphs", 0) if lines else 0


def check_compile(s: Suite) -> dict:
    counted = [sys.executable, "bench/gpu.py", COUNT_GRAPHS]
    if s.gpu:
        out = os.path.join(s.out, "compile")
        cmd = counted + ["bench/cifar.py", "--seeds", "2", "--warmup", "--torch_compile", "--target", "0.94"]
        text = s.sh("torch_compile", cmd + ["--out", out] + s.cifar_args())
        with open(os.path.join(out, "summary.json")) as f:
            runs = json.load(f)["runs"]
        m = {
            "accuracy_mean": mean(r["accuracy"] for r in runs),
            "images_per_s_mean": mean(r["images_per_s"] for r in runs),
            "train_s_mean": mean(r["train_s"] for r in runs),
            "steady_epoch_s_mean": mean(steady_epoch_s(r) for r in runs),
        }
    else:
        out = os.path.join(s.out, "compile")
        cmd = counted + ["recipes/cifar.py", *s.cifar_args(), "--torch_compile", "--output_dir", out]
        text = s.sh("torch_compile", cmd + ["--overwrite_output_dir", "--disable_tqdm", "--logging_steps", "2"])
        rows = read_rows(out)
        rates = [r["samples_per_second"] for r in rows if "samples_per_second" in r][1:]  # the first holds compiling
        m = {"accuracy_mean": last(rows, "eval_accuracy"), "images_per_s_mean": mean(rates) if rates else None}
    m["compiled_graphs"] = compiled_graphs(text)
    if not m["compiled_graphs"]:
        raise CheckFailed("--torch_compile compiled no graph (dynamo's count is 0): the run was eager")
    eager = s.rows.get("cifar", {}).get("metrics", {}).get("steady_epoch_s_mean")
    if s.gpu and eager and m.get("steady_epoch_s_mean"):
        m["speedup_vs_eager"] = eager / m["steady_epoch_s_mean"]  # per epoch after the first: compiling excluded
    speed = f"{m['images_per_s_mean']:.0f} img/s" if m["images_per_s_mean"] else "img/s n/a"
    summary = f"acc {m['accuracy_mean']:.4f}, {speed}, {m['compiled_graphs']} graphs" + (
        f", x{m['speedup_vs_eager']:.2f} of eager per epoch after the first" if "speedup_vs_eager" in m else ""
    )
    return {"metrics": m, "summary": summary}


def check_overhead(s: Suite) -> dict:
    # bench/overhead.py, not a loop of this file's own: there the hand-written loop, bare Accelerate and the Trainer
    # share the model, the data path (a DataLoader, batches moved to the device) and the optimizer (one AdamW
    # group, no clipping), on the same device; an earlier version of this row compared the regression recipe
    # (decay/no-decay groups, clipping, its own data) with a loop that had neither.
    rounds, steps = (3, 600) if s.gpu else (1, 100)
    cmd = [sys.executable, "bench/overhead.py", "--rounds", str(rounds), "--steps", str(steps)]
    text = s.sh("overhead", cmd + ([] if s.gpu else ["--cpu"]))
    result = json.loads([line for line in text.splitlines() if line.startswith("RESULT ")][-1][7:])
    ms = result["ms_per_step"]
    m = {
        "plain_ms_per_step": ms["plain"],
        "accelerate_ms_per_step": ms["accel"],
        "trainer_ms_per_step": ms["trainer"],
        "defaults_ms_per_step": ms["defaults"],
        "plain_defaults_ms_per_step": ms["plain+"],
        "final_weights": result["final_weights"],
        "peak_memory_mb": result["peak_memory_mb"],
        "rounds": rounds,
        "steps": steps,
        "device": result["device"],
    }
    m["ratio"] = m["trainer_ms_per_step"] / m["plain_ms_per_step"]
    summary = (
        f"trainer {m['trainer_ms_per_step']:.3f} vs plain {m['plain_ms_per_step']:.3f} ms/step: x{m['ratio']:.3f} "
        f"(bare Accelerate {m['accelerate_ms_per_step']:.3f})"
    )
    return {
        "metrics": m,
        "summary": summary,
        "goal": "trainer / plain <= 1.02",
        "met": m["ratio"] <= 1.02 if s.gpu else None,
    }


# A dropped Trainer's GPU memory is back when the next seed starts: what the process holds then may exceed what the
# first seed found by the allocator's rounding and cuDNN/cuBLAS workspaces, not by a model, its optimizer and the
# device-resident CIFAR (the first H100 run grew by about that much over 5 seeds before the fix: docs/cifar.md).
HELD_SLACK_MB = 64


def check_peak_memory(s: Suite) -> dict:
    cifar = s.rows.get("cifar", {})
    if not cifar.get("status", "").startswith("ok"):
        raise CheckFailed("needs the cifar row, which did not run")
    keys = ("peak_memory_mb", "logged_peak_memory_mb", "peak_memory_mb_per_seed", "held_before_mb_per_seed")
    m = {k: cifar["metrics"].get(k) for k in keys}
    kind = "GPU max allocated" if s.gpu else "CPU peak RSS"
    logged = f", Trainer logged {m['logged_peak_memory_mb']:.0f} MB" if m["logged_peak_memory_mb"] else ""
    summary = f"{m['peak_memory_mb']:.0f} MB ({kind}){logged}; per seed {m['peak_memory_mb_per_seed']}"
    held = [h for h in m["held_before_mb_per_seed"] or [] if h is not None]
    if held:
        summary += f"; held before each seed {held} MB" + ("" if s.gpu else " (resident)")
    if not s.gpu or not held:  # CPU: freed memory need not leave the process; tests/test_trainer.py checks the freeing
        return {"metrics": m, "summary": summary}
    met = max(held) - held[0] <= HELD_SLACK_MB
    goal = f"a dropped Trainer frees its GPU memory: held before each seed <= the first's + {HELD_SLACK_MB} MB"
    return {"metrics": m, "summary": summary, "goal": goal, "met": met}


# The auto_micro_batch row: the regression recipe's MLP made wide, so that an update's activations (~200 KB a
# sample in fp32) dwarf its weights, and memory grows with the micro-batch. The reference run starts at SMALL; the
# capped runs ask for BIG at the same global batch, with this process's memory capped at CAP x the reference's peak:
# SMALL fits, 2 x SMALL does not, so --auto_micro_batch halves BIG down to SMALL.
OOM_ARGS = ["--num_features", "16", "--hidden_size", "16384", "--num_train_samples", "65536",
            "--num_eval_samples", "256", "--max_steps", "4", "--learning_rate", "1e-4", "--save_steps", "0",
            "--logging_steps", "1",
            "--seed", "0", "--disable_tqdm", "--overwrite_output_dir"]  # fmt: skip
OOM_SMALL, OOM_BIG, OOM_CAP = 2048, 16384, 1.5
CAP_MEMORY = "--cap_memory"  # bench/gpu.py --cap_memory MB SCRIPT ARGS...: see cap_memory()


def cap_memory(argv: list[str]) -> None:
    """`python SCRIPT ARGS` with this process's GPU memory capped at MB (argv: MB SCRIPT ARGS...), through torch's
    per-process fraction: the caching allocator then raises a real CUDA out-of-memory error beyond it, as a
    smaller GPU would."""
    import runpy

    import torch

    mb, path = float(argv[0]), argv[1]
    torch.cuda.set_per_process_memory_fraction(mb * 2**20 / torch.cuda.get_device_properties(0).total_memory)
    sys.argv = [path, *argv[2:]]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def _weights(out: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model.safetensors"))


def check_auto_micro_batch(s: Suite) -> dict:
    import torch

    runs = {k: os.path.join(s.out, f"oom_{k}") for k in ("small", "refused", "halved")}
    recipe = [sys.executable, "recipes/regression.py", *OOM_ARGS]
    accumulation = OOM_BIG // OOM_SMALL
    s.sh("oom_small", recipe + ["--output_dir", runs["small"], "--per_device_train_batch_size", str(OOM_SMALL),
                                "--gradient_accumulation_steps", str(accumulation)])  # fmt: skip
    peak = max(r["peak_memory_mb"] for r in read_rows(runs["small"]) if "peak_memory_mb" in r)
    cap = [sys.executable, "bench/gpu.py", CAP_MEMORY, f"{OOM_CAP * peak:.0f}", "recipes/regression.py", *OOM_ARGS]
    cap += ["--per_device_train_batch_size", str(OOM_BIG)]
    rc, refused = s.run("oom_refused", cap + ["--output_dir", runs["refused"]])
    if rc == 0:
        raise CheckFailed(f"a micro-batch of {OOM_BIG} fitted under {OOM_CAP * peak:.0f} MB: no out of memory to test")
    lines = [x for x in refused.splitlines()[1:] if x.strip()]
    one_line = [x for x in lines if f"Out of memory in an update at a micro-batch of {OOM_BIG} samples" in x]
    if not one_line or "Traceback" in refused or "--auto_micro_batch" not in one_line[0]:
        raise CheckFailed(f"without the flag, not the one-line error (log: {s.logs}/oom_refused.log)")
    text = s.sh("oom_halved", cap + ["--output_dir", runs["halved"], "--auto_micro_batch"])
    halvings = [x for x in text.splitlines() if x.startswith("out of memory at micro-batch size")]
    a, b = _weights(runs["halved"]), _weights(runs["small"])
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    m = {
        "cap_mb": round(OOM_CAP * peak),
        "small_peak_mb": round(peak),
        "refused_line": one_line[0][:300],
        "halvings": halvings,
        "bit_identical": all(torch.equal(a[k], b[k]) for k in a),
        "max_abs_diff": diff,
        "losses_halved": [r["loss"] for r in read_rows(runs["halved"]) if "loss" in r],
        "losses_small": [r["loss"] for r in read_rows(runs["small"]) if "loss" in r],
    }
    summary = (
        f"capped at {m['cap_mb']} MB: without the flag one line; with it {len(halvings)} halvings "
        f"{OOM_BIG} -> {OOM_SMALL}, weights vs a run started at {OOM_SMALL}: "
        f"{'bit-identical' if m['bit_identical'] else f'max abs diff {diff:.2e}'}"
    )
    goal = f"a real CUDA out of memory halves {OOM_BIG} down to {OOM_SMALL} and gives the started-small run's weights"
    met = len(halvings) == 3 and m["bit_identical"]
    return {"metrics": m, "summary": summary, "goal": goal, "met": met}


SAVE_ARGS = ["--hidden_size", "1024", "--max_steps", "8", "--save_steps", "4", "--logging_steps", "4", "--seed", "0",
             "--disable_tqdm"]  # fmt: skip


def check_save_async(s: Suite) -> dict:
    """tests/test_async_save.py's promise on the device: --save_async's checkpoints hold the synchronous ones' bytes
    (on a GPU they go through pinned host memory, a path CPUs do not take), and a run resumed from one ends with
    the uninterrupted run's weights."""
    import shutil

    runs = {k: os.path.join(s.out, f"save_{k}") for k in ("sync", "async", "resumed")}
    for k in runs:
        shutil.rmtree(runs[k], ignore_errors=True)
    recipe = [sys.executable, "recipes/regression.py", *SAVE_ARGS]
    s.sh("save_sync", recipe + ["--output_dir", runs["sync"]])
    s.sh("save_async", recipe + ["--output_dir", runs["async"], "--save_async"])
    step_4 = os.path.join("checkpoints", "step_4")
    shutil.copytree(os.path.join(runs["async"], step_4), os.path.join(runs["resumed"], step_4))
    s.sh(
        "save_resumed", recipe + ["--output_dir", runs["resumed"], "--save_async", "--resume_from_checkpoint", "latest"]
    )

    def manifest(run: str, step: int) -> dict:
        with open(os.path.join(runs[run], "checkpoints", f"step_{step}", "manifest.json")) as f:
            return json.load(f)["files"]

    def final(run: str) -> bytes:
        with open(os.path.join(runs[run], "model.safetensors"), "rb") as f:
            return f.read()

    for run in ("async", "resumed"):  # equal bytes prove nothing if the flag did not reach the run
        with open(os.path.join(runs[run], "run_config.json")) as f:
            if json.load(f)["args"].get("save_async") is not True:
                raise CheckFailed(f"the {run} run's run_config.json does not record save_async: true")
    files = {(run, step): manifest(run, step) for run in ("sync", "async") for step in (4, 8)}
    differing = sorted(
        os.path.join("checkpoints", f"step_{step}", name)
        for step in (4, 8)
        for name, entry in files["async", step].items()
        if files["sync", step].get(name) != entry
    )
    m = {
        "checkpoints_equal": {step: files["async", step] == files["sync", step] for step in (4, 8)},
        "differing_files": differing,
        # Bytes can differ where values do not: on a GPU the synchronous optimizer.bin pickles its tensors tagged
        # cuda:0, the background copy's are on the CPU (seen on an H100; a resume moves them to the parameters'
        # device either way). So a differing file's tensors are compared as values too.
        "differing_files_same_values": all(same_values(runs, name) for name in differing),
        "async_final_equal": final("async") == final("sync"),
        "resumed_final_equal": final("resumed") == final("sync"),
    }
    met = m["differing_files_same_values"] and m["async_final_equal"] and m["resumed_final_equal"]
    bytes_equal = all(m["checkpoints_equal"].values())
    summary = (
        f"async checkpoints {'=' if bytes_equal else '!='} sync byte for byte"
        + ("" if bytes_equal else f" (differ: {', '.join(differing)}; values "
           f"{'equal' if m['differing_files_same_values'] else 'DIFFER'})")
        + f"; resumed from an async step 4: final weights {'=' if m['resumed_final_equal'] else '!='} uninterrupted"
    )  # fmt: skip
    goal = "--save_async's checkpoints hold the sync ones' values, and a run resumed from one is bit-identical"
    return {"metrics": m, "summary": summary, "goal": goal, "met": met if s.gpu else None}


def same_values(runs: dict, name: str) -> bool:
    """Whether the sync and async runs' file `name` holds the same values (a torch.save pickle, on the CPU)."""
    import torch

    if not name.endswith((".bin", ".pt", ".pth")):
        return False
    a, b = (torch.load(os.path.join(runs[k], name), map_location="cpu", weights_only=True) for k in ("sync", "async"))

    def equal(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(equal, x, y))
        return x == y

    return equal(a, b)


CHECKS = {
    "cifar": check_cifar,
    "cifar_muon": check_cifar_muon,
    "bf16": check_bf16,
    "fp16": check_fp16,
    "fp8": check_fp8,
    "torch_compile": check_compile,
    "overhead": check_overhead,
    "auto_micro_batch": check_auto_micro_batch,
    "save_async": check_save_async,
    "peak_memory": check_peak_memory,
}


def skip_reason(s: Suite, name: str) -> str | None:
    if name in s.a.skip:
        return "skipped: --skip"
    if name == "peak_memory" and s.rows.get("cifar", {}).get("status", "").startswith("skipped"):
        return "skipped: needs the cifar row, which was skipped"
    if not s.gpu and name == "auto_micro_batch":
        return f"{NEEDS_CUDA} (a real CUDA out of memory; tests/test_micro_batch.py raises one on CPUs)"
    if not s.gpu and name == "fp16":
        return f"{NEEDS_CUDA} (Accelerate runs fp16 on a CPU as plain fp32: no autocast, no loss scaler)"
    if name == "fp8":
        if not s.gpu:
            return f"{NEEDS_CUDA} (compute capability >= 8.9)"
        import torch

        # Not accel_trainer.precision.has_fp8: this process imports nothing of the package (see tiny_dataset).
        cc = torch.cuda.get_device_capability()
        if cc < (8, 9):
            return f"skipped: needs compute capability >= 8.9 (this GPU: {cc[0]}.{cc[1]})"
        import accelerate.utils as au

        # Each release's own list: accelerate 1.16 dropped MS-AMP (and is_msamp_available with it).
        asks = ("is_transformer_engine_available", "is_torchao_available", "is_msamp_available")
        if not any(getattr(au, name, lambda: False)() for name in asks):
            return "skipped: no fp8 backend installed (transformer-engine, torchao or MS-AMP)"
    return None


def run_row(s: Suite, name: str) -> dict:
    """One row: skipped, ok with its numbers, or failed with one line. Deciding to skip is inside the `try` too: a
    check that cannot even ask its question must not end the suite before the table and the JSON."""
    try:
        reason = skip_reason(s, name)
        if not reason and s.deadline is not None and s.time_left() < 1 and name != "peak_memory":
            reason = f"skipped: no time left in --budget {s.a.budget:.0f} s"
        return {"status": reason} if reason else {"status": "ok", **CHECKS[name](s)}
    except CheckFailed as e:
        return {"status": f"failed: {e}"}
    except Exception as e:  # a bug in a check must not hide the other rows
        return {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


# ------------------------------------------------------------------------------------------------------ main
def tiny_dataset(out: str) -> str:
    """The tests' tiny learnable CIFAR (tests/cifar_fixtures.py), written once under --out."""
    root = os.path.join(out, "tiny_cifar")
    if not os.path.isdir(os.path.join(root, "hub")):
        import datasets

        datasets.disable_progress_bars()
        # cifar_fixtures imports recipes/cifar_data.py, which imports accel_trainer: where the package is not
        # installed (the GPU machine), only the children have this checkout on their path (harness.child_env).
        sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
        from cifar_fixtures import make_tiny_cifar

        make_tiny_cifar(root)
    return os.path.join(root, "hub")


def device_name(gpu: bool) -> str:
    import torch

    if gpu:
        cc = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {cc[0]}.{cc[1]}), CUDA {torch.version.cuda}"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="reduced mode on the CPU (the default where there is no GPU)")
    p.add_argument("--dataset", default=None, help="CIFAR-10 folder (GPU mode); CPU mode builds a tiny one")
    p.add_argument("--cache_dir", default=None, help="decoded-array cache of recipes/cifar.py")
    p.add_argument("--seeds", type=int, default=None, help="seeds of the cifar rows (default 20; CPU mode 2)")
    p.add_argument(
        "--cifar_compile",
        default=None,
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        help="the cifar rows under --torch_compile_mode MODE (compiled once, in the warm-up run; default: eager)",
    )
    p.add_argument("--skip", nargs="*", default=[], choices=ROWS, help="rows to leave out (reported as skipped)")
    p.add_argument("--out", default="runs/gpu_suite", help="runs, logs and (default) the JSON go here")
    p.add_argument("--json", default=None, help="the table as JSON (default: OUT/suite.json)")
    p.add_argument("--timeout", type=float, default=600, help="seconds any one command may take")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole suite (default: no bound)")
    a = p.parse_args()

    import torch

    if not a.cpu and not torch.cuda.is_available():
        print("no CUDA device: running the CPU reduced mode (--cpu)", flush=True)
        a.cpu = True
    if a.cpu:
        a.cache_dir = a.cache_dir or os.path.join(os.path.abspath(a.out), "cache")
        a.dataset = a.dataset or tiny_dataset(os.path.abspath(a.out))
    else:
        a.dataset = a.dataset or next(
            (d for d in (os.path.join(ROOT, "shared/data/cifar10"), os.path.join(ROOT, "../shared/data/cifar10"))
             if os.path.isdir(d)),
            None,
        )  # fmt: skip
        if a.dataset is None:
            print("error: no CIFAR-10 folder found; pass --dataset DIR (e.g. ../shared/data/cifar10).", file=sys.stderr)
            return 2
    if not os.path.isdir(a.dataset):
        print(f"error: --dataset {a.dataset} is not a folder; pass a local CIFAR-10 folder.", file=sys.stderr)
        return 2
    s = Suite(a)
    t_suite = time.perf_counter()
    mode = "gpu" if s.gpu else "cpu-reduced"
    print(f"bench/gpu.py, {mode} mode, on {device_name(s.gpu)}; torch {torch.__version__}", flush=True)
    for name in ROWS:
        t0 = time.perf_counter()
        row = run_row(s, name)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        s.rows[name] = row
        print(f"  {name:14s} {row['status'] if row['status'] != 'ok' else row.get('summary', 'ok')}", flush=True)

    total = time.perf_counter() - t_suite
    print(f"\n{'check':14s} {'status':8s} {'seconds':>7s}  result")
    for name, row in s.rows.items():
        status = row["status"].split(":")[0]
        detail = row.get("summary") or row["status"].split(": ", 1)[-1]
        if row.get("met") is not None:
            detail += f"  [goal {row['goal']}: {'met' if row['met'] else 'NOT met'}]"
        print(f"{name:14s} {status:8s} {row['seconds']:7.1f}  {detail}")
    print(f"total {total:.0f} s")
    report = {
        "mode": mode,
        "device": device_name(s.gpu),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "total_s": round(total, 1),
        "rows": [{"name": n, **r} for n, r in s.rows.items()],
    }
    path = a.json or os.path.join(s.out, "suite.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 1 if any(r["status"].startswith("failed") for r in s.rows.values()) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [COUNT_GRAPHS]:
        count_graphs(sys.argv[2:])
    elif sys.argv[1:2] == [NAN_LOSS]:
        nan_loss(sys.argv[2:])
    elif sys.argv[1:2] == [CAP_MEMORY]:
        cap_memory(sys.argv[2:])
    else:
        sys.exit(main())
