"""A dead or hung peer rank, named: around fit()'s loop with several processes, a collective that fails or times out
(--ddp_timeout) becomes one PeerFailure line naming the rank that stopped answering (a monitored barrier on a side
gloo group) and where every rank was (StackDumps: each rank's Python stack and last collectives, in
output_dir/stacks), instead of a backend traceback. The launcher reads the line (faults.DEAD_RANKS).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

from . import privates, safe_read
from .errors import UserError
from .faults import dead_ranks_phrase, restart_count


class PeerFailure(UserError):
    """A collective failed or timed out: another rank died or hangs. The message names it when it can."""


def make_diagnostic_group(accelerator, timeout_s: int):
    """A separate gloo group used only after a collective failed, to find which rank stopped answering. Its own
    timeout is --ddp_timeout too: torch's default (30 min) would let a rank whose peer's link is cut wait that long
    inside the diagnosis itself (seen with gdb in the link-cut test)."""
    if accelerator.num_processes == 1:
        return None
    import torch.distributed as dist

    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - diagnostics are best effort
        return None


def _is_collective_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    # gloo's errors are plain RuntimeErrors: most name gloo; a timeout inside DDP's backward all-reduce surfaces
    # from gloo's transport as "Application timeout caused pair closure".
    return isinstance(e, RuntimeError) and bool(_BACKEND_FAILURE.search(str(e)))


_BACKEND_FAILURE = re.compile(r"gloo|nccl|timeout caused pair closure|connection closed by peer", re.I)


@contextmanager
def peer_failures(acc, diag_group, timeout_s: float, step: Callable[[], int], folder: str | None = None):
    """Around fit()'s loop with several processes: a collective that fails or times out (--ddp_timeout) because
    a peer died or hangs becomes a PeerFailure that names the rank and where every rank was (StackDumps, in
    `folder`/stacks), instead of a backend traceback. `diag_group` is make_diagnostic_group's; `step()` the update
    count to report."""
    if acc.num_processes == 1:
        yield
        return
    dumps = StackDumps(folder, acc.process_index) if folder else None
    try:
        if dumps:
            dumps.start()
        yield
    except (UserError, SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001
        if not _is_collective_failure(e):
            raise
        if dumps:
            dumps.write(error=e)  # where this rank waited, before the others are asked for theirs
            dumps.ask_every_rank()
        raise describe_peer_failure(acc, diag_group, e, step(), timeout_s, dumps) from e
    finally:
        if dumps:
            dumps.stop()


def describe_peer_failure(
    accelerator, group, error: BaseException, step: int, timeout_s: int, dumps: StackDumps | None = None
) -> PeerFailure:
    """After a collective failed: a monitored barrier on the side group names the ranks that do not answer; the
    stack files (when `dumps`) say where they, and this rank, were."""
    import torch.distributed as dist

    rank = accelerator.process_index
    culprit, culprits = "another rank", []
    if group is not None:
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=min(timeout_s, 10)), wait_all_ranks=True)
        except Exception as e:  # noqa: BLE001
            text = str(e)
            m = re.search(r"[Rr]anks? ([\d, ]+) failed to pass", text)
            if m:
                culprit = "rank " + m.group(1).strip().rstrip(",")
                culprits = [int(r) for r in re.findall(r"\d+", m.group(1))]
            elif rank != 0:
                culprit = "rank 0 (or another rank)"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    where = ""
    if dumps is not None:
        deadline = time.monotonic() + 5  # one bound for all: a file on another machine's disk never appears here
        places = [dumps.where(r, deadline) for r in culprits[:4]] + [dumps.where(rank, deadline)]
        where = f"; {'; '.join(places)}; the Python stack of every rank: {dumps.directory}/rank<N>.txt"
    return PeerFailure(
        f"rank {rank}: a collective failed after step {step} ({first}): {dead_ranks_phrase(culprit)} "
        f"(no answer within --ddp_timeout={timeout_s} s){where}. The whole job stops; resume with "
        "--resume_from_checkpoint latest."
    )


# --------------------------------------------------------------------- where each rank is when a collective fails
STACKS_DIR = "stacks"  # in the run's output folder: rank<N>.txt, one per rank
_DUMP_DONE = "-- end of dump --"
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (\S+)')


class StackDumps:
    """The Python stack of every rank at the moment a collective fails, each written by the rank itself into
    `<folder>/stacks/rank<N>.txt`.

    A rank that sees the failure (its collective timed out, or its peer's link closed) writes where it waited (the
    exception's traceback) and every thread's stack, then sets a key in the launcher's store (torchrun's TCPStore
    at MASTER_ADDR:MASTER_PORT, the server every rank already reaches; one more client connection per rank, so a
    blocked wait never holds the process group's own client). On every rank a daemon thread polls that key twice a
    second and, when it is set, writes its rank's stacks with `faulthandler` -- which reads the frames of a main
    thread sleeping, computing or blocked in a collective alike, as long as that main thread lets the GIL go (a
    Python loop, `time.sleep`, a torch op or a collective all do). The last collective a rank entered is the
    `torch.distributed` frame nearest the top of its main thread's stack.
    """

    POLL_S = 0.5
    JOIN_S = 2  # stop() waits this long at most for the watcher to leave a store call (one answers in milliseconds)

    def __init__(self, folder: str, rank: int):
        self.directory = os.path.join(folder, STACKS_DIR)
        self.rank = rank
        self.key = f"accel_trainer/dump_stacks/{restart_count()}"
        self._stop, self._lock, self._written = threading.Event(), threading.Lock(), False
        self._thread: threading.Thread | None = None

    def path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank{rank}.txt")

    def start(self):
        try:  # a file of an earlier attempt in the same folder would be read as this one's
            os.remove(self.path(self.rank))
        except OSError:
            pass
        self._thread = threading.Thread(target=self._watch, name="accel_trainer-stack-dumps", daemon=True)
        self._thread.start()

    def stop(self):
        """The watcher ends and is waited for (bounded): a daemon thread still inside a store call (torch's binding
        lets the GIL go during it) when the interpreter exits aborts the whole process as that call returns --
        "terminate called without an active exception", SIGABRT, after a run that had finished -- because taking
        the GIL back in a finalizing interpreter ends the thread inside a C++ destructor."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.JOIN_S)

    def _store(self):
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        import torch.distributed as dist

        try:
            return dist.TCPStore(
                addr, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
            )
        except Exception:  # noqa: BLE001 - best effort: without the store a rank still writes its own stack
            return None

    def ask_every_rank(self):
        store = self._store()
        if store is not None:
            try:
                store.set(self.key, str(self.rank))
            except Exception:  # noqa: BLE001
                pass

    def _watch(self):
        store = self._store()
        while store is not None and not self._stop.wait(self.POLL_S):
            try:
                if store.check([self.key]):
                    self.write(asked_by=store.get(self.key).decode())
                    return
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def write(self, error: BaseException | None = None, asked_by: str | None = None):
        """This rank's stacks: the failed collective's traceback (`error`) or, asked by a peer, every thread's."""
        import faulthandler
        import socket
        import traceback

        with self._lock:
            if self._written and error is None:
                return
            self._written = True
            try:
                os.makedirs(self.directory, exist_ok=True)
                with open(self.path(self.rank), "w") as f:
                    why = f"its collective failed: {error!r}"[:300] if error else f"rank {asked_by} asked"
                    f.write(
                        f"rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}) at "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {why}\n"
                        f"main thread 0x{threading.main_thread().ident:016x}\n"
                    )
                    if error is not None:  # in faulthandler's format, which where() reads
                        f.write(f"Where the failed collective was entered:\n{_thread_header()}\n")
                        for fr in reversed(traceback.extract_tb(error.__traceback__)):
                            f.write(f'  File "{fr.filename}", line {fr.lineno} in {fr.name}\n')
                        f.write("\n")
                    f.write("Every thread (most recent call first):\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                    f.write(_last_collectives())
                    f.write(f"{_DUMP_DONE}\n")
            except OSError:
                pass

    def where(self, rank: int, deadline: float) -> str:
        """ "rank 1 was in loss (recipe.py:77), its last collective ...", from its stack file (waited for until
        `deadline`, a time.monotonic())."""
        text = ""
        while True:
            try:
                text = safe_read.read_text(self.path(rank), max_bytes=16 << 20)
            except (OSError, ValueError):
                text = ""
            if _DUMP_DONE in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if _DUMP_DONE not in text:
            return f"rank {rank}: no stack here in time (on another machine's disk, or the rank holds the GIL)"
        frames = _main_thread_frames(text)
        last = re.search(r"^last collective: (.*)$", text, re.M)
        last = f", its last collective {last.group(1)}" if last else ""
        return f"rank {rank} was {_summary(frames)}{last}" if frames else f"rank {rank}: see {self.path(rank)}"


def _last_collectives(n: int = 5) -> str:
    """The last `n` collectives this rank entered, from torch's Flight Recorder (on when TORCH_FR_BUFFER_SIZE > 0,
    which accel.flight_recorder sets), newest last: "last collective: #12 gloo:all_reduce (default_pg) ended".
    Read through privates.flight_recorder_json (torch has no public reader); a torch without it gives nothing."""
    try:
        entries = safe_read.loads(privates.flight_recorder_json()).get("entries", [])
    except Exception:  # noqa: BLE001 - best effort
        return ""
    lines = []
    for e in entries[-n:]:
        state = "ended" if e.get("retired") else e.get("state", "?")  # retired: finished, failed or timed out
        group = (e.get("process_group") or ["", "?"])[-1]
        lines.append(f"#{e.get('collective_seq_id')} {e.get('profiling_name')} ({group}) {state}")
    if not lines:
        return ""
    return (
        "Last collectives entered (torch's Flight Recorder, oldest first):\n"
        + "".join(f"  {line}\n" for line in lines)
        + f"last collective: {lines[-1]}\n"
    )


def _thread_header() -> str:
    """The main thread as faulthandler names it (its ident, zero-padded hex)."""
    return f"Thread 0x{threading.main_thread().ident:016x} (most recent call first):"


def _main_thread_frames(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames in a stack file, innermost first: (file, line, function)."""
    m = re.search(r"^main thread (0x[0-9a-f]+)$", text, re.M)
    if not m:
        return []
    lines = text.splitlines()
    start = next(
        (i for i, ln in enumerate(lines) if ln.endswith(f"hread {m.group(1)} (most recent call first):") and i > 0),
        None,
    )
    frames = []
    for line in lines[start + 1 :] if start is not None else []:
        f = _FRAME.match(line)
        if not f:
            break
        frames.append((f.group(1), int(f.group(2)), f.group(3)))
    return frames


def _summary(frames: list[tuple[str, int, str]]) -> str:
    """ "in loss (recipe.py:77)", plus the collective it waits in when there is one."""
    import sysconfig

    import torch

    libs = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, os)) + (sysconfig.get_paths()["purelib"],)
    own = os.path.dirname(os.path.abspath(__file__)) + os.sep
    mine = [f for f in frames if not f[0].startswith(libs) or f[0].startswith(own)]
    file, line, func = (mine or frames)[0]
    text = f"in {func} ({os.path.basename(file)}:{line})"
    collective = next((f for f in frames if f[0].endswith("distributed_c10d.py")), None)
    return text + (f" waiting in {collective[2]}" if collective else "")
