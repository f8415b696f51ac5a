"""Resume policy: which checkpoint a run continues from (a folder, `latest`, `auto`, skipping a bad newest one
with the reason), whether it fits this run (the global batch, the seed mid-epoch, a stream's world size), where
this rank is in the epoch for any world size (resumed_position), and the resume itself (loading: load.py).
"""

from __future__ import annotations

import os
import sys

from ..errors import why
from ..faults import restart_count
from . import load as ckpt_load
from .folder import (
    EMA_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoints_root,
    is_real_folder,
    list_checkpoints,
    not_checkpoints,
    remove_stale_tmp,
    restore_set_aside,
    set_aside_newer,
)
from .verify import verify_checkpoint


# ------------------------------------------------------------------------------------------------------ resolving
def warn(msg: str):
    from ..errors import one_line

    print(one_line(msg), file=sys.stderr, flush=True)  # a warning quotes a checkpoint's reason: one line, always


def resolve_resume_path(spec: str, output_dir: str, log=warn, skip=()) -> str | None:
    """The verified folder `--resume_from_checkpoint` names: a folder, 'latest' (the newest good checkpoint in
    output_dir; an error if there is none) or 'auto' (the same, but None when there is no checkpoint at all).
    A bad newest checkpoint is skipped with a message naming the problem; the previous good one is used."""
    if spec.startswith("auto:"):  # an elastic restart of a run started from another folder: newest here first
        return resolve_resume_path("auto", output_dir, log, skip) or resolve_resume_path(
            spec[5:], output_dir, log, skip
        )
    if spec in ("latest", "auto"):
        for path in restore_set_aside(output_dir):
            log(f"Restored {path}: killed while the same step was being written again.")
        for path in not_checkpoints(output_dir):
            log(f"warning: skipping {path}: named like a checkpoint, but not a folder (a symbolic link, a file): not "
                "one this run wrote.")  # fmt: skip
        root = checkpoints_root(output_dir)
        if os.path.lexists(root) and not is_real_folder(root):
            raise CheckpointError(
                f"--resume_from_checkpoint {spec}: {root} is not a folder (a file, a FIFO or a link): the run keeps its "
                "checkpoints in a folder of that name. Move it away, or pass the folder of a checkpoint."
            )
        found = [p for p in list_checkpoints(output_dir) if p not in skip]
        if not found:
            if spec == "auto":
                return None
            ran = any(os.path.exists(os.path.join(output_dir, f)) for f in (MODEL_FILE, "run_config.json"))
            raise CheckpointError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_root(output_dir)}. "
                + (
                    previous_run_advice(output_dir)
                    if ran
                    else "Drop the flag to start a new run, or pass the folder of a checkpoint."
                )
            )
        errors = []
        for path in reversed(found):
            try:
                verify_checkpoint(path, log)
            except CheckpointError as e:
                errors.append(str(e))
                log(f"warning: skipping checkpoint {path}: {e}")
                continue
            if errors:
                log(
                    f"warning: resuming from {path}, the newest usable checkpoint ({len(errors)} newer one(s) "
                    "skipped, see above)."
                )
            return path
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: none of the {len(found)} checkpoint(s) in "
            f"{checkpoints_root(output_dir)} is usable; the newest: {errors[0]}"
        )
    if not os.path.isdir(spec):
        what = "a file, not a folder" if os.path.exists(spec) else "no such folder"
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: {what}. Pass a checkpoint folder "
            f"(output_dir/checkpoints/step_<N>), 'latest' or 'auto'."
        )
    if os.path.lexists(os.path.join(spec, STATE_FILE)) and not os.path.isfile(os.path.join(spec, STATE_FILE)):
        raise CheckpointError(
            f"Checkpoint {spec}: {os.path.join(spec, STATE_FILE)} is not a regular file (a link, a FIFO, a device or "
            "a folder); refused. Resume from another checkpoint."
        )
    if not os.path.isfile(os.path.join(spec, STATE_FILE)):
        steps = list_checkpoints(spec)  # the run's output_dir given instead of one of its checkpoints
        fix = (
            f"it is a run's output_dir: pass {steps[-1]}, or 'latest' with --output_dir {spec}"
            if steps
            else "pass a folder output_dir/checkpoints/step_<N> that accel-trainer wrote"
        )
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: not a checkpoint of ours ({STATE_FILE} missing): {fix}."
        )
    verify_checkpoint(spec, log)
    return spec


def previous_run_advice(output_dir: str) -> str:
    """What to do with an output_dir that holds a run, naming only ways that work: `latest` where a checkpoint
    can be continued, never for a run without one (`latest` would then refuse, advising to drop the flag)."""
    if list_checkpoints(output_dir):
        return (
            "Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to delete it and start "
            "over, or another --output_dir."
        )
    model = os.path.join(output_dir, MODEL_FILE)
    if os.path.isfile(model):
        return (
            f"That run finished and has no checkpoint to continue from; its model is {model}. To train again, pass "
            "--overwrite_output_dir (deletes that run) or another --output_dir."
        )
    return (
        "It has no checkpoint to continue from (it stopped before its first save): pass --overwrite_output_dir to "
        "delete it and start over, or another --output_dir."
    )


def effective_resume_spec(spec: str | None) -> str | None:
    """On an elastic restart the newest checkpoint of this run wins over whatever the command line said: the
    group restarts with the same arguments and must continue, not start over (or from the original folder)."""
    if restart_count() > 0:
        return "auto" if spec in (None, "latest", "auto") else f"auto:{spec}"
    return spec


def resolve_on_main(accelerator, spec: str, output_dir: str, skip=()) -> str | None:
    """resolve_resume_path on the main process only (one reader of the files); the others get its answer, or
    its error, so that every rank resumes from the same folder or every rank stops with the same message."""
    return on_main(
        accelerator, lambda: resolve_resume_path(spec, output_dir, skip=skip), f"--resume_from_checkpoint {spec}"
    )


def on_main(accelerator, fn, what: str, share: bool = True):
    """fn() on the main process only. A UserError there is raised on every rank with the same message (the others
    wait for it at a broadcast, not at the next collective). Returns fn()'s value, on every rank with `share`."""
    from ..errors import UserError

    if accelerator.num_processes == 1:
        return fn()
    from accelerate.utils import broadcast_object_list

    answer, value = [None, None], None
    if accelerator.is_main_process:
        try:
            value = fn()
            answer = [value if share else None, None]
        except UserError as e:
            answer = [None, (type(e).__name__, str(e))]
        except Exception as e:  # a bug: the others stop with its name instead of waiting at the broadcast
            broadcast_object_list([None, ("UserError", f"{what}: the main process failed ({why(e)}).")], from_process=0)
            raise
    broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        kind, message = answer[1]
        raise (CheckpointError if kind == "CheckpointError" else UserError)(message)
    return value if accelerator.is_main_process else answer[0]


# ------------------------------------------------------------------------------------------------------- resuming
class Unusable(CheckpointError):
    """A checkpoint refused before anything of it was set (load.check): `latest` can go on to the one before."""


def resume(
    accelerator, path: str, args, model, optimizer, scheduler, *, ema=None, streaming=False, batches_per_epoch=None,
    extra=None, say=warn,
) -> tuple[dict, int]:  # fmt: skip
    """Load the verified checkpoint `path` into the run, on every rank; returns (its trainer state, this rank's
    micro-batch position in the epoch: resumed_position). Every rank first checks everything against the run
    (load.check, then `extra()`: the data position's per-rank files), and all agree before anything is set: a refusal
    on any rank is the same one line on every rank (Unusable), with nothing of the run changed. Then the main
    process tidies output_dir for the run that continues: interrupted writes removed, newer checkpoints set aside
    (`say` prints the first)."""
    quiet = lambda line: None  # noqa: E731
    main_say = say if accelerator.is_main_process else quiet

    def check():
        saved = ckpt_load.check_state(path)
        position = resumed_position(saved, path, args, accelerator.num_processes, streaming)
        if batches_per_epoch is not None and position >= batches_per_epoch:
            raise CheckpointError(
                f"Checkpoint {path}: {os.path.join(path, STATE_FILE)} holds batch_in_epoch {saved['batch_in_epoch']} "
                f"(written by {saved['num_processes']} process(es)), at or past the end of an epoch of this data "
                f"({batches_per_epoch} micro-batches per process here): a checkpoint of other data, or a damaged "
                "one. Resume with the data it was written with, or from another checkpoint."
            )
        plan = ckpt_load.check(accelerator, path, model, optimizer, scheduler, ema=ema,
                               args_changed=args.allow_args_change)  # fmt: skip
        if extra is not None:
            extra(saved)
        return saved, position, plan

    try:
        saved, position, plan = agree(accelerator, check, f"checking {path}")
    except CheckpointError as e:
        raise Unusable(str(e)) from None
    _check_ema(path, ema, main_say)
    agree(accelerator, lambda: ckpt_load.apply(plan, say=main_say), f"loading {path}")

    def tidy():
        if not accelerator.is_main_process:
            return
        for stale in remove_stale_tmp(args.output_dir):
            what = "remains of a deletion" if ".deleting-" in stale else "a checkpoint whose writing was interrupted"
            say(f"Removed {stale}: {what}.")
        moved, aside = set_aside_newer(args.output_dir, saved["global_step"])
        if moved:  # said even when quiet: checkpoints were moved
            warn(
                f"warning: moved {', '.join(os.path.basename(p) for p in moved)} to {aside}: newer than "
                f"step_{saved['global_step']}, which this run resumes from, so `latest` would prefer them over "
                "this run's own checkpoints. Delete that folder if you do not need it."
            )

    agree(accelerator, tidy, f"tidying {args.output_dir}")
    return saved, position


def agree(accelerator, fn, what: str):
    """fn() on every rank, then every rank learns every rank's outcome: a UserError on any rank is raised on every
    rank (the others' line names the rank), so that no rank goes on alone into a collective the others never
    reach, nor says it resumed while another refused. Returns fn()'s value."""
    from ..errors import UserError

    error, value = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it; re-raised below
        error = e
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        mine = None
        if error is not None:
            mine = (type(error).__name__, str(error)) if isinstance(error, UserError) else ("", why(error))
        outcomes = gather_object([(accelerator.process_index, mine)])
        failed = [(rank, outcome) for rank, outcome in outcomes if outcome is not None]
        if failed and error is None:
            rank, (kind, message) = failed[0]
            if not kind:
                message = f"{what}: rank {rank} failed ({message})."
            raise (CheckpointError if kind in ("CheckpointError", "Unusable") else UserError)(message)
    if error is not None:
        raise error
    return value


def _check_ema(path: str, ema, say) -> None:
    """An EMA that does not continue is said in one line: a checkpoint without one (the EMA starts from its weights)
    or a run without --ema_decay (the average ends), where before the EMA restarted or ended without a word. (Its
    tensors are checked against the model when it is loaded.)"""
    file = os.path.join(path, EMA_FILE)
    if ema is None:
        if os.path.isfile(file):
            say(f"note: the EMA weights in {file} end here: this run has no --ema_decay.")
        return
    if not os.path.isfile(file):
        say(
            f"note: checkpoint {path} has no {EMA_FILE} (written without --ema_decay): the EMA starts from its weights."
        )


def resumed_position(saved: dict, path: str, args, world: int, streaming: bool = False) -> int:
    """This rank's micro-batch position in the epoch for a checkpoint written by any world size. The order of
    an epoch's samples is a function of (seed, epoch) only, and each global micro-batch is the next
    per_device x processes samples of it, so the samples already seen are batch_in_epoch x per_device x
    processes: the same samples on any world size. Exact when the global batch is unchanged; the per-rank
    random streams are not (a rank that did not exist restarts from the seed)."""
    if streaming and saved["num_processes"] != world:
        raise CheckpointError(
            f"Checkpoint {path} was written by {saved['num_processes']} processes reading their own parts of "
            f"the stream; this run has {world}. A stream's position cannot move to another world size: resume "
            f"on {saved['num_processes']} processes."
        )
    old_micro = saved["per_device_train_batch_size"] * saved["num_processes"]
    old_global = old_micro * saved["gradient_accumulation_steps"]
    new_micro = args.per_device_train_batch_size * world
    new_global = new_micro * args.gradient_accumulation_steps
    if old_global != new_global and not args.allow_global_batch_change:
        raise CheckpointError(
            f"Checkpoint {path} was written with a global batch of {old_global} (per_device_train_batch_size="
            f"{saved['per_device_train_batch_size']} x gradient_accumulation_steps="
            f"{saved['gradient_accumulation_steps']} x {saved['num_processes']} processes); this run's is "
            f"{new_global}. Keep the global batch (e.g. --per_device_train_batch_size "
            f"{old_global // (args.gradient_accumulation_steps * world) or 1} on {world} processes), or pass "
            "--allow_global_batch_change to continue with another (not exact: see docs/fault-tolerance.md)."
        )
    if saved["batch_in_epoch"] and saved.get("seed", args.seed) != args.seed:  # older checkpoints lack the seed
        raise CheckpointError(
            f"Checkpoint {path} was written with --seed {saved['seed']} in the middle of epoch {saved['epoch']}; "
            f"this run's --seed {args.seed} orders that epoch otherwise, so some of its samples would be trained on "
            f"twice and others not at all. Resume with --seed {saved['seed']} (or from a checkpoint at an epoch's "
            "end, where another seed orders the epochs after it)."
        )
    seen = saved["batch_in_epoch"] * old_micro  # samples of this epoch already trained on
    window = new_micro * args.gradient_accumulation_steps
    return seen // window * args.gradient_accumulation_steps  # whole updates; exact when the batch is kept
