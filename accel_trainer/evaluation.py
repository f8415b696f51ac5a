"""Evaluation: the loss and the recipe's metrics over the whole eval split, every sample counted once on any world
size, and the best model kept (--metric_for_best_model), stopped on (--early_stopping_patience) and loaded at the end
(--load_best_model_at_end). Plain functions; `Trainer.evaluate` calls them and fires the evaluate_end event between
the two.
"""

from __future__ import annotations

import json
import math
import os

import torch
from accelerate.data_loader import DataLoaderShard

from . import safe_read
from .errors import UserError
from .micro_batch import first_samples, sample_count


def _eval_outputs(recipe, model, batch) -> dict:
    out = dict(recipe.eval_step(model, batch)) if recipe.eval_step else {}
    if "loss" not in out:
        out["loss"], out["n_items"] = recipe.loss(model, batch)
    return out


def outputs(recipe, model, batch, device, real_rows=None) -> dict:
    """Per-sample tensors for gather_for_metrics: `loss` (summed over the sample's items), `n_items`, and
    `predictions`/`references` when the recipe gives them. A per-batch mean loss is spread evenly over the
    batch's samples, which is exact when every sample has the same number of items (their sum always is).

    `real_rows(B)` (the last batch of a padded split): how many leading rows of this rank's batch are real samples,
    the rest being Accelerate's repeats, which gather_for_metrics drops. A mean over the whole batch would carry
    the repeats' losses into the real rows, so the loss is taken again over the real rows alone."""
    out = _eval_outputs(recipe, model, batch)
    loss, n = out["loss"], torch.as_tensor(out["n_items"], device=device)
    if loss.ndim == 0:
        B = len(out["references"]) if "references" in out else sample_count(batch)
        k = B if real_rows is None else real_rows(B)
        if k < B:
            real = _eval_outputs(recipe, model, first_samples(batch, k)) if k else {"loss": 0, "n_items": 0}
            loss, n = torch.as_tensor(real["loss"], device=device), torch.as_tensor(real["n_items"], device=device)
        repeats = torch.zeros(B - k, device=device)  # dropped by gather_for_metrics; zero either way
        out["loss"] = torch.cat([(loss.float() * n / max(k, 1)).expand(k), repeats])
        out["n_items"] = torch.cat([(n.float() / max(k, 1)).expand(k), repeats])
    return out


def real_rows(accelerator, eval_loader):
    """For outputs(): None, or -- on the last batch of a split that Accelerate padded with repeated samples to
    even out the ranks -- a function of the batch size giving how many of this rank's rows gather_for_metrics keeps
    (a prefix: it keeps the first `remainder` rows of the ranks' batches laid end to end). Every rank calls it at
    the same batch (a collective): the padding makes their batch counts equal."""
    acc, state = accelerator, accelerator.gradient_state
    if not isinstance(eval_loader, DataLoaderShard) or acc.num_processes == 1:
        return None
    if not state.end_of_dataloader or state.remainder <= 0:
        return None

    def kept(batch_size: int) -> int:
        mine = torch.full((batch_size,), acc.process_index, device=acc.device)
        return int((acc.gather_for_metrics(mine) == acc.process_index).sum())

    return kept


def gather(accelerator, eval_loader, out: dict) -> dict:
    """Per-sample eval tensors of this rank's batch of `eval_loader` -> those of every rank, each sample of the
    split once."""
    acc = accelerator
    if acc.num_processes > 1:
        out = pad_tokens(acc, out)
    if isinstance(eval_loader, DataLoaderShard):
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


def pad_tokens(accelerator, out: dict) -> dict:
    """Per-token predictions/references ([batch, tokens, ...]) padded along dim 1 with -100 to the widest rank's:
    batches padded per batch to their own longest row have different widths on different ranks, and a gather
    needs one shape. -100 is what metrics skip (transformers' ignore index). A collective on every rank: each
    rank's predictions have the same number of dimensions (one recipe)."""
    return {
        k: accelerator.pad_across_processes(v, dim=1, pad_index=-100)
        if k in ("predictions", "references") and torch.is_tensor(v) and v.ndim >= 2
        else v
        for k, v in out.items()
    }


@torch.no_grad()
def evaluate(accelerator, recipe, ctx, model, eval_loader) -> dict:
    """eval_loss (the mean over every item of the split), eval_samples and eval_<metric> of the recipe's
    build_metrics, with `model` in eval mode (its mode is restored)."""
    device = accelerator.device
    metrics = recipe.build_metrics(ctx) if recipe.build_metrics else {}
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_samples = 0
    if hasattr(eval_loader, "set_epoch"):
        eval_loader.set_epoch(0)
    for batch in eval_loader:
        out = outputs(recipe, model, batch, device, real_rows(accelerator, eval_loader))
        out = gather(accelerator, eval_loader, out)
        loss_sum += out["loss"].double().sum()
        n_sum += out["n_items"].double().sum()
        n_samples += len(out["loss"])
        if "predictions" in out:
            for m in metrics.values():
                m.add_batch(predictions=out["predictions"].cpu(), references=out["references"].cpu())
    results = {"eval_loss": (loss_sum / n_sum.clamp(min=1)).item()}
    results["eval_samples"] = n_samples  # every sample of the split exactly once, on any world size
    for m in metrics.values():
        results.update({f"eval_{k}": v for k, v in (m.compute() or {}).items()})
    model.train(was_training)
    return results


def keep_if_best(accelerator, args, best: float | None, step: int, results: dict, save_model) -> float | None:
    """output_dir/best/: model.safetensors (the evaluated weights, written by `save_model(path)`, which every rank
    calls) and best.json of the best evaluation so far, kept apart from checkpoints (save_total_limit never
    deletes it). Returns the new best value when this evaluation at `step` beats `best` (None: it does not); the
    caller keeps it in its Progress, which every checkpoint saves, so a resumed run keeps comparing against it."""
    name = args.metric_for_best_model
    key = name if name in results else f"eval_{name}"
    if key not in results:
        raise UserError(
            f"--metric_for_best_model {name}: the evaluation gives no such metric; it gives "
            f"{', '.join(sorted(results))}."
        )
    value = float(results[key])
    greater = _greater_is_better(args, key)
    if not math.isfinite(value) or (best is not None and not (value > best if greater else value < best)):
        return None
    folder = os.path.join(args.output_dir, "best")
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
    save_model(os.path.join(folder, "model.safetensors"))
    if accelerator.is_main_process:
        with open(os.path.join(folder, "best.json.tmp"), "w") as f:
            json.dump({"step": step, "metric": key, "value": value, "greater_is_better": greater}, f)
        os.replace(os.path.join(folder, "best.json.tmp"), os.path.join(folder, "best.json"))
    return value


def check_early_stopping(args, eval_loader, recipe_name: str):
    """--early_stopping_patience counts evaluations of the eval split: refused at start-up without one (it would
    never stop)."""
    if args.early_stopping_patience and eval_loader is None:
        raise UserError(
            f"--early_stopping_patience {args.early_stopping_patience}: recipe {recipe_name}'s build_data gives no "
            "'eval' split to evaluate on; add one, or drop the flag."
        )


def stopped_early(args, progress) -> str | None:
    """The line saying the run stops early, when --early_stopping_patience evaluations in a row have not improved
    on the best --metric_for_best_model (transformers' EarlyStoppingCallback: strictly better counts); else None.
    `progress` (the Trainer's, saved in every checkpoint) counts them, so a resumed run that had stopped stays
    stopped."""
    patience = args.early_stopping_patience
    if not patience or progress.evals_without_improvement < patience:
        return None
    best = f"{progress.best_metric:.6g} at step {progress.best_step}" if progress.best_step is not None else "none"
    return (
        f"accel-trainer: stopping early at step {progress.global_step}: {patience} evaluation(s) in a row did not "
        f"improve {args.metric_for_best_model} (best: {best}; --early_stopping_patience {patience})."
    )


def load_best(accelerator, model, output_dir: str, progress) -> bool:
    """--load_best_model_at_end: output_dir/best/'s weights (keep_if_best wrote them from the evaluated model) loaded
    into `model`, the plain evaluated module, on every rank. False when no evaluation kept one (`progress`, the same
    on every rank, says: a file check could differ between ranks, and the save that follows is collective). Reads
    safetensors only. A peft model's best/ is its adapter folder; a transformers model's is a save_pretrained
    folder, read by its class's from_pretrained (tied and renamed weights, shards) and copied over; a plain
    module's one file."""
    from safetensors.torch import load_file, load_model

    if progress.best_step is None:
        return False
    folder = os.path.join(output_dir, "best")
    accelerator.wait_for_everyone()  # the main process wrote best/ before it came here
    if os.path.isfile(os.path.join(folder, "adapter_config.json")):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(os.path.join(folder, "adapter_model.safetensors")))
    elif os.path.isfile(os.path.join(folder, "config.json")):
        model.load_state_dict(type(model).from_pretrained(folder).state_dict())  # copied in the model's dtype
    else:
        load_model(model, os.path.join(folder, "model.safetensors"), device=str(next(model.parameters()).device))
    return True


def _greater_is_better(args, key: str) -> bool:
    return args.greater_is_better if args.greater_is_better is not None else not key.endswith("loss")


def previous_best(args, output_dir: str) -> dict | None:
    """The record of output_dir/best/ ({"step", "metric", "value"} from best.json) when this run can go on
    comparing against it: --metric_for_best_model names the same metric, compared the same way. None otherwise
    (no metric asked, another metric or direction, best.json missing or unreadable: killed mid-write)."""
    name = args.metric_for_best_model
    try:
        record = safe_read.read_json(os.path.join(output_dir, "best", "best.json"), max_bytes=1 << 16)
        key, value, step = record["metric"], float(record["value"]), int(record["step"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if not name or key not in (name, f"eval_{name}") or not math.isfinite(value):
        return None
    if record.get("greater_is_better", _greater_is_better(args, key)) != _greater_is_better(args, key):
        return None
    return {"step": step, "metric": key, "value": value}
