"""The recipe checked on the run's first batch before the first update: `loss`, `eval_step` and every metric of
`build_metrics`, on every rank, each wrong return value one line naming the hook, what it returned and what the
contract expects (docs/architecture.md, "The recipe contract").

Why before: a metric that cannot take the recipe's predictions otherwise fails at the first evaluation, after
training (the whole run for a 1-epoch run), with a traceback that prints both tensors; a loss of the wrong shape
fails deep inside update.py.

How: `check_first_window(trainer, window)` takes the first window the training loop takes anyway (nothing extra
is read from the data, the loader's order is untouched) and, before the first update, runs the hooks on its
first micro-batch as the update will run it (cut to the size --auto_micro_batch halved it to, in a resumed run):
one forward of `loss` in train mode and one of `eval_step` in eval mode, both under no_grad, then
each metric on a fresh `build_metrics(ctx)`. The RNG states (torch's, on the CPU and the accelerator, and Python's)
and the model's buffers (batch-norm statistics move in a train-mode forward) are restored, so a run's numbers are
bit-identical to a run without the check. A separate no_grad forward rather than checking inside the first update:
the update's path (DDP's hooks, the fast path) stays as it is, and an error is agreed on by every rank before any
rank starts a backward that the others would wait in. Cost: one forward and one eval forward, once. The outcome is
agreed on by every rank (one gather, bounded by the process group's timeout, --ddp_timeout): a failure on any rank
stops every rank with the failing rank's line.

Out of memory in the check (seen on an H100: a forward's first activation alone did not fit, under no_grad too)
is not the check's to report: the update reports it in its own line, or halves the micro-batch with
--auto_micro_batch. The check then runs on the first half of its batch, then the first quarter, ..., since the
hooks' contract shows on a few samples as well; on one sample that does not fit it is left to the update.

Where an epoch's last batch holds one sample on some rank, `loss` also runs on one sample of the batch: a model that
cannot train on one (BatchNorm over [batch, features]) would otherwise fail at that update, an epoch in.

`ACCEL_TRAINER_RECIPE_CHECK=0` skips the check (a run whose metric is known to fail, to keep its model).

A bare 0-d loss (`return out.loss`, the transformers habit) is accepted: `counting_items` weighs it by the batch's
sample count (micro_batch.sample_count: its first tensor's first dimension) everywhere the loss is used (update,
evaluation), and the check says so once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random

import torch
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache

from . import evaluation, micro_batch, privates
from .recipe import RecipeError

OPT_OUT = "ACCEL_TRAINER_RECIPE_CHECK"
EVAL_PAIRS = (("loss", "n_items"), ("predictions", "references"))


def counting_items(recipe):
    """The recipe with its `loss` accepting a bare 0-d tensor: (loss, the batch's sample count). Idempotent."""
    if getattr(recipe.loss, "_counts_items", False):
        return recipe
    user_loss = recipe.loss

    @functools.wraps(user_loss)  # __wrapped__: signature checks and error messages see the recipe's own function
    def loss(model, batch):
        out = user_loss(model, batch)
        if isinstance(out, torch.Tensor) and out.ndim == 0:
            return out, _sample_count(batch)
        return out

    loss._counts_items = True
    return dataclasses.replace(recipe, loss=loss)


def _sample_count(batch) -> int:
    n = micro_batch.sample_count(batch)
    if not n:
        raise RecipeError(
            "loss returned a bare 0-d tensor and the batch's sample count cannot be found (no tensor in it with a "
            "first dimension): return (mean loss, number of items)."
        )
    return n


def check_first_window(trainer, window: list):
    """The training loop's first window, checked (module docstring) before its update."""
    if os.environ.get(OPT_OUT, "1") != "0" and window:
        micro_batches, _ = trainer.updater.micro.split(window)
        check(trainer, micro_batches[0])


def check(trainer, batch) -> None:
    """Run the recipe's hooks on `batch` on every rank; raise one RecipeError line on every rank if any rank failed."""
    acc = trainer.accelerator
    problem, error, note = None, None, None
    try:
        note = _check_fitting(trainer, batch)
    except RecipeError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 -- a bug in the recipe's code: raised as it is, after the ranks agree
        problem, error = f"the recipe check failed: {_first_line(e)}", e
    problem = _agree(acc, problem)
    if error is not None:
        raise error
    if problem is not None:
        raise RecipeError(problem)
    if note:
        trainer.reporter.print(note)


def _check_fitting(trainer, batch) -> str | None:
    """_check_hooks on `batch`, or on its first half, quarter, ... where it runs out of memory (module docstring)."""
    while True:
        try:
            return _check_hooks(trainer, batch)
        except torch.OutOfMemoryError:
            n = micro_batch.sample_count(batch)
        clear_device_cache()  # out of the except block: the failed forward's frames (activations) are released
        if not n or n <= 1:
            return None  # the update runs out of memory too, and says so in its own line
        batch = micro_batch.first_samples(batch, math.ceil(n / 2))


def _check_hooks(trainer, batch) -> str | None:
    """Raise RecipeError for the first hook that breaks the contract; return the bare-loss note, if any."""
    # The eager module, not the compiled one: under --torch_compile a train-mode forward under no_grad and an eval
    # forward at the train batch size are graphs the run never uses, each compiled for the check alone (seen on an
    # H100: 2 of the CIFAR run's recompiles; docs/cifar.md). The outputs' types and shapes are the same.
    recipe = trainer.recipe
    # Not under FSDP: there the module under the compile wrapper ran without gathering its shards ("got mixed
    # torch.Tensor and DTensor", seen with Accelerate 1.15), so a sharded run checks through the compiled one.
    sharded = trainer.accelerator.distributed_type == DistributedType.FSDP
    model = trainer.model if sharded else privates.uncompiled(trainer.model)
    user_loss = getattr(recipe.loss, "__wrapped__", recipe.loss)
    was_training = model.training
    with _unchanged(model, trainer.accelerator.device), torch.no_grad():
        try:
            model.train()
            note = _check_loss(user_loss(model, batch), batch)
            _check_one_sample(trainer.data, user_loss, model, batch)
            if recipe.eval_step is not None or recipe.build_metrics is not None:
                model.eval()
                _check_eval(recipe, trainer.ctx, model, batch, trainer.accelerator.device)
        finally:
            model.train(was_training)
    return note


def _check_one_sample(data, loss, model, batch) -> None:
    """Where an epoch's last batch holds one sample on some rank (loaders.last_batch_rows), the loss on one sample
    of this batch: a model that cannot train on one (BatchNorm over [batch, features]: "Expected more than 1 value
    per channel") would otherwise fail at that update, an epoch into the run, on that rank alone."""
    rows = getattr(data, "last_rows", None)  # a stream has no last batch
    if not rows or 1 not in rows or (micro_batch.sample_count(batch) or 1) <= 1:  # a batch of one was just checked
        return
    try:
        loss(model, micro_batch.first_samples(batch, 1))
    except Exception as e:  # noqa: BLE001 -- whatever fails on one sample fails at the last batch too
        where = f" on rank {rows.index(1)}" if len(rows) > 1 else ""
        raise RecipeError(
            f"the last training batch of each epoch holds 1 sample{where}, and loss fails on one sample "
            f"({_first_line(e)}): pass --dataloader_drop_last, or a --per_device_train_batch_size or "
            "--max_train_samples that leaves more than one."
        ) from None


def _check_loss(out, batch) -> str | None:
    expected = "loss must return (mean loss, number of items)"
    if isinstance(out, torch.Tensor) and out.ndim == 0:
        n = _sample_count(batch)
        return (
            f"note: loss returns a bare 0-d tensor; each batch is weighted by its sample count ({n} here). To weigh "
            "by tokens or other items, return (mean loss, number of items)."
        )
    if isinstance(out, torch.Tensor):
        raise RecipeError(
            f"{expected}; got a tensor of shape {list(out.shape)}: reduce it to its mean and return (loss.mean(), "
            "number of items), or a bare 0-d loss."
        )
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise RecipeError(f"{expected}; got {_describe(out)}: return (loss, batch_size) or a bare 0-d loss tensor.")
    mean, n = out
    if not isinstance(mean, torch.Tensor) or mean.numel() != 1 or not mean.is_floating_point():
        raise RecipeError(
            f"{expected}; its first element is {_describe(mean)}: the mean loss must be a floating-point tensor of "
            "one value, with its gradient (not loss.item())."
        )
    if isinstance(n, torch.Tensor):
        if n.numel() != 1:
            raise RecipeError(f"{expected}; its second element is {_describe(n)}: the number of items is one count.")
    elif isinstance(n, bool) or not isinstance(n, (int, float)):
        raise RecipeError(f"{expected}; its second element is {_describe(n)}: the number of items is one count.")
    return None


def _check_eval(recipe, ctx, model, batch, device) -> None:
    out = {}
    if recipe.eval_step is not None:
        out = recipe.eval_step(model, batch)
        expected = (
            "eval_step must return a dict with 'loss' and 'n_items' (per sample, or the batch's mean and count) "
            "and/or 'predictions' and 'references' (first dimension: the batch)"
        )
        if not isinstance(out, dict):
            raise RecipeError(f"{expected}; got {_describe(out)}.")
        given = [pair for pair in EVAL_PAIRS if any(k in out for k in pair)]
        broken = [pair for pair in given if not all(k in out for k in pair)]
        if not given or broken:
            raise RecipeError(f"{expected}; got the keys {sorted(map(str, out))}.")
        try:
            out = evaluation.outputs(recipe, model, batch, device)
        except RecipeError:
            raise
        except Exception as e:
            raise RecipeError(
                f"{expected}; got {_describe(out)}, which evaluation cannot take: {_first_line(e)}"
            ) from None
    metrics = recipe.build_metrics(ctx) if recipe.build_metrics is not None else {}
    if metrics and "predictions" not in out:
        raise RecipeError(
            f"build_metrics gives {sorted(metrics)} but eval_step returns no 'predictions' and 'references' for "
            "them: return them from eval_step (first dimension: the batch)."
        )
    for name, metric in metrics.items():
        p, r = out["predictions"], out["references"]
        try:
            metric.add_batch(predictions=p.cpu(), references=r.cpu())
            metric.compute()
        except Exception as e:  # noqa: BLE001 -- whatever the metric raises, it cannot take these values
            raise RecipeError(
                f"metric {name!r} cannot take eval_step's predictions of shape {_shape(p)} and references of shape "
                f"{_shape(r)} "
                f"({_first_line(e)}): give it what it takes (the built-in accuracy/f1/mse: one value per sample; "
                "flatten per-token values, e.g. predictions[labels != -100]) or use a metric for these shapes."
            ) from None


@dataclasses.dataclass
class _unchanged:
    """The RNG states and the model's buffers as they were before the check (the run must not see it)."""

    model: torch.nn.Module
    device: torch.device

    def __enter__(self):
        self.python = random.getstate()
        self.cpu = torch.get_rng_state()
        self.accel = torch.get_device_module(self.device).get_rng_state() if self.device.type != "cpu" else None
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        random.setstate(self.python)
        torch.set_rng_state(self.cpu)
        if self.accel is not None:
            torch.get_device_module(self.device).set_rng_state(self.accel)
        return False


def _agree(acc, problem: str | None) -> str | None:
    """Every rank's outcome (None: every rank passed): its own line when every rank failed, else the first failing
    rank's line, naming it. One gather and, when only some ranks failed, one broadcast of that line as bytes (no
    pickling), each bounded by the process group's timeout."""
    if acc.num_processes == 1:
        return problem
    from accelerate.utils import broadcast

    failed = acc.gather(torch.tensor([0 if problem is None else 1], device=acc.device))
    if not bool(failed.any()):
        return None
    if bool(failed.all()):  # the usual case (one recipe, one kind of batch): each rank's own line, the same line
        return problem
    rank = int(failed.nonzero()[0])
    size = 2048
    text = torch.zeros(size, dtype=torch.uint8, device=acc.device)
    if acc.process_index == rank:
        raw = problem.encode()[:size]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = broadcast(text, from_process=rank)
    line = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return f"{line} (on rank {rank})"  # the same line on every rank


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return "a 0-d tensor" if x.ndim == 0 else f"a tensor of shape {list(x.shape)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: ({', '.join(_describe(v) for v in x)})"
    kind = type(x).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _shape(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else _describe(x)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
