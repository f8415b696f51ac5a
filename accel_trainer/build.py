"""The run's parts built from the recipe, in the order the Trainer's set-up builds them: the model (build_model),
then, once the data has sized the run, the model made ready to train (prepare: the optimizer and scheduler prepared
by Accelerate, under FSDP sharded; the fp8 check; the EMA copy); then what run_config.json records of them.
Each takes what it needs; none keeps state (the Trainer holds what they return).
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any, NamedTuple

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from . import precision, privates, sharding, shards
from .errors import UserError
from .optim import default_optimizer, default_scheduler
from .runlog import library_versions, topology
from .update import registered_comm_hook


def build_model(recipe, ctx) -> torch.nn.Module:
    """The recipe's model, with --gradient_checkpointing and --sync_batchnorm applied."""
    model = recipe.build_model(ctx)
    if ctx.targs.gradient_checkpointing:
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
    if ctx.targs.sync_batchnorm and ctx.world_size > 1:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


class Prepared(NamedTuple):
    """The model made ready to train: what Accelerate prepared (under FSDP: sharded), what sharding learned, the
    fp8 count and the EMA copy."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    sharding_info: Any
    fp8_layers: dict | None  # {"converted", "linear", "backend"} under fp8, else None
    ema: AveragedModel | None  # None without --ema_decay


def prepare(recipe, ctx, model) -> Prepared:
    """The recipe's optimizer and scheduler, or our defaults (optim.py, at ctx.learning_rate; ctx.num_training_steps
    is set), prepared by Accelerate. Under FSDP (sharding.py): the wrap policy for this model first, then the check
    that it really is sharded. Then the fp8 check and the EMA copy of the prepared model."""
    args, acc = ctx.targs, ctx.accelerator
    optimizer = (
        recipe.build_optimizer(model, ctx)
        if recipe.build_optimizer
        else default_optimizer(model, args, acc.device, ctx.learning_rate)
    )
    scheduler = (
        recipe.build_scheduler(optimizer, ctx)
        if recipe.build_scheduler
        else default_scheduler(optimizer, ctx.num_training_steps, args)
    )
    (model, optimizer, scheduler), info = sharding.prepare_sharded(
        acc, model, optimizer, scheduler, wrap=recipe.fsdp_wrap
    )
    # No prepared object may refer to itself: a dropped Trainer's model and optimizer must go at once (their memory,
    # on a GPU), not at Python's next full collection. Before the EMA's copy: a forward that does not hold the model.
    precision.own_autocast_forward(acc, model)
    privates.step_patch_without_cycle(optimizer)  # fp16's optimizer wrapper
    ema = None
    if args.ema_decay > 0:  # of the plain module: of the compiled wrapper it would hold (and save) `_orig_mod.` names
        plain = acc.unwrap_model(model, keep_torch_compile=False)
        ema = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay), use_buffers=True)
    return Prepared(model, optimizer, scheduler, info, _check_fp8(acc, model), ema)


def _check_fp8(accelerator, model) -> dict | None:
    # fp8 converts only some layers: counted (for run_config.json and the console), refused when there are none.
    if accelerator.mixed_precision != "fp8":
        return None
    return precision.check_fp8_layers(model, str(accelerator.fp8_backend.value))


def parameter_counts(model) -> dict:
    """{"trainable", "frozen"}: the model's parameters (each shared one once; under FSDP the whole model's, a
    DTensor counting its global size) that train and that do not (a LoRA adapter's base model)."""
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    return counts


def run_config(trainer) -> dict:
    """What run_config.json records of a built Trainer. Collective (the sharding holdings): every rank calls it."""
    t, args = trainer, trainer.args
    return {
        "recipe": t.recipe.name,
        "num_processes": t.accelerator.num_processes,
        "global_train_batch_size": t.ctx.global_batch_size,
        "total_steps": t.total_steps,
        "updates_per_epoch": t.updates_per_epoch,
        "learning_rate": {
            "used": t.learning_rate,
            "base": args.learning_rate,
            "scaling": args.lr_scaling,
            "base_batch_size": args.lr_base_batch_size,
        },
        "args": args.to_dict(),
        "recipe_args": asdict(t.recipe_args) if is_dataclass(t.recipe_args) else None,
        "topology": topology(t.accelerator),
        # the DDP comm hook in place, as registered by Accelerate; None: no DDP model
        "ddp_comm_hook": registered_comm_hook(t.updater.ddp),
        "process": t.process,  # what the run changed in the whole process (accel.configure_process)
        "fp8_layers": t.fp8_layers,  # {"converted", "linear", "backend"} under fp8, else None
        "parameters": parameter_counts(t.accelerator.unwrap_model(t.model, keep_torch_compile=False)),
        # What each rank holds (parameters now; the local shards under FSDP), in rank order. Collective.
        "sharding": shards.rank_holdings(t.accelerator, t.model, t.optimizer, t.sharding_info),
        "versions": library_versions(),
    }
