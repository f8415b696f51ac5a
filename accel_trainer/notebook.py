"""Scale out from a notebook without restarting the kernel: debug on one device, then launch N processes.

`accelerate.notebook_launcher` refuses to start processes once an `Accelerator` exists in the kernel (its state is
process-wide, and forked workers would inherit a world of one). Our Trainers in the notebook are single-process
and disposable, so we drop that state first: the Trainers built before the launch cannot train any more (build
a new one), and everything else is Accelerate's own launcher.

On a machine without a GPU, Accelerate's launcher says "Launching training on 2 CUDAs." (it names CUDA whenever it
finds no other accelerator) and each process warns that OMP_NUM_THREADS is unset before setting it to 1. There we
say what is launched in one line, set that same OMP_NUM_THREADS=1 for the processes unless the user set it, and
leave out Accelerate's CUDA line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys


def notebook_launcher(function, args=(), num_processes: int | None = None, **kwargs):
    """`accelerate.notebook_launcher(function, args, num_processes, ...)`, callable after single-device Trainers
    were used in the same kernel. Each process runs `function(*args)`; build the Trainer inside it."""
    from accelerate import notebook_launcher as accelerate_notebook_launcher
    from accelerate.utils import get_current_device_type, is_cuda_available, patch_environment

    from . import privates

    if num_processes is None or num_processes <= 1:
        return accelerate_notebook_launcher(function, args=args, num_processes=num_processes, **kwargs)
    privates.reset_accelerate_state(partial=True)
    # No accelerator: CPU processes (get_current_device_type falls back to "cuda" when it finds no other device).
    if get_current_device_type()[0] != "cuda" or is_cuda_available():
        return accelerate_notebook_launcher(function, args=args, num_processes=num_processes, **kwargs)
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    print(
        f"Launching training on {num_processes} CPU processes (no GPU here), OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', '1')} each"
        + (" (set it before the launch to choose)." if threads else ".")
    )
    with patch_environment(**threads), _without_line(re.compile(r"Launching training on \d+ CUDAs\.")):
        return accelerate_notebook_launcher(function, args=args, num_processes=num_processes, **kwargs)


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
