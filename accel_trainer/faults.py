"""Faults: preemption signals, elastic restarts, a dead or hung peer rank, and test-only fault injection.

Preemption: while `fit()` runs, SIGTERM and SIGUSR1 (what SLURM, Kubernetes and cloud preemption send) only set
a flag. At the next update boundary every rank checkpoints and the process exits with `EXIT_PREEMPTED` (75,
EX_TEMPFAIL: "try again later"). With several processes the ranks agree through the all-reduce the update does
anyway (one more number in it, no extra collective): a signal that reaches one rank stops them all at the same
step. A second signal ends the process at once (the default action).

Elastic restarts: under `accelerate launch --max_restarts N` (torchrun), a restarted worker group sees
TORCHELASTIC_RESTART_COUNT > 0 and resumes from the newest good checkpoint by itself (`auto`).

Test-only fault injection: the environment variable ACCEL_TRAINER_TEST_FAULTS (see `TestFaults`). Never set it
in a real run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager

from .errors import UserError

EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h; documented in docs/fault-tolerance.md
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
            f"[rank {os.environ.get('RANK', '0')}] {self.signal_name} received: checkpointing at the next "
            "update boundary, then exiting (send a signal again to exit at once).\n".encode(),
        )

    def __enter__(self):
        self.requested, self.signal_name = False, None
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


# ----------------------------------------------------------------------------------------------- dead or hung peer
def make_diagnostic_group(accelerator):
    """A separate gloo group used only after a collective failed, to find which rank stopped answering."""
    if accelerator.num_processes == 1:
        return None
    import torch.distributed as dist

    try:
        return dist.new_group(backend="gloo")
    except Exception:  # noqa: BLE001 - diagnostics are best effort
        return None


def _is_collective_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()  # gloo's errors are plain RuntimeErrors that name gloo (timeouts, closed connections)
    return isinstance(e, RuntimeError) and ("gloo" in text or "nccl" in text)


@contextmanager
def peer_failures(trainer):
    """Around fit()'s loop with several processes: a collective that fails or times out (--ddp_timeout) because
    a peer died or hangs becomes a PeerFailure that names the rank, instead of a backend traceback."""
    acc = trainer.accelerator
    if acc.num_processes == 1:
        yield
        return
    try:
        yield
    except (UserError, SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001
        if not _is_collective_failure(e):
            raise
        raise describe_peer_failure(acc, trainer._diag_group, e, trainer.global_step, trainer.args.ddp_timeout) from e


def describe_peer_failure(accelerator, group, error: BaseException, step: int, timeout_s: int) -> PeerFailure:
    """After a collective failed: a monitored barrier on the side group names the ranks that do not answer."""
    from datetime import timedelta

    import torch.distributed as dist

    rank = accelerator.process_index
    culprit = "another rank"
    if group is not None:
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=min(timeout_s, 10)), wait_all_ranks=True)
        except Exception as e:  # noqa: BLE001
            text = str(e)
            import re

            m = re.search(r"[Rr]anks? ([\d, ]+) failed to pass", text)
            if m:
                culprit = "rank " + m.group(1).strip().rstrip(",")
            elif rank != 0:
                culprit = "rank 0 (or another rank)"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return PeerFailure(
        f"rank {rank}: a collective failed after step {step} ({first}): {culprit} died or hangs "
        f"(no answer within --ddp_timeout={timeout_s} s). The whole job stops; resume with "
        "--resume_from_checkpoint latest."
    )


# --------------------------------------------------------------------------------------------- test fault injection
class TestFaults:
    """Faults for the tests, from ACCEL_TRAINER_TEST_FAULTS="key=value,...". Keys:

    step_delay=S         sleep S seconds after every update (slows a run so a test can kill it mid-way)
    save_delay=S         sleep S seconds inside save_checkpoint, before the manifest/rename (a kill lands there)
    exit_at=R:N          rank R exits with status 3 after update N, on the first elastic attempt only
    hang_at=R:N          rank R stops making progress after update N (sleeps; SIGTERM ends it at once)
    """

    __test__ = False  # not a pytest class

    def __init__(self, spec: str):
        self.step_delay = self.save_delay = 0.0
        self.exit_at = self.hang_at = None
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, _, value = item.partition("=")
            if key in ("step_delay", "save_delay"):
                setattr(self, key, float(value))
            elif key in ("exit_at", "hang_at"):
                r, _, n = value.partition(":")
                setattr(self, key, (int(r), int(n)))
            else:
                raise ValueError(f"ACCEL_TRAINER_TEST_FAULTS: unknown key {key!r}")

    @classmethod
    def from_env(cls) -> TestFaults | None:
        spec = os.environ.get("ACCEL_TRAINER_TEST_FAULTS")
        return cls(spec) if spec else None

    def after_update(self, rank: int, step: int):
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.exit_at == (rank, step) and restart_count() == 0:
            print(f"[test fault] rank {rank} exits with status 3 after step {step}", file=sys.stderr, flush=True)
            os._exit(3)
        if self.hang_at == (rank, step):
            print(f"[test fault] rank {rank} hangs after step {step}", file=sys.stderr, flush=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(1)

    def during_save(self, folder: str):
        if self.save_delay:
            time.sleep(self.save_delay)
