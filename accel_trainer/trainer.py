"""The Trainer: one object over `accelerate.Accelerator` that owns the loop. Read it top to bottom:

    __init__   set-up, one way: take the arguments resolved once (resolve.py: the recipe, loaded once, and the run's
               one RecipeContext), configure the process and build the Accelerator (accel.configure_process),
               complete the context, then the recipe's model, loaders (loaders.py), optimizer and scheduler
               (build.py; optim.py by default), prepare; the components that own the run's state; resume
               (checkpointing/manager.py) when a checkpoint is named
    fit        for each accumulation window: update, then log (logwindow.py) / evaluate / checkpoint / preempt when due
    update     one optimizer update (update.py: item-weighted accumulation, clip, step, schedule, EMA); the step count
    evaluate   evaluation.py: every eval sample once on any world size, the metrics, the best model kept; the
               evaluate_end event

Sharded training (FSDP2, docs/sharding.md) is the same loop: accel.py makes Accelerate shard (on CPU too),
prepare goes through sharding.prepare_sharded, checkpoints are DCP shards and save_model gathers the full model.

Hooks are named events (events.py), never subclassing: a recipe's `on_<event>` functions, or `trainer.on(...)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
import traceback
import weakref

import torch
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import build, debugging, evaluation, faults, loaders, peers, preflight, shards
from .accel import compile_notes, configure_process
from .args import TrainingArguments
from .checkpointing.manager import AFTER_TRAINING_TRACEBACK, CheckpointManager, prepare_output_dir
from .checkpointing.pretrained import push_to_hub
from .entry import python_api
from .errors import UserError
from .events import Events
from .logwindow import LogWindow
from .progress import Progress
from .resolve import ResolvedArgs, resolve_args, user_values
from .runlog import Reporter, end_line, flat_config, start_line
from .throughput import Meter, detected_peak_tflops
from .update import Updater


class AfterTrainingError(UserError):
    """Training finished and its weights are saved; what came after (the final evaluation, fit_end) failed."""


class Trainer:
    @python_api  # bad input from the Python API: one UserError naming keywords, not flags (entry.py)
    def __init__(
        self, recipe, args: ResolvedArgs | TrainingArguments | None = None, recipe_args=None, quiet: bool = False
    ):
        # Set-up flows one way. The arguments, resolved once (resolve.py; run() and from_recipe have done it, a
        # notebook's TrainingArguments(...) is resolved here like the same flags), with the recipe loaded once (given
        # ResolvedArgs, the recipe they were resolved for is the one used) and the run's one RecipeContext, which
        # the recipe's configure saw.
        resolved = (
            args if isinstance(args, ResolvedArgs) else resolve_args(recipe, values=user_values(args, recipe_args))
        )
        # The Trainer's own copy of the training arguments: the caller's can build another Trainer as they are.
        self.args, self.recipe_args, self.given = dataclasses.replace(resolved.targs), resolved.rargs, resolved.given
        args = self.args
        self.recipe = preflight.counting_items(resolved.recipe)  # a bare 0-d loss: weighed by the batch's samples
        # Everything the run changes in the whole process happens in accel.configure_process, recorded in
        # run_config.json ("process"); the world is known from here on, and completes the context.
        self.accelerator, self.process = configure_process(args)
        acc = self.accelerator
        self.reporter = Reporter(acc, args.output_dir, quiet=quiet)
        # The run owns output_dir from here until fit() ends (a second run on it is refused); checked on every rank
        # before any rank writes.
        resume_path, kept_best, lock = prepare_output_dir(acc, args, self.reporter.print, resolved)
        try:
            self._set_up(resolved, resume_path, kept_best, lock)
        except BaseException:
            if lock is not None:  # a run refused while setting up leaves no folder of its own behind
                lock.release(tidy=True)
            raise

    def _set_up(self, resolved: ResolvedArgs, resume_path: str | None, kept_best: dict, lock):
        """The rest of __init__, once the run owns output_dir: the context, model, data, optimisation, components."""
        args, acc = self.args, self.accelerator
        self.ctx = resolved.ctx.complete(acc, targs=args, resume_from=resume_path)
        # --lr_scaling: the learning rate the optimizer is built with, scaled for this world's global batch; the
        # arguments keep the user's --learning_rate.
        self.learning_rate = self.ctx.learning_rate
        self.events = Events()
        for event, handler in self.recipe.events.items():
            self.events.on(event, handler)

        # Model and data: the recipe's (build.py). Loaders first: the number of batches per epoch on this rank
        # (after Accelerate shards them) sets the number of updates, which the scheduler needs before it is built.
        set_seed(args.seed)
        model = build.build_model(self.recipe, self.ctx)
        # self.data: where the run is in its data (loaders.MapPosition, or streaming.Stream for a stream)
        built = self.recipe.build_data(self.ctx)
        self.train_loader, self.eval_loader, self.data = loaders.build_loaders(built, args, acc, self.recipe.name)
        self.tokenizer = built.get("tokenizer")  # saved beside a transformers model (checkpointing/pretrained.py)
        evaluation.check_early_stopping(args, self.eval_loader, self.recipe.name)
        if args.dataloader_num_workers and not isinstance(self.train_loader, DataLoader):  # a stream's is one
            self.reporter.print(
                f"note: --dataloader_num_workers {args.dataloader_num_workers} does nothing here: recipe "
                f"{self.recipe.name} batches its data itself (build_data's 'loader'), in the training process."
            )
        for line in compile_notes(acc, getattr(self.data, "last_rows", None)):  # what CUDA graphs cannot take
            self.reporter.print(line)
        # (micro-batches per epoch on this rank, updates per epoch, total updates). A stream's length is unknown
        # (None): the run length is --max_steps, an epoch ends when the stream does.
        run_length = self.data.run_length(args, self.eval_loader, self.recipe.name)
        self.micro_batches_per_epoch, self.updates_per_epoch, self.total_steps = run_length
        self.ctx.complete(num_training_steps=self.total_steps)

        # Optimisation (build.prepare): the recipe's optimizer and scheduler, or our defaults, prepared (under FSDP:
        # sharded); the fp8 count (None without fp8) and the EMA copy (None without --ema_decay).
        ready = build.prepare(self.recipe, self.ctx, model)
        self.model, self.optimizer, self.scheduler, self.sharding_info, self.fp8_layers, self.ema = ready
        self.sharded = acc.distributed_type == DistributedType.FSDP
        if ready.fp8_layers:
            self.reporter.print(
                "fp8: {converted} of {linear} Linear layers converted ({backend}).".format(**ready.fp8_layers)
            )

        # The run's state, and the components that own theirs.
        self.progress = Progress(**kept_best)
        self.log_window = LogWindow(args, acc, self.data, self.train_loader, self.scheduler, self.progress)
        self._train_iter = None  # fetch_batch()'s position
        self._debug = debugging.DebugStart()  # undone by fit(): train_step/overfit_batch (debugging.py)
        # Faults: preemption votes ride on the update's all-reduce (faults.py); a side gloo group names a dead rank
        # (peers.py).
        self.preemption = faults.Preemption(acc.device, acc.num_processes)
        self._diag_group = peers.make_diagnostic_group(acc, args.ddp_timeout)
        self.meter = Meter(acc, args.peak_tflops or detected_peak_tflops(acc.mixed_precision))
        self.updater = Updater(
            acc, self.model, self.optimizer, self.scheduler, self.recipe.loss, args, ema=self.ema, meter=self.meter,
            preemption=self.preemption, on_skipped=self.progress.skipped, say=self.reporter.print,
        )  # fmt: skip
        # The manager calls back into the Trainer (its events; a log row before each save) through a weak reference:
        # a reference cycle would keep a dropped Trainer's model, optimizer and data (on a GPU, their memory) alive
        # until Python's next full garbage collection, under the next Trainer of a notebook or a seed sweep.
        me = weakref.ref(self)
        self.checkpoints = CheckpointManager(
            acc, args, state=[self.progress, self.data, self.updater], data=self.data, model=self.model,
            optimizer=self.optimizer, scheduler=self.scheduler, ema=self.ema, preemption=self.preemption, say=self.reporter.print,
            fire=lambda event, *a: me().events.fire(event, me(), *a), before_save=lambda: me().log(),
            save_full_model=functools.partial(shards.save_full_model, acc, self.model, output_dir=args.output_dir)
            if self.sharded else None, tokenizer=self.tokenizer, lock=lock, recipe_args=self.recipe_args,
        )  # fmt: skip
        self.profiler = None  # --profile_steps: torch's profiler over those updates (profiling.py)
        if args.profile_steps:
            self._attach_profiler()

        if resume_path:
            resume_path = self.checkpoints.resume(resume_path)  # the one before, where latest skipped a refused one
        # After the resume: a checkpoint this run cannot continue leaves the record of the run that wrote it.
        self.reporter.write_run_config(os.path.join(args.output_dir, "run_config.json"), build.run_config(self))
        if args.trackers:
            acc.init_trackers(args.run_name or self.recipe.name, config=flat_config(args, self.recipe_args))
        self.reporter.print(start_line(self.reporter.run_config, args.output_dir, resume_path))

    @classmethod
    @python_api
    def from_recipe(cls, recipe, quiet: bool = False, **values) -> Trainer:
        """A Trainer from a recipe and the values you would give as flags: `Trainer.from_recipe(regression,
        output_dir="out", max_steps=200, hidden_size=64)` is `python recipes/regression.py --output_dir out
        --max_steps 200 --hidden_size 64`, the same resolved arguments (recipe defaults, presets, then yours)."""
        resolved = resolve_args(recipe, values=values)
        return cls(resolved.recipe, resolved, quiet=quiet)

    def on(self, event: str, handler):
        """Attach a handler to a named event: one of events.EVENTS (the table in events.py says when each fires)."""
        return self.events.on(event, handler)

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def epoch(self) -> int:
        return self.data.epoch

    # ---------------------------------------------------------------------------------------------------- set-up

    def _attach_profiler(self):
        from .profiling import UpdateProfiler

        self.profiler = UpdateProfiler(self)
        self.profiler.attach(self.events)

    # ------------------------------------------------------------------------------------------------- training
    @python_api
    def fit(self) -> dict:
        """Train to `total_steps` optimizer updates, evaluating, logging and checkpointing on the way; after
        train_step/overfit_batch, from the state the Trainer was built with (debugging.py). The run's lock on
        output_dir is released when it returns or fails (a second fit() takes it again)."""
        self.checkpoints.own_output_dir()
        try:
            return self._fit()
        finally:
            self.checkpoints.release_output_dir()

    def _fit(self) -> dict:
        self._debug.rewind(self)
        args, p = self.args, self.progress
        bar = self._progress_bar()
        metrics: dict = {}
        self.model.train()
        self.meter.restart()
        self.events.fire("fit_start", self)
        peers_watched = peers.peer_failures(
            self.accelerator, self._diag_group, args.ddp_timeout, lambda: self.global_step, args.output_dir
        )
        # the profiler, too, stops on every way out: a failed run keeps the profile of the updates it did
        profiled = self.profiler.running(self.global_step) if self.profiler else contextlib.nullcontext()
        # One flat loop over the run's windows (the micro-batches of one update each), handed out as the data position
        # moves: what the run asked for, each when it is due. The time between asking for a window and getting it
        # is the log rows' data wait.
        # (none when a notebook's train_step() calls went past the run length, or a resumed run had stopped early)
        done = p.global_step >= self.total_steps or evaluation.stopped_early(args, p)
        windows = self.data.windows(args.gradient_accumulation_steps) if not done else ()
        first = True
        with self.checkpoints.guard(), self.preemption, peers_watched, profiled:
            asked = time.perf_counter()
            for window in windows:
                self.meter.waited(time.perf_counter() - asked)
                if first:  # the recipe's hooks on the run's first batch, before its first update (preflight.py)
                    preflight.check_first_window(self, window)
                    first = False
                self.update(window)
                if self.events.has("update_end"):  # handlers see the step count, learning rate and skips as they are
                    if self.updater.pending is not None:
                        self.updater.settle()
                    self.events.fire("update_end", self)
                self.checkpoints.announce_written()
                bar.update(1)
                step = p.global_step
                if step >= self.total_steps:
                    self.log(bar)
                    break
                if step % args.logging_steps == 0:
                    self.log(bar)
                # epochs: never for a stream, whose epochs end at other updates on each rank
                epoch_ended = self.data.epoch_just_ended()
                if self.eval_loader is not None and args.evaluates_after(step, epoch_ended):
                    with self.meter.paused():  # not update time in the log rows
                        metrics = self.evaluate()
                    if self._stops_early():  # the run then ends as after its last update
                        break
                if args.saves_after(step, epoch_ended):
                    with self.meter.paused():
                        self.save_checkpoint()
                if self.preemption.agreed():  # a signal reached some rank by the previous update
                    self.checkpoints.preempt(bar)
                asked = time.perf_counter()
        bar.close()
        with self.checkpoints.guard():  # the final checkpoint's write too (Ctrl-C while it is waited for)
            return self._finish(metrics)

    def _finish(self, metrics: dict) -> dict:
        """After the last update. The final checkpoint, then the weights, are saved first, so that nothing after
        training (the final evaluation and its metrics, a fit_end handler's plots or upload) can lose them, and a
        model file that cannot be written still leaves the final checkpoint; a failure after training is one line
        saying where they are (AfterTrainingError). A resumed finished checkpoint evaluates again, without an
        update, so the final evaluation need not be in it."""
        self.checkpoints.wait()  # the loop's last background write is committed before anything else
        saved = []
        if self.args.checkpoints:
            saved.append(self.save_checkpoint())
            self.checkpoints.wait()  # committed before the model file is written
        saved.insert(0, self.save_model())
        failed = None
        try:
            if self.args.load_best_model_at_end and self.eval_loader is not None:
                self.evaluate()  # the last update's weights compete for best/ too
                plain = self.ema.module if self.ema is not None else self.unwrapped_model  # what save_model saves
                if evaluation.load_best(self.accelerator, plain, self.args.output_dir, self.progress):
                    saved[0] = self.save_model()  # the best weights, evaluated below as the final evaluation
            if self.eval_loader is not None or self.events.has("evaluate_end"):
                metrics = self.evaluate(final=True)
        except Exception as e:  # noqa: BLE001 - reported in one line, after the saves above
            failed = ("the final evaluation", e)
        if failed is None:
            try:
                self.events.fire("fit_end", self, metrics)
            except Exception as e:  # noqa: BLE001
                failed = ("a fit_end handler", e)
        if failed is not None:
            raise self._after_training_error(saved, *failed)
        if self.accelerator.is_main_process:  # a previous attempt's, now answered
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.args.output_dir, AFTER_TRAINING_TRACEBACK))
        self.accelerator.end_training()
        self.reporter.print(end_line(self.global_step, time.perf_counter() - self.reporter.start, saved[0]))
        if self.args.push_to_hub and self.accelerator.is_main_process:  # a failure: one line, the model stays saved
            url = push_to_hub(self.args.output_dir, self.args.hub_model_id, self.global_step)
            self.reporter.print(f"Pushed {self.args.output_dir} to the Hub: {url}")
        return metrics

    def _after_training_error(self, saved: list[str], what: str, error: Exception) -> AfterTrainingError:
        """One line for a failure after training: what is saved where, what failed and how to run only that again.
        A bug's traceback (not a UserError's: its message is the whole story) goes to a file the line names."""
        detail = str(error)
        if not isinstance(error, UserError):
            first = (str(error).strip().splitlines() or [""])[0][:300].rstrip(".")
            where = os.path.join(self.args.output_dir, AFTER_TRAINING_TRACEBACK)
            if self.accelerator.is_main_process:
                with open(where, "w") as f:
                    traceback.print_exception(error, file=f)
            detail = f"{type(error).__name__}: {first} (traceback in {where})"
        again = (
            "fix it, then run again with --resume_from_checkpoint latest, which does not train again"
            if self.args.checkpoints
            else "fix it and evaluate the saved model"
        )
        return AfterTrainingError(
            f"Training finished at step {self.global_step}; saved: {', '.join(saved)}. Then {what} failed: "
            f"{detail.rstrip('.')}. The weights are safe: {again}."
        )

    def _progress_bar(self):
        # Not on a terminal (a log file, a SLURM job), a bar would flood the log: the plain line per log row stays.
        quiet = self.args.disable_tqdm or not self.accelerator.is_main_process or not sys.stderr.isatty()
        return tqdm(total=self.total_steps, initial=self.global_step, dynamic_ncols=True, desc="train", disable=quiet)

    def update(self, window: list, schedule: bool = True):
        """One optimizer update over a window of micro-batches (this rank's share of the global batch; update.py).
        Returns the mean loss over every item of the global batch (a tensor; no host sync)."""
        done = self.updater(window, schedule=schedule)
        self.progress.updated()
        self.log_window.record(done, window, self.updater.micro_losses, self.micro_batches_per_epoch)
        return done.loss

    def log(self, progress_bar=None) -> dict | None:
        """One metrics.jsonl row for the updates since the last log (logwindow.py: the only host sync of the loop)."""
        self.updater.settle()  # the last update's outcome, if only the device knew it yet
        metrics = self.log_window.row()
        if metrics is None:
            return None
        metrics.update(self.meter.row())  # throughput, step time, data wait, memory (mfu): a gather on N ranks
        if progress_bar is not None and not progress_bar.disable:
            # What set_postfix(loss=..., samples_s=...) shows, without its OrderedDict and number checks (a cost per
            # row callgrind showed: docs/benchmarks.md); no refresh of its own: the row's progress_bar.write redraws it.
            progress_bar.set_postfix_str(
                f"loss={metrics['loss']:.4g}, samples_s={metrics['samples_per_second']:.4g}", refresh=False
            )
        return self.reporter.log(metrics, self.global_step, self._epoch_float(), progress_bar)

    def _epoch_float(self) -> float:
        return self.data.epoch_float()

    # ------------------------------------------------------------------------------------------------ evaluation
    def gather_eval(self, out: dict) -> dict:
        """Per-sample eval tensors of this rank's batch -> those of every rank, each sample of the split once.
        For evaluate_end handlers (e.g. test-time augmentation) that loop over `trainer.eval_loader`."""
        return evaluation.gather(self.accelerator, self.eval_loader, out)

    @property
    def eval_model(self) -> torch.nn.Module:
        """The weights evaluation and the final save use: the EMA when --ema_decay is on."""
        return self.ema.module if self.ema is not None else self.model

    @torch.no_grad()
    def evaluate(self, final: bool = False) -> dict:
        """Loss and metrics over the whole eval split (evaluation.py), then the evaluate_end event's extras; logged,
        and the best model kept with --metric_for_best_model."""
        self.updater.settle()  # handlers may read the step count, the learning rate, the skips
        results: dict = {}
        if self.eval_loader is not None:
            results = evaluation.evaluate(self.accelerator, self.recipe, self.ctx, self.eval_model, self.eval_loader)
        for extra in self.events.fire("evaluate_end", self, dict(results), final):
            results.update(extra or {})
        if results:
            self.reporter.log(results, self.global_step, self._epoch_float())
            if self.args.metric_for_best_model:
                p = self.progress
                best = evaluation.keep_if_best(
                    self.accelerator, self.args, p.best_metric, p.global_step, results, self.save_model
                )
                if best is not None or not final:  # the final evaluation does not count for early stopping
                    p.new_best(best)
        return results

    def _stops_early(self) -> bool:
        """--early_stopping_patience evaluations in a row without improvement: say so, and stop (fit)."""
        line = evaluation.stopped_early(self.args, self.progress)
        if line:
            self.reporter.print(line)
        return line is not None

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        """A checkpoint of this update (checkpointing.manager; --save_async: written in the background)."""
        return self.checkpoints.save()

    def save_model(self, path: str | None = None) -> str:
        """The evaluated weights (EMA when on) as safetensors of the plain model: no `module.`/`_orig_mod.`."""
        return self.checkpoints.save_model(path)

    # ----------------------------------------------------------------------------------- notebook / debugging
    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def fetch_batch(self):
        """The next training batch (on the device), continuing across epochs."""
        if self._train_iter is None:
            self._train_iter = self.data.batches(self.epoch, 0)
        try:
            return next(self._train_iter)
        except StopIteration:
            self._train_iter = self.data.batches(self.epoch + 1, 0)
            return next(self._train_iter)

    def train_step(self, batch=None, schedule: bool = True) -> float:
        """One optimizer update on one batch (fetched if not given). Returns its loss (NaN for a skipped one)."""
        self._debug.before_update(self)
        self.model.train()
        loss = self.update([batch if batch is not None else self.fetch_batch()], schedule=schedule)
        self.progress.debugged()
        self.updater.settle()
        return float(loss)

    def overfit_batch(self, steps: int = 100, batch=None) -> list[float]:
        """Train repeatedly on one batch at the current learning rate (the schedule is held): the loss should go
        towards zero, or the model/loss/data is broken."""
        batch = batch if batch is not None else self.fetch_batch()
        return [self.train_step(batch, schedule=False) for _ in range(steps)]
