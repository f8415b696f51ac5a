"""Writing checkpoints and the model: only a full disk is called a full disk; another write error (a permission,
an object that cannot be pickled) is one line naming the file and its own cause; a file is on disk (fsync) before
the rename that makes it visible, and the rename is on disk (the folder's fsync) after it."""

import errno
import os
import shutil
import stat
import subprocess
from collections import namedtuple

import pytest
import torch
from helpers import RECIPES, env, launch_cmd

from accel_trainer.checkpointing.folder import DiskFullError, is_disk_full, write_file_atomically
from accel_trainer.errors import UserError

LOW_SPACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "low_space.py")
Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def little_free_space(monkeypatch):
    """The disk reports 4 KiB free: below one checkpoint of any run, the state in which every error was once
    called a full disk."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, (1 << 30) - 4096, 4096))


@pytest.fixture
def immutable():
    """chattr +i: even root gets EPERM writing there (the tests run as root, which ignores file modes)."""
    marked = []

    def mark(path):
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported here")
        marked.append(path)

    yield mark
    for path in marked:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@pytest.mark.slow
def test_a_real_permission_error_with_little_free_space_is_not_a_full_disk(tmp_path, little_free_space, immutable):
    folder = tmp_path / "locked"
    folder.mkdir()
    immutable(folder)
    path = str(folder / "model.safetensors")
    with pytest.raises(UserError) as e:
        write_file_atomically(path, lambda tmp: open(tmp, "wb"), str(tmp_path), f"the model to {path}")
    msg = str(e.value)
    assert not isinstance(e.value, DiskFullError) and "disk is full" not in msg, msg
    assert "Operation not permitted" in msg and f"{path}.tmp" in msg and "\n" not in msg, msg


def test_an_object_that_cannot_be_pickled_with_little_free_space_is_not_a_full_disk(tmp_path, little_free_space):
    path = str(tmp_path / "state.pt")
    with pytest.raises(UserError) as e:
        write_file_atomically(path, lambda tmp: torch.save({"f": lambda: 0}, tmp), str(tmp_path), f"the state {path}")
    msg = str(e.value)
    assert not isinstance(e.value, DiskFullError) and "disk is full" not in msg, msg
    assert "cannot be pickled" in msg and "lambda" in msg and path in msg and "\n" not in msg, msg


def test_only_a_full_disk_is_called_one(tmp_path, monkeypatch):
    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(full, str(tmp_path)) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), "x")
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), "x")
    # torch's C++ writer says "unexpected pos" / "file write failed" with no errno: a full disk only when it is short
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not is_disk_full(short_write, str(tmp_path))  # this disk has room
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, (1 << 30) - 4096, 4096))
    assert is_disk_full(short_write, str(tmp_path))
    for other in (
        PermissionError(errno.EACCES, "Permission denied", "/x/model.safetensors.tmp"),
        RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: Permission denied"),
        TypeError("cannot pickle '_thread.lock' object"),
        ValueError("a bug in a recipe"),
    ):
        assert not is_disk_full(other, str(tmp_path)), other


@pytest.mark.slow
def test_a_run_whose_model_file_cannot_be_written_says_so_with_little_free_space(tmp_path, immutable):
    # As users run it: the model file's temporary name is locked (EPERM, reported by safetensors without errno)
    # and the disk reports little free space. One line naming the file and the cause, not "the disk is full"; the
    # checkpoints are kept.
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors.tmp").write_bytes(b"")
    immutable(out / "model.safetensors.tmp")
    proc = subprocess.run(
        launch_cmd(1) + [LOW_SPACE, os.path.join(RECIPES, "regression.py"), "--output_dir", str(out)]
        + ["--max_steps", "4", "--save_steps", "2", "--disable_tqdm"],
        capture_output=True, text=True, timeout=240, env=env(),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "disk is full" not in errors[0] and "Operation not permitted" in errors[0], errors[0]
    assert str(out / "model.safetensors") in errors[0] and "step 4" in errors[0], errors[0]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_4"]


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    # Power loss: without the file's fsync the rename can reach the disk before the data (a complete-looking,
    # empty or partial file); without the folder's, the rename itself can be lost.
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "model.safetensors"
    write_file_atomically(str(path), lambda tmp: open(tmp, "wb").write(b"weights"), str(tmp_path), "the model")
    assert path.read_bytes() == b"weights"
    file_ino, folder_ino = path.stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", "file", file_ino), ("rename", file_ino), ("fsync", "folder", folder_ino)], events
