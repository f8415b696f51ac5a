"""Faults: preemption signals and elastic restarts; what the workers print that the launcher reads. A dead or hung
peer rank is named by peers.py.

Preemption: while `fit()` runs, SIGTERM and SIGUSR1 (what SLURM, Kubernetes and cloud preemption send) only set
a flag (under `accel-trainer launch`, a SIGUSR1 during set-up too: see keep_early_preemption). At the next
update boundary every rank checkpoints and the process exits with `EXIT_PREEMPTED` (75,
EX_TEMPFAIL: "try again later"). With several processes the ranks agree through the all-reduce the update does
anyway (one more number in it, no extra collective): a signal that reaches one rank stops them all at the same
step. A second signal ends the process at once (the default action).

Elastic restarts: under `accelerate launch --max_restarts N` (torchrun), a restarted worker group sees
TORCHELASTIC_RESTART_COUNT > 0 (restart_count) and resumes from the newest good checkpoint by itself (`auto`;
checkpointing/resume.py, effective_resume_spec).

Faults are injected in tests through the Trainer's named events (tests/fault_recipe.py), never from inside fit().
"""

from __future__ import annotations

import os
import re
import signal

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


def restart_count() -> int:
    """How many times torchelastic has restarted this worker group (0 on the first attempt or without it)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


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
