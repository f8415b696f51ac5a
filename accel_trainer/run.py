"""`run(recipe)`: what `python recipes/x.py`, `accelerate launch recipes/x.py` and `accel-trainer train` call.

Set-up flows one way: resolve.resolve_args loads the recipe once and resolves the arguments once (the one
resolution every entry point shares; the recipe's `configure` sees the run's one RecipeContext), then the Trainer
builds the process and the Accelerator from them (accel.configure_process), completes that context and builds its
components; then it fits. A known kind of bad input (a missing recipe or data file, an occupied output folder, a bad checkpoint, a bad
argument value) ends with one clear line on stderr and exit 1, not a traceback; anything else raises as usual.
"""

from __future__ import annotations

import errno
import os
import sys

from .entry import USER_ERRORS, command_line
from .resolve import resolve_args


def run(recipe, argv: list[str] | None = None) -> dict:
    with command_line():  # messages keep their flags (entry.py)
        return _run(recipe, argv)


def _run(recipe, argv):
    from .trainer import Trainer

    output_dir = None  # known once the arguments are: a full disk from then on is one line
    try:
        args = resolve_args(recipe, argv)
        output_dir = args.targs.output_dir
        return Trainer(args.recipe, args).fit()
    except USER_ERRORS as e:
        _error_line(e)
        _leave_the_world()
        sys.exit(1)
    except OSError as e:  # a full disk outside a checkpoint or model write (run_config.json, a log row): one line
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or output_dir is None:
            raise
        from .checkpointing.folder import DiskFullError, disk_full_is_one_line

        try:
            with disk_full_is_one_line(output_dir, e.filename or f"into {output_dir}"):
                raise e
        except DiskFullError as full:
            _error_line(full)
            _leave_the_world()
            sys.exit(1)


def _leave_the_world(bound_s: float = 10.0) -> None:
    """A rank that stops on an error leaves its process group before the interpreter ends: a gloo group left to the
    interpreter's exit aborted the process now and then ("terminate called without an active exception", SIGABRT,
    after the rank's one error line), and the launcher reported a crash. Bounded: a rank whose group does not close
    in time exits at once, without the interpreter's clean-up."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group to leave (argument errors come before)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    import threading

    closer = threading.Thread(target=dist.destroy_process_group, name="accel_trainer-leave", daemon=True)
    closer.start()
    closer.join(bound_s)
    if closer.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _error_line(error: BaseException) -> None:
    """`error: <message>` on stderr in one write: print() writes the text and its newline separately, and under
    a launcher (unbuffered output) two ranks' lines were seen glued into one."""
    text = str(error)
    if "\nOriginal Traceback" in text:  # raised in a DataLoader worker: the worker's traceback, then our line
        text = text.strip().splitlines()[-1].split(": ", 1)[-1]
    line = f"error: {text}\n"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), line.encode())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a notebook's or a test's captured stream)
        sys.stderr.write(line)
        sys.stderr.flush()
