"""The checkpoint manager: the one object the Trainer talks to about checkpoints.

    resume_path, kept_best, lock = prepare_output_dir(accelerator, args)  # owns output_dir; resume or start anew
    manager = CheckpointManager(accelerator, args, state=[progress, data, updater], data=data, lock=lock, ...)
    manager.resume(resume_path)                                        # every component loads its part
    manager.save() / manager.wait() / manager.announce_written()      # in fit(); --save_async writes in background
    with manager.guard(): ...                                          # no background write left behind on the way out
    manager.preempt(progress_bar)                                      # checkpoint at this update, then exit
    manager.save_model(path)                     # the evaluated weights: a save_pretrained folder, or safetensors

The run state is the components' `state_dict()`s (the Trainer's Progress, the data position -- loaders.MapPosition
or streaming.Stream --, the Updater's K), merged into trainer_state.json, one key per value (the format is that of
earlier versions), with the run's shape that resume.py checks a resume against. The data position also writes
per-rank files (a stream's position) through the same save, while training waits, --save_async or not. The model,
optimizer, scheduler, scaler and RNG states are state.py's files (JSON and safetensors, no pickle); the EMA
weights a file of their own (folder.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from accelerate.utils import DistributedType
from safetensors.torch import save_model

from .. import evaluation, faults
from ..errors import UserError
from ..shards import full_state_dict
from ..update import is_plain_torch
from . import changes, placement, pretrained
from . import folder as ckpt_folder
from . import lock as ckpt_lock
from . import record as ckpt_record
from . import resume as ckpt_resume
from . import state as ckpt_state

AFTER_TRAINING_TRACEBACK = "error_after_training.txt"  # a bug's traceback, named by AfterTrainingError's line
PREVIOUS_RUN_FILES = (
    "metrics.jsonl", "run_config.json", "checkpoints", "model.safetensors", "best", AFTER_TRAINING_TRACEBACK,
    "config.json", "generation_config.json",  # a transformers model's (pretrained.py): never beside other weights
)  # fmt: skip


def prepare_output_dir(
    accelerator, args, say=None, resolved=None
) -> tuple[str | None, dict, ckpt_lock.OutputLock | None]:
    """(the checkpoint to resume from (None: a new run), the best evaluation of an earlier attempt whose best/ is
    kept (Progress fields), the lock the main process holds on output_dir (lock.py; None on the others)), once
    every rank has checked output_dir; then it exists. The lock is taken first: a second run on the folder is
    refused before it reads or moves anything there. `resolved`: the arguments, resolved with the record of the
    checkpoint the resume was expected to take (record.py): the one verified must hold the same."""
    spec = args.resume_from_checkpoint
    elsewhere = spec and not spec.startswith(("latest", "auto")) and os.path.isdir(spec)
    if elsewhere and not placement.within(spec, ckpt_folder.checkpoints_root(args.output_dir)):
        placement.refuse_overlap(
            spec, args.output_dir
        )  # before the lock file is written into output_dir (the checkpoint)
    placement.refuse_nested_runs(args.output_dir, PREVIOUS_RUN_FILES)  # before the lock file too: nothing is changed
    lock = ckpt_resume.on_main(accelerator, lambda: _own(args, say), "output_dir", share=False)
    try:
        ckpt_lock.check_shared(accelerator, args.output_dir, lock, args.checkpoints)
        resume_path, kept_best = _check_output_dir(accelerator, args)
        expected = getattr(resolved, "resumed", None)
        if resume_path is not None and expected is not None and resume_path != expected[0]:
            if ckpt_record.read(resume_path) != expected[1]:  # latest fell back to a checkpoint of other arguments
                raise ckpt_folder.CheckpointError(
                    f"--resume_from_checkpoint {args.resume_from_checkpoint}: the checkpoint resumed, {resume_path}, "
                    f"was written with other arguments than {expected[0]}, which could not be used (see above). "
                    f"Pass --resume_from_checkpoint {resume_path} to continue it."
                )
        if say is not None and accelerator.is_main_process:
            for note in getattr(resolved, "notes", ()):
                say(note)
        accelerator.wait_for_everyone()
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return resume_path, kept_best, lock


def _own(args, say) -> ckpt_lock.OutputLock:
    """The lock on output_dir, once the run is known to be able to write there (a refusal lets it go)."""
    lock = ckpt_lock.acquire(args.output_dir, say)
    try:
        changes.check_writable(args.output_dir, args.checkpoints)
    except BaseException:
        lock.release(tidy=True)
        raise
    return lock


def _check_output_dir(accelerator, args) -> tuple[str | None, dict]:
    """The verified checkpoint to resume from (None: a new run), and a clean output_dir for a new run.
    'auto' (and any elastic restart: resume.effective_resume_spec) resumes when there is a checkpoint and starts anew when
    there is none, replacing the logs of an attempt that died before its first checkpoint."""
    out = args.output_dir
    spec = ckpt_resume.effective_resume_spec(args.resume_from_checkpoint)
    path = ckpt_resume.resolve_on_main(accelerator, spec, out) if spec else None
    if path is not None and placement.within(path, ckpt_folder.checkpoints_root(out)):
        return path, {}  # this run's own checkpoint: output_dir holds the run it continues
    if path is not None:
        placement.refuse_overlap(path, out)
    # A new run, or one continued from a checkpoint elsewhere: output_dir must not hold another run, whose model,
    # logs and checkpoints this one would write over or mix with its own.
    kept_best: dict = {}
    previous = [f for f in PREVIOUS_RUN_FILES if os.path.exists(os.path.join(out, f))]
    leftovers = spec is not None and spec.startswith("auto") and "model.safetensors" not in previous
    if previous and not (args.overwrite_output_dir or leftovers):
        raise FileExistsError(
            f"output_dir {out} holds a previous run ({', '.join(previous)}). {ckpt_resume.previous_run_advice(out)}"
        )
    if leftovers and not args.overwrite_output_dir and "best" in previous:
        previous.remove("best")
        kept_best = _keep_best(accelerator, args, out)
    if previous:
        accelerator.wait_for_everyone()  # every rank has checked before the main one deletes
        why = "--overwrite_output_dir" if args.overwrite_output_dir else "starting over"
        doing = f"{why}: cannot delete the previous run in {out}"
        # All or nothing (a previous run half deleted is lost and not replaced); a refusal reaches every rank.
        paths = [os.path.join(out, f) for f in previous]
        ckpt_resume.on_main(accelerator, lambda: changes.delete(paths, doing), "output_dir", share=False)
    return path, kept_best


def _keep_best(accelerator, args, out: str) -> dict:
    """An attempt that died before its first checkpoint (started again with 'auto') may have written best/:
    the new attempt keeps it and compares against its record, replacing it only when it evaluates better.
    One that cannot be compared against (another metric, no best.json) is moved aside, never deleted."""
    record = evaluation.previous_best(args, out)
    kept = {}
    if record is not None:
        kept = {"best_metric": record["value"], "best_step": record["step"]}
        found = f"step {record['step']}, {record['metric']} {record['value']:.6g}"
        what = f"kept ({found}) until this run evaluates better"
    else:
        accelerator.wait_for_everyone()  # every rank has read best/ before it moves
        aside = os.path.join(out, f"best.previous-{time.strftime('%Y%m%d-%H%M%S')}")
        if accelerator.is_main_process:
            changes.move(os.path.join(out, "best"), aside, f"Cannot move {os.path.join(out, 'best')} to {aside}")
        what = f"moved to {aside}: this run cannot compare against it (another metric, or no best.json)"
    if accelerator.is_main_process:
        print(
            f"Starting over (no checkpoint in {ckpt_folder.checkpoints_root(out)}); the best model of the attempt "
            f"before, {os.path.join(out, 'best')}, is {what}.",
            file=sys.stderr,
            flush=True,
        )
    return kept


class CheckpointManager:
    """Saves and resumes the run: `state` (objects with state_dict()/load_state_dict() whose dicts make
    trainer_state.json; their keys do not overlap), `data` (the data position, which also writes per-rank files),
    the prepared model and optimizer, the EMA (or None). `fire(event, *args)` fires a Trainer event;
    `before_save()` runs before every checkpoint (the Trainer logs the updates not yet logged, which also stops a
    run on a non-finite loss before anything is written over a good checkpoint); `say` prints on the main process;
    `save_full_model(path)`: under FSDP, every rank gathers the shards and the main one writes (sharding.py).
    `tokenizer`: what build_data handed over (its "tokenizer": a tokenizer or processor), saved beside a
    transformers model."""

    def __init__(
        self, accelerator, args, *, state: list, data, model, optimizer, scheduler, ema, preemption, say, fire,
        before_save, save_full_model=None, tokenizer=None, lock=None, recipe_args=None,
    ):  # fmt: skip
        self.accelerator, self.args = accelerator, args
        self.components, self.data = state, data
        self.model, self.optimizer, self.scheduler, self.ema = model, optimizer, scheduler, ema
        self.preemption, self.say, self.fire, self.before_save = preemption, say, fire, before_save
        self.save_full_model = save_full_model
        self.tokenizer = tokenizer
        self.record = ckpt_record.of(
            args, recipe_args, accelerator.num_processes
        )  # the run's arguments, in every checkpoint (record.py)
        self.lock = lock  # the main process's lock on output_dir (lock.py), held until fit() ends
        self.owns_output_dir = True
        self.saved_step = None  # the step of the last checkpoint written by this run
        # the step at which a resume went on with another global batch (--allow_global_batch_change), from where on
        # the data position no longer follows from the step (checkpointing/counters.py); None: never
        self.batch_changed_at = None
        self.pending_path = None  # a background write's folder, until checkpoint_written fired for it
        self.writer = self._async_writer() if args.save_async else None
        # The frozen parameters as built (a LoRA adapter's base): checkpoints hold their fingerprints, not them,
        # while they stay unchanged (state.py). Not under FSDP, whose checkpoints hold each rank's shards.
        self.sharded = accelerator.distributed_type == DistributedType.FSDP
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)
        self.frozen = ckpt_state.frozen(plain) if accelerator.is_main_process and not self.sharded else {}

    # ----------------------------------------------------------------------------------------------- run state
    def state_dict(self) -> dict:
        """trainer_state.json: every component's state, and the shape of the run that wrote it."""
        state: dict = {}
        for component in self.components:
            state.update(component.state_dict())
        return {
            **state,
            "num_processes": self.accelerator.num_processes,
            "per_device_train_batch_size": self.args.per_device_train_batch_size,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "seed": self.args.seed,
            "global_batch_changed_at": self.batch_changed_at,
        }

    def resume(self, path: str) -> str:
        """Continue the run from the verified checkpoint `path` (resume.resume: the weights, optimizer and RNG
        states, and this rank's position for any world size, every part checked against the run on every rank
        first); then every component loads its part. With `latest`/`auto`, a checkpoint refused by those checks is
        skipped for the one before, as one the verifier refuses is. Returns the checkpoint resumed from."""
        acc, spec, tried = self.accelerator, ckpt_resume.effective_resume_spec(self.args.resume_from_checkpoint), []
        while True:
            try:
                state, position = ckpt_resume.resume(
                    acc, path, self.args, self.model, self.optimizer, self.scheduler, ema=self.ema,
                    streaming=self.data.per_rank, batches_per_epoch=getattr(self.data, "batches_per_epoch", None),
                    extra=lambda saved: self.data.load_rank_files(path, saved),
                    say=self.say,
                )  # fmt: skip
                break
            except ckpt_resume.Unusable as e:
                if spec is None or not spec.startswith(("latest", "auto")):
                    raise ckpt_folder.CheckpointError(str(e)) from None
                tried.append((path, str(e)))
                if acc.is_main_process:
                    ckpt_resume.warn(f"warning: skipping checkpoint {path}: {e}")
                try:
                    path = ckpt_resume.resolve_on_main(acc, spec, self.args.output_dir, skip=[p for p, _ in tried])
                except ckpt_folder.CheckpointError:
                    raise ckpt_folder.CheckpointError(tried[0][1]) from None  # the newest one's reason
                if path is None:
                    raise ckpt_folder.CheckpointError(tried[0][1]) from None
                if ckpt_record.read(path) != ckpt_record.read(tried[0][0]):  # the run's arguments came from that one
                    raise ckpt_folder.CheckpointError(
                        f"{tried[0][1]} The checkpoint before it, {path}, was written with other arguments than the "
                        f"ones this run took from it: pass --resume_from_checkpoint {path} to continue from there."
                    ) from None
        here = {**state, "batch_in_epoch": position}  # this rank's place in the epoch on this world size
        old = state["per_device_train_batch_size"] * state["gradient_accumulation_steps"] * state["num_processes"]
        new = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * acc.num_processes
        self.batch_changed_at = state.get("global_batch_changed_at") if old == new else state["global_step"]
        for component in self.components:
            component.load_state_dict(here)
        moved = "" if state["num_processes"] == acc.num_processes else (
            f", written by {state['num_processes']} processes: batch {state['batch_in_epoch']} there"
        )  # fmt: skip
        self.say(
            f"Resumed from {path} at step {state['global_step']} (epoch {self.data.epoch}, batch {position}{moved})."
        )
        return path

    # ------------------------------------------------------------------------------------------------- saving
    def own_output_dir(self):
        """The lock on output_dir, taken again by a fit() after an earlier one ended (and released it)."""
        acc = self.accelerator
        if not self.owns_output_dir:  # the same on every rank: the others wait for the main process's answer
            self.lock = ckpt_resume.on_main(
                acc, lambda: ckpt_lock.acquire(self.args.output_dir, self.say), "output_dir", share=False
            )
            self.owns_output_dir = True
        if self.lock is not None:
            self.lock.check(self.args.output_dir)

    def release_output_dir(self):
        self.owns_output_dir = False
        if self.lock is not None:
            self.lock.release()

    def save(self) -> str:
        if self.lock is not None:
            self.lock.check(self.args.output_dir)
        self.before_save()
        self.wait()  # one write at a time: the staging memory is reused, the order kept
        state = self.state_dict()
        step = state["global_step"]
        acc = self.accelerator
        captured = ckpt_state.capture(
            acc, self.model, self.optimizer, self.scheduler, step, self.sharded, frozen=self.frozen
        )
        if acc.is_main_process:
            captured.small[ckpt_state.RECORD_FILE] = self.record
        path = ckpt_folder.save_checkpoint(
            acc,
            self.args.output_dir,
            state,
            captured,
            ema=self.ema,
            save_total_limit=self.args.save_total_limit,
            on_staged=lambda folder: self.fire("checkpoint_staged", folder),
            async_writer=self.writer,
            # this rank's data position at this update, also under --save_async
            write_extra=lambda folder: self.data.save_rank_files(folder, step),
        )
        self.saved_step = step
        if self.writer is None:
            self.fire("checkpoint_written", path)
        else:
            self.pending_path = path  # checkpoint_written fires once it is committed
        return path

    def save_model(self, path: str | None = None) -> str:
        """The evaluated weights (EMA when on) as safetensors of the plain model: no `module.`/`_orig_mod.`.
        A transformers model's folder (that of `path`) becomes a save_pretrained folder with the recipe's
        tokenizer (pretrained.py): from_pretrained and pipeline() load it."""
        acc, out = self.accelerator, self.args.output_dir
        path = path or os.path.join(out, "model.safetensors")
        plain = acc.unwrap_model(self.model, keep_torch_compile=False)
        if pretrained.is_pretrained(plain):
            return self._save_pretrained(plain, os.path.dirname(path))
        if self.save_full_model is not None:  # every rank takes part in gathering the shards; the main one writes
            return self.save_full_model(path)
        acc.wait_for_everyone()
        if acc.is_main_process:
            model = self.ema.module if self.ema is not None else acc.unwrap_model(self.model, keep_torch_compile=False)
            ckpt_folder.write_file_atomically(path, lambda tmp: save_model(model, tmp), out, f"the model to {path}")
        acc.wait_for_everyone()
        return path

    def _save_pretrained(self, plain, folder: str) -> str:
        acc = self.accelerator
        acc.wait_for_everyone()
        # Under FSDP every rank takes part in gathering the full state once; the main process alone writes.
        sd = full_state_dict(acc, self.model) if self.ema is None else None
        if acc.is_main_process:
            if self.ema is not None:  # the EMA is refused under FSDP: a plain module on the main process
                sd = self.ema.module.state_dict()
            pretrained.write_folder(plain, sd, folder, self.args.output_dir, tokenizer=self.tokenizer)
        acc.wait_for_everyone()
        return os.path.join(folder, "model.safetensors")

    # --save_async (async_writer.py): the write runs in the background; a failure stops every rank at one update.
    def _async_writer(self):
        from .async_writer import AsyncWriter

        acc = self.accelerator
        if not (is_plain_torch(acc) or acc.distributed_type == DistributedType.FSDP):
            raise UserError(
                f"--save_async supports one process, DDP and FSDP2, not {acc.distributed_type}; drop --save_async."
            )
        writer = AsyncWriter(self.accelerator, self.args.ddp_timeout)
        # Every rank learns the same outcome, so every rank votes to stop: they stop at the same update (the
        # preemption vote), where preempt() waits for the write and raises its one-line error.
        writer.on_failure = self.preemption.request_stop
        return writer

    def announce_written(self):
        if self.writer is not None and self.pending_path is not None and not self.writer.pending():
            if self.writer.error is None:
                self.fire("checkpoint_written", self.pending_path)
                self.pending_path = None

    def wait(self):
        """The pending background write is over (raising its failure), and announced."""
        if self.writer is not None:
            self.writer.wait()  # in fit() inside meter.paused(): not update time
            self.announce_written()

    def preempt(self, progress_bar=None):
        """Checkpoint at this update boundary (unless one was just written), then exit with EXIT_PREEMPTED."""
        self.wait()  # a failed background write stops the run here, with its own message
        step = self.state_dict()["global_step"]
        path = (
            os.path.join(ckpt_folder.checkpoints_root(self.args.output_dir), f"step_{step}")
            if self.saved_step == step
            else self.save()
        )
        self.wait()
        if progress_bar is not None:
            progress_bar.close()
        self.accelerator.end_training()
        self.say(
            f"Preempted ({self.preemption.signal_name or 'signal on another rank'}): checkpoint "
            f"{path} at step {step}; {faults.preempted_exit()}. Resume "
            "with --resume_from_checkpoint latest."
        )
        raise faults.Preempted(path, step)

    @contextlib.contextmanager
    def guard(self):
        """Around fit()'s loop and its end. Whatever ends them early (an exception, Ctrl-C, a NaN stop, a dead peer;
        a preemption has already waited), a checkpoint still being written in the background is committed, or
        cleanly absent, before the error goes on. Left to the interpreter's exit, the daemon thread would be stopped
        mid-write (or abort the process inside torch) and the checkpoint lost. Bounded by the writer's timeout."""
        try:
            yield
        except BaseException:
            w = self.writer
            if w is not None and w.in_flight():
                self._finish_write_on_the_way_out(w)
            raise

    def _finish_write_on_the_way_out(self, w):
        from .async_writer import CheckpointWriteError

        path = self.pending_path
        try:
            if w.pending():
                self.say(
                    f"Stopping: first finishing the checkpoint {path} being written in the background (at most "
                    f"{w.timeout_s} s; interrupt again to abandon it)."
                )
            self.wait()
            self.say(f"Checkpoint {path} committed; resume with --resume_from_checkpoint latest.")
        except CheckpointWriteError as e:  # the error that ends the run goes on; this one is said, not lost
            print(f"warning: {e}", file=sys.stderr, flush=True)
        finally:
            w.close()  # the run stops: the writer's group is not left to the interpreter's teardown
