"""Where a run's output folder may lie: a folder of its own, never a checkpoint, never inside another run's folder
and never holding one in what the run writes, moves or deletes (checkpoints/, best/, ...), whatever the flags;
and a checkpoint resumed from elsewhere never overlaps it. Each check is made before the run's lock file is written,
so a refused run changes nothing."""

from __future__ import annotations

import os

from ..errors import UserError
from . import lock as ckpt_lock


def refuse_nested_runs(out: str, entries) -> None:
    """output_dir neither lies in a run's folder nor holds one in `entries` (the names a run writes in it)."""
    _refuse_inside_a_run(out)
    _refuse_holding_a_run(out, entries)


def within(path: str, root: str) -> bool:
    """`path` is `root` or under it, links resolved."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


RUN_MARKS = (ckpt_lock.LOCK_FILE, "run_config.json")  # a folder that holds a run (or held one)
CHECKPOINT_MARKS = ("manifest.json", "trainer_state.json")  # a checkpoint folder, ours or a forged one


def _refuse_inside_a_run(out: str) -> None:
    """output_dir is a folder of its own: never a checkpoint, never inside another run's checkpoints/ or best/.
    Whatever the flags (--overwrite_output_dir too): a run there wrote its model over a checkpoint's and its lock
    into it, or set aside the checkpoints of a run still writing them (its lock is on the folder above)."""
    real = os.path.realpath(out)
    if any(os.path.lexists(os.path.join(real, f)) for f in CHECKPOINT_MARKS):
        raise UserError(
            f"--output_dir {out} is a checkpoint folder (it holds {' or '.join(CHECKPOINT_MARKS)}): the run would "
            "write its model and logs over the checkpoint's files. Give an output_dir of its own (to continue from "
            f"the checkpoint: --resume_from_checkpoint {out} --output_dir <new folder>)."
        )
    child, parent = real, os.path.dirname(real)
    while parent != child:
        owned = os.path.basename(child) in ("checkpoints", "best")
        if owned and any(os.path.lexists(os.path.join(parent, f)) for f in RUN_MARKS):
            raise UserError(
                f"--output_dir {out} lies in {child}, the {os.path.basename(child)}/ folder of the run in {parent}: "
                "the run would write over that run's files and its checkpoints would be moved or deleted there. "
                "Give an output_dir outside it."
            )
        child, parent = parent, os.path.dirname(parent)


def _refuse_holding_a_run(out: str, entries) -> None:
    """The other way round: no run's folder lies in the entries this run writes into, deletes or moves (checkpoints/,
    best/, ...), whatever the flags. A run started on X/checkpoints, then one on X with 'auto' (no checkpoint of its
    own: it starts over) deleted the first run's folder while that run held its lock (the lock is on X/checkpoints,
    not on X); with --overwrite_output_dir it deleted it too, and a run continuing in X mixed its checkpoints in."""
    for entry in entries:
        top = os.path.join(out, entry)
        if os.path.islink(top) or not os.path.isdir(top):
            continue
        for here, dirs, files in os.walk(top):  # links are not followed: a link is deleted, not what it names
            marks = [f for f in RUN_MARKS if f in files or f in dirs]
            if marks:
                raise UserError(
                    f"--output_dir {out}: {here} holds another run's output folder ({', '.join(marks)}); this run "
                    f"would write into, move or delete it ({entry}/ is this run's own). Give the other run's folder "
                    "a place outside this one (or remove it yourself), or give another --output_dir."
                )


def refuse_overlap(checkpoint: str, out: str) -> None:
    """A checkpoint from outside output_dir's checkpoints/ must lie outside output_dir, and output_dir outside it:
    the run writes its model, logs, best/ and checkpoints there, over or into the checkpoint's own files."""
    if within(checkpoint, out) or within(out, checkpoint):
        raise UserError(
            f"--resume_from_checkpoint {checkpoint} and --output_dir {out} overlap: the run would write into the "
            "checkpoint it resumes from. Give another --output_dir, one that neither holds the checkpoint nor lies in it."
        )
