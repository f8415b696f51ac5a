"""`--save_async`: a checkpoint stalls training only for the copy of the state off the training tensors.

    writer = AsyncWriter(accelerator, timeout_s)            # one per Trainer
    writer.start(tmp, commit, on_staged)                    # main thread: copy the state, then return
    writer.wait()                                           # before the next save, at preemption, at the end
                                                            # and on every way out of fit() (bounded: timeout_s)
    writer.failed / writer.error                            # set by the background thread

What a synchronous save writes (checkpointing/state.py), with the same names and bytes:

- in the training thread, synchronously: state.capture() of this update (the model's and optimizer's state dicts,
  the scheduler, scaler and this rank's RNG states), and the small JSON files written at once (kilobytes; the RNG
  states must be those of this update anyway);
- in the training thread: a copy of the model and optimizer state dicts to CPU memory by torch's DCP stager
  (`DefaultStager`: tensors sharing storage stay shared, as GPT-2's tied embedding must for the safetensors file to
  be the synchronous one; pinned memory where there is a GPU). This copy is the stall;
- in a background thread: state.write_tensors() of the copies (model.safetensors and the optimizer's files on the
  main process; FSDP2: each rank's DCP safetensors shards), then `commit()`.

Several processes: the background threads talk over their own gloo group (a collective from a second thread on
the training group could interleave with the training's collectives). After writing, the ranks exchange their
outcome; the main process commits (manifest, rename, retention: folder.save_checkpoint's own code) only when
every rank wrote its part, and tells the others whether the commit worked. So every rank knows the same outcome,
and the Trainer stops all of them at the same update (the preemption vote) when it is a failure.

The GPU paths (pinned staging, non-blocking copies, then a device synchronize before training goes on) are torch's;
this module's handling of them was read twice but has not yet run on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from datetime import timedelta

from ..errors import UserError


class CheckpointWriteError(UserError):
    """A checkpoint written in the background failed; the message names it and the last good checkpoint."""


class AsyncWriter:
    def __init__(self, accelerator, timeout_s: int = 1800):
        self.accelerator = accelerator
        self.timeout_s = timeout_s
        self._group = None
        self._thread: threading.Thread | None = None
        self._tmp: str | None = None  # the folder being written
        self._abandoned = False  # wait() gave up on the write: it must not commit if it ever ends
        self.error: BaseException | None = None
        self.on_failure = None  # called from the background thread when the outcome is a failure (all ranks)

    # ------------------------------------------------------------------------------------------- training thread
    def start(self, tmp: str, captured, commit, on_staged=None, guard=None):
        """Write the model and optimizer files of `captured` (state.capture) into `tmp` in the background; `commit()`
        runs on the main process once every rank's files are there. `guard()`: a context manager around the writes
        (a full disk -> one line). Returns once the state is copied. The previous write must have been waited for."""
        assert self._thread is None, "wait() for the previous checkpoint first"
        self.error = None
        acc = self.accelerator
        if acc.num_processes > 1 and self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        big = dataclasses.replace(
            captured, **self._stage({"weights": captured.weights, "optimizer": captured.optimizer})
        )
        self._tmp = tmp
        self._thread = threading.Thread(
            target=self._write, args=(tmp, big, commit, on_staged, guard), name="accel-trainer-checkpoint", daemon=True
        )
        self._thread.start()

    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_flight(self) -> bool:
        """A write was started and not yet waited for (it may have ended)."""
        return self._thread is not None

    def wait(self):
        """Block until the background write (and its commit) is over, at most timeout_s (--ddp_timeout, which also
        bounds the write's collectives); raise its failure, or that it did not end in time, as a one-line error."""
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            alive, self._thread = self._thread.is_alive(), None
            if alive:  # a hung file system: the thread is left (a daemon), its folder is not committed
                self._abandoned = True
                raise CheckpointWriteError(
                    f"The checkpoint {self._tmp} was still being written in the background after {self.timeout_s} s "
                    "(--ddp_timeout); it was not committed, the previous checkpoint is intact. Check the file system, "
                    "then resume with --resume_from_checkpoint latest."
                )
        if self.error is not None:
            self.close()  # the run stops here: the group's threads are not left to the interpreter's teardown
            raise self.error

    def close(self):
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None

    def _stage(self, state):
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # A stager per checkpoint, closed once it has staged: torch 2.11's and 2.12's close themselves at the end of
        # stage(), so a kept one failed at the second checkpoint (KeyError: <class 'type'>; seen with 2.11 on an
        # H100, then on a CPU). 2.13's would keep its host copies for the next checkpoint (faster to stage on a
        # CPU: docs/fault-tolerance.md); this gives that up, and frees the copies between checkpoints instead.
        gpu = torch.cuda.is_available()  # pinned memory and non-blocking copies need one
        options = StagingOptions(
            use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=gpu
        )
        stager = DefaultStager(options)
        try:
            return stager.stage(state)
        finally:
            stager.close()

    # ----------------------------------------------------------------------------------------- background thread
    def _write(self, tmp: str, big, commit, on_staged, guard):
        error: BaseException | None = None
        try:
            with guard() if guard is not None else contextlib.nullcontext():
                self._write_files(tmp, big)
            if on_staged is not None:
                on_staged(tmp)
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the training thread
            error = e
        error = self._agree(error, "written")
        if error is None and self._abandoned:  # given up by wait(): too late to commit (said there)
            error = CheckpointWriteError(f"the write of {tmp} was given up after {self.timeout_s} s")
        if error is None and self.accelerator.is_main_process:
            try:
                commit()
            except BaseException as e:  # noqa: BLE001
                error = e
        error = self._agree(error, "committed", from_main=True)
        if error is not None:
            self.error = error if isinstance(error, UserError) else _one_line(error, tmp)
            if self.on_failure is not None:
                self.on_failure()

    def _write_files(self, tmp: str, big):
        from . import state as ckpt_state

        ckpt_state.write_tensors(tmp, big, self.accelerator.is_main_process, self._group)

    def _agree(self, error: BaseException | None, what: str, from_main: bool = False) -> BaseException | None:
        """Every rank's outcome to every rank (bounded by the group's timeout). `from_main`: only the main
        process's outcome counts (the commit); the others' are already known to be good."""
        if self._group is None:
            return error
        import torch.distributed as dist

        mine = (
            None if error is None else (error if isinstance(error, UserError) else f"{type(error).__name__}: {error}")
        )
        outcomes: list = [None] * self.accelerator.num_processes
        try:
            dist.all_gather_object(outcomes, str(mine) if mine is not None else None, group=self._group)
        except Exception as e:  # noqa: BLE001 - a rank that died or hangs: this checkpoint is not complete
            return error or RuntimeError(f"the ranks could not agree that the checkpoint was {what} ({e})")
        if error is not None:
            return error
        for rank, outcome in enumerate(outcomes[:1] if from_main else outcomes):
            if outcome is not None:
                return CheckpointWriteError(
                    outcome if rank == self.accelerator.process_index else f"rank {rank}: {outcome}"
                )
        return None


def _one_line(error: BaseException, tmp: str) -> CheckpointWriteError:
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return CheckpointWriteError(
        f"Writing the checkpoint {tmp} in the background failed ({type(error).__name__}: {first}); it was not "
        "committed, the previous checkpoint is intact. Fix the cause, then resume with --resume_from_checkpoint latest."
    )
