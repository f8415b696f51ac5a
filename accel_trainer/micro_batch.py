"""--auto_micro_batch: out of memory during an update halves the micro-batch and doubles the accumulation, so the
global batch, the schedule and the numbers stay what they were; without the flag, out of memory is one line.

Each loader batch (`--per_device_train_batch_size` samples) runs as micro-batches of at most `size` samples (its
tensors cut along dim 0, in order), each weighted by its item count like any micro-batch (update.py). An update
then reads the same samples in the same order as a run started with `--per_device_train_batch_size size` and
`--gradient_accumulation_steps` times (batch / size) more: on one process the very same micro-batches. The loaders,
the data position and the number of updates are untouched (a checkpoint's global batch is unchanged), so the
failed update is redone from the window it already holds: not skipped, not read twice.

Every rank agrees before any rank halves. An out-of-memory error can strike one rank only; the others would go on
into the window's last backward, whose gradient all-reduce (DDP's) the failed rank never joins. So with the flag on
the update's one all-reduce (loss sum, item count, preemption vote: update.py) carries an out-of-memory count too,
and is waited for *before* that last backward (the count's overlap with the backward is given up, only with the
flag). A rank that fails joins that same all-reduce from its handler; a rank that did not fail reads the count
there. Either way every rank sees the same count and takes the same decision: halve and redo, or stop. An
out-of-memory error in the window's last backward, after the vote, cannot be agreed on any more (the other ranks
are inside DDP's all-reduce): on several processes that is the one-line stop; on one process it is redone too.
Before a redo every rank puts DDP back to a window's start (_decide): without that, a rank that had run the synced
forward all-reduces alone in the redo's first backward, or broadcasts buffers alone (both seen to hang in tests).

The size is saved in checkpoints (`micro_batch_size` in trainer_state.json): a resumed run keeps the halved size
(the flag comes with the run's arguments, run_args.json); one that turns the flag off (`--auto_micro_batch false`)
runs the loader's batches, so a size in a checkpoint always comes with the flag (checkpointing/counters.py). Tested on CPUs, where a recipe raises torch.OutOfMemoryError (tests/test_micro_batch.py);
run on one H100 with a real CUDA out of memory (bench/gpu.py's auto_micro_batch row), not yet on several GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from accelerate.utils import DistributedType, honor_type
from accelerate.utils.memory import clear_device_cache

from . import privates
from .errors import UserError
from .throughput import peak_memory_mb


class OutOfMemory(UserError):
    pass


class Agreed(Exception):  # noqa: N818 - not an error: the ranks voted to redo the update at a smaller micro-batch
    """Raised on a rank that did not run out of memory when the update's all-reduce says another one did."""

    def __init__(self, ranks: int):
        super().__init__(ranks)
        self.ranks = ranks


class MicroBatches:
    """The micro-batch size of a run's updates, and what an out-of-memory error in one does to it."""

    def __init__(self, args, accelerator, say=print):
        self.enabled = bool(getattr(args, "auto_micro_batch", False))
        self.batch_size = args.per_device_train_batch_size
        self.accumulation = args.gradient_accumulation_steps
        self.accelerator, self.say = accelerator, say
        self.size: int | None = None  # None: the loader's batches as they come
        self.splits = False  # whether loader batches are cut (size below the batch size): set by _resize
        self.voted = False  # this attempt's vote was cast (update.py sets it): an error after it cannot be agreed
        if self.enabled and accelerator.distributed_type == DistributedType.FSDP:
            # FSDP reduce-scatters in every backward of a window: a rank that fails leaves the others there.
            raise UserError("--auto_micro_batch is not supported under FSDP yet: set the micro-batch by hand.")

    def _resize(self, size: int):
        self.size, self.splits = size, size < self.batch_size

    @property
    def waits(self) -> bool:
        """Whether the update's all-reduce is waited for before the last backward (the vote needs it)."""
        return self.enabled and self.accelerator.num_processes > 1

    def split(self, window: list) -> tuple[list, list[int]]:
        """(micro-batches, the index in `window` of the loader batch each comes from)."""
        if not self.splits:
            return window, list(range(len(window)))
        micro, origin = [], []
        for i, batch in enumerate(window):
            n = sample_count(batch)
            starts = range(0, n, self.size) if n and n > self.size else [None]
            for start in starts:
                micro.append(batch if start is None else _cut(batch, n, start, self.size))
                origin.append(i)
        return micro, origin

    def run(self, updater, window: list):
        """updater._forward_backward over `window` at the current size; on out of memory (any rank's), the
        agreed decision, then again from the same window."""
        while True:
            self.voted, failed = False, None
            try:
                micro, origin = self.split(window)
                return updater._forward_backward(micro, origin)
            except torch.OutOfMemoryError as e:
                failed = _first_line(e)
            except Agreed as e:
                ranks = e.ranks
            # Here, out of the except block: the failed micro-batch's frames (its activations) are released.
            updater.inner_opt.zero_grad(set_to_none=True)
            clear_device_cache()  # the accelerator's cached blocks (CUDA, XPU, MPS, ...) back for the redo
            if failed is not None:
                ranks = self._vote(updater, failed)
            self._decide(ranks, failed, updater)

    def _vote(self, updater, failed: str) -> int:
        """This rank ran out of memory: join the update's all-reduce (the other ranks are in it or on their way)
        and return how many ranks did."""
        if not self.enabled or self.accelerator.num_processes == 1:
            return 1
        if self.voted:  # the vote was cast: the others are in the last backward's gradient all-reduce
            raise OutOfMemory(self._message(failed, after_vote=True))
        return updater.vote_out_of_memory()

    def _decide(self, ranks: int, failed: str | None, updater):
        size = self.size or self.batch_size
        if not self.enabled:
            raise OutOfMemory(self._message(failed))
        if size <= 1:
            raise OutOfMemory(
                f"Out of memory at a micro-batch of 1 sample with --auto_micro_batch ({self._where(ranks, failed)}):"
                " nothing is left to halve. Lower the memory one sample needs (--gradient_checkpointing, "
                "--mixed_precision bf16, a shorter sequence, a smaller model) or use a device with more memory."
            )
        self._resize(math.ceil(size / 2))
        if updater.ddp is not None:
            # The ranks that did not fail ran the last micro-batch's forward with gradient sync on: DDP then expects
            # that backward, and would all-reduce in the next no_sync backward. Forgotten on every rank alike (it
            # also lets DDP rebuild its buckets once more, a collective every rank then joins).
            privates.ddp_forget_forward(updater.ddp)
            # DDP broadcasts its buffers in a window's first forward when the previous forward synced; a rank that
            # failed before its last forward ended holds another value than one that did not, so the redo's first
            # forward would broadcast on some ranks only. True on every rank: the broadcast a window starts with.
            updater.ddp.require_forward_param_sync = True
        self.say(
            f"out of memory at micro-batch size {size} ({self._where(ranks, failed)}): --auto_micro_batch halves it "
            f"to {self.size} and accumulates {self.accumulation_now()} micro-batches per update (was "
            f"{self._accumulation(size)}); the global batch is unchanged, and the update is redone from the same data."
        )

    def _accumulation(self, size: int) -> int:
        return self.accumulation * math.ceil(self.batch_size / size)

    def accumulation_now(self) -> int:
        return self._accumulation(self.size or self.batch_size)

    def _where(self, ranks: int, failed: str | None) -> str:
        world = self.accelerator.num_processes
        parts = [] if world == 1 else [f"{ranks} of {world} ranks"]
        if failed is not None:
            parts.append(f"rank {self.accelerator.process_index}: peak {self._peak()}")
        return ", ".join(parts) or "peak unknown"

    def _peak(self) -> str:
        return f"{peak_memory_mb(self.accelerator.device):.0f} MiB on {self.accelerator.device}"

    def _message(self, failed: str | None, after_vote: bool = False) -> str:
        size = self.size or self.batch_size
        lead = f"Out of memory in an update at a micro-batch of {size} samples"
        if after_vote:
            lead += " in the window's last backward, after the ranks agreed (it cannot be redone on several processes)"
        return (
            f"{lead} (rank {self.accelerator.process_index}, peak {self._peak()}): {failed or 'on another rank'}. "
            "Pass --auto_micro_batch to halve the micro-batch and accumulate more (the global batch unchanged), or "
            "lower --per_device_train_batch_size and raise --gradient_accumulation_steps by the same factor."
        )

    def state_dict(self) -> dict:
        return {"micro_batch_size": self.size}

    def load_state_dict(self, state: dict):
        size = state.get("micro_batch_size")
        if size is not None and (type(size) is not int or size < 1):
            raise UserError(
                f"The checkpoint's trainer_state.json has micro_batch_size {size!r}, not a positive integer or null: "
                "not written by this Trainer. Set it to null (the loader's batch) or to the size to resume with."
            )
        if size is not None and size < self.batch_size and not self.enabled:  # the user turned the flag off
            self.say(f"note: the checkpoint's run halved the micro-batch to {size} (--auto_micro_batch); this run, "
                     f"without the flag, runs the loader's batches of {self.batch_size} as they come.")  # fmt: skip
        elif size is not None and size < self.batch_size:
            self._resize(size)
            self.say(
                f"micro-batch size {self.size} (halved by --auto_micro_batch in the checkpoint's run), "
                f"{self.accumulation_now()} micro-batches per update."
            )


def sample_count(batch) -> int | None:
    """The batch's number of samples: the first dimension of its first tensor, depth first (None: no tensor with
    one). What Accelerate's find_batch_size reads, except that it raises where a batch starts with something
    else, e.g. a column of strings that a recipe's loss tokenizes itself."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch if isinstance(batch, (list, tuple)) else batch.values() if isinstance(batch, Mapping) else ()
    for value in values:
        n = sample_count(value)
        if n is not None:
            return n
    return None


def first_samples(batch, size: int):
    """The batch's first `size` samples (cut as _cut does), or the batch itself where it has no sample count or
    not more than `size` samples."""
    n = sample_count(batch)
    return _cut(batch, n, 0, size) if n and n > size else batch


def _cut(batch, n: int, start: int, size: int):
    """Samples [start, start + size) of a batch of n: every tensor whose first dimension is n, and every list of n
    plain values (a column of strings or numbers), cut there; anything else (a 0-d tensor, a tensor of another
    length, a single value) as it is."""

    def cut(x):
        if isinstance(x, torch.Tensor):
            return x[start : start + size] if x.dim() and x.shape[0] == n else x
        if isinstance(x, Mapping):
            return type(x)({k: cut(v) for k, v in x.items()})
        if isinstance(x, (list, tuple)):
            if len(x) == n and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in x):
                return x[start : start + size]
            return honor_type(x, (cut(v) for v in x))
        return x

    return cut(batch)


def _first_line(error: BaseException) -> str:
    """The error's first line, cut after its last whole sentence within 200 characters: CUDA's out-of-memory
    message is one line of ~600 (how much was asked, what is free, what this process holds, allocator advice)."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if len(line) > 200:
        end = line[:200].rfind(". ")
        line = line[:end] if end > 0 else line[:200]
    return line.rstrip(".")
