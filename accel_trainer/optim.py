"""The default optimizer and scheduler: what a recipe without build_optimizer / build_scheduler trains with.

A recipe's own builders may call them too (recipes/regression.py's build_scheduler does).
"""

from __future__ import annotations

import functools
import math

import torch

from . import privates
from .args import TrainingArguments
from .recipe import RecipeError


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
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate if learning_rate is None else learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused_adamw_supported(decay + no_decay, device or next(model.parameters()).device),
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
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if args.lr_scheduler_type == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)
    from transformers import get_scheduler

    return get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=num_training_steps
    )
