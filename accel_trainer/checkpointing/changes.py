"""Changes to the output folder's layout -- a folder moved aside, a folder or file deleted -- and the check at
set-up that the run can write there. folder.py and manager.py change the output folder only through these.

A folder or file the OS will not let go (a read-only mount, a folder of another user, an entry made immutable with
`chattr +i`, which stops root too) is one line, FolderError, naming the path, the OS's reason and the fix: never a
traceback from inside shutil. Deleting is all or nothing: every entry of what is to go is checked first (its
folder writable, no immutable or append-only flag), so that a deletion which would stop half-way (a checkpoint
with half its files, a previous run half overwritten) does not start; what passes is renamed aside in one step,
then deleted, so that what a failure the check could not foresee leaves behind is never taken for a checkpoint.
Moving several folders aside is all or none too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import struct
import sys
import tempfile

from ..errors import OneLineError

# The fix that goes with every refusal: the three causes seen (a flag, a mode, a mount), each undone by its owner.
HOW = "chattr -i or -a for a locked entry, chmod for its permissions, a read-write mount"
AGAIN = f"Make it writable ({HOW}), then run again."
DELETING = ".deleting-"  # a folder renamed aside to be deleted: left only where the deletion failed or was killed


class FolderError(OneLineError):
    """An entry of the output folder that cannot be created, moved or deleted; the message names it, why, and the
    fix. What the message names as kept was left whole."""


@contextlib.contextmanager
def one_line(doing: str, path: str, then: str = AGAIN):
    """An OSError inside is FolderError: `<doing>: <the file the OS named>: <its reason>. <then>`."""
    try:
        yield
    except OSError as e:
        where = e.filename or path
        raise FolderError(f"{doing}: {where}: {e.strerror or e} ({type(e).__name__}). {then}") from None


# ------------------------------------------------------------------------------------------------- checks first
def _flag(path: str) -> str | None:
    """'immutable (chattr +i)' or 'append-only (chattr +a)' when such a flag stops `path` being deleted or
    renamed (root too; no permission bit shows it); None when not, or where the file system keeps no flags."""
    st = os.lstat(path)
    if hasattr(st, "st_flags"):  # BSD, macOS
        if st.st_flags & (stat.UF_IMMUTABLE | stat.SF_IMMUTABLE):
            return "immutable (chflags)"
        return "append-only (chflags)" if st.st_flags & (stat.UF_APPEND | stat.SF_APPEND) else None
    if not sys.platform.startswith("linux") or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return None  # a FIFO or a device is not opened: that could block, or act
    import array
    import fcntl

    get_flags = 0x80086601 if struct.calcsize("l") == 8 else 0x80046601  # FS_IOC_GETFLAGS, _IOR('f', 1, long)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, get_flags, flags)
    except OSError:  # a file system without such flags
        return None
    finally:
        os.close(fd)
    if flags[0] & 0x10:  # FS_IMMUTABLE_FL
        return "immutable (chattr +i)"
    return "append-only (chattr +a)" if flags[0] & 0x20 else None  # FS_APPEND_FL


def _unwritable(folder: str) -> str | None:
    """Why no entry can be added to or removed from `folder`, or None when they can."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    if flag := _flag(folder):
        return flag
    with contextlib.suppress(OSError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "on a read-only file system"
    return "not writable by this user (its permissions)"


def cannot_delete(path: str) -> tuple[str, str] | None:
    """(the first entry that stops `path` -- a file, or a folder and all it holds -- being deleted, why), or None."""
    if reason := _unwritable(os.path.dirname(os.path.abspath(path))):
        return os.path.dirname(os.path.abspath(path)), reason
    todo = [path]
    while todo:
        entry = todo.pop()
        if reason := _flag(entry):
            return entry, reason
        if stat.S_ISDIR(os.lstat(entry).st_mode):  # a link is deleted, never followed
            if reason := _unwritable(entry):
                return entry, reason
            try:
                todo += [os.path.join(entry, name) for name in os.listdir(entry)]
            except OSError as e:
                return entry, f"not readable ({e.strerror})"
    return None


def cannot_move(path: str) -> tuple[str, str] | None:
    """(what stops the folder `path` being renamed into another folder, why), or None. Such a rename rewrites the
    folder's own `..` entry: the folder must be writable as well as the one it is in."""
    parent = os.path.dirname(os.path.abspath(path))
    if reason := _unwritable(parent):
        return parent, reason
    if reason := _flag(path):
        return path, reason
    return None if os.access(path, os.W_OK) else (path, "not writable by this user (its permissions)")


def _refusal(doing: str, blocked: tuple[str, str], kept: str, then: str) -> FolderError:
    return FolderError(f"{doing}: {blocked[0]} is {blocked[1]}; {kept}. {then}")


# ----------------------------------------------------------------------------------------------------- changes
def delete(paths: list[str], doing: str, then: str = AGAIN, kept: str = "nothing was deleted") -> None:
    """Delete `paths` (files, or folders with all they hold), all or none: each is checked before any is touched.
    A folder is renamed aside (`.deleting-<name>-<random>`, beside it) and then deleted, so a failure or a kill
    halfway through the deletion leaves remains under that name, which nothing reads as a checkpoint or a run."""
    paths = [p for p in paths if os.path.lexists(p)]
    for path in paths:
        if blocked := cannot_delete(path):
            raise _refusal(doing, blocked, kept, then)
    for path in paths:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            with one_line(doing, path, then):
                os.remove(path)
            continue
        gone = os.path.join(os.path.dirname(path), f"{DELETING}{os.path.basename(path)}-{secrets.token_hex(4)}")
        with one_line(doing, path, then):
            os.replace(path, gone)
        with one_line(f"{doing} (its remains are in {gone}: delete them by hand)", gone, then):
            shutil.rmtree(gone)


def move(src: str, dst: str, doing: str, then: str = AGAIN) -> None:
    """os.replace(src, dst) of a folder, checked first; a failure is one line and `src` stays where it was."""
    if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
        if blocked := cannot_move(src):
            raise _refusal(doing, blocked, f"{src} was left where it is", then)
    with one_line(doing, src, then):
        os.replace(src, dst)


def move_into_new_folder(paths: list[str], root: str, prefix: str, mode: int, doing: str) -> str:
    """Move the folders `paths` into a folder made now in `root` (mkdtemp: a new name, created atomically, so that
    nothing already there -- a link to elsewhere, someone's folder -- is moved into) and return it. All or none:
    each is checked first, and a move that fails anyway puts back the ones moved before it."""
    for path in paths:
        if blocked := cannot_move(path):
            raise _refusal(doing, blocked, "nothing was moved", AGAIN)
    with one_line(doing, root):
        aside = tempfile.mkdtemp(prefix=prefix, dir=root)
        os.chmod(aside, mode)
    moved: list[str] = []
    try:
        for path in paths:
            move(path, os.path.join(aside, os.path.basename(path)), doing)
            moved.append(path)
    except FolderError:
        for path in reversed(moved):
            with contextlib.suppress(OSError):
                os.replace(os.path.join(aside, os.path.basename(path)), path)
        with contextlib.suppress(OSError):
            os.rmdir(aside)
        raise
    return aside


def check_writable(output_dir: str, checkpoints: bool) -> None:
    """At set-up, before any training: the run can add files to output_dir (its model and logs) and, when it writes
    checkpoints, to checkpoints/ in it. A run that learned it at its first checkpoint or at its end had trained for
    nothing."""
    folders = [output_dir] + ([os.path.join(output_dir, "checkpoints")] if checkpoints else [])
    for folder in folders:
        if os.path.isdir(folder) and (reason := _unwritable(folder)):
            raise FolderError(
                f"--output_dir {output_dir}: {folder} is {reason}: the run writes its "
                f"{'checkpoints' if folder != output_dir else 'model and logs'} there. Make it writable ({HOW}), "
                "or give another --output_dir."
            )
