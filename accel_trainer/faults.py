"""Faults: preemption signals, elastic restarts, a dead or hung peer rank, and test-only fault injection.

Preemption: while `fit()` runs, SIGTERM and SIGUSR1 (what SLURM, Kubernetes and cloud preemption send) only set
a flag (under `accel-trainer launch`, a SIGUSR1 during set-up too: see keep_early_preemption). At the next
update boundary every rank checkpoints and the process exits with `EXIT_PREEMPTED` (75,
EX_TEMPFAIL: "try again later"). With several processes the ranks agree through the all-reduce the update does
anyway (one more number in it, no extra collective): a signal that reaches one rank stops them all at the same
step. A second signal ends the process at once (the default action).

Elastic restarts: under `accelerate launch --max_restarts N` (torchrun), a restarted worker group sees
TORCHELASTIC_RESTART_COUNT > 0 and resumes from the newest good checkpoint by itself (`auto`).

Faults are injected in tests through the Trainer's named events (tests/fault_recipe.py), never from inside fit().
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

from . import privates
from .errors import UserError

EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h; documented in docs/fault-tolerance.md


# --- What the workers print that `accel-trainer launch` reads (launch.py), written and parsed here only ----------
def received_line(signal_name: str, what: str) -> bytes:
    """ "[rank N] SIGUSR1 received...": the launcher signals each worker once, and stops once every rank said so."""
    return f"[rank {os.environ.get('RANK', '0')}] {signal_name} received{what}\n".encode()


RECEIVED = re.compile(r"\[rank (\d+)\] (SIGUSR1|SIGTERM) received")


def preempted_exit(exit_code: int | None = None) -> str:
    """The Trainer's last words after its preemption checkpoint."""
    return f"exiting with code {EXIT_PREEMPTED if exit_code is None else exit_code}"


# That line, or torchrun's report of a worker's exit code: either means the workers stopped for a preemption.
PREEMPTED = re.compile(rf"{preempted_exit()}\b|exitcode\s*:\s*{EXIT_PREEMPTED}\b")


def dead_ranks_phrase(culprit: str) -> str:
    """How a PeerFailure names the rank(s) that stopped answering: "...: rank 3 died or hangs"."""
    return f"{culprit} died or hangs"


DEAD_RANKS = re.compile(r": ranks? ([\d, ]+) died or hangs")
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(SystemExit):
    """Raised by fit() after the preemption checkpoint; exits the process with EXIT_PREEMPTED when not caught.
    `.checkpoint` is the folder written."""

    def __init__(self, checkpoint: str, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.checkpoint, self.step = checkpoint, step

    def __str__(self):
        return f"preempted: checkpoint {self.checkpoint} written at step {self.step}; exit code {EXIT_PREEMPTED}"


class PeerFailure(UserError):
    """A collective failed or timed out: another rank died or hangs. The message names it when it can."""


def restart_count() -> int:
    """How many times torchelastic has restarted this worker group (0 on the first attempt or without it)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def effective_resume_spec(spec: str | None) -> str | None:
    """On an elastic restart the newest checkpoint of this run wins over whatever the command line said: the
    group restarts with the same arguments and must continue, not start over (or from the original folder)."""
    if restart_count() > 0:
        return "auto" if spec in (None, "latest", "auto") else f"auto:{spec}"
    return spec


# Set by `accel-trainer launch` for its workers: they arrive with SIGUSR1 ignored (the launcher ignores it in
# torchrun's agent, which would otherwise die of it, and an ignored signal stays ignored across exec).
LAUNCHED_ENV = "ACCEL_TRAINER_LAUNCHED"
_early_signal: list[str] = []  # a preemption notice that arrived before fit() (at most one)


def _early_notice(signum, frame):
    if _early_signal:  # a second signal: exit at once, as during fit()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _early_signal.append(signal.Signals(signum).name)
    os.write(
        2,
        received_line(
            _early_signal[0],
            " before training: checkpointing at the first update boundary, then exiting (send a signal again to "
            "exit at once).",
        ),
    )


def keep_early_preemption():
    """In a worker of `accel-trainer launch`, from the start of set-up (accel.configure_process) on: a SIGUSR1
    during set-up (tokenising, loading) is kept for fit(), which checkpoints at its first update boundary and exits
    EXIT_PREEMPTED, instead of being dropped (ignored until fit() installs its handler). Elsewhere nothing changes.
    Called by accel.configure_process, not at import: importing the package changes no process-wide setting; True
    when the handler was installed (run_config.json's "process")."""
    if os.environ.get(LAUNCHED_ENV) != "1":
        return False
    try:
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_IGN, signal.SIG_DFL):
            signal.signal(signal.SIGUSR1, _early_notice)
            return True
    except ValueError:  # set up outside the main thread: no handler can be installed from here
        pass
    return False


class PreemptionHandler:
    """Installed by fit() in the main thread; `requested` turns True when one of PREEMPT_SIGNALS arrives."""

    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.requested:  # a second signal: give up on the checkpoint, die the default way
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested, self.signal_name = True, signal.Signals(signum).name
        # os.write, not print: the handler may run while the main code is inside a write to stderr (tqdm), and a
        # buffered write from here would raise "reentrant call" at that arbitrary point.
        os.write(
            2,
            received_line(
                self.signal_name,
                ": checkpointing at the next update boundary, then exiting (send a signal again to exit at once).",
            ),
        )

    def __enter__(self):
        self.requested, self.signal_name = bool(_early_signal), (_early_signal or [None])[0]
        _early_signal.clear()  # taken: fit() stops at its first update boundary
        for name in PREEMPT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. fit() from a worker thread): no handler
                pass
        return self

    def __exit__(self, exc_type, exc, tb):
        # After a preemption checkpoint the process is on its way out with EXIT_PREEMPTED: further signals (torchrun
        # SIGTERMs the other workers as soon as the first one exits) must not turn that exit into a -15.
        exiting = exc_type is not None and issubclass(exc_type, Preempted)
        for sig, prev in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if exiting else prev)
        self._previous = {}
        return False


class Vote:
    """The all-reduced count of ranks that got a preemption signal, copied to the host without waiting for the
    device; `agreed()` is called one update later, when the copy has normally long finished (on a GPU it waits for
    the previous update's all-reduce only, never for the current update's work)."""

    __slots__ = ("host", "event")

    def __init__(self, count):
        if count.is_cuda:
            import torch

            self.host = count.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = count, None

    def agreed(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host > 0)


class Preemption:
    """Preemption for fit(): the signal handler, and the ranks' agreement on the update at which all of them stop.

        with preemption:                      # installs the handlers for the duration of fit()
            totals = [..., preemption.vote()] # this rank's vote rides on the update's one all-reduce
            preemption.record(reduced[-1])    # the reduced vote (several processes)
            if preemption.agreed(): ...       # every rank reads the same vote at the same update

    With one process `agreed()` is the flag itself (no collective, no cost). With several, it is the vote of the
    PREVIOUS update, whose all-reduce has finished by now: no wait on the current update's GPU work; every rank
    therefore stops at the same step, one update after the signal arrived anywhere.
    """

    def __init__(self, device, num_processes: int):
        import torch

        self.handler = PreemptionHandler()
        self.num_processes = num_processes
        self._values = (torch.zeros((), device=device), torch.ones((), device=device))
        self._current = self._previous = None

    @property
    def signal_name(self) -> str | None:
        return self.handler.signal_name

    def __enter__(self):
        self.handler.__enter__()
        self._current = self._previous = None
        return self

    def __exit__(self, *exc):
        return self.handler.__exit__(*exc)

    def vote(self):
        return self._values[self.handler.requested]  # 1 on a rank that got a signal

    def request_stop(self):
        """As if a signal arrived, without one (any thread): e.g. a failed background checkpoint write, which
        _preempt then reports. signal_name stays None."""
        self.handler.requested = True

    def record(self, reduced_vote):
        self._current = Vote(reduced_vote)

    def agreed(self) -> bool:
        if self.num_processes == 1:
            return self.handler.requested
        vote, self._previous = self._previous, self._current
        return vote is not None and vote.agreed()


# ----------------------------------------------------------------------------------------------- dead or hung peer
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
        self._stop.set()

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
                text = open(self.path(rank)).read()
            except OSError:
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
    `_dump_fr_trace_json` is private: torch has no public way to read its recorder from Python (the public
    dump-on-timeout file is written by the NCCL watchdog only); a torch without it gives nothing here."""
    try:
        import json

        entries = json.loads(privates.flight_recorder_json()).get("entries", [])
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
