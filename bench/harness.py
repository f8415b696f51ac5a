"""What every bench does, written once: the environment its child processes run in, a free port, an `accelerate
launch` line, a command line from keywords, a run watched through its metrics.jsonl (with the process's CPU
seconds), reading a run's rows, and the hand-written loop the Trainer is measured against.

The tests start their children the same way: tests/helpers.py imports this module (`env`, `free_port`,
`launch_cmd`, `metrics` are these functions). Why a plain module, not a package: `python bench/x.py` puts bench/
first on sys.path, so the benches `import harness` as they are; tests/helpers.py adds bench/ to sys.path once.
Nothing to install, no `bench/__init__.py`.

Only the standard library is imported at the top: bench/startup.py times processes that import this module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------- child processes
def child_env(threads: int | None = 1, **extra: str) -> dict:
    """os.environ for a child run: offline (nothing from the Hub: fail fast instead of retrying), no progress
    colours, unbuffered output, `threads` OpenMP/MKL threads per process (None: as inherited), outside any outer
    launch's world (no WORLD_SIZE), importing this checkout's accel_trainer first; then `extra`.

    This is a tidier environment than a user's, and the one place that says why: `threads` (1 by default) keeps the
    suite fast on a small machine, where two lanes of tests share two cores and every 2-process run would
    otherwise start one thread per core in each process; and it keeps the thread count, and so the order of
    float reductions, the same on every machine for runs that the tests compare with each other.
    TOKENIZERS_PARALLELISM=false keeps out the warning tokenizers prints in each process it finds forked after
    its own threads ran. A user has none of these: `user_env` is the environment a user has, and each way to run
    (python, accelerate launch, accel-trainer launch, notebook_launcher, the README's notebook in a kernel, the
    README's commands) has a test in it (tests/test_user_conditions.py, test_notebook.py, test_readme.py)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        ACCELERATE_DISABLE_RICH="1",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


USER_UNSET = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def user_env(**extra: str) -> dict:
    """child_env as a user has it: torch's default threads and no TOKENIZERS_PARALLELISM (USER_UNSET removed,
    also when the caller's own environment sets them); still offline, outside any outer world, this checkout
    first; then `extra`."""
    env = child_env(threads=None)
    for name in USER_UNSET:
        env.pop(name, None)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(nproc: int, port: int | None = None, mode: tuple[str, ...] = ("--multi_gpu",)) -> list[str]:
    """`accelerate launch` for nproc CPU processes that truly form one world (see accelerate_configs/README.md);
    plain `python` for one. `mode`: the launcher's distributed flags (DDP by default; FSDP2 for `FSDP2`)."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_processes", str(nproc),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port or free_port())]  # fmt: skip


FSDP2 = ("--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")


def flags(**kw) -> list[str]:
    """A command line from keywords, in order: `x=3` -> `--x 3`; `x=True` -> `--x`; False or None: left out."""
    out = []
    for k, v in kw.items():
        if v is True:
            out.append(f"--{k}")
        elif v is not None and v is not False:
            out += [f"--{k}", str(v)]
    return out


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a running process (all its threads) from /proc; None where there is no /proc. Robust to
    other processes sharing the cores, which wall time is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def exit_with_log(what: str, rc: int, log: str):
    """Stop the bench in one line naming what failed, followed by the end of its output."""
    with open(log) as f:
        sys.exit(f"error: {what} failed (exit {rc}); its output ends with:\n{f.read()[-3000:]}")


def watch(cmd: list[str], out: str, timeout: float, *, env: dict, cwd: str, rows: int | None = None):
    """Run `cmd` (output to OUT.log), polling OUT/metrics.jsonl every 2 ms while it runs. For each complete row as
    it appears: (seconds since the start, the process's CPU seconds then; /proc ticks are 10 ms). Reading stops
    after `rows` rows (None: all). Returns (exit code, those stamps, seconds to exit); past `timeout` the run is
    killed and the bench exits naming it."""
    metrics, log = os.path.join(out, "metrics.jsonl"), out + ".log"
    stamps = []
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        while True:
            if rows is None or len(stamps) < rows:
                try:
                    with open(metrics) as f:
                        n = sum(1 for line in f if line.endswith("\n"))
                except FileNotFoundError:
                    n = 0
                if n > len(stamps):  # rows that appeared together get the same reading
                    now, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid)
                    stamps += [(now, cpu)] * (n - len(stamps))
            if proc.poll() is not None:  # after the read: a row written just before the exit is seen
                break
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                sys.exit(f"error: {' '.join(cmd[:3])} ... took longer than {timeout:.0f} s; see {log}")
            time.sleep(0.002)
        end = time.perf_counter() - t0
    return proc.returncode, stamps, end


# ------------------------------------------------------------------------------------------------ reading runs
def read_metrics(out: str) -> list[dict]:
    """A run's metrics.jsonl rows."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_run_config(out: str) -> dict:
    with open(os.path.join(out, "run_config.json")) as f:
        return json.load(f)


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_json(path: str | None, results: dict):
    """--json: also write the results there (nothing when not given)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


# ---------------------------------------------------------------------------------------------------- baseline
def hand_written_loop(model, loader, loss_fn, optimizer, scheduler, steps: int, *, max_grad_norm=0.0, backward=None,
                      after_update=None):  # fmt: skip
    """The loop the Trainer is measured against, as a user writes it by hand: forward (`loss_fn(model, batch)`),
    backward, clip (when max_grad_norm), step, schedule, zero_grad, over epochs of `loader` until `steps` updates
    (with `set_epoch` before each epoch where its sampler has one, as a DistributedSampler needs).
    `backward`: Accelerate's for a bare-Accelerate baseline (default: loss.backward()). `after_update(step, loss)`
    logs; a host sync there (loss.item()) is the caller's to make, as a logging loop would."""
    from torch.nn.utils import clip_grad_norm_

    step, epoch = 0, 0
    sampler = getattr(loader, "sampler", None)
    while step < steps:
        if hasattr(sampler, "set_epoch"):  # a DistributedSampler's order is a function of (seed, epoch)
            sampler.set_epoch(epoch)
        epoch += 1
        for batch in loader:
            loss = loss_fn(model, batch)
            if backward:
                backward(loss)
            else:
                loss.backward()
            if max_grad_norm:
                clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if after_update:
                after_update(step, loss)
            if step == steps:
                return
