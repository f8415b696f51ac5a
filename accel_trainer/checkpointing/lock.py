"""A run owns its output folder for its whole life: an OS lock (flock) on `output_dir/.accel-trainer.lock`, held by
the main process from the output folder's checks until fit() ends.

Two runs on one folder lost a model: a second run started with `--resume_from_checkpoint auto` moved the live run's
newest checkpoint aside and wrote its own model.safetensors, and both exited 0. Now the second one is refused in one
line naming the first (its process, host, start and command, which the holder writes into the lock file).

- The OS releases the lock when the holding process dies, however it dies: a SIGKILLed run leaves no stale lock.
- A forked child (notebook_launcher's workers) does not inherit its parent's lock: it takes its own, or is told who
  holds it (a Trainer in the notebook's kernel that has not finished).
- In one process, a newer Trainer on the same folder takes the lock over from an older one (a notebook cell run
  again): the older one can no longer write there (`check()` says so at its next checkpoint).
- Several nodes on a shared file system: only the main process (rank 0) locks. flock is a lock across hosts on
  NFSv4 and on Lustre mounted with `flock`; on a file system where it is local to a host (Lustre `localflock`,
  NFS mounted `nolock`), a second run started on another host is not detected. Where flock is not supported at all
  the run says so in a note line and goes on unlocked.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import stat
import sys
import time

from .. import safe_read
from ..errors import OneLineError, UserError

LOCK_FILE = ".accel-trainer.lock"
_held: dict = {}  # realpath of output_dir -> the OutputLock this process holds on it


class OutputDirInUse(OneLineError):
    """Another run holds the output folder."""


class OutputLock:
    def __init__(self, folder: str, fd: int | None, token: str | None = None, created: bool = False):
        self.folder, self.fd = folder, fd
        self.token = token  # written into the lock file: the other nodes look for it (check_shared)
        self.created = created  # acquire() created output_dir: a run refused at set-up takes it away again
        self.taken_over = False

    def check(self, output_dir: str):
        """Raise when a newer Trainer in this process took the folder over: this one must not write there."""
        if self.taken_over:
            raise OutputDirInUse(
                f"output_dir {output_dir} was taken over by a newer Trainer in this process; this one no longer "
                "writes there. Use the newer one, or give this one another output_dir."
            )

    def __del__(self):  # a Trainer dropped before its fit() ended
        try:  # no contextlib here: at interpreter exit the module's globals may be gone (the OS releases the lock)
            self.release()
        except Exception:  # noqa: BLE001, S110
            pass

    def release(self, tidy: bool = False):
        """Let the folder go. `tidy`: the run was refused before it wrote anything; an output_dir it created that
        holds nothing but the lock file is removed. The file is unlinked while still locked: a run that opens it
        after that creates another, and one that opened it before finds it unlinked once it has the lock (acquire
        checks), so no two runs hold the folder."""
        if _held.get(self.folder) is self:
            del _held[self.folder]
        if tidy and self.created and self.fd is not None and not self.taken_over:
            with contextlib.suppress(OSError):
                if os.listdir(self.folder) == [LOCK_FILE]:
                    os.unlink(os.path.join(self.folder, LOCK_FILE))
                    os.rmdir(self.folder)
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def acquire(output_dir: str, say=None) -> OutputLock:
    """The lock on `output_dir` (created if needed) for this process, or OutputDirInUse naming its holder."""
    import fcntl

    created = not os.path.lexists(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"output_dir {output_dir} cannot be created ({e.strerror}): give an --output_dir on a writable disk."
        ) from None
    real = os.path.realpath(output_dir)
    old = _held.get(real)
    if old is not None:  # an earlier Trainer of this process: the newer one takes the folder over
        old.taken_over = True
        lock = OutputLock(real, old.fd, old.token)
        old.fd = None
        _held[real] = lock
        return lock
    check_own_entries(output_dir)
    path = os.path.join(real, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:  # a read-only folder or mount, a folder of another user, a link
        if e.errno == errno.ELOOP:
            raise OutputDirInUse(
                f"{path} is a symbolic link: the run keeps its lock there, in a file of its own. Remove the link, "
                "then run again."
            ) from None
        raise OutputDirInUse(
            f"output_dir {output_dir} is not writable ({e.strerror}: {path}): the run writes its checkpoints and "
            "model there. Make it writable, or give another --output_dir."
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device named like the lock
        os.close(fd)
        raise OutputDirInUse(f"{path} is not a regular file: the run keeps its lock there. Remove it, then run again.")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500], "token": secrets.token_hex(8)}  # fmt: skip
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) != _inode(path):
            # the holder unlinked the file (a refused run tidying up, release) after this process opened it: the
            # lock of a file no longer in the folder protects nothing; take the folder's own, anew
            os.close(fd)
            return acquire(output_dir, say)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise OutputDirInUse(
            f"output_dir {output_dir} is in use by another run ({holder}): two runs in one folder would write over "
            "each other's checkpoints and model. Wait for it to end, or give another --output_dir."
        ) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        if say is not None:
            say(f"note: output_dir {output_dir} cannot be locked on this file system ({e.strerror}): a second run "
                "started on it would not be refused.")  # fmt: skip
        with contextlib.suppress(OSError):  # the record still tells the other nodes the folder is shared
            with open(path, "w") as f:
                json.dump(record, f)
        return OutputLock(real, None, record["token"])
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as e:  # the record is for the next run's refusal line: a full disk is said, the lock holds
        os.close(fd)
        raise UserError(
            f"output_dir {output_dir} cannot be written ({e.strerror}): the disk is full or the folder read-only. "
            "Free space there, or give another --output_dir."
        ) from None
    lock = OutputLock(real, fd, record["token"], created)
    _held[real] = lock
    return lock


def _inode(path: str) -> tuple | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_dev


def check_shared(accelerator, output_dir: str, lock: OutputLock | None, checkpoints: bool):
    """Every rank, several processes: output_dir is one folder for all of them (every rank writes its RNG state and,
    under FSDP, its shards into the checkpoint the main process commits). Each rank looks for the token the main
    process wrote into the lock file; a rank on a node with a folder of its own (no shared file system) would
    write its part where the main process never sees it, and the checkpoint would resume with other numbers.
    With checkpoints, such a run is refused in one line on every rank; without, nothing but the main process
    writes there."""
    from accelerate.utils import broadcast_object_list, gather_object

    if accelerator.num_processes == 1:
        return
    token = [lock.token if accelerator.is_main_process and lock is not None else None]
    broadcast_object_list(token, from_process=0)
    try:
        seen = safe_read.read_json(os.path.join(output_dir, LOCK_FILE), max_bytes=4096).get("token")  # short
    except (OSError, ValueError, AttributeError):
        seen = None
    mine = None if token[0] is None or seen == token[0] else (accelerator.process_index, socket.gethostname())
    apart = [x for x in gather_object([mine]) if x is not None]
    if apart and checkpoints:
        rank, host = apart[0]
        raise UserError(
            f"output_dir {output_dir} is not one folder for every process: rank {rank} on {host} does not see what "
            f"rank 0 writes there ({len(apart)} rank(s) do not). Every rank writes its part of each checkpoint "
            "into it: give an --output_dir on a file system every node shares, or --save_strategy no to train "
            "without checkpoints."
        )


# What a run writes in its output folder, by name: each must be what the run writes there (a folder, a file), never a
# link (through one, two runs wrote into one folder, or a file outside was written over) nor a FIFO (the run blocked
# forever opening it). Checked before the run reads or writes anything there, so a refusal leaves all as it was.
OWN_FOLDERS = ("checkpoints", "best")
OWN_FILES = ("run_config.json", "metrics.jsonl", "model.safetensors", "error_after_training.txt")


def check_own_entries(output_dir: str):
    for name in OWN_FOLDERS + OWN_FILES:
        path = os.path.join(output_dir, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise OutputDirInUse(
                f"{path} is a symbolic link (to {os.path.realpath(path)}): the run keeps its own {name} in its output "
                "folder, which it locks; through a link it would write where another run or file is. Link the whole "
                "--output_dir instead, or remove the link."
            )
        if not (stat.S_ISDIR(mode) if name in OWN_FOLDERS else stat.S_ISREG(mode)):
            kind = "folder" if name in OWN_FOLDERS else "regular file"
            raise OutputDirInUse(
                f"{path} is not a {kind} (a FIFO, a device, ...): the run writes its own {name} there. Move it away, "
                "or give another --output_dir."
            )


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it; 'unknown' when the record cannot be read."""
    try:
        record = safe_read.loads(os.pread(fd, 4096, 0) or b"null")  # another's record: strictly, bounded
        where = f"process {record['pid']} on {record['host']}, started {record['started']}"
        if record["pid"] == os.getppid() and record["host"] == socket.gethostname():
            where += (" -- this process's parent, e.g. a notebook kernel holding a Trainer whose fit() has not "
                      "ended: let it end, or del that Trainer")  # fmt: skip
        return f"{where}: {record['command']}" if record.get("command") else where
    except (OSError, ValueError, TypeError, KeyError):
        return "a process that did not say which"


def _forget_in_child():
    """After fork: the child holds none of its parent's locks (it may take its own)."""
    for lock in list(_held.values()):
        if lock.fd is not None:
            os.close(lock.fd)  # the parent's descriptor keeps the flock
            lock.fd = None
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)
