"""Throughput, time and memory of the updates since the last log row: what every training log row carries.

    samples_per_second   samples of the global batch per second, summed over ranks
    items_per_second     the loss's items (samples or target tokens, all-reduced per update) per second
    step_time_s          wall seconds per update (the slowest rank)
    data_wait_fraction   the share of that time spent waiting for the next batch (the slowest rank)
    peak_memory_mb       the peak since the previous row: the accelerator's max allocated (reset at each row), else
                         the process's peak RSS (reset at each row on Linux), the largest rank
    mfu                  model FLOPs utilisation, when the FLOPs of an update are counted and a peak is known

Costs per update: two perf_counter() calls and a shape lookup; no host sync (the item count stays a device tensor
until the log row). At a log row, one gather of five numbers when there are several processes: the log row
already syncs the host for the loss.

MFU: the FLOPs of the first update on this rank, counted once by torch.utils.flop_counter while it runs (no extra
forward; under --torch_compile that update runs eagerly, see FlopCount), times the updates since the last row, over
the wall time and the device's peak (--peak_tflops, or the table below for a detected GPU). Later updates with other
shapes (text of other lengths) are estimated by the first. The table is looked up by the exact model name: a GPU it
does not list gives no MFU, never another model's.
"""

from __future__ import annotations

import functools
import os
import resource
import time
from contextlib import ExitStack, contextmanager

import torch


def host_floats(values: list) -> list[float]:
    """Scalars (one-element tensors, or numbers) as Python floats: on an accelerator with one stack and one copy to
    the host (a copy per value would sync the host once per value); on a CPU one float() each, which is cheaper
    than the stack. Why not tensor ops: each costs more CPU than the row's Python. For the losses and gradient norms of
    a log row, the type checks, stack, finiteness test and mean as tensors took several times the instructions of a
    float() each and arithmetic on the list (callgrind; docs/benchmarks.md, "Choices the numbers decided")."""
    if values and isinstance(values[0], torch.Tensor) and values[0].device.type != "cpu":
        return stacked_floats(values)
    return [float(v) for v in values]


def stacked_floats(values: list) -> list[float]:
    """host_floats on an accelerator: one stack, one copy."""
    try:
        return torch.stack(values).reshape(len(values)).tolist()
    except (TypeError, RuntimeError):  # numbers, other devices, other shapes: one at a time
        return [float(v) for v in values]


# Dense bf16/fp16 tensor-core peaks, TFLOP/s, from the vendors' data sheets (no sparsity), by exact model name as
# torch.cuda.get_device_name() gives it, normalised by gpu_model(). Exact, not substrings: "H100" is also in
# "H100 PCIe" (756) and "H100 NVL" (835), "A10" in "A10G", "A100" in "RTX A1000", "L4" in "L40".
PEAK_TFLOPS_BF16 = {
    "h100 80gb hbm3": 989.0,  # H100 SXM5
    "h100 pcie": 756.0,
    "h100 nvl": 835.0,
    "h200": 989.0,  # H200 SXM
    "h200 nvl": 835.0,
    "gh200 480gb": 989.0,
    "a100 sxm4 80gb": 312.0,
    "a100 sxm4 40gb": 312.0,
    "a100 80gb pcie": 312.0,
    "a100 pcie 40gb": 312.0,
    "l40s": 362.0,
    "l40": 181.0,
    "l4": 121.0,
    "a10": 125.0,
}


def gpu_model(device_name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'a100 sxm4 80gb': no vendor, lower case, one space between words (drivers differ
    in the vendor prefix and in dashes)."""
    words = device_name.replace("-", " ").replace("_", " ").lower().split()
    return " ".join(words[1:] if words[:1] == ["nvidia"] else words)


def detected_peak_tflops(mixed_precision: str | None) -> float | None:
    """The peak of the GPU this process uses, for bf16/fp16 training; None when unknown (CPU, fp32, other GPU)."""
    if not torch.cuda.is_available() or mixed_precision not in ("bf16", "fp16"):
        return None
    return PEAK_TFLOPS_BF16.get(gpu_model(torch.cuda.get_device_name()))


@functools.lru_cache(maxsize=8)  # twice per log row, the same answer every time
def _allocator_stats(device):
    """torch's module for `device` when it keeps peak-allocation statistics (torch.cuda, torch.xpu), else None."""
    module = getattr(torch, torch.device(device).type, None) if device is not None else None
    has = all(hasattr(module, f) for f in ("max_memory_allocated", "reset_peak_memory_stats"))
    return module if has and torch.device(device).type != "cpu" else None


def peak_memory_mb(device) -> float:
    """The peak since the last reset_peak_memory(device): allocated on an accelerator, else the process's RSS."""
    stats = _allocator_stats(device)
    if stats is not None:
        return stats.max_memory_allocated(device) / 2**20
    return _peak_rss_mb()


_proc_fds: dict = {}  # (pid, name) -> an fd on /proc/self/<name>, opened once per process (see _proc)


def _proc(name: str, flags: int) -> int:
    # Kept open: opening /proc/self/status and clear_refs on every log row was a cost bench/overhead.py showed;
    # a read or write on an open fd costs far less. Keyed by pid: a forked child's "self" is not its parent's.
    key = (os.getpid(), name)
    if key not in _proc_fds:
        _proc_fds[key] = os.open(f"/proc/self/{name}", flags | os.O_CLOEXEC)
    return _proc_fds[key]


def _peak_rss_mb() -> float:
    # VmHWM: the very value that reset_peak_memory resets; ru_maxrss (a lifetime peak) where /proc is missing.
    try:
        status = os.pread(_proc("status", os.O_RDONLY), 16384, 0)
        start = status.index(b"VmHWM:") + len(b"VmHWM:")
        return int(status[start : status.index(b"kB", start)]) / 1024  # kB
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak_memory(device):
    """Start a new peak. On a CPU, Linux resets the process's peak RSS (VmHWM) when 5 is written to
    /proc/self/clear_refs (Linux >= 4.0); elsewhere, or where that is refused, the CPU peak is the lifetime peak."""
    stats = _allocator_stats(device)
    if stats is not None:
        stats.reset_peak_memory_stats(device)
        return
    try:
        os.write(_proc("clear_refs", os.O_WRONLY), b"5")
    except OSError:
        pass


class FlopCount:
    """The FLOPs of the code run inside it, counted by torch.utils.flop_counter, with torch.compile set to run
    eagerly: dynamo does not trace under a dispatch mode such as FlopCounterMode, and marks every code object it
    met there as skipped for the rest of the process, so a compiled model's first update counted under the mode
    never compiled at all (0 graphs with --torch_compile wherever a peak was known). force_eager runs that update
    as written, with no dynamo callback to mark anything; compiling starts with the next update. The count is the
    eager model's, which is what MFU means (the model's FLOPs, not the kernels'). set_stance: torch >= 2.6."""

    def __init__(self):
        from torch.utils.flop_counter import FlopCounterMode

        self.mode = FlopCounterMode(display=False)
        self._stack = ExitStack()

    def __enter__(self):
        self._stack.enter_context(torch.compiler.set_stance("force_eager"))
        self._stack.enter_context(self.mode)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def get_total_flops(self) -> int:
        return self.mode.get_total_flops()


class Meter:
    """Counts and times the updates between two log rows on this rank; `row()` turns them into log fields."""

    def __init__(self, accelerator, peak_tflops: float | None = None):
        self.accelerator = accelerator
        self.peak_tflops = peak_tflops
        self.flops_per_update: float | None = None  # set once, by count_flops()
        self._reset(time.perf_counter())

    def _reset(self, now: float):
        reset_peak_memory(self.accelerator.device)  # the next row's peak is its window's, not the run's
        self.since, self.updates, self.samples, self.wait_s, self.excluded_s = now, 0, 0, 0.0, 0.0
        # The updates' item counts: numbers are summed as they come, device tensors at the row (no sync before).
        self.item_count, self.item_tensors = 0, []

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
        # cost more than the rest of this class together (docs/benchmarks.md, "Choices the numbers decided").
        self.updates += 1
        self.samples += samples
        if isinstance(items, torch.Tensor):
            self.item_tensors.append(items)
        else:
            self.item_count += items

    def count_flops(self):
        """A context for the first update: counts its FLOPs while it runs (None afterwards: nothing to do)."""
        if self.flops_per_update is not None or self.peak_tflops is None:
            return None
        return FlopCount()

    def counted(self, mode):
        self.flops_per_update = float(mode.get_total_flops())

    def row(self) -> dict:
        """The log fields for the updates since the last row, combined over ranks (a collective when several)."""
        now = time.perf_counter()
        elapsed = max(now - self.since - self.excluded_s, 1e-9)
        acc = self.accelerator
        items = self.item_count + sum(host_floats(self.item_tensors))
        mfu = (
            self.flops_per_update * self.updates / elapsed / (self.peak_tflops * 1e12)
            if self.flops_per_update and self.peak_tflops
            else float("nan")
        )
        local = [self.samples, items, self.wait_s / elapsed, elapsed / max(self.updates, 1), peak_memory_mb(acc.device),
                 mfu]  # fmt: skip
        if acc.num_processes > 1:
            ranks = acc.gather(torch.tensor([local], dtype=torch.float64, device=acc.device)).cpu().tolist()
        else:  # no tensors to build on one process (a cost per row in bench/overhead.py)
            ranks = [local]
        columns = list(zip(*ranks))
        # The ranks' windows differ a little (each times its own); the job goes at its slowest rank's pace, so
        # rates are over the slowest rank's time: samples_per_second x step_time_s = the global batch.
        slowest = max(columns[3])  # seconds per update
        updates = max(self.updates, 1)
        fields = {
            "samples_per_second": sum(columns[0]) / (slowest * updates),
            # the Trainer all-reduces each update's item count whenever there are several processes: every rank
            # holds the global count
            "items_per_second": columns[1][0] / (slowest * updates),
            "step_time_s": slowest,
            "data_wait_fraction": max(columns[2]),
            "peak_memory_mb": max(columns[4]),
        }
        if self.flops_per_update and self.peak_tflops:
            fields["mfu"] = sum(columns[5]) / len(columns[5])
        self._reset(now)
        return fields
