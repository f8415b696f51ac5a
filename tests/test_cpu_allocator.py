"""A CPU run fixes glibc's malloc thresholds (cpu_allocator.py): memory a step frees stays in the process for the
next step instead of going back to the OS and being faulted in again. Each case is a fresh process (the settings
are the process's): 240 MiB of 24 MiB tensors is allocated and freed after a Trainer was built, and the resident
memory that the free gave back to the OS is printed. 24 MiB: below the fixed 32 MiB mmap threshold, and above
glibc's default one as far as that moves during a small run (it rises to the largest mmapped block freed so far),
so without the settings each block is its own mmap and goes back at once; with them they come from the heap,
which is never trimmed. (1 MiB blocks made a flaky control: once the default threshold had risen above them they
came from the heap too, and whether its top was trimmed depended on what small allocation sat above them.)"""

import json
import os
import subprocess
import sys

import pytest
from helpers import RECIPES, env

CODE = """
import json, os, sys, torch
sys.path.insert(0, {recipes!r})
import regression
from accel_trainer import Trainer, TrainingArguments

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

args = TrainingArguments(output_dir={out!r}, max_steps=2, save_steps=0, disable_tqdm=True, use_cpu=True)
t = Trainer(regression, args, regression.Args(), quiet=True)
t.fit()
tensors = [torch.ones(6 * 2**20) for _ in range(10)]  # 10 x 24 MiB, written
before = rss_mb()
del tensors
print("RESULT", json.dumps({{"returned_mb": before - rss_mb(), "cpu_allocator": t.process["cpu_allocator"]}}))
"""


def run(tmp_path, **extra_env):
    code = CODE.format(recipes=RECIPES, out=str(tmp_path / "run"))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(**extra_env), timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    with open(tmp_path / "run" / "run_config.json") as f:
        assert json.load(f)["process"]["cpu_allocator"] == result["cpu_allocator"]
    return result


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_cpu_run_keeps_freed_memory_and_the_user_can_say_no(tmp_path):
    tuned = run(tmp_path / "tuned")
    assert tuned["cpu_allocator"]["tuned"] is True, tuned
    assert tuned["returned_mb"] < 16, tuned  # kept for the next step
    # The control: without the settings glibc gives the freed blocks back (they were mmapped, or trimmed off the
    # heap's top), so the assertion above is about the settings, not about this allocation pattern.
    untouched = run(tmp_path / "opted_out", ACCEL_TRAINER_CPU_MALLOC="0")
    assert untouched["cpu_allocator"] == {"tuned": False, "why": "ACCEL_TRAINER_CPU_MALLOC=0"}
    assert untouched["returned_mb"] > 64, untouched
    given = run(tmp_path / "given", MALLOC_TRIM_THRESHOLD_="1000000")
    assert given["cpu_allocator"] == {"tuned": False, "why": "malloc settings given in the environment"}


def test_a_gpu_run_or_the_users_own_allocator_leaves_malloc_alone(monkeypatch):
    from accel_trainer import cpu_allocator  # answers before any mallopt: this process's malloc is not changed

    # As in a fresh process: an earlier CPU Trainer in this pytest process has tuned it already, and the settings
    # are then the process's for every later run (also a GPU one), which is not what this checks.
    monkeypatch.setattr(cpu_allocator, "_done", None)
    for var in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES", "LD_PRELOAD"]:
        monkeypatch.delenv(var, raising=False)
    assert cpu_allocator.keep_freed_memory("cuda") == {"tuned": False, "why": "training on cuda"}
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert cpu_allocator.keep_freed_memory("cpu") == {
        "tuned": False,
        "why": "another allocator is preloaded (LD_PRELOAD)",
    }
