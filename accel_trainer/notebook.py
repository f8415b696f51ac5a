"""Scale out from a notebook without restarting the kernel: debug on one device, then launch N processes.

`accelerate.notebook_launcher` refuses to start processes once an `Accelerator` exists in the kernel (its state is
process-wide, and forked workers would inherit a world of one). Our Trainers in the notebook are single-process
and disposable, so we drop that state first: the Trainers built before the launch cannot train any more (build
a new one), and everything else is Accelerate's own launcher.
"""

from __future__ import annotations


def notebook_launcher(function, args=(), num_processes: int | None = None, **kwargs):
    """`accelerate.notebook_launcher(function, args, num_processes, ...)`, callable after single-device Trainers
    were used in the same kernel. Each process runs `function(*args)`; build the Trainer inside it."""
    from accelerate import notebook_launcher as accelerate_notebook_launcher
    from accelerate.state import AcceleratorState, GradientState

    if num_processes is not None and num_processes > 1:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return accelerate_notebook_launcher(function, args=args, num_processes=num_processes, **kwargs)
