"""Throughput, time and memory of the updates since the last log row: what every training log row carries.

    samples_per_second   samples of the global batch per second, summed over ranks
    items_per_second     the loss's items (samples or target tokens, all-reduced per update) per second
    step_time_s          wall seconds per update (the slowest rank)
    data_wait_fraction   the share of that time spent waiting for the next batch (the slowest rank)
    peak_memory_mb       GPU max allocated (else the process's peak RSS), the largest rank
    mfu                  model FLOPs utilisation, when the FLOPs of an update are counted and a peak is known

Costs per update: two perf_counter() calls and a shape lookup; no host sync (the item count stays a device tensor
until the log row). At a log row, one gather of five numbers when there are several processes: the log row
already syncs the host for the loss.

MFU: the FLOPs of the first update on this rank, counted once by torch.utils.flop_counter while it runs (no extra
forward), times the updates since the last row, over the wall time and the device's peak (--peak_tflops, or the
table below for a detected GPU). Later updates with other shapes (text of other lengths) are estimated by the first.
"""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager

import torch

# Dense bf16/fp16 tensor-core peaks, TFLOP/s, from the vendors' data sheets (SXM parts; no sparsity).
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def detected_peak_tflops(mixed_precision: str | None) -> float | None:
    """The peak of the GPU this process uses, for bf16/fp16 training; None when unknown (CPU, fp32, other GPU)."""
    if not torch.cuda.is_available() or mixed_precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS_BF16.items() if key in name), None)


def peak_memory_mb(device) -> float:
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Meter:
    """Counts and times the updates between two log rows on this rank; `row()` turns them into log fields."""

    def __init__(self, accelerator, peak_tflops: float | None = None):
        self.accelerator = accelerator
        self.peak_tflops = peak_tflops
        self.flops_per_update: float | None = None  # set once, by count_flops()
        self._reset(time.perf_counter())

    def _reset(self, now: float):
        self.since, self.updates, self.samples, self.wait_s, self.excluded_s = now, 0, 0, 0.0, 0.0
        self.items: list = []  # per update: a device tensor (summed at the row, no sync before) or a number

    def restart(self):
        """At the start of fit(): set-up and notebook steps before it are not training time."""
        self._reset(time.perf_counter())

    def waited(self, seconds: float):
        self.wait_s += seconds

    @contextmanager
    def paused(self):
        """Around an evaluation or a checkpoint between two log rows: not update time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_s += time.perf_counter() - start

    def updated(self, samples: int, items):
        # A list append, not a running tensor sum: one tensor op (or a tensor built from an int) per update would
        # cost more than the rest of this class together (measured: ~35 us for torch.tensor() on a CPU).
        self.updates += 1
        self.samples += samples
        self.items.append(items)

    def count_flops(self):
        """A context for the first update: counts its FLOPs while it runs (None afterwards: nothing to do)."""
        if self.flops_per_update is not None or self.peak_tflops is None:
            return None
        from torch.utils.flop_counter import FlopCounterMode

        return FlopCounterMode(display=False)

    def counted(self, mode):
        self.flops_per_update = float(mode.get_total_flops())

    def row(self) -> dict:
        """The log fields for the updates since the last row, combined over ranks (a collective when several)."""
        now = time.perf_counter()
        elapsed = max(now - self.since - self.excluded_s, 1e-9)
        acc = self.accelerator
        tensors = [i.detach().float().reshape(()) for i in self.items if torch.is_tensor(i)]
        items = sum(float(i) for i in self.items if not torch.is_tensor(i))
        items += float(torch.stack(tensors).sum()) if tensors else 0.0
        mfu = (
            self.flops_per_update * self.updates / elapsed / (self.peak_tflops * 1e12)
            if self.flops_per_update and self.peak_tflops
            else float("nan")
        )
        local = torch.tensor(
            [self.samples, items, self.wait_s / elapsed, elapsed / max(self.updates, 1), peak_memory_mb(acc.device),
             mfu],
            dtype=torch.float64, device=acc.device,
        )  # fmt: skip
        ranks = acc.gather(local[None]) if acc.num_processes > 1 else local[None]
        ranks = ranks.cpu()
        # The ranks' windows differ a little (each times its own); the job goes at its slowest rank's pace, so
        # rates are over the slowest rank's time: samples_per_second x step_time_s = the global batch.
        slowest = float(ranks[:, 3].max())  # seconds per update
        updates = max(self.updates, 1)
        fields = {
            "samples_per_second": float(ranks[:, 0].sum()) / (slowest * updates),
            # the Trainer all-reduces each update's item count whenever there are several processes: every rank
            # holds the global count
            "items_per_second": float(ranks[0, 1]) / (slowest * updates),
            "step_time_s": slowest,
            "data_wait_fraction": float(ranks[:, 2].max()),
            "peak_memory_mb": float(ranks[:, 4].max()),
        }
        if self.flops_per_update and self.peak_tflops:
            fields["mfu"] = float(ranks[:, 5].mean())
        self._reset(now)
        return fields
