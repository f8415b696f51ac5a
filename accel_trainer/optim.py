"""The default optimizer and scheduler: what a recipe without build_optimizer / build_scheduler trains with.

A recipe's own builders may call them too (recipes/regression.py's build_scheduler does).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from . import privates
from .args import TrainingArguments
from .recipe import RecipeError

# The optimizers and schedulers built here hold the run's arguments for the whole run (the default schedules change
# only each group's 'lr'). torch's load_state_dict takes the checkpoint's settings over them: a crafted
# optimizer.json trained on at another weight decay, and --allow_args_change --learning_rate at the old rate. A
# checkpoint's must equal them (checkpointing/load.py), or with --allow_args_change they are put back
# (keep_run_settings). A recipe's own optimizer or schedule may change any of them: left as torch loads them.
BUILT_HERE: weakref.WeakSet = weakref.WeakSet()


def run_settings(opt, scheduler) -> dict:
    """{"groups": the settings each param group holds from the run's arguments, "base_lrs": the schedule's or None}
    of what was built here."""
    keys = (("weight_decay", "eps", "betas") if opt in BUILT_HERE else ()) + (
        ("initial_lr",) if scheduler in BUILT_HERE else ()
    )
    return {
        "groups": [{k: g[k] for k in keys if k in g} for g in opt.param_groups],
        "base_lrs": list(scheduler.base_lrs) if scheduler in BUILT_HERE else None,
    }


def keep_run_settings(opt, scheduler, settings: dict) -> None:
    """Put `settings` (run_settings before the load) back after a checkpoint's were loaded."""
    for group, mine in zip(opt.param_groups, settings["groups"]):
        group.update(mine)
    if settings["base_lrs"] is not None:
        scheduler.base_lrs = list(settings["base_lrs"])


def set_scheduled_lrs(opt, scheduler) -> None:
    """Each group's current learning rate as the schedule built here gives it at its step (LambdaLR: base rate x
    the schedule's factor, what its step() sets), never the checkpoint's 'lr': a crafted one (5.0, -3.0) trained
    the first resumed update at that rate while metrics.jsonl logged the schedule's."""
    if scheduler not in BUILT_HERE or not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (torch's field)


def default_optimizer(
    model, args: TrainingArguments, device: torch.device | None = None, learning_rate: float | None = None
):
    """AdamW at `learning_rate` (the Trainer passes ctx.learning_rate, after --lr_scaling), else --learning_rate."""
    # No weight decay on biases and normalisation weights (1-d tensors), as transformers does.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    if not decay + no_decay:  # torch's "optimizer got an empty parameter list", a traceback, in the user's terms
        if not any(True for _ in model.parameters()):
            raise RecipeError("the model from build_model has no parameters: return the module to train.")
        raise RecipeError(
            "the model has no parameter to train (none has requires_grad=True): unfreeze the ones to train "
            "(p.requires_grad_(True)) in build_model, or give the recipe a build_optimizer."
        )
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return _built_here(
        torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=args.learning_rate if learning_rate is None else learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            fused=fused_adamw_supported(decay + no_decay, device or next(model.parameters()).device),
        )
    )


def fused_adamw_supported(params: list, device: torch.device) -> bool:
    """Fused AdamW (one kernel for all tensors) where torch has it for the training device and these dtypes, as
    transformers' Trainer defaults to: on one CPU thread it steps bench/text.py's GPT-2 several times faster
    than the per-tensor loop (docs/benchmarks.md; torch picks that loop by default on a CPU, foreach on a GPU).
    Decided by the training device, not by where the parameters are now: under FSDP's low-memory loading they are
    on the meta device on every rank but 0, and every rank must build the same optimizer."""
    supported = torch.device(device).type in privates.fused_optimizer_device_types()
    return supported and all(p.is_floating_point() for p in params)  # not complex ones


def _linear_with_warmup(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))


def _constant(_step: int) -> float:
    return 1.0


def default_scheduler(optimizer, num_training_steps: int, args: TrainingArguments):
    """--lr_scheduler_type with warm-up, as `transformers.get_scheduler` builds it. The default ("linear") and
    "constant" are built here with the same formulas and the same LambdaLR (a partial, so the state_dict is the
    same and a checkpoint of either loads into the other; tests/test_args_parser.py compares them step by step),
    because `import transformers` slows start-up (docs/benchmarks.md). Other names: transformers."""
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * num_training_steps)
    if args.lr_scheduler_type == "linear":
        lr_lambda = functools.partial(
            _linear_with_warmup, num_warmup_steps=warmup, num_training_steps=num_training_steps
        )
        return _built_here(torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda))
    if args.lr_scheduler_type == "constant":
        return _built_here(torch.optim.lr_scheduler.LambdaLR(optimizer, _constant))
    from transformers import get_scheduler

    return _built_here(
        get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=num_training_steps)
    )


def _built_here(obj):
    BUILT_HERE.add(obj)
    return obj
