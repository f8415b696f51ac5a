"""A run owns its output folder (accel_trainer/checkpointing/lock.py) and deletes or moves only folders it wrote.

Two runs on one folder lost a model: the second, started with --resume_from_checkpoint auto while the first was
writing, moved the first's newest checkpoint aside and wrote its own model.safetensors; both exited 0. A FIFO named
like a leftover folder (`.tmp_step_9`, `.old_step_8`) blocked `--resume_from_checkpoint latest` forever. A
read-only output folder was an OSError traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import RECIPES, ROOT, launch_cmd
from procs import Launch

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments  # noqa: E402
from accel_trainer.checkpointing.folder import list_checkpoints  # noqa: E402
from accel_trainer.errors import UserError  # noqa: E402

FAULTS = os.path.join(ROOT, "tests", "fault_recipe.py")


def make(out, **kw):
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("disable_tqdm", True)
    return Trainer(regression, TrainingArguments(output_dir=str(out), **kw), regression.Args(), quiet=True)


def start(out, log, *extra, nproc=1):
    cmd = launch_cmd(nproc) + [FAULTS, "--output_dir", str(out), "--per_device_train_batch_size", "8",
                               "--logging_steps", "1", "--disable_tqdm", *extra]  # fmt: skip
    return Launch(cmd, str(log), cwd=ROOT, deadline=240)


def rows(out) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_run_on_a_running_folder_is_refused_and_a_killed_one_leaves_no_lock(tmp_path, nproc):
    out = tmp_path / "run"
    # the first run waits after update 11 (its step_10 written) until the test has tried the second one
    first = start(out, tmp_path / "first.log", "--max_steps", "40", "--save_steps", "10",
                  "--faults", "gate_at=11", nproc=nproc)  # fmt: skip
    second = None
    try:
        first.wait_until(lambda: os.path.isdir(out / "checkpoints" / "step_10"))  # then it holds at update 11
        second = start(out, tmp_path / "second.log", "--max_steps", "40", "--save_steps", "10",
                       "--resume_from_checkpoint", "auto", nproc=nproc)  # fmt: skip
        rc = second.wait()
        (tmp_path / "run.gate").touch()
        assert rc == 1, second.output()
        log = second.output(None)
        errors = {line for line in log.splitlines() if line.startswith("error: ")}
        assert len(errors) == 1, log  # every rank says the same one line
        (error,) = errors
        holder = re.search(rf"output_dir {re.escape(str(out))} is in use by another run \(process (\d+) on ", error)
        assert holder and int(holder.group(1)) in {p.pid for p in first.tree()}, error  # its main process
        # no traceback from a process of the run (under accelerate launch its launcher then prints torch elastic's
        # own report of the failed workers, a ChildFailedError traceback of accelerate's, not ours)
        assert not re.search(r"^(\[rank\d+\]: )?Traceback" if nproc == 1 else r"^\[rank\d+\]: Traceback", log, re.M)
        first.wait_ok()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    # the first run is untouched: all its checkpoints, none set aside, its model written once, at its end
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["step_10", "step_20", "step_30", "step_40"]
    assert not [d for d in os.listdir(out / "checkpoints") if d.startswith("superseded")]
    assert max(r["step"] for r in rows(out) if "loss" in r) == 40
    # SIGKILL leaves no stale lock: the next run resumes at once
    killed = start(out, tmp_path / "killed.log", "--max_steps", "80", "--save_steps", "10",
                   "--resume_from_checkpoint", "latest", "--faults", "step_delay=0.1", nproc=nproc)  # fmt: skip
    try:
        killed.wait_until(lambda: any(r.get("step", 0) >= 41 for r in rows(out)))
        killed.kill(signal.SIGKILL)
        killed.wait()
    finally:
        killed.stop()
    again = start(out, tmp_path / "again.log", "--max_steps", "50", "--save_steps", "10", "--faults", "",
                  "--resume_from_checkpoint", "latest", nproc=nproc)  # fmt: skip
    log = again.wait_ok()
    assert "Resumed from" in log and "in use" not in log


def test_a_newer_trainer_in_the_same_process_takes_the_folder_over(tmp_path):
    """A notebook cell run again builds a second Trainer on the same folder while the first is still referenced:
    the newer one has it; the older one refuses to write there."""
    older = make(tmp_path / "run", max_steps=4, save_steps=2)
    newer = make(tmp_path / "run", max_steps=4, save_steps=2, overwrite_output_dir=True)
    newer.fit()
    with pytest.raises(UserError, match="was taken over by a newer Trainer in this process"):
        older.fit()
    # once a fit() has ended the folder is free: a Trainer after it takes it as a new owner
    assert make(tmp_path / "run", max_steps=6, resume_from_checkpoint="latest").fit() is not None


@pytest.mark.slow
def test_fifos_named_like_leftover_folders_are_one_line_not_a_hang(tmp_path):
    out = tmp_path / "run"
    make(out, max_steps=8, save_steps=4).fit()
    root = out / "checkpoints"
    for name in (".old_step_8", ".tmp_step_9"):
        os.mkfifo(root / name)
        # bounded: in a child process, killed at the timeout if it hangs as before
        code = (f"import sys; sys.path.insert(0, {RECIPES!r}); import regression; "
                "from accel_trainer import Trainer, TrainingArguments; "
                f"Trainer(regression, TrainingArguments(output_dir={str(out)!r}, max_steps=12, "
                "resume_from_checkpoint='latest'), regression.Args()).fit()")  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode != 0 and f"{root / name} is not a folder" in proc.stderr, proc.stderr[-3000:]
        assert os.path.exists(root / name)  # left as it is, for its owner
        os.remove(root / name)
    # a link named like a checkpoint is skipped by `latest`, said, and never followed
    os.symlink(root / "step_4", root / "step_12")
    trainer = make(out, max_steps=12, resume_from_checkpoint="latest")
    assert trainer.global_step == 8


def _mount_tmpfs(path, *options):
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join(("size=64m",) + options)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")


@pytest.mark.slow
def test_a_read_only_output_folder_is_one_line_new_or_resumed(tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro")
    try:
        with pytest.raises(UserError, match=r"output_dir .*/ro/run cannot be created \(Read-only file system\)"):
            make(ro / "run", max_steps=4)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
    disk = tmp_path / "disk"
    _mount_tmpfs(disk)
    try:
        make(disk / "run", max_steps=4, save_steps=2).fit()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(UserError, match=r"output_dir .*/disk/run is not writable \(Read-only file system"):
            make(disk / "run", max_steps=8, resume_from_checkpoint="latest")
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
