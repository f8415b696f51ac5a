"""Scale out from a notebook without restarting the kernel: debug on one device, then launch N processes.

`accelerate.notebook_launcher` refuses to start processes once an `Accelerator` exists in the kernel (its state is
process-wide, and forked workers would inherit a world of one). Our Trainers in the notebook are single-process
and disposable, so we drop that state first: the Trainers built before the launch cannot train any more (build
a new one), and everything else is Accelerate's own launcher.

Accelerate's launcher forks the kernel on CPUs and CUDA GPUs (that is how a function defined in a cell reaches the
processes). A kernel whose torch has run an op on its GNU OpenMP thread pool (any op over torch's grain size: every
real model's training) handed the workers a pool whose threads a fork does not copy, and each worker blocked
forever in its first parallel op (issue 40). So the kernel releases its pool just before each fork
(`omp_pause_resource_all`, OpenMP 5.0's call that frees the runtime's threads; the kernel's next parallel op starts
a new pool), and each worker starts a pool of its own. Each worker runs its share of the threads the kernel's torch uses, or OMP_NUM_THREADS if set before the launch:
the workers share the kernel's cores, and a forked torch keeps the kernel's thread count (it reads OMP_NUM_THREADS
once, when it starts). A runtime that cannot release its pool (no `omp_pause_resource_all`: GCC older than 9) gets
1 thread per worker, which never enters the pool.

On a machine without a GPU, Accelerate's launcher says "Launching training on 2 CUDAs." (before 1.16 it names CUDA
whenever it finds no other accelerator; "2 CPUs." since) and each process warns that OMP_NUM_THREADS is unset before setting it. There we say
what is launched in one line, with the threads each process runs, and leave out Accelerate's CUDA line.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys

from .errors import UserError

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not just put them to sleep
# Set while our launcher runs (os.register_at_fork has no way to unregister), and so in the forked workers for their
# lifetime: a fork of theirs (a DataLoader's) releases their pool too.
_release_before_fork = False
_hook_registered = False


def notebook_launcher(function, args=(), num_processes: int | None = None, **kwargs):
    """`accelerate.notebook_launcher(function, args, num_processes, ...)`, callable after single-device Trainers
    were used in the same kernel. Each process runs `function(*args)`; build the Trainer inside it."""
    from accelerate import notebook_launcher as accelerate_notebook_launcher
    from accelerate.utils import get_current_device_type, is_cuda_available, patch_environment

    from . import privates

    if num_processes is None or num_processes <= 1:
        return accelerate_notebook_launcher(function, args=args, num_processes=num_processes, **kwargs)
    threads, why = _threads_per_process(num_processes)  # before anything changes: it refuses a bad OMP_NUM_THREADS
    privates.reset_accelerate_state(partial=True)
    # No accelerator: CPU processes (get_current_device_type says "cpu" there since accelerate 1.16, and "cuda",
    # its fallback when it finds no other device, before).
    cpu = get_current_device_type()[0] in ("cpu", "cuda") and not is_cuda_available()
    if cpu:
        print(f"Launching training on {num_processes} CPU processes (no GPU here), OMP_NUM_THREADS={threads} each{why}")
    else:
        print(f"Each of the {num_processes} processes runs OMP_NUM_THREADS={threads}{why}")
    # A partial, picklable where the launcher spawns; named as `function`, which torch's elastic launch names it by.
    worker = functools.update_wrapper(functools.partial(_worker, function, threads), function)
    # OMP_NUM_THREADS in the workers' environment too: what they start reads it, and Accelerate warns without it.
    drop = _without_line(re.compile(r"Launching training on \d+ (CUDA|CPU)s\.")) if cpu else contextlib.nullcontext()
    with patch_environment(OMP_NUM_THREADS=str(threads)), _openmp_released_at_fork(), drop:
        return accelerate_notebook_launcher(worker, args=args, num_processes=num_processes, **kwargs)


def _threads_per_process(num_processes: int) -> tuple[int, str]:
    """The threads each worker runs, and the end of the line that says where that number comes from."""
    import torch

    value = os.environ.get("OMP_NUM_THREADS")
    chosen = None
    if value is not None:
        first = value.split(",")[0].strip()  # OpenMP's list form "4,2" sets nested levels; the first is ours
        if not first.isdigit() or int(first) < 1:
            raise UserError(
                f"OMP_NUM_THREADS={value!r} is not a number of threads: set it to 1 or more, or unset it."
            ) from None
        chosen = int(first)
    if not _can_release_openmp():
        return 1, (
            ": this kernel's OpenMP runtime cannot release its thread pool before the fork (it needs "
            "omp_pause_resource_all, GCC 9's libgomp or newer), and more threads would hang on the kernel's pool."
        )
    if chosen is None:
        return max(1, torch.get_num_threads() // num_processes), " (set it before the launch to choose)."
    return chosen, "."


def _worker(function, threads: int, *args):
    """What each launched process runs: `function(*args)` on `threads` threads, set before its first op."""
    import torch

    torch.set_num_threads(threads)
    return function(*args)


def _gnu_openmp_runtimes() -> list[str]:
    """The GNU OpenMP runtimes loaded in this process: torch's, and any other library's copy. Read from
    /proc/self/maps, so Linux only: elsewhere none is found and nothing is released (not measured there)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[5] for line in lines if line.count(" ") >= 5 and "/libgomp" in line}
    return sorted(p for p in paths if os.path.basename(p).startswith("libgomp") and os.path.exists(p))


def _can_release_openmp() -> bool:
    for path in _gnu_openmp_runtimes():
        try:
            ctypes.CDLL(path).omp_pause_resource_all  # noqa: B018 - present or AttributeError
        except (OSError, AttributeError):
            return False
    return True


def _release_openmp_pools() -> None:
    """Free this thread's OpenMP thread pool in every loaded GNU runtime: the forked child then starts its own."""
    for path in _gnu_openmp_runtimes():
        pause = ctypes.CDLL(path).omp_pause_resource_all
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pause(_OMP_PAUSE_HARD)


def _before_fork():
    # Runs in the forking thread, the only one a child has: its pool is the one the child would block on.
    if _release_before_fork:
        _release_openmp_pools()


@contextlib.contextmanager
def _openmp_released_at_fork():
    """Every fork made inside (the launcher's workers, the elastic agent's restarts) first releases the pool."""
    global _release_before_fork, _hook_registered
    if not _hook_registered:
        os.register_at_fork(before=_before_fork)
        _hook_registered = True
    _release_before_fork = True
    try:
        yield
    finally:
        _release_before_fork = False


class _DropLine:
    """sys.stdout, less one printed line matching `pattern` (print writes the text, then its end, separately).
    The launched processes, forked, inherit it: their output passes through unchanged."""

    def __init__(self, stream, pattern: re.Pattern):
        self._stream, self._pattern, self._dropped = stream, pattern, False

    def write(self, text: str) -> int:
        if self._pattern.fullmatch(text):
            self._dropped = True
            return len(text)
        if self._dropped and text == "\n":
            self._dropped = False
            return len(text)
        self._dropped = False
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _without_line(pattern: re.Pattern):
    stream = sys.stdout
    sys.stdout = _DropLine(stream, pattern)
    try:
        yield
    finally:
        sys.stdout = stream
