"""Each way to run, in the environment a user has (harness.user_env: torch's default threads, no OMP_NUM_THREADS,
MKL_NUM_THREADS or TOKENIZERS_PARALLELISM), on every core the machine shows: `python`, `accelerate launch`,
`accel-trainer launch`, and `notebook_launcher` after a Trainer trained in the same process (the README's notebook
flow as a plain script; tests/test_notebook.py runs the README's cells in a real kernel). The rest of the suite
runs its children in a tidier environment; harness.child_env says why.

The model is wide enough for torch to run its ops on its OpenMP thread pool, as any real model's are: torch runs an
element-wise op on the pool only above 32768 elements (at::internal::GRAIN_SIZE), and the recipe's default width
(32 hidden units x 16 samples) never gets there. With it, `notebook_launcher` after a Trainer ran in the process
hung forever: the forked workers blocked in their first parallel op on the parent's OpenMP pool, whose threads a
fork does not copy (issue 40)."""

import os
import re
import sys

import pytest
from helpers import RECIPES, ROOT, call_in_session, free_port, run_config, user_env

WIDE = 4096  # hidden units: 16 samples x 4096 = 65536 elements per activation, twice the grain
RUN = ["--max_steps", "10", "--hidden_size", str(WIDE), "--save_steps", "0", "--disable_tqdm"]
TWO_PROCESSES = os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml")
BOUND_S = 300  # a 2-process run here takes ~20 s on a loaded 2-core machine; a hang meets this bound

# More than one core, seen as a user's torch sees them (default threads): the conditions under which it hung.
pytestmark = [
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the user's conditions under test need more than one core"),
    pytest.mark.slow,
]


@pytest.mark.parametrize(
    "entry, world",
    [
        ("python", 1),
        ("accelerate launch", 2),
        ("accel-trainer launch", 2),
    ],
)
def test_each_command_line_entry_point_runs_in_a_users_environment(tmp_path, entry, world):
    out = tmp_path / "run"
    launch = {
        "python": [sys.executable],
        "accelerate launch": [sys.executable, "-m", "accelerate.commands.launch"],
        "accel-trainer launch": [sys.executable, "-m", "accel_trainer.cli", "launch"],
    }[entry]
    if world == 2:
        launch += ["--config_file", TWO_PROCESSES, "--main_process_port", str(free_port())]
    cmd = launch + [os.path.join(RECIPES, "regression.py"), "--output_dir", str(out)] + RUN
    proc = call_in_session(cmd, BOUND_S, env=user_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run_config(str(out))["num_processes"] == world
    assert (out / "model.safetensors").exists()


NOTEBOOK_FLOW = """
import os, sys
sys.path.insert(0, {recipes!r})
import torch
import regression
from accel_trainer import Trainer, notebook_launcher

# Debug on one device first, as the README's notebook does: the process's torch has now run its thread pool.
Trainer.from_recipe(regression, output_dir={out!r} + "/one", max_steps=10, hidden_size={wide}, save_steps=0).fit()
print("kernel threads", torch.get_num_threads())
{choose}

def train():
    # One write of one short line: print's separate writes of two workers interleave on one pipe.
    os.write(1, f"worker threads {{torch.get_num_threads()}}\\n".encode())
    Trainer.from_recipe(regression, output_dir={out!r} + "/two", max_steps=10, hidden_size={wide}, save_steps=0).fit()

notebook_launcher(train, num_processes=2, use_port="{port}")
"""


def notebook_flow(tmp_path, choose: str = ""):
    """The README's notebook flow as a plain script in a user's environment: (threads of the process that
    launched, each worker's threads, the launch's output)."""
    out = tmp_path / "nb"
    script = NOTEBOOK_FLOW.format(recipes=RECIPES, out=str(out), wide=WIDE, choose=choose, port=free_port())
    proc = call_in_session([sys.executable, "-c", script], BOUND_S, env=user_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run_config(str(out / "two"))["num_processes"] == 2 and (out / "two" / "model.safetensors").exists()
    kernel = int(re.search(r"kernel threads (\d+)", proc.stdout).group(1))
    # Two processes print to one pipe: their lines can run together, so find, not split.
    workers = [int(n) for n in re.findall(r"worker threads (\d+)", proc.stdout)]
    assert len(workers) == 2, proc.stdout[-3000:]
    return kernel, workers, proc.stdout


def test_notebook_launcher_after_a_trainer_in_the_process_runs_in_a_users_environment(tmp_path):
    kernel, workers, stdout = notebook_flow(tmp_path)
    assert kernel > 1, "torch sees one core: the conditions of the hang are not there"
    # The workers share the cores the launching process's torch uses, as they share the machine.
    share = max(1, kernel // 2)
    assert workers == [share, share], stdout[-3000:]
    assert f"Launching training on 2 CPU processes (no GPU here), OMP_NUM_THREADS={share} each" in stdout


def test_notebook_launcher_workers_run_the_threads_the_user_chose_after_the_pool_ran(tmp_path):
    # Two threads per worker after the launching process ran its pool: 1 thread per worker would not hang (one
    # thread never wakes the pool), 2 did.
    kernel, workers, stdout = notebook_flow(tmp_path, choose="os.environ['OMP_NUM_THREADS'] = '2'")
    assert workers == [2, 2], stdout[-3000:]
    assert "Launching training on 2 CPU processes (no GPU here), OMP_NUM_THREADS=2 each." in stdout
