"""The Trainer: one object over `accelerate.Accelerator` that owns the loop. Read it top to bottom:

    __init__   build the Accelerator, check the output folder, build model/data/optimizer/scheduler, prepare
    fit        epochs -> windows of `gradient_accumulation_steps` micro-batches -> one optimizer update each
    _update    forward/backward each micro-batch, normalise by items, clip, step, schedule, EMA
    evaluate   gather_for_metrics over the eval split, `evaluate` metrics, the recipe's eval hook

Gradient accumulation is ours, not `accelerator.accumulate`: one update's gradient must be the mean over every
item (sample or token) of the global batch, weighted by item count, on any world size. Each micro-batch's
backward uses its summed loss (mean x n_items); at the window's end the item count of the whole global batch is
all-reduced once and the gradients are scaled by world_size / N (DDP has averaged over ranks). With one process
and no accumulation the mean loss is already that, and we skip the bookkeeping (no cost over a plain loop).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from contextlib import nullcontext
from dataclasses import asdict, is_dataclass

import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import DistributedType, find_batch_size, set_seed
from safetensors.torch import save_model
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import faults
from .accel import build_accelerator
from .args import TrainingArguments
from .errors import UserError
from .recipe import Recipe, load_recipe
from .reporting import Reporter, library_versions, topology

# Distributed types where the optimizer/backward are plain torch objects, so we may call them directly and skip
# Accelerate's per-step wrappers (which cost ~0.6 ms/step on a small model, mostly a package lookup).
_PLAIN = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
PREVIOUS_RUN_FILES = ("metrics.jsonl", "run_config.json", "checkpoints", "model.safetensors", "best")


class NonFiniteLossError(UserError):
    pass


def _is_dataset(obj) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not hasattr(obj, "set_epoch")


def _take(ds, n: int | None):
    if n is None or n >= len(ds):
        return ds
    return ds.select(range(n)) if hasattr(ds, "select") else Subset(ds, range(n))


def default_optimizer(model, args: TrainingArguments):
    # No weight decay on biases and normalisation weights (1-d tensors), as transformers does.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )


def default_scheduler(optimizer, num_training_steps: int, args: TrainingArguments):
    from transformers import get_scheduler

    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * num_training_steps)
    return get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=num_training_steps
    )


class Trainer:
    def __init__(self, recipe, args: TrainingArguments | None = None, recipe_args=None, quiet: bool = False):
        self.recipe: Recipe = load_recipe(recipe)
        self.args = args = args if args is not None else TrainingArguments()
        if recipe_args is None and self.recipe.Args is not None:
            recipe_args = self.recipe.Args()
        self.recipe_args = recipe_args
        if args.output_dir is None:
            args.output_dir = os.path.join("output", self.recipe.name)

        self.accelerator = acc = build_accelerator(args)
        self._check_world()
        resume_path = self._check_output_dir()  # on every rank, before any rank writes
        acc.wait_for_everyone()
        if acc.is_main_process:
            os.makedirs(args.output_dir, exist_ok=True)
        self.reporter = Reporter(acc, args.output_dir, quiet=quiet)

        # Model, data, optimisation: the recipe's, or our defaults.
        set_seed(args.seed)
        model = self.recipe.build_model(recipe_args, args)
        if args.gradient_checkpointing:
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
        if args.sync_batchnorm and acc.num_processes > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        data = self.recipe.build_data(recipe_args, args, acc)
        if "train" not in data:
            raise ValueError(f"Recipe {self.recipe.name}: build_data must return a dict with a 'train' entry.")
        # Data loaders first: the number of batches per epoch on this rank (after Accelerate shards them) sets the
        # number of updates, which the scheduler needs before it is built.
        train = self._loader(data["train"], train=True)
        evald = self._loader(data["eval"], train=False) if data.get("eval") is not None else None
        self.train_loader = acc.prepare(train) if isinstance(train, DataLoader) else train
        self.eval_loader = acc.prepare(evald) if isinstance(evald, DataLoader) else evald
        self.micro_batches_per_epoch = len(self.train_loader)
        if self.micro_batches_per_epoch == 0:
            raise UserError(
                "The training data gives no batch on this process: fewer samples than "
                "per_device_train_batch_size x processes? Lower the batch size or add data."
            )
        self.updates_per_epoch = math.ceil(self.micro_batches_per_epoch / args.gradient_accumulation_steps)
        self.total_steps = (
            args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * self.updates_per_epoch)
        )

        optimizer = (
            self.recipe.build_optimizer(model, recipe_args, args)
            if self.recipe.build_optimizer
            else default_optimizer(model, args)
        )
        scheduler = (
            self.recipe.build_scheduler(optimizer, self.total_steps, recipe_args, args)
            if self.recipe.build_scheduler
            else default_scheduler(optimizer, self.total_steps, args)
        )
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        self.ema = (
            AveragedModel(
                acc.unwrap_model(self.model), multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay), use_buffers=True
            )
            if args.ema_decay > 0
            else None
        )

        # The fast path: call torch's optimizer, scaler and backward directly where Accelerate adds nothing.
        self._plain = acc.distributed_type in _PLAIN
        self._inner_opt = self.optimizer.optimizer
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._weighted = acc.num_processes > 1 or args.gradient_accumulation_steps > 1

        self.global_step = 0  # optimizer updates done (attempted, including fp16-skipped ones)
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of the current epoch already consumed
        self.skipped_steps = 0  # fp16 overflow skips + non-finite skips
        self.best_metric = self.best_step = None  # --metric_for_best_model: the best evaluation so far
        self._log_window: list = []  # (loss tensor, n_items) per update since the last log
        self._train_iter = None
        # Faults (faults.py): preemption signals set a flag that fit() checks at update boundaries; with several
        # processes the ranks agree through the update's all-reduce. A side gloo group names a dead/hung rank.
        self._preemption = faults.PreemptionHandler()
        self._vote_values = (torch.zeros((), device=acc.device), torch.ones((), device=acc.device))
        self._stop_vote = self._prev_vote = None
        self._saved_step = None
        self._diag_group = faults.make_diagnostic_group(acc)
        self._test_faults = faults.TestFaults.from_env()  # None unless a test injects faults

        self._write_run_config()
        if args.trackers:
            acc.init_trackers(args.run_name or self.recipe.name, config=self._flat_config())
        if resume_path:
            self._resume(resume_path)

    # ---------------------------------------------------------------------------------------------------- set-up
    def _check_world(self):
        # The world this process joined must be the one the launcher/config describe (topology.py): it catches
        # every process training alone in a world of 1, per-machine/total mix-ups and bad machine ranks.
        from .topology import check_world

        check_world(self.accelerator)

    def _check_output_dir(self) -> str | None:
        """The verified checkpoint to resume from (None: a new run), and a clean output_dir for a new run.
        'auto' (and any elastic restart, see faults.py) resumes when there is a checkpoint and starts anew when
        there is none, replacing the logs of an attempt that died before its first checkpoint."""
        args, out = self.args, self.args.output_dir
        spec = faults.effective_resume_spec(args.resume_from_checkpoint)
        if spec:
            path = ckpt.resolve_on_main(self.accelerator, spec, out)
            if path is not None:
                return path
        previous = [f for f in PREVIOUS_RUN_FILES if os.path.exists(os.path.join(out, f))]
        leftovers = spec is not None and spec.startswith("auto") and "model.safetensors" not in previous
        if previous and not (args.overwrite_output_dir or leftovers):
            raise FileExistsError(
                f"output_dir {out} holds a previous run ({', '.join(previous)}). Pass --resume_from_checkpoint latest"
                " to continue it, --overwrite_output_dir to delete it and start over, or another --output_dir."
            )
        if previous:
            self.accelerator.wait_for_everyone()  # every rank has checked before the main one deletes
            if self.accelerator.is_main_process:
                for f in previous:
                    path = os.path.join(out, f)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return None

    def _loader(self, data, train: bool):
        """A DataLoader for a map-style dataset; a recipe's own batch loader is used as it is."""
        args = self.args
        if not _is_dataset(data):
            for attr in ("__iter__", "__len__", "set_epoch"):
                if not hasattr(data, attr):
                    raise TypeError(
                        f"Recipe data {type(data).__name__} is neither a map-style Dataset nor a batch "
                        f"loader (lacks {attr}); see docs/architecture.md."
                    )
            return data
        data = _take(data, args.max_train_samples if train else args.max_eval_samples)
        return DataLoader(
            data,
            shuffle=train,
            collate_fn=self.recipe.collate,
            num_workers=args.dataloader_num_workers,
            batch_size=args.per_device_train_batch_size if train else args.per_device_eval_batch_size,
            drop_last=args.dataloader_drop_last if train else False,
            pin_memory=torch.cuda.is_available(),
            # Own generator: creating an iterator must not draw from the global RNG (dropout's), or a resumed
            # run would see other random numbers than the uninterrupted one.
            generator=torch.Generator().manual_seed(args.seed),
        )

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
        world = topology(self.accelerator)
        self.reporter.write_run_config(
            os.path.join(self.args.output_dir, "run_config.json"),
            {
                "recipe": self.recipe.name,
                "num_processes": self.accelerator.num_processes,
                "global_train_batch_size": (
                    self.args.per_device_train_batch_size
                    * self.args.gradient_accumulation_steps
                    * self.accelerator.num_processes
                ),
                "total_steps": self.total_steps,
                "updates_per_epoch": self.updates_per_epoch,
                "args": self.args.to_dict(),
                "recipe_args": asdict(self.recipe_args) if is_dataclass(self.recipe_args) else None,
                "topology": world,
                "versions": library_versions(),
            },
        )

    # ------------------------------------------------------------------------------------------------- training
    def fit(self) -> dict:
        """Train to `total_steps` optimizer updates, evaluating, logging and checkpointing on the way."""
        args, acc = self.args, self.accelerator
        G, L = args.gradient_accumulation_steps, self.micro_batches_per_epoch
        progress = tqdm(
            total=self.total_steps,
            initial=self.global_step,
            dynamic_ncols=True,
            desc="train",
            disable=args.disable_tqdm or not acc.is_main_process,
        )
        self.model.train()
        last_eval: dict = {}
        with self._preemption, faults.peer_failures(self):
            while self.global_step < self.total_steps:
                batches = self._epoch_batches(self.epoch, self.batch_in_epoch)
                window = []
                for batch in batches:
                    window.append(batch)
                    # Windows are aligned to the epoch start; the last one of an epoch may be shorter.
                    if len(window) < G and self.batch_in_epoch + len(window) < L:
                        continue
                    self.batch_in_epoch += len(window)
                    self._update(window)
                    if self._test_faults is not None:
                        self._test_faults.after_update(acc.process_index, self.global_step)
                    window = []
                    progress.update(1)
                    epoch_done = self.batch_in_epoch >= L
                    if epoch_done:
                        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                    step, last = self.global_step, self.global_step >= self.total_steps
                    if step % args.logging_steps == 0 or last:
                        self._log(progress)
                    if (
                        self.eval_loader is not None
                        and not last
                        and ((args.eval_steps and step % args.eval_steps == 0) or (not args.eval_steps and epoch_done))
                    ):
                        last_eval = self.evaluate()
                    if args.save_steps and step % args.save_steps == 0 and not last:
                        self.save_checkpoint()
                    if not last and self._preemption_agreed():
                        self._preempt(progress)
                    if last or epoch_done:
                        break
        progress.close()
        if self.eval_loader is not None or self.recipe.on_evaluate:
            last_eval = self.evaluate(final=True)
        if args.save_steps:
            self.save_checkpoint()
        self.save_model()
        acc.end_training()
        return last_eval

    def _epoch_batches(self, epoch: int, skip: int):
        loader = self.train_loader
        loader.set_epoch(epoch)  # the order is a function of (seed, epoch) only
        if skip == 0:
            return iter(loader)
        if isinstance(loader, DataLoaderShard) or isinstance(loader, DataLoader):
            return iter(self.accelerator.skip_first_batches(loader, skip))
        if hasattr(loader, "skip_first_batches"):
            return iter(loader.skip_first_batches(skip))
        it = iter(loader)
        for _ in range(skip):
            next(it)
        return it

    def _backward(self, loss):
        if not self._plain:
            self.accelerator.backward(loss)
        elif self.accelerator.scaler is not None:
            self.accelerator.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _update(self, window: list, schedule: bool = True):
        """One optimizer update over a window of micro-batches (this rank's share of the global batch)."""
        acc, args = self.accelerator, self.args
        loss_sum, n_sum = 0.0, 0
        for i, batch in enumerate(window):
            sync = i == len(window) - 1
            with nullcontext() if sync or acc.num_processes == 1 else acc.no_sync(self.model):
                loss, n = self.recipe.loss(self.model, batch)
                self._backward(loss * n if self._weighted else loss)
            loss_sum = loss_sum + loss.detach() * n
            n_sum = n_sum + n

        if self._weighted:
            totals = torch.stack(
                [
                    torch.as_tensor(loss_sum, dtype=torch.float32, device=acc.device).reshape(()),
                    torch.as_tensor(n_sum, dtype=torch.float32, device=acc.device).reshape(()),
                    self._vote_values[self._preemption.requested],
                ]
            )  # 1 on a rank that got SIGTERM
            if acc.num_processes > 1:
                totals = acc.reduce(totals, reduction="sum")
                self._stop_vote = faults.Vote(totals[2])  # the preemption vote rides on this all-reduce
            loss_sum, n_sum = totals[0], totals[1]
            grads = [p.grad for p in self._params if p.grad is not None]
            # DDP averaged the per-rank sums over ranks; the mean over all N items of the global batch is that
            # times world_size / N. clamp: a window with no items (all masked) leaves the gradients at zero.
            torch._foreach_mul_(grads, acc.num_processes / n_sum.clamp(min=1))
        loss_mean = loss_sum / n_sum

        if args.nan_policy == "skip" and not torch.isfinite(loss_mean):
            self._inner_opt.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.global_step += 1
            return

        if args.max_grad_norm > 0:
            self._grad_norm = acc.clip_grad_norm_(self._params, args.max_grad_norm)
        stepped = self._optimizer_step()
        if stepped:
            if schedule:
                self.scheduler.step()
            if self.ema is not None:
                self.ema.update_parameters(acc.unwrap_model(self.model))
        else:
            self.skipped_steps += 1
        self._inner_opt.zero_grad(set_to_none=True)
        self.global_step += 1
        self._log_window.append((loss_mean.detach() if torch.is_tensor(loss_mean) else loss_mean, self.global_step))

    def _optimizer_step(self) -> bool:
        """Step the optimizer; False when fp16 loss scaling skipped the step (an overflow)."""
        scaler = self.accelerator.scaler
        if not self._plain:
            self.optimizer.step()
            return not self.optimizer.step_was_skipped
        if scaler is None:
            self._inner_opt.step()
            return True
        scale = scaler.get_scale()
        scaler.step(self._inner_opt)
        scaler.update()
        return scaler.get_scale() >= scale  # the scale only drops when an inf/nan gradient skipped the step

    def _log(self, progress=None):
        if not self._log_window:
            return
        losses = torch.stack([torch.as_tensor(loss, dtype=torch.float32) for loss, _ in self._log_window]).float().cpu()
        finite = torch.isfinite(losses)
        if not finite.all() and self.args.nan_policy == "stop":
            bad_step = self._log_window[int((~finite).nonzero()[0])][1]
            raise NonFiniteLossError(
                f"Loss is {losses[~finite][0].item()} at step {bad_step}; the run stops (no checkpoint is written "
                "over the last good one). Lower the learning rate, check the data, or pass --nan_policy skip."
            )
        metrics = {
            "loss": losses[finite].mean().item() if finite.any() else float("nan"),
            "learning_rate": self.scheduler.get_last_lr()[0],
        }
        if getattr(self, "_grad_norm", None) is not None:
            metrics["grad_norm"] = float(self._grad_norm)
        if self.accelerator.scaler is not None:
            metrics["loss_scale"] = self.accelerator.scaler.get_scale()
        if self.skipped_steps or self.accelerator.scaler is not None or self.args.nan_policy == "skip":
            metrics["skipped_steps"] = self.skipped_steps
        self._log_window = []
        return self.reporter.log(metrics, self.global_step, self._epoch_float(), progress)

    def _epoch_float(self) -> float:
        return self.epoch + self.batch_in_epoch / self.micro_batches_per_epoch

    # ------------------------------------------------------------------------------------------------ evaluation
    def _eval_outputs(self, model, batch) -> dict:
        """Per-sample tensors for gather_for_metrics: `loss` (summed over the sample's items), `n_items`, and
        `predictions`/`references` when the recipe gives them. A per-batch mean loss is spread evenly over the
        batch's samples, which is exact when every sample has the same number of items."""
        out = dict(self.recipe.eval_step(model, batch)) if self.recipe.eval_step else {}
        if "loss" not in out:
            out["loss"], out["n_items"] = self.recipe.loss(model, batch)
        loss, n = out["loss"], torch.as_tensor(out["n_items"], device=self.accelerator.device)
        if loss.ndim == 0:
            B = len(out["references"]) if "references" in out else find_batch_size(batch)
            out["loss"] = (loss.float() * n / B).expand(B)
            out["n_items"] = (n.float() / B).expand(B)
        return out

    def gather_eval(self, out: dict) -> dict:
        """Per-sample eval tensors of this rank's batch -> those of every rank, each sample of the split once.
        Also for recipes' eval hooks (e.g. test-time augmentation) that loop over `trainer.eval_loader`."""
        acc = self.accelerator
        if isinstance(self.eval_loader, DataLoaderShard):
            return acc.gather_for_metrics(out)  # drops the samples Accelerate repeated to even out the ranks
        if acc.num_processes == 1:
            return out
        # A recipe's batch loader gives disjoint shards whose batch sizes may differ by rank: pad to a common
        # size, gather, and keep the real rows (all ranks must yield the same number of batches).
        # (int64, not bool: gloo cannot gather bool tensors.)
        out = dict(out, _valid=torch.ones(len(next(iter(out.values()))), dtype=torch.int64, device=acc.device))
        gathered = acc.gather(acc.pad_across_processes(out, dim=0))
        valid = gathered.pop("_valid").bool()
        return {k: v[valid] for k, v in gathered.items()}

    @torch.no_grad()
    def evaluate(self, final: bool = False) -> dict:
        """Loss and metrics over the whole eval split; every sample counted once on any world size."""
        acc = self.accelerator
        model = self.ema.module if self.ema is not None else self.model
        metrics = self.recipe.build_metrics(self.recipe_args) if self.recipe.build_metrics else {}
        results: dict = {}
        if self.eval_loader is not None:
            was_training = model.training
            model.eval()
            loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
            n_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
            n_samples = 0
            self.eval_loader.set_epoch(0) if hasattr(self.eval_loader, "set_epoch") else None
            for batch in self.eval_loader:
                out = self.gather_eval(self._eval_outputs(model, batch))
                loss_sum += out["loss"].double().sum()
                n_sum += out["n_items"].double().sum()
                n_samples += len(out["loss"])
                if "predictions" in out:
                    for m in metrics.values():
                        m.add_batch(predictions=out["predictions"].cpu(), references=out["references"].cpu())
            results["eval_loss"] = (loss_sum / n_sum.clamp(min=1)).item()
            results["eval_samples"] = n_samples  # every sample of the split exactly once, on any world size
            for m in metrics.values():
                results.update({f"eval_{k}": v for k, v in (m.compute() or {}).items()})
            model.train(was_training)
        if self.recipe.on_evaluate:
            results.update(self.recipe.on_evaluate(self, results, final) or {})
        if results:
            self.reporter.log(results, self.global_step, self._epoch_float())
            if self.args.metric_for_best_model:
                self._keep_if_best(results)
        return results

    def _keep_if_best(self, results: dict):
        """output_dir/best/: model.safetensors (the evaluated weights) and best.json of the best evaluation so far,
        kept apart from checkpoints (save_total_limit never deletes it). The best value is part of the checkpoint
        state, so a resumed run keeps comparing against it."""
        name = self.args.metric_for_best_model
        key = name if name in results else f"eval_{name}"
        if key not in results:
            raise UserError(
                f"--metric_for_best_model {name}: the evaluation gives no such metric; it gives "
                f"{', '.join(sorted(results))}."
            )
        value = float(results[key])
        greater = self.args.greater_is_better if self.args.greater_is_better is not None else not key.endswith("loss")
        if not math.isfinite(value) or (
            self.best_metric is not None and not (value > self.best_metric if greater else value < self.best_metric)
        ):
            return
        self.best_metric, self.best_step = value, self.global_step
        best = os.path.join(self.args.output_dir, "best")
        if self.accelerator.is_main_process:
            os.makedirs(best, exist_ok=True)
        self.save_model(os.path.join(best, "model.safetensors"))
        if self.accelerator.is_main_process:
            with open(os.path.join(best, "best.json.tmp"), "w") as f:
                json.dump({"step": self.global_step, "metric": key, "value": value}, f)
            os.replace(os.path.join(best, "best.json.tmp"), os.path.join(best, "best.json"))

    # ---------------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "skipped_steps": self.skipped_steps,
            "num_processes": self.accelerator.num_processes,
            "best_metric": self.best_metric,
            "best_step": self.best_step,
            "per_device_train_batch_size": self.args.per_device_train_batch_size,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "seed": self.args.seed,
        }

    def save_checkpoint(self) -> str:
        if self._log_window:
            self._log()  # also stops on a non-finite loss before anything is written over a good checkpoint
        path = ckpt.save_checkpoint(
            self.accelerator,
            self.args.output_dir,
            self.global_step,
            self.state(),
            ema=self.ema,
            save_total_limit=self.args.save_total_limit,
            hooks=self._test_faults,
        )
        self._saved_step = self.global_step
        return path

    def _preemption_agreed(self) -> bool:
        """True once a preemption signal reached this process (1 process: a flag, no cost) or, with several
        processes, any rank: every rank reads the same all-reduced vote at the same update. The vote read is the
        previous update's, whose all-reduce has finished by now: no wait on the current update's GPU work."""
        if self.accelerator.num_processes == 1:
            return self._preemption.requested
        vote, self._prev_vote = self._prev_vote, self._stop_vote
        return vote is not None and vote.agreed()

    def _preempt(self, progress=None):
        """Checkpoint at this update boundary (unless one was just written), then exit with EXIT_PREEMPTED."""
        path = (
            os.path.join(ckpt.checkpoints_root(self.args.output_dir), f"step_{self.global_step}")
            if self._saved_step == self.global_step
            else self.save_checkpoint()
        )
        if progress is not None:
            progress.close()
        self.accelerator.end_training()
        self.reporter.print(
            f"Preempted ({self._preemption.signal_name or 'signal on another rank'}): checkpoint "
            f"{path} at step {self.global_step}; exiting with code {faults.EXIT_PREEMPTED}. Resume "
            "with --resume_from_checkpoint latest."
        )
        raise faults.Preempted(path, self.global_step)

    def _resume(self, path: str):
        mine = self.state()
        changed = [
            k
            for k in ("num_processes", "per_device_train_batch_size", "gradient_accumulation_steps")
            if path and ckpt.read_state(path).get(k) != mine[k]
        ]
        if changed:
            raise ckpt.CheckpointError(
                f"Checkpoint {path} was written with "
                + ", ".join(f"{k}={ckpt.read_state(path)[k]}" for k in changed)
                + " but this run has "
                + ", ".join(f"{k}={mine[k]}" for k in changed)
                + ". The position in the data "
                "and the per-process random states are tied to them: resume with the same values."
            )
        state = ckpt.load_checkpoint(self.accelerator, path, self.model, ema=self.ema)
        if self.accelerator.is_main_process:
            for stale in ckpt.remove_stale_tmp(self.args.output_dir):
                self.reporter.print(f"Removed {stale}: a checkpoint whose writing was interrupted.")
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.batch_in_epoch, self.skipped_steps = state["batch_in_epoch"], state["skipped_steps"]
        self.best_metric, self.best_step = state.get("best_metric"), state.get("best_step")
        self.reporter.print(
            f"Resumed from {path} at step {self.global_step} (epoch {self.epoch}, batch {self.batch_in_epoch})."
        )

    def save_model(self, path: str | None = None) -> str:
        """The evaluated weights (EMA when on) as safetensors of the plain model: no `module.`/`_orig_mod.`."""
        path = path or os.path.join(self.args.output_dir, "model.safetensors")
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            tmp = path + ".tmp"
            save_model(self.ema.module if self.ema is not None else self.unwrapped_model, tmp)
            os.replace(tmp, path)
        self.accelerator.wait_for_everyone()
        return path

    # ----------------------------------------------------------------------------------- notebook / debugging
    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def fetch_batch(self):
        """The next training batch (on the device), continuing across epochs."""
        if self._train_iter is None:
            self._train_iter = self._epoch_batches(self.epoch, 0)
        try:
            return next(self._train_iter)
        except StopIteration:
            self._train_iter = self._epoch_batches(self.epoch + 1, 0)
            return next(self._train_iter)

    def train_step(self, batch=None, schedule: bool = True) -> float:
        """One optimizer update on one batch (fetched if not given). Returns its loss."""
        self.model.train()
        self._update([batch if batch is not None else self.fetch_batch()], schedule=schedule)
        loss = self._log_window[-1][0]
        return float(loss)

    def overfit_batch(self, steps: int = 100, batch=None) -> list[float]:
        """Train repeatedly on one batch at the current learning rate (the schedule is held): the loss should go
        towards zero, or the model/loss/data is broken."""
        batch = batch if batch is not None else self.fetch_batch()
        return [self.train_step(batch, schedule=False) for _ in range(steps)]
