"""glibc malloc settings for training on a CPU: freed tensor memory stays in the process for the next step.

Why (measured): a training step frees and allocates the same large tensors (activations, gradients, logits) every
step. glibc's malloc serves a block above its mmap threshold (128 KiB at start, moved up to 32 MiB as such blocks
are freed) with a fresh mmap, and gives the top of its heap back to the OS above its trim threshold: either way the
next step touches new pages, each a page fault that zeroes 4 KiB. How often depends on the process's allocation
history, so the same loop in two processes runs at different speeds. With the thresholds fixed as below, an update
of bench/text.py's GPT-2 faults no page in and runs faster (docs/observability.md, "The CPU allocator"). torch's
own CPU launcher (`python -m torch.backends.xeon.run_cpu`) does the same with jemalloc and its memory decay turned
off. The cost: memory the run frees stays with the process (up to its peak) instead of going back to the OS while it
trains.

Not done where the user chose an allocator or its settings (LD_PRELOAD of jemalloc/tcmalloc/mimalloc, MALLOC_*_
variables, GLIBC_TUNABLES), off glibc, for a GPU run (its tensors are not in malloc), or with
ACCEL_TRAINER_CPU_MALLOC=0. What was done is recorded in run_config.json ("process": "cpu_allocator"), by accel.configure_process.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # bytes: glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); bigger blocks are still mmapped
TRIM_THRESHOLD = -1  # never give the heap's top back to the OS during the run ("-1 disables trimming", mallopt(3))
OPT_OUT = "ACCEL_TRAINER_CPU_MALLOC"

_done: dict | None = None  # process-wide: the settings are the process's, made once


def keep_freed_memory(device_type: str) -> dict:
    """Fix glibc's thresholds for a run on `device_type` unless the user chose otherwise; what happened, as a dict
    for run_config.json."""
    global _done
    if _done is not None:
        return _done
    reason = _why_not(device_type)
    if reason:
        return {"tuned": False, "why": reason}  # not remembered: a later CPU run in this process may tune
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int  # values are C ints
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _done = (
        {"tuned": True, "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
        if ok
        else {"tuned": False, "why": "mallopt refused the thresholds"}
    )
    return _done


def _why_not(device_type: str) -> str | None:
    if os.environ.get(OPT_OUT, "1") == "0":
        return f"{OPT_OUT}=0"
    if device_type != "cpu":
        return f"training on {device_type}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return "another allocator is preloaded (LD_PRELOAD)"
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or "malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return "malloc settings given in the environment"
    return None
