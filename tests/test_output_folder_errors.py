"""A partly unwritable output folder is one line naming the entry, the OS's reason and the fix, and nothing is lost
(accel_trainer/checkpointing/changes.py).

The attacker's cases (as root, so with `chattr +i`): checkpoints/ immutable, resumed (PermissionError traceback
from os.makedirs at the next save); a newer checkpoint immutable when resuming an older one (traceback from the
move aside); the output folder immutable (one line, but only after training for nothing); a finished run's
model.safetensors immutable with --overwrite_output_dir (the checkpoints and logs were deleted before the model
refused: the previous run lost, a traceback); a file of an old checkpoint immutable with --save_total_limit 1
(the checkpoint half deleted, a traceback). Root ignores file modes, so as root an entry is locked with
`chattr +i`; as another user, by its folder's mode (nothing in a 0555 folder can be added or deleted), which the
same checks meet.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import struct
import sys

import pytest
from helpers import RECIPES

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments  # noqa: E402
from accel_trainer.errors import UserError  # noqa: E402

LOCK_FILE = ".accel-trainer.lock"  # rewritten by every run that takes the folder: not the run's data


def make(out, **kw):
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("disable_tqdm", True)
    kw.setdefault("logging_steps", 2)
    return Trainer(regression, TrainingArguments(output_dir=str(out), **kw), regression.Args(), quiet=True)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 12-step run with checkpoints at steps 4, 8 and 12 and its model."""
    out = tmp_path_factory.mktemp("errors") / "run"
    make(out, max_steps=12, save_steps=4).fit()
    return out


@pytest.fixture
def killed(finished, tmp_path):
    """The same run killed after its step-8 checkpoint: step_12 and the model are not there."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "step_12")
    os.remove(out / "model.safetensors")
    return out


def immutable(path: str, on: bool) -> None:
    """`chattr +i` / `chattr -i` as chattr does it (FS_IOC_GETFLAGS, FS_IOC_SETFLAGS): the fast tier starts no
    process. Raises OSError where the file system keeps no such flag or the user may not set it."""
    import array
    import fcntl

    get, put = (0x80086601, 0x40086602) if struct.calcsize("l") == 8 else (0x80046601, 0x40046602)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, get, flags)
        flags[0] = flags[0] | 0x10 if on else flags[0] & ~0x10  # FS_IMMUTABLE_FL
        fcntl.ioctl(fd, put, flags)
    finally:
        os.close(fd)


@pytest.fixture
def lock():
    """lock(path) makes `path` undeletable and, a folder, unwritable, and returns the entry a message must name:
    as root `path` itself (chattr +i, where this file system supports it), else the folder that holds a file."""
    undo = []

    def mark(path) -> str:
        path = str(path)
        if os.geteuid() == 0:
            try:
                immutable(path, True)
            except OSError as e:
                pytest.skip(f"root ignores file modes and chattr +i is not supported here ({e.strerror})")
            undo.append(lambda: immutable(path, False))
            return path
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        mode = os.stat(folder).st_mode
        os.chmod(folder, 0o555)
        undo.append(lambda: os.chmod(folder, mode))
        return folder

    yield mark
    for u in reversed(undo):
        u()


def snapshot(folder) -> dict:
    """Every entry under `folder` with its content's hash: what a refusal must leave as it was."""
    seen = {}
    for dirpath, dirnames, names in os.walk(folder):
        for d in dirnames:
            seen[os.path.relpath(os.path.join(dirpath, d), folder)] = "folder"
        for n in names:
            if n != LOCK_FILE:
                with open(os.path.join(dirpath, n), "rb") as f:
                    seen[os.path.relpath(os.path.join(dirpath, n), folder)] = hashlib.sha256(f.read()).hexdigest()
    return seen


def one_line(e: pytest.ExceptionInfo, *names) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, message
    return message


def test_an_unwritable_checkpoints_folder_is_one_line_before_training(killed, lock):
    named = lock(killed / "checkpoints")
    before = snapshot(killed)
    with pytest.raises(UserError) as e:
        make(killed, max_steps=12, save_steps=4, resume_from_checkpoint="latest").fit()
    one_line(e, named, "output_dir")
    assert snapshot(killed) == before  # refused at set-up: nothing trained, nothing written


def test_a_checkpoints_folder_that_turns_read_only_during_the_run_is_one_line(killed, monkeypatch):
    # What set-up cannot see: the mount turns read-only between two checkpoints. The OS call fails as it would.
    makedirs = os.makedirs

    def read_only(path, *args, **kw):
        if ".tmp_step_" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return makedirs(path, *args, **kw)

    trainer = make(killed, max_steps=12, save_steps=4, resume_from_checkpoint="latest")
    before = snapshot(killed / "checkpoints")
    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(UserError) as e:
        trainer.fit()
    one_line(e, str(killed / "checkpoints" / ".tmp_step_12"), "Read-only file system", "step 8", "latest")
    assert snapshot(killed / "checkpoints") == before


def test_a_newer_checkpoint_that_cannot_be_moved_aside_is_one_line_and_nothing_moves(killed, lock):
    named = lock(killed / "checkpoints" / "step_8")
    before = snapshot(killed / "checkpoints")
    with pytest.raises(UserError) as e:
        make(killed, max_steps=12, save_steps=4, resume_from_checkpoint=str(killed / "checkpoints" / "step_4"))
    one_line(e, named, "step_8", "nothing was moved")
    assert snapshot(killed / "checkpoints") == before  # no superseded-* folder, half filled or empty


def test_an_unwritable_output_folder_is_one_line_before_training(killed, lock):
    named = lock(killed)
    before = snapshot(killed)
    with pytest.raises(UserError) as e:
        make(killed, max_steps=12, save_steps=4, resume_from_checkpoint="latest").fit()
    one_line(e, named, "output_dir")
    assert snapshot(killed) == before  # before: step_12 was written, then the model refused


def test_a_refused_overwrite_deletes_nothing_of_the_previous_run(finished, tmp_path, lock):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    named = lock(out / "model.safetensors")
    before = snapshot(out)
    with pytest.raises(UserError) as e:
        make(out, max_steps=8, save_steps=4, overwrite_output_dir=True)
    one_line(e, named, "overwrite_output_dir=True", "nothing was deleted")
    assert snapshot(out) == before  # before: checkpoints/ and the logs were gone, then the model refused


def test_an_old_checkpoint_save_total_limit_cannot_delete_is_kept_whole_and_the_run_goes_on(killed, lock, capsys):
    old = killed / "checkpoints" / "step_4"
    named = lock(old / "manifest.json")
    before = snapshot(old)
    make(
        killed, max_steps=12, save_steps=4, resume_from_checkpoint="latest", save_total_limit=1, allow_args_change=True
    ).fit()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "--save_total_limit 1" in warnings[0] and named in warnings[0], warnings
    assert snapshot(old) == before  # whole: before, half its files were deleted
    assert sorted(os.listdir(killed / "checkpoints")) == ["step_12", "step_4"]  # step_8 deletable, deleted
    assert os.path.isfile(killed / "model.safetensors")


def test_a_deletion_that_fails_past_the_checks_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    # What no check foresees (an I/O error halfway through): the folder was renamed aside first, so its remains
    # are named and never read as a checkpoint; the next resume's tidying deletes them.
    from accel_trainer.checkpointing import folder

    step = tmp_path / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    for name in ("manifest.json", "model.safetensors"):
        (step / name).write_bytes(b"x")
    rmtree = shutil.rmtree

    def fails_halfway(path, *args, **kw):
        os.remove(os.path.join(path, "model.safetensors"))
        raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(path, "manifest.json"))

    monkeypatch.setattr(shutil, "rmtree", fails_halfway)
    with pytest.raises(UserError) as e:
        folder.remove_folder(str(step))
    message = one_line(e, "delete them by hand", os.strerror(errno.EIO))
    (remains,) = os.listdir(tmp_path / "checkpoints")
    assert remains.startswith(".deleting-step_4-") and remains in message, message
    assert folder.list_checkpoints(str(tmp_path)) == []
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert folder.remove_stale_tmp(str(tmp_path)) == [str(tmp_path / "checkpoints" / remains)]
    assert os.listdir(tmp_path / "checkpoints") == []
