"""The Trainer: one object over `accelerate.Accelerator` that owns the loop. Read it top to bottom:

    __init__   take the resolved arguments (resolve.py), configure the process and build the Accelerator
               (accel.configure_process), then the recipe's model, loaders (loaders.py), optimizer and scheduler
               (optim.py by default), prepare; resume (checkpointing/manager.py) when a checkpoint is named
    fit        for each accumulation window: update, then log / evaluate / checkpoint / preempt when due
    update     one optimizer update (update.py: item-weighted accumulation, clip, step, schedule, EMA); the step count
    evaluate   evaluation.py: every eval sample once on any world size, the metrics, the best model kept; the
               evaluate_end event

Sharded training (FSDP2, docs/sharding.md) is the same loop: accel.py makes Accelerate shard (on CPU too),
prepare goes through sharding.prepare_sharded, checkpoints are DCP shards and save_model gathers the full model.

Hooks are named events (events.py), never subclassing: a recipe's `on_<event>` functions, or `trainer.on(...)`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, is_dataclass

import torch
from accelerate.utils import DistributedType, set_seed
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import debugging, evaluation, faults, loaders, nan_batch, precision, preflight, sharding
from .accel import configure_process
from .args import TrainingArguments
from .checkpointing.manager import AFTER_TRAINING_TRACEBACK, CheckpointManager, prepare_output_dir
from .checkpointing.pretrained import push_to_hub
from .entry import python_api
from .errors import UserError
from .events import Events
from .optim import default_optimizer, default_scheduler
from .recipe import RecipeContext, load_recipe
from .resolve import (
    ResolvedArgs,
    output_dir_of,  # noqa: F401 - its old home: callers may still import it from here
    resolve_args,
    trainer_arguments,
)
from .runlog import Reporter, end_line, library_versions, start_line, topology
from .throughput import Meter, detected_peak_tflops, host_floats
from .update import Updater, registered_comm_hook


class NonFiniteLossError(UserError):
    pass


class AfterTrainingError(UserError):
    """Training finished and its weights are saved; what came after (the final evaluation, fit_end) failed."""


@dataclass
class Progress:
    """How far the run is; saved in every checkpoint (trainer_state.json). Where it is in the data (epoch, batch in
    the epoch) is the data position's (loaders.MapPosition, streaming.Stream). Written only by its methods below,
    which only the Trainer calls (an update, a new best evaluation, a resume)."""

    global_step: int = 0  # optimizer updates done (attempted, including fp16- and NaN-skipped ones)
    skipped_steps: int = 0  # fp16 overflow skips + non-finite skips
    best_metric: float | None = None  # --metric_for_best_model: the best evaluation so far
    best_step: int | None = None

    def updated(self, stepped: bool):
        self.global_step += 1
        self.skipped_steps += not stepped

    def new_best(self, value: float):
        self.best_metric, self.best_step = value, self.global_step

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict):
        """A checkpoint's values; a field it lacks (an older checkpoint) keeps its default."""
        for name, default in asdict(Progress()).items():
            setattr(self, name, state.get(name, default))


class Trainer:
    @python_api  # bad input from the Python API: one UserError naming keywords, not flags (entry.py)
    def __init__(
        self, recipe, args: ResolvedArgs | TrainingArguments | None = None, recipe_args=None, quiet: bool = False
    ):
        self.recipe, self.args, self.recipe_args, self.given = trainer_arguments(recipe, args, recipe_args)
        self.recipe = preflight.counting_items(self.recipe)  # a bare 0-d loss: weighed by the batch's samples
        args = self.args
        # Everything the run changes in the whole process happens in accel.configure_process, recorded in
        # run_config.json ("process"); the world is known from here on.
        self.accelerator, self.process = configure_process(args)
        acc = self.accelerator
        resume_path, kept_best = prepare_output_dir(acc, args)  # checked on every rank before any rank writes
        self.reporter = Reporter(acc, args.output_dir, quiet=quiet)
        self.events = Events()
        for event, handler in self.recipe.events.items():
            self.events.on(event, handler)
        self.ctx = self._context(resume_path)
        # --lr_scaling: the learning rate the optimizer is built with, scaled for this world's global batch; the
        # arguments keep the user's --learning_rate.
        self.learning_rate = self.ctx.learning_rate

        # Model and data: the recipe's. Loaders first: the number of batches per epoch on this rank (after
        # Accelerate shards them) sets the number of updates, which the scheduler needs before it is built.
        set_seed(args.seed)
        model = self._build_model()
        # self.data: where the run is in its data (loaders.MapPosition, or streaming.Stream for a stream)
        built = self.recipe.build_data(self.ctx)
        self.train_loader, self.eval_loader, self.data = loaders.build_loaders(built, args, acc, self.recipe.name)
        self.tokenizer = built.get("tokenizer")  # saved beside a transformers model (checkpointing/pretrained.py)
        if args.dataloader_num_workers and not isinstance(self.train_loader, DataLoader):  # a stream's is one
            self.reporter.print(
                f"note: --dataloader_num_workers {args.dataloader_num_workers} does nothing here: recipe "
                f"{self.recipe.name} batches its data itself (build_data's 'loader'), in the training process."
            )
        self.micro_batches_per_epoch, self.updates_per_epoch, self.total_steps = self._run_length()
        self.ctx = self.ctx.replace(num_training_steps=self.total_steps)

        # Optimisation: the recipe's optimizer and scheduler, or our defaults; prepared (under FSDP: sharded).
        (self.model, self.optimizer, self.scheduler), self.sharding_info = self._prepare(model)
        self.sharded = acc.distributed_type == DistributedType.FSDP
        self.fp8_layers = self._check_fp8()  # {"converted", "linear", "backend"} under fp8, else None
        self.ema = self._build_ema()  # None without --ema_decay

        # The run's state, and the components that own theirs.
        self.progress = Progress(**kept_best)
        self._log_window: list = []  # (loss tensor, grad norm, step, stepped) per update since the last log
        self._nan_batches = nan_batch.Tracker(keep_batches=self.data.per_rank)  # --nan_policy stop: which batch
        self._train_iter = None  # fetch_batch()'s position
        self._debug = debugging.DebugStart()  # undone by fit(): train_step/overfit_batch (debugging.py)
        # Faults (faults.py): preemption votes ride on the update's all-reduce; a side gloo group names a dead rank.
        self.preemption = faults.Preemption(acc.device, acc.num_processes)
        self._diag_group = faults.make_diagnostic_group(acc, args.ddp_timeout)
        self.meter = Meter(acc, args.peak_tflops or detected_peak_tflops(acc.mixed_precision))
        self.updater = Updater(
            acc, self.model, self.optimizer, self.scheduler, self.recipe.loss, args, ema=self.ema, meter=self.meter,
            preemption=self.preemption, say=self.reporter.print,
        )  # fmt: skip
        self.checkpoints = CheckpointManager(
            acc, args, state=[self.progress, self.data, self.updater], data=self.data, model=self.model,
            optimizer=self.optimizer, ema=self.ema, preemption=self.preemption, say=self.reporter.print,
            fire=lambda event, *a: self.events.fire(event, self, *a), before_save=self.log,
            save_full_model=functools.partial(sharding.save_full_model, acc, self.model, output_dir=args.output_dir)
            if self.sharded else None, tokenizer=self.tokenizer,
        )  # fmt: skip
        if args.profile_steps:
            self._attach_profiler()

        self._write_run_config()
        if args.trackers:
            acc.init_trackers(args.run_name or self.recipe.name, config=self._flat_config())
        if resume_path:
            self.checkpoints.resume(resume_path)
        self.reporter.print(start_line(self.reporter.run_config, args.output_dir, resume_path))

    @classmethod
    @python_api
    def from_recipe(cls, recipe, quiet: bool = False, **values) -> Trainer:
        """A Trainer from a recipe and the values you would give as flags: `Trainer.from_recipe(regression,
        output_dir="out", max_steps=200, hidden_size=64)` is `python recipes/regression.py --output_dir out
        --max_steps 200 --hidden_size 64`, the same resolved arguments (recipe defaults, presets, then yours)."""
        recipe = load_recipe(recipe)
        return cls(recipe, resolve_args(recipe, values=values), quiet=quiet)

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

    def _context(self, resume_from: str | None) -> RecipeContext:
        acc = self.accelerator
        return RecipeContext(
            args=self.recipe_args,
            targs=self.args,
            world_size=acc.num_processes,
            process_index=acc.process_index,
            accelerator=acc,
            given=self.given,
            resume_from=resume_from,
        )

    def _build_model(self) -> torch.nn.Module:
        model = self.recipe.build_model(self.ctx)
        if self.args.gradient_checkpointing:
            # transformers >= 5 names it activation_checkpointing_enable (the old name warns); 4.x has only the old.
            enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
                model, "gradient_checkpointing_enable", None
            )
            if enable is None:
                raise UserError(
                    "--gradient_checkpointing needs a transformers model (activation_checkpointing_enable)"
                    "; for another model, wrap its blocks in torch.utils.checkpoint in build_model."
                )
            enable()
        if self.args.sync_batchnorm and self.accelerator.num_processes > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return model

    def _run_length(self) -> tuple[int | None, int | None, int]:
        """(micro-batches per epoch on this rank, updates per epoch, total updates). A stream's length is unknown
        (None): the run length is --max_steps, an epoch ends when the stream does."""
        return self.data.run_length(self.args, self.eval_loader, self.recipe.name)

    def _prepare(self, model):
        """((model, optimizer, scheduler) prepared by Accelerate, what sharding learned). Under FSDP
        (sharding.py): the wrap policy for this model first, then the check that it really is sharded."""
        r, args = self.recipe, self.args
        optimizer = (
            r.build_optimizer(model, self.ctx)
            if r.build_optimizer
            else default_optimizer(model, args, self.accelerator.device, self.learning_rate)
        )
        scheduler = (
            r.build_scheduler(optimizer, self.ctx)
            if r.build_scheduler
            else default_scheduler(optimizer, self.total_steps, args)
        )
        return sharding.prepare_sharded(self.accelerator, model, optimizer, scheduler, wrap=r.fsdp_wrap)

    def _check_fp8(self) -> dict | None:
        # fp8 converts only some layers: counted, written to run_config.json, and refused when there are none.
        acc = self.accelerator
        if acc.mixed_precision != "fp8":
            return None
        c = precision.check_fp8_layers(self.model, str(acc.fp8_backend.value))
        self.reporter.print(f"fp8: {c['converted']} of {c['linear']} Linear layers converted ({c['backend']}).")
        return c

    def _build_ema(self) -> AveragedModel | None:
        # The EMA copy is of the plain module: of the compiled wrapper it would hold (and save) `_orig_mod.` names.
        if self.args.ema_decay <= 0:
            return None
        multi_avg_fn = get_ema_multi_avg_fn(self.args.ema_decay)
        return AveragedModel(self.unwrapped_model, multi_avg_fn=multi_avg_fn, use_buffers=True)

    def _attach_profiler(self):
        from .profiling import UpdateProfiler

        self.profiler = UpdateProfiler(self)
        self.profiler.attach(self.events)

    def _flat_config(self) -> dict:
        cfg = {k: v for k, v in self.args.to_dict().items() if isinstance(v, (int, float, str, bool))}
        if is_dataclass(self.recipe_args):
            cfg.update(
                {
                    f"recipe.{k}": v
                    for k, v in asdict(self.recipe_args).items()
                    if isinstance(v, (int, float, str, bool))
                }
            )
        return cfg

    def _write_run_config(self):
        self.reporter.write_run_config(
            os.path.join(self.args.output_dir, "run_config.json"),
            {
                "recipe": self.recipe.name,
                "num_processes": self.accelerator.num_processes,
                "global_train_batch_size": self.ctx.global_batch_size,
                "total_steps": self.total_steps,
                "updates_per_epoch": self.updates_per_epoch,
                "learning_rate": {
                    "used": self.learning_rate,
                    "base": self.args.learning_rate,
                    "scaling": self.args.lr_scaling,
                    "base_batch_size": self.args.lr_base_batch_size,
                },
                "args": self.args.to_dict(),
                "recipe_args": asdict(self.recipe_args) if is_dataclass(self.recipe_args) else None,
                "topology": topology(self.accelerator),
                # the DDP comm hook in place, as registered by Accelerate; None: no DDP model
                "ddp_comm_hook": registered_comm_hook(self.updater.ddp),
                "process": self.process,  # what the run changed in the whole process (accel.configure_process)
                "fp8_layers": self.fp8_layers,  # {"converted", "linear", "backend"} under fp8, else None
                # What each rank holds (parameters now; the local shards under FSDP), in rank order. Collective.
                "sharding": sharding.rank_holdings(self.accelerator, self.model, self.optimizer, self.sharding_info),
                "versions": library_versions(),
            },
        )

    # ------------------------------------------------------------------------------------------------- training
    @python_api
    def fit(self) -> dict:
        """Train to `total_steps` optimizer updates, evaluating, logging and checkpointing on the way; after
        train_step/overfit_batch, from the state the Trainer was built with (debugging.py)."""
        self._debug.rewind(self)
        args, p = self.args, self.progress
        bar = self._progress_bar()
        metrics: dict = {}
        self.model.train()
        self.meter.restart()
        self.events.fire("fit_start", self)
        peers = faults.peer_failures(
            self.accelerator, self._diag_group, args.ddp_timeout, lambda: self.global_step, args.output_dir
        )
        with self.checkpoints.guard(), self.preemption, peers:
            for window in preflight.checked(self, self.windows()):  # micro-batches of one update; the first checked
                self.update(window)
                self.events.fire("update_end", self)
                self.checkpoints.announce_written()
                bar.update(1)
                step, last = p.global_step, p.global_step >= self.total_steps
                if step % args.logging_steps == 0 or last:
                    self.log(bar)
                # at an epoch's end; not for a stream, whose epochs end at other updates on each rank
                eval_due = step % args.eval_steps == 0 if args.eval_steps else self.data.epoch_just_ended()
                if not last and self.eval_loader is not None and eval_due:
                    with self.meter.paused():  # not update time in the log rows
                        metrics = self.evaluate()
                if not last and args.save_steps and step % args.save_steps == 0:
                    with self.meter.paused():
                        self.save_checkpoint()
                if not last and self.preemption.agreed():  # a signal reached some rank by the previous update
                    self.checkpoints.preempt(bar)
                if last:
                    break
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
        if self.args.save_steps:
            saved.append(self.save_checkpoint())
            self.checkpoints.wait()  # committed before the model file is written
        saved.insert(0, self.save_model())
        failed = None
        try:
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
            if self.args.save_steps
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

    def windows(self):
        """Accumulation windows from the current position on; the position moves as each window is handed out,
        so a checkpoint written after the update of a window resumes right after it. The time spent here, between
        handing out two windows, is the time spent waiting for data."""
        if self.global_step >= self.total_steps:  # e.g. a notebook's train_step() calls went past the run length
            return
        asked = time.perf_counter()
        for window in self.data.windows(self.args.gradient_accumulation_steps):  # the data position moves
            self.meter.waited(time.perf_counter() - asked)
            yield window
            asked = time.perf_counter()

    def update(self, window: list, schedule: bool = True):
        """One optimizer update over a window of micro-batches (this rank's share of the global batch; update.py).
        Returns the mean loss over every item of the global batch (a tensor; no host sync)."""
        done = self.updater(window, schedule=schedule)
        self.progress.updated(done.stepped)
        self._log_window.append((done.loss, done.grad_norm, self.global_step, done.stepped))
        if self.args.nan_policy == "stop":  # which batch, should this window's row see a non-finite value
            self._nan_batches.record(self.updater.micro_losses, window, self.data, self.micro_batches_per_epoch)
        return done.loss

    def log(self, progress_bar=None) -> dict | None:
        """One metrics.jsonl row for the updates since the last log (the only host sync of the loop)."""
        if not self._log_window:
            return None
        window = self._log_window
        # --nan_policy stop checks the updates' gradient norms with their losses.
        stop = self.args.nan_policy == "stop"
        checked = [i for i, (_, g, _, stepped) in enumerate(window) if g is not None and stepped] if stop else []
        # The window's values as Python floats in one call (throughput.host_floats: no host sync per value on an
        # accelerator); the finiteness test and the mean are arithmetic on the list, not tensor ops.
        values = host_floats([v for v, *_ in window] + [window[i][1] for i in checked])
        losses = values[: len(window)]
        all_finite = all(map(math.isfinite, values))
        if not all_finite and self.args.nan_policy == "stop":
            self._stop_if_not_finite(losses, dict(zip(checked, values[len(window) :])))
        finite = losses if all_finite else [v for v in losses if math.isfinite(v)]  # --nan_policy skip: those
        loss = sum(finite) / len(finite) if finite else math.nan
        metrics = {
            "loss": loss,
            "learning_rate": self.scheduler.get_last_lr()[0],
        }
        if self.args.max_grad_norm > 0 and window[-1][1] is not None:  # the last update's norm, when clipping
            metrics["grad_norm"] = float(window[-1][1])
        if self.accelerator.scaler is not None:
            metrics["loss_scale"] = self.accelerator.scaler.get_scale()
        if self.progress.skipped_steps or self.accelerator.scaler is not None or self.args.nan_policy == "skip":
            metrics["skipped_steps"] = self.progress.skipped_steps
        metrics.update(self.meter.row())  # throughput, step time, data wait, memory (mfu): a gather on N ranks
        self._log_window = []
        self._nan_batches.clear()
        if progress_bar is not None and not progress_bar.disable:
            # What set_postfix(loss=..., samples_s=...) shows, without its OrderedDict and number checks (~20K CPU
            # instructions a row, callgrind); no refresh of its own: the row's progress_bar.write redraws the bar.
            progress_bar.set_postfix_str(
                f"loss={metrics['loss']:.4g}, samples_s={metrics['samples_per_second']:.4g}", refresh=False
            )
        return self.reporter.log(metrics, self.global_step, self._epoch_float(), progress_bar)

    def _stop_if_not_finite(self, losses, norms: dict):
        """--nan_policy stop: the first update of the log window whose loss, or whose gradient norm (`norms`: index in
        the window -> norm; a finite loss can have NaN/inf gradients, which the step turns into NaN weights), is not
        finite stops the run."""
        for first, loss in enumerate(losses):
            norm = norms.get(first, 0.0)
            if math.isfinite(loss) and math.isfinite(norm):
                continue
            what = f"Loss is {loss}" if not math.isfinite(loss) else f"The gradient norm is {norm} (loss {loss:.4g})"
            step = self._log_window[first][2]
            where = nan_batch.describe(
                self._nan_batches, first, step, loader=self.train_loader, stream=self.data.per_rank,
                accelerator=self.accelerator, output_dir=self.args.output_dir,
            )  # fmt: skip
            raise NonFiniteLossError(
                f"{what} at step {step}; the run stops (no checkpoint is written over the last good one). The batch: "
                f"{where}. Replay it with the recipe's loss (docs/fault-tolerance.md, When it fails), lower the "
                "learning rate, check the data, or pass --nan_policy skip."
            )

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
                if best is not None:
                    p.new_best(best)
        return results

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
        return float(self.update([batch if batch is not None else self.fetch_batch()], schedule=schedule))

    def overfit_batch(self, steps: int = 100, batch=None) -> list[float]:
        """Train repeatedly on one batch at the current learning rate (the schedule is held): the loss should go
        towards zero, or the model/loss/data is broken."""
        batch = batch if batch is not None else self.fetch_batch()
        return [self.train_step(batch, schedule=False) for _ in range(steps)]
