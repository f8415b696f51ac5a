"""--profile_steps A-B: a torch.profiler trace of updates A..B on every rank, attached through the Trainer's events.

Writes `output_dir/profile/rank<R>.<...>.pt.trace.json` (open in TensorBoard's profiler plugin, Perfetto or
chrome://tracing) and `output_dir/profile/summary_rank<R>.txt`, and prints on the main process the top ops by
self time and the time spent in collectives (gloo/NCCL all-reduce, broadcast, ...): docs/observability.md says
how to read them.
"""

from __future__ import annotations

import contextlib
import os

import torch

# Op names of collectives in torch.profiler's key averages, for gloo and NCCL (c10d ops, backend kernels, the
# communication records torch.distributed emits).
COLLECTIVE_MARKERS = ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "all_gather", "allgather",
                      "reduce_scatter", "broadcast", "record_param_comms")  # fmt: skip


def is_collective(name: str) -> bool:
    name = name.lower()
    return any(m in name for m in COLLECTIVE_MARKERS)


class UpdateProfiler:
    def __init__(self, trainer):
        # Not the Trainer itself: it holds this profiler through its events, and a reference back would keep a
        # dropped Trainer (its model and data) alive until Python's next full garbage collection.
        self.say = trainer.reporter.print
        self.first, self.last = trainer.args.profile_range
        self.folder = os.path.join(trainer.args.output_dir, "profile")
        self.rank = trainer.accelerator.process_index
        self.prof = None
        self.summary: dict | None = None

    def attach(self, events):
        events.on("update_end", lambda trainer: self.prof.step() if self.prof is not None else None)

    @contextlib.contextmanager
    def running(self, done: int):
        """Profiling while fit() trains: stopped on every way out, so a run that fails keeps the profile of the
        updates it did (and no profiler is left running in the process)."""
        self.start(done)
        try:
            yield
        finally:
            self.stop()

    def start(self, done: int):
        # done: the updates done so far; a resumed run's next update is done + 1
        if self.last <= done:
            self.say(f"--profile_steps {self.first}-{self.last}: already past step {done}.")
            return
        active_from = max(self.first - 1 - done, 0)  # index of the first profiled update among those to come
        warmup = 1 if active_from >= 1 else 0  # one unrecorded profiled step first, as torch recommends
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.folder, exist_ok=True)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=active_from - warmup, warmup=warmup, active=self.last - max(self.first - 1, done), repeat=1
            ),
            on_trace_ready=self._ready,
            record_shapes=True,
            profile_memory=True,
        )
        self.prof.start()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()
            # torch's profile object sits in reference cycles of its own, freed only by a full garbage collection:
            # its callback must not keep this run (the reporter, hence the Accelerator and the model) alive with it.
            self.prof.on_trace_ready = None
            self.prof = None

    def _ready(self, prof):
        torch.profiler.tensorboard_trace_handler(self.folder, worker_name=f"rank{self.rank}")(prof)
        averages = prof.key_averages()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        total_us = sum(getattr(e, key) for e in averages)
        comm_us = sum(getattr(e, key) for e in averages if is_collective(e.key))
        table = averages.table(sort_by=key, row_limit=12)
        self.summary = {
            "updates": [self.first, self.last],
            "self_time_ms": total_us / 1e3,
            "collective_ms": comm_us / 1e3,
            "collective_fraction": comm_us / total_us if total_us else 0.0,
        }
        text = (
            f"Profile of updates {self.first}-{self.last}, rank {self.rank} ({device} self time): "
            f"{total_us / 1e3:.1f} ms in ops, {comm_us / 1e3:.1f} ms ({self.summary['collective_fraction']:.1%}) "
            f"in collectives.\n{table}"
        )
        with open(os.path.join(self.folder, f"summary_rank{self.rank}.txt"), "w") as f:
            f.write(text)
        self.say(text + f"\nTraces: {self.folder}")
