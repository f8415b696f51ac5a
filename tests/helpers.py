"""Shared test helpers: run recipes the way users do (python / accelerate launch) with bounded waits."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
# Children are started as the benches start theirs: one harness (bench/harness.py, a plain module on bench/).
sys.path.insert(0, os.path.join(ROOT, "bench"))
from harness import FSDP2, flags, free_port, launch_cmd, user_env  # noqa: E402, F401 - re-exported for the tests
from harness import child_env as env  # noqa: E402, F401
from harness import read_metrics as metrics  # noqa: E402, F401
from harness import read_run_config as run_config  # noqa: E402, F401

# The environment an elastic launch on this one machine needs beside launcher()'s command: its own c10d rendezvous.
# With one machine, accelerate hands --main_process_port to torchrun as master_port, which only the static rendezvous
# reads: c10d listens on torchrun's default endpoint, localhost:29400, with the run id "none". Two elastic launches
# at once (test_matrix's rows run in parallel; CI's two lanes too) then share one store: the second agent cannot bind
# it, joins the first one's rendezvous as a client and fails with "RendezvousConnectionError: The connection to the
# C10d store has failed" once the first launch ends. Port 0: the agent's store takes a free port itself, atomically
# (torchrun's advice for one node). accelerate has no --rdzv_endpoint flag; torchrun reads PET_RDZV_ENDPOINT for it.
ELASTIC_ENV = {"PET_RDZV_ENDPOINT": "127.0.0.1:0"}


def launcher(world: str, max_restarts: int = 0) -> list[str]:
    """The command that starts a recipe on `world`: "1" (python), "ddp" (2 CPU processes, one world) or "fsdp"
    (2 CPU processes, FSDP2 from `accelerate launch --use_fsdp` flags, as tests/test_sharding.py launches it);
    with `max_restarts`, elastic (c10d rendezvous, torchrun restarts the group after a worker dies), to be started
    with ELASTIC_ENV in its environment."""
    if world == "1":
        return launch_cmd(1)
    cmd = launch_cmd(2, mode=FSDP2) if world == "fsdp" else launch_cmd(2)
    if max_restarts:
        cmd[3:3] = ["--max_restarts", str(max_restarts), "--rdzv_backend", "c10d"]
    return cmd


def run(
    script: str,
    args: list[str],
    nproc: int = 1,
    timeout: float = 240,
    check: bool = True,
    cwd=None,
    extra_env: dict | None = None,
) -> subprocess.CompletedProcess:
    script = script if os.path.isabs(script) else os.path.join(RECIPES, script)
    proc = subprocess.run(
        launch_cmd(nproc) + [script] + [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**(extra_env or {})),
        cwd=cwd or ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def call(cmd: list[str], timeout: float, **extra_env) -> subprocess.CompletedProcess:
    """`cmd` run from the repository root in the tests' environment, its output captured, its wait bounded."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra_env), cwd=ROOT)


def call_in_session(cmd: list[str], timeout: float, env: dict, cwd=None) -> subprocess.CompletedProcess:
    """`cmd` in a session of its own, its output captured. Past `timeout` the whole session is killed, the processes
    a launcher forked too (they would hang on, holding their port), and the test fails naming the bound."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd or ROOT,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{' '.join(map(str, cmd))[:120]} ... still running after {timeout:.0f} s, killed:\n"
                             f"STDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-3000:]}") from None  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the launch left behind
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def two_machine_config(directory, *, port=None, rdzv=None, main_ip="127.0.0.1", name="two", extra=()) -> str:
    """A topology of 2 machines x 1 CPU process, written by the wizard itself (non-interactive) as a user would;
    returns the config's path."""
    argv = ["--dir", str(directory), "--name", name, "--no-interactive", "--machines", "2"]
    argv += ["--processes-per-machine", "1", "--cpu", "--main-ip", main_ip]
    argv += (["--main-port", str(port)] if port is not None else []) + (["--rdzv", rdzv] if rdzv else [])
    from accel_trainer.cluster import wizard  # here: most test files never write a topology

    assert wizard.main(argv + list(extra)) == 0
    return os.path.join(str(directory), f"{name}.yaml")


def weights(output_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(output_dir, "model.safetensors"))


def assert_same_weights(a: dict, b: dict, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def last_step(output_dir) -> int:
    """The newest step in a run's metrics.jsonl (0 before the first row); a line being written is skipped."""
    try:
        lines = open(os.path.join(output_dir, "metrics.jsonl")).read().splitlines()
    except FileNotFoundError:
        return 0
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return max(steps, default=0)


@contextlib.contextmanager
def small_tmpfs(folder, size: str):
    """A real disk of `size` (e.g. "640k") mounted at `folder` (created) for a test that must fill it; unmounted
    after. Skips where mounting is not allowed (not root): CI runs as root, so there it always runs."""
    import pytest

    os.makedirs(folder, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)
