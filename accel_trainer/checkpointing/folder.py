"""Checkpoint folders on disk: `output_dir/checkpoints/step_<N>/`, the run's state as state.py writes it (JSON and
safetensors), `trainer_state.json` (position in the run), `ema.safetensors` (with EMA on) and, last,
`manifest.json`. Files follow the umask, as any program's do.

Atomicity: a checkpoint is written into `.tmp_step_<N>/`; when every process has written its part, the main
process hashes every file (sha256, size; this also fsyncs them), writes `manifest.json` and renames the folder
to `step_<N>`. A kill at any moment leaves either the complete folder or a `.tmp_step_<N>` that is never used.
A write that fails for a known cause (a full disk, a permission, a value a checkpoint cannot keep) is one line
naming it and the last good checkpoint (disk_full_is_one_line). Only folders the run wrote are deleted or moved,
by lstat (remove_folder), and only through changes.py: all or nothing, a refusal in one line naming the entry the OS
would not let go. Reading a folder back: verify.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time

from ..errors import OneLineError, UserError
from . import changes

STATE_FILE = "trainer_state.json"
EMA_FILE = "ema.safetensors"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 2  # 1: accel-trainer <= 0.2, Accelerate's pickle-based save_state folders
MODEL_FILE = "model.safetensors"  # accelerate's SAFE_MODEL_NAME + ".safetensors"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)$|^" + re.escape(changes.DELETING))  # and remains of a deletion
_OLD_DIR = re.compile(r"^\.old_step_(\d+)$")  # a complete checkpoint set aside while the same step is re-saved


class CheckpointError(OneLineError):
    """A checkpoint that cannot be used; the message names the folder or file and what to do (one line, whatever
    the checkpoint's files say)."""


class DiskFullError(UserError):
    """The disk filled while writing a checkpoint or the model; the message names where and the last good step."""


class WriteError(UserError):
    """A checkpoint or the model could not be written for another cause than a full disk (a permission, an object
    that cannot be pickled); the message names the file, the cause and the last good step."""


def checkpoints_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Checkpoint folders (renamed into place, so complete unless damaged afterwards), oldest first: entries named
    step_<N> that are, by lstat, folders (a symbolic link or anything else of that name is not one the run wrote:
    not_checkpoints names them)."""
    return [path for _, path in sorted(_entries(output_dir, _STEP_DIR, folders=True))]


def not_checkpoints(output_dir: str) -> list[str]:
    """Entries named like a checkpoint (step_<N>) that are not folders: links, FIFOs, files."""
    return [path for _, path in sorted(_entries(output_dir, _STEP_DIR, folders=False))]


def _entries(output_dir: str, pattern, folders: bool) -> list[tuple[int, str]]:
    root = checkpoints_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for d in os.listdir(root):
        if m := pattern.match(d):
            path = os.path.join(root, d)
            if is_real_folder(path) == folders:
                found.append((int(m.group(1)), path))
    return found


def is_real_folder(path: str) -> bool:
    """A folder by lstat: not a link to one, not a FIFO or file named like one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_folder(path: str) -> None:
    """Delete a folder the run wrote (a checkpoint, a temporary or set-aside one), only if it is one by lstat:
    shutil.rmtree opens what it is given, and a FIFO named like a leftover folder blocked it forever. Anything
    else of that name is a one-line CheckpointError naming it; nothing is deleted. All or nothing (changes.delete):
    a folder the OS will not let go entirely is a one-line changes.FolderError, and left whole."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "not a folder"
        raise CheckpointError(
            f"{path} is {kind}, named like a folder accel-trainer writes there; it was left as it is. Move or delete "
            "it by hand, then run again."
        )
    changes.delete([path], f"Cannot delete {path}")


def _move_folder(src: str, dst: str) -> None:
    """os.replace of a folder the run wrote, only if `src` is one by lstat (remove_folder's rule)."""
    if not is_real_folder(src):
        remove_folder(src)  # raises, naming what it is
        return
    changes.move(src, dst, f"Cannot move {src} to {dst}")


def _remove_or_warn(path: str, why: str) -> None:
    """A folder the run no longer needs, deleted after a checkpoint was committed: one that cannot be deleted is
    kept whole and said in a warning line, and the run goes on. Its checkpoint is written and complete; stopping
    a run for the disk space of an old folder would lose the training since, and the next checkpoint tries again."""
    if not is_real_folder(path):
        return remove_folder(path)  # gone already, or raises naming what it is
    then = f"The run goes on; make it writable ({changes.HOW}) and the next checkpoint deletes it."
    try:
        changes.delete([path], f"warning: {why}: cannot delete {path}", then, kept="it is kept whole")
    except changes.FolderError as e:
        print(str(e), file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------- writing
def hash_file(path: str, fsync: bool = True) -> tuple[int, str]:
    """(size, sha256) of a file: for the manifest when writing (fsync), and to verify it before a resume."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:  # on disk before the rename makes the folder visible (power loss, not only kills)
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it: racy with threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str):
    """Give a file we wrote the mode any program's new file gets (0666 minus the umask): safetensors writes its
    files 0600, which colleagues on a shared cluster cannot read."""
    os.chmod(path, 0o666 & ~_umask())


def fsync_path(path: str):
    """A file's or a folder's contents (a folder's: its entries) to disk: open read-only, fsync."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(dirpath, n), folder) for n in names]
    return sorted(p for p in out if p != MANIFEST_FILE)


def write_manifest(folder: str, state: dict) -> dict:
    """Hash every file of a finished checkpoint folder and write manifest.json (the last file written)."""
    manifest = {
        "format": MANIFEST_FORMAT,  # checkpointing.state.FORMAT: JSON and safetensors only
        "step": state["global_step"],
        "epoch": state["epoch"],
        "batch_in_epoch": state["batch_in_epoch"],
        "num_processes": state["num_processes"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {},
    }
    for rel in _files(folder):
        follow_umask(os.path.join(folder, rel))
        size, digest = hash_file(os.path.join(folder, rel))
        manifest["files"][rel] = {"size": size, "sha256": digest}
    tmp = os.path.join(folder, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST_FILE))
    fsync_path(folder)
    return manifest


def save_checkpoint(
    accelerator,
    output_dir: str,
    state: dict,
    captured,
    ema=None,
    save_total_limit: int | None = None,
    on_staged=None,
    async_writer=None,
    write_extra=None,
) -> str:
    """Every process calls this (each writes its own RNG state; under FSDP its own shards). `state`: the trainer
    state; `captured`: checkpointing.state.capture() of this update. Returns the final folder. `on_staged(tmp)` runs
    when this process's files are in the temporary folder, before the commit (fault tests kill the run there).
    `write_extra(tmp)` writes this process's own extra state (a stream's position) while training waits, with
    --save_async too: it must be taken at this update, not when the background write ends.
    With `async_writer` (async_writer.AsyncWriter, --save_async) it returns once the state is copied: the model and
    optimizer files, then the same commit, follow in the background; the folder exists only once committed."""
    from . import state as ckpt_state

    step = state["global_step"]
    root = checkpoints_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    what = f"checkpoint step_{step} into {root}"
    main = accelerator.is_main_process
    if main:
        restore_set_aside(output_dir)
        remove_folder(tmp)
        with disk_full_is_one_line(output_dir, what):  # checkpoints/ read-only, immutable, on a full disk
            os.makedirs(tmp)
    accelerator.wait_for_everyone()
    with disk_full_is_one_line(output_dir, what, tmp):
        if write_extra is not None:
            write_extra(tmp)
        ckpt_state.write_small(tmp, captured)  # scheduler, scaler, this rank's RNG: kilobytes, at this update
        if async_writer is None:
            ckpt_state.write_tensors(tmp, captured, main)
        if main:
            if ema is not None:
                ckpt_state.save_weights(ema.module.state_dict(), os.path.join(tmp, EMA_FILE), step)
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(state, f, indent=2)

    def commit():  # main process, once every rank's files are in tmp
        with disk_full_is_one_line(output_dir, what, tmp):
            ckpt_state.name_shards(tmp, step)
            write_manifest(tmp, state)
        _commit(root, tmp, final, step)
        if save_total_limit:  # only committed (complete) folders are listed: the newest one always stays
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                _remove_or_warn(old, f"--save_total_limit {save_total_limit}")

    if async_writer is not None:
        with disk_full_is_one_line(output_dir, what, tmp):
            # Only a full disk becomes a message here: the writer names any other failure itself ("in the background").
            guard = lambda: disk_full_is_one_line(output_dir, what, tmp, others=False)  # noqa: E731
            async_writer.start(tmp, captured, commit, on_staged, guard=guard)
        return final
    if on_staged is not None:
        on_staged(tmp)
    accelerator.wait_for_everyone()  # every rank's files are in tmp
    if main:
        commit()
    accelerator.wait_for_everyone()
    return final


def _folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, rel)) for rel in _files(path)) if os.path.isdir(path) else 0


# A full disk in words (errno ENOSPC/EDQUOT as text: safetensors' Rust writer, a message passed on by a library).
_NO_SPACE = ("No space left on device", "os error 28", "StorageFull", "Disk quota")
# torch.save's C++ writer (inline_container.cc) reports a short write without errno or cause (measured on a full
# tmpfs: "unexpected pos 576 vs 534", "basic_ios::clear: iostream error"): a full disk only when the disk is short.
_SHORT_WRITE = ("unexpected pos", "iostream error", "file write failed")
# Other write failures reported without an OSError: safetensors ("I/O error: ... (os error 1)"), torch ("open file
# failed with strerror: Permission denied").
_WRITE_FAILED = _SHORT_WRITE + ("os error", "strerror", "I/O error")


def is_disk_full(error: BaseException, folder: str, needed: int = 0) -> bool:
    """ENOSPC/EDQUOT as an OSError or in a library's words, or -- torch.save's C++ writer reports a full disk
    without errno -- a short write of torch's while the disk of `folder` has less room left than `needed` (what
    the write takes: a checkpoint of this run) or 1 MiB. Nothing else: a permission error or an object that cannot
    be pickled is not a full disk, however little room is left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if any(s in text for s in _NO_SPACE):
        return True
    if isinstance(error, OSError) or not any(s in text for s in _SHORT_WRITE):
        return False
    try:
        return shutil.disk_usage(folder).free < max(1 << 20, needed)
    except OSError:
        return False


def _cannot_pickle(error: BaseException) -> bool:
    """pickle's own error, or the AttributeError/TypeError it raises for a local object or a lock."""
    import pickle

    return isinstance(error, pickle.PicklingError) or (
        isinstance(error, (AttributeError, TypeError)) and "pickle" in str(error)
    )


@contextlib.contextmanager
def disk_full_is_one_line(output_dir: str, what: str, partial: str | None = None, others: bool = True):
    """A write under output_dir that fails for a known cause becomes one line saying which, where, and which
    checkpoint is the last good one (the newest complete one, which a failed write never touches):
    DiskFullError for a full disk (the partial folder or file is deleted, giving its space back), WriteError
    for a file that cannot be written (permissions, a read-only mount) or an object that cannot be pickled
    (`others=False`: these re-raise, for a caller that names them itself). Anything else re-raises as it is."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only the causes above become a message; anything else re-raises
        good = list_checkpoints(output_dir)
        full = is_disk_full(e, output_dir, _folder_size(good[-1]) if good else 0)
        pickling = not full and _cannot_pickle(e)
        if not full and not (
            others and (pickling or isinstance(e, OSError) or any(s in str(e) for s in _WRITE_FAILED))
        ):
            raise
        last = f"the last good checkpoint is step {_step_of(good[-1])} ({good[-1]})" if good else "no checkpoint yet"
        then = "resume with --resume_from_checkpoint latest" if good else "run it again"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        if full:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True) if is_real_folder(partial) else _remove(partial)
            raise DiskFullError(
                f"The disk is full: writing {what} failed ({type(e).__name__}: {first}); {last}. Free space there, "
                f"then {then}."
            ) from None
        where = getattr(e, "filename", None) or partial or output_dir
        if pickling:
            raise WriteError(
                f"Writing {what} failed: {where}: an object cannot be pickled ({type(e).__name__}: {first}); "
                f"{last}. Make that object picklable or keep it out of the saved state, then {then}."
            ) from None
        cause = getattr(e, "strerror", None) or first
        raise WriteError(
            f"Writing {what} failed: {where}: {cause} ({type(e).__name__}); {last}. Make {os.path.dirname(where)} "
            f"writable (its permissions, a read-only mount, a locked file), then {then}."
        ) from None


def write_file_atomically(path: str, write, output_dir: str, what: str) -> str:
    """`write(tmp)`, fsync, then rename tmp to `path` and fsync the folder: a reader (or a kill) never sees half a
    file, and after a power loss the name points to the whole file or the old one (without the file's fsync the
    rename can reach the disk before the data). A failed write is one line (disk_full_is_one_line). The model
    files (model.safetensors, best/) of plain and sharded runs go here."""
    tmp = path + ".tmp"
    with disk_full_is_one_line(output_dir, what, tmp):
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)  # fsync can report the write's ENOSPC (delayed allocation): inside the guard
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    follow_umask(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))
    return path


def _remove(path: str):
    with contextlib.suppress(OSError):
        os.remove(path)


def _step_of(path: str) -> int:
    return int(os.path.basename(path).split("_")[1])


def _commit(root: str, tmp: str, final: str, step: int):
    """Rename the written folder into place. A checkpoint of the same step already there (a resumed finished run
    writes its last step again) is first renamed aside to `.old_step_<N>` and deleted only after the new one is
    in place: a kill in between leaves `.old_step_<N>`, which restore_set_aside puts back. Never a moment without
    a complete step_<N>-or-its-copy on disk."""
    old = os.path.join(root, f".old_step_{step}")
    if os.path.lexists(final):
        remove_folder(old)
        _move_folder(final, old)
    with changes.one_line(f"Cannot rename {tmp} to {final}", tmp):
        os.replace(tmp, final)
    fsync_path(root)
    _remove_or_warn(old, f"the copy of step_{step} it replaces")


def restore_set_aside(output_dir: str) -> list[str]:
    """Put back a `.old_step_<N>` whose replacement never arrived (killed between _commit's two renames); delete
    one whose replacement is in place. Main process, before checkpoints are listed or written."""
    root = checkpoints_root(output_dir)
    restored = []
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if m := _OLD_DIR.match(d):
            final = os.path.join(root, f"step_{m.group(1)}")
            if os.path.lexists(final):
                _remove_or_warn(os.path.join(root, d), f"the copy of {os.path.basename(final)} it was replaced by")
            else:
                _move_folder(os.path.join(root, d), final)
                restored.append(final)
    return restored


def set_aside_newer(output_dir: str, step: int) -> tuple[list[str], str | None]:
    """A run resumed from step K continues a new lineage: checkpoints in output_dir newer than K (a later
    attempt, or another run's) would be preferred by `latest` over this run's own. They are moved, not deleted,
    into `checkpoints/superseded-<time>/`. Returns (moved step folders, that folder)."""
    newer = [p for p in list_checkpoints(output_dir) if int(os.path.basename(p).split("_")[1]) > step]
    if not newer:
        return [], None
    root = checkpoints_root(output_dir)
    aside = changes.move_into_new_folder(  # all or none, into a folder made now (never a name already there)
        newer, root, f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-", 0o777 & ~_umask(),
        f"Cannot set aside {', '.join(os.path.basename(p) for p in newer)} (newer than step_{step}, resumed from)",
    )  # fmt: skip
    fsync_path(root)
    return newer, aside


# ------------------------------------------------------------------------------------------------------- reading
def remove_stale_tmp(output_dir: str) -> list[str]:
    """Delete `.tmp_step_*` folders that a killed save left behind (main process, before training)."""
    root = checkpoints_root(output_dir)
    stale = [os.path.join(root, d) for d in (os.listdir(root) if os.path.isdir(root) else []) if _TMP_DIR.match(d)]
    for path in sorted(stale):
        remove_folder(path)
    return stale
