"""One optimizer update over a window of micro-batches (this rank's share of the global batch). The path a batch
takes, top to bottom in `Updater.__call__`:

    forward + backward of each micro-batch, weighted by its item count (recipe.loss gives the mean and the count)
    before the window's last backward: the one all-reduce (loss sum, item count, preemption vote) is started;
        DDP all-reduces the gradients as it does in a hand-written loop (FSDP: reduce-scatters them)
    after it: the gradients corrected to the mean over every item of the global batch (a no-op with equal counts)
    clip (--max_grad_norm), the non-finite check (--nan_policy skip), the optimizer step (fp16 overflow skips)
    then, if it stepped: the scheduler and the EMA; the gradients zeroed

Gradient accumulation is ours, not `accelerator.accumulate`: one update's gradient must be the mean over every
item (sample or token) of the global batch, weighted by item count, on any world size. Each micro-batch's
backward uses its summed loss (mean x n_items). Before the window's last backward (the one DDP communicates) this
rank's gradients are scaled by 1 / K, K the items per rank of the previous update (N / world_size, the same number
on every rank), so what DDP averages over the ranks is the sum of item gradients / K: of mean size, which a
compressing comm hook (fp16) needs. The item count N of this global batch is all-reduced *asynchronously*
meanwhile; after the backward the gradients are multiplied by K x world_size / N: the mean over all N items. With
the same counts as the previous update (fixed-size batches, the usual case) that factor is exactly 1 and nothing
is multiplied. So DDP runs its own all-reduce, with no Python comm hook, and nothing waits in the middle of the
backward (a hook that waited there made the 2-process step slower than a hand-written DDP loop's:
docs/benchmarks.md). The first update of a run (no previous count) waits for N before its backward; K is saved
in checkpoints (`state` / `load`), so a resumed run scales as the uninterrupted one did (bit-identical). Under FSDP
the scaling comes after the last backward. With one process and no accumulation the mean loss is already that, and
we skip the bookkeeping (no cost over a plain loop).

The Trainer keeps the run's side of an update (the step counter, skipped steps, the log window); the Updater
owns what one update needs from one call to the next: the fast-path choices, the item reference K and the last
gradient norm.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

from . import precision, privates
from .micro_batch import Agreed, MicroBatches, sample_count

# Distributed types where the optimizer/backward are plain torch objects, so we may call them directly and skip
# Accelerate's per-step wrappers (which add a package lookup per step: docs/benchmarks.md, "Cost per update").
_PLAIN_TORCH_TYPES = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def is_plain_torch(accelerator) -> bool:
    """Whether torch's optimizer, scaler and backward may be called directly (Accelerate adds nothing there; not
    FSDP: its gradient-sync switch and DTensor-aware clipping are Accelerate's)."""
    return accelerator.distributed_type in _PLAIN_TORCH_TYPES


@dataclass
class Result:
    loss: torch.Tensor  # the mean over every item of the global batch (no host sync)
    grad_norm: torch.Tensor | None  # Updater.grad_norm: the global gradient norm before clipping, when clipping
    checked: torch.Tensor | None  # what --nan_policy checks of the gradients (Updater._checked); None under fp16
    stepped: bool | torch.Tensor  # False: skipped; a device flag where only the device knows yet (Updater.settle)
    checked_is_flag: bool = False  # `checked` is a flag (1.0: not finite), not the norm


class Updater:
    """`updater(window)` runs one optimizer update. `updater.grad_norm` (and its Result's) is that update's global
    gradient norm before clipping, measured when clipping (--max_grad_norm), else None: without clipping nothing
    needs the norm (--nan_policy's check takes one fused pass instead, _checked).

    Whether an update stepped is known on the device first where it can be skipped there (fp16 loss scaling, or
    --nan_policy skip with an optimizer that skips on the device): such an update's outcome is pending until
    `settle()` reads it, which the next update does once its forward and backward are queued, so no update waits
    for its own kernels. `on_skipped()` is called for each update found skipped."""

    def __init__(self, accelerator, model, optimizer, scheduler, loss, args, *, ema=None, meter, preemption,
                 on_skipped, say=print):  # fmt: skip
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.loss, self.ema, self.meter, self.preemption = loss, ema, meter, preemption
        self.max_grad_norm, self.nan_policy, self.on_skipped = args.max_grad_norm, args.nan_policy, on_skipped
        self.plain_torch = is_plain_torch(accelerator)
        self.sharded = accelerator.distributed_type == DistributedType.FSDP
        self.inner_opt = optimizer.optimizer
        # the scheduler Accelerate wraps (it only passes step() on: the Accelerator does not step it with the
        # optimizer), stepped directly as the optimizer is
        self.inner_sched = scheduler.scheduler if isinstance(scheduler, AcceleratedScheduler) else scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.weighted = accelerator.num_processes > 1 or args.gradient_accumulation_steps > 1
        self.micro = MicroBatches(args, accelerator, say)  # --auto_micro_batch (micro_batch.py)
        # The DDP wrapper, if any (--torch_compile: Accelerate compiles the DDP-wrapped model); None without one
        # (FSDP, one process, or no trainable parameters: nothing is communicated).
        ddp = privates.uncompiled(model)
        self.ddp = ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else None
        self.reference = None  # K: the previous update's items per rank (a tensor; None: not known yet)
        self.grad_norm = None
        self._one = torch.ones((), device=accelerator.device)  # the unit scale of the gradient check (_checked)
        self.autocast = precision.update_autocast(accelerator)  # None in fp32
        self.pending = None  # (stepped flag on the device, schedule) of an update whose outcome is not read yet
        self.micro_losses: list = []  # the last update's per-micro-batch losses, detached (nan_batch.py)
        self.repeats_at = None  # the index in the window of a batch of repeats alone (__call__)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the Updater: K (update.py's docstring), None before the first DDP update."""
        return {"items_per_rank": None if self.reference is None else float(self.reference), **self.micro.state_dict()}

    def load_state_dict(self, state: dict):
        """Resume with a checkpoint's K (none in a checkpoint from a run without DDP, or from before K was saved:
        the first update then waits for its own count); and the micro-batch size --auto_micro_batch chose."""
        self.micro.load_state_dict(state)
        if state.get("items_per_rank") is not None and self.ddp is not None:
            self.reference = torch.tensor(state["items_per_rank"], device=self.accelerator.device)

    def __call__(self, window: list, schedule: bool = True) -> Result:
        # An epoch's last window may end in a batch of Accelerate's repeats alone (loaders.MapPosition): weighed
        # by zero items, and no samples.
        self.repeats_at = len(window) - 1 if getattr(window, "repeats_last", False) else None
        flops = self.meter.count_flops()  # the first update only, and only when an MFU can be reported
        if flops is None:
            loss_mean, n_sum = self.micro.run(self, window)  # _forward_backward, redone smaller on out of memory
        else:
            with flops:
                loss_mean, n_sum = self.micro.run(self, window)
            self.meter.counted(flops)
        samples = 0
        for batch in window[:-1] if self.repeats_at is not None else window:
            samples += sample_count(batch) or 0
        self.meter.updated(samples, n_sum)
        grad_norm = self._clip() if self.max_grad_norm > 0 else None
        checked = self._checked(grad_norm)
        flag = checked is not None and grad_norm is None and self.plain_torch  # a flag, not a norm (_checked)
        if self.pending is not None:  # the previous update's outcome, before this step (its scheduler step first)
            self.settle()
        stepped = (
            self._step_if_finite(loss_mean, checked, flag) if self.nan_policy == "skip" else self._optimizer_step()
        )
        if stepped is not True and stepped is not False:  # a device flag
            if self.ema is None:
                self.pending = (stepped, schedule)
            else:  # the EMA averages this step's weights, now or never: it must know (a host read)
                stepped = bool(stepped)
        if stepped is True:
            if schedule:
                self.inner_sched.step()
            if self.ema is not None:
                self.ema.update_parameters(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        elif stepped is False:
            self.on_skipped()
        self.inner_opt.zero_grad(set_to_none=True)
        self.grad_norm = grad_norm
        return Result(loss_mean, grad_norm, checked, stepped, flag)

    def settle(self):
        """Read the pending update's outcome: its scheduler step if it stepped, on_skipped() if not. Called by the
        next update before its optimizer step, when its forward and backward are queued (on a GPU the read waits
        for the previous update's kernels alone, not for the queue to drain), and by the Trainer before anything
        outside the loop looks at the step count, the learning rate or the skips (a log row, an evaluation,
        update_end handlers, a notebook step)."""
        if self.pending is None:
            return
        stepped, schedule = self.pending
        self.pending = None
        if bool(stepped):
            if schedule:
                self.inner_sched.step()
        else:
            self.on_skipped()

    def _forward_backward(self, window: list, origin: list[int]):
        """Every micro-batch's forward and backward; returns the window's mean loss (detached) and item count over
        every rank (the batch's own with one micro-batch on one process). origin[i]: the loader batch micro-batch i is cut
        from (--auto_micro_batch; micro_losses has one loss per loader batch, for nan_batch.py)."""
        acc = self.accelerator
        loss_sum, n_sum = None, 0
        self.micro_losses = []
        by_items = self.weighted or self.micro.splits  # a cut loader batch is several micro-batches
        if not by_items:  # one micro-batch on one process: its mean is the update's, as it is
            loss, n = self.loss(self.model, window[0]) if self.autocast is None else self._autocast_loss(window[0])
            self.micro_losses.append(loss.detach())  # which micro-batch was not finite, read only if one was
            self._backward(loss)
            return self.micro_losses[0], n  # no kernels to weigh it
        for i, batch in enumerate(window):
            last = i == len(window) - 1  # DDP all-reduces gradients on the window's last backward only
            with nullcontext() if last or acc.num_processes == 1 else acc.no_sync(self.model):
                loss, n = self.loss(self.model, batch) if self.autocast is None else self._autocast_loss(batch)
                if origin[i] == self.repeats_at:
                    n = n * 0
                detached = loss.detach()
                if i and origin[i] == origin[i - 1]:  # a cut of the same loader batch: non-finite if one is
                    self.micro_losses[-1] = self.micro_losses[-1] + detached
                else:
                    self.micro_losses.append(detached)  # which micro-batch was not finite, read only if one was
                weighted = detached * n
                loss_sum = weighted if loss_sum is None else loss_sum + weighted  # no `0.0 +` kernel
                n_sum = n_sum + n
                if last and self.ddp is not None:  # sum / K, K the same on every rank; corrected after
                    pending = self._start_totals(loss_sum, n_sum)
                    if self.reference is None or self.micro.waits:  # the first update: K from its own N
                        loss_sum, n_sum = self._finish_totals(pending)  # (one wait); the vote: micro_batch.py
                        pending = None
                        if self.reference is None:
                            self.reference = self._items_per_rank(n_sum)
                    self._backward(loss * n * self._to_mean(self.reference, 1))
                    if pending is not None:
                        loss_sum, n_sum = self._finish_totals(pending)
                    self._correct(n_sum)
                elif last and not self.sharded:  # no DDP wrapper (no trainable parameters): nothing to weigh
                    loss_sum, n_sum = self._reduce_totals(loss_sum, n_sum)
                    self._backward(loss * n * self._to_mean(n_sum, self.accelerator.num_processes))
                else:
                    self._backward(loss * n)  # summed loss: its gradient stays local, in fp32
        if by_items and self.sharded:
            # FSDP2 accumulates a window's gradients inside its unsharded parameters, out of our reach until the
            # last backward's reduce-scatter writes the sharded .grad: scaled after it (see _to_mean).
            loss_sum, n_sum = self._reduce_totals(loss_sum, n_sum)
            self._to_mean(n_sum, self.accelerator.num_processes)
        return (loss_sum / n_sum).detach(), n_sum

    def _autocast_loss(self, batch):
        """The recipe's loss in mixed precision: its forward and loss under the run's autocast, as a hand-written
        mixed-precision loop runs them (the model's forward then adds nothing: precision.AutocastForward)."""
        with self.autocast:
            return self.loss(self.model, batch)

    def _clip(self):
        """Clip the gradients to --max_grad_norm; returns the norm before clipping (a tensor, no host sync)."""
        if not self.plain_torch:  # FSDP's DTensor-aware clipping is Accelerate's
            return self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)
        # What Accelerate does on these types (unscale, then torch's clip), called directly: its clip_grad_norm_
        # parses torch's version string on every call (docs/benchmarks.md, "Choices the numbers decided").
        if self.accelerator.scaler is not None:
            self.accelerator.scaler.unscale_(self.inner_opt)
        return torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)

    def _end_scaler_iteration(self):
        """fp16, an update skipped for a non-finite loss: end the GradScaler's iteration as a step would, or the next
        update's unscale_ raises "unscale_() has already been called" (clipping unscaled this one). unscale_ (unless
        clipping did) records whether the gradients are finite; update() then backs the scale off when they are
        not, as GradScaler does for a step it skips (a non-finite loss almost always has non-finite gradients)."""
        scaler = self.accelerator.scaler
        if scaler is None:
            return
        if self.max_grad_norm <= 0:  # _clip did not unscale (Accelerate's FSDP clipping unscales too)
            scaler.unscale_(self.inner_opt)
        scaler.update()

    def _checked(self, grad_norm):
        """What --nan_policy checks of the gradients with the loss (a finite loss can still give non-finite
        gradients, and NaN weights after the step), on the device: the norm clipping measured (finite when they
        are), else, where the gradients are plain tensors, a flag (1.0: one is not finite) from one fused pass over
        them, not the norm (three kernels and one allocation per tensor that nothing reads). None under fp16: an
        overflow is the scaler's to skip."""
        if self.accelerator.scaler is not None:
            return None
        if grad_norm is None and self.plain_torch:
            flag = torch.zeros((), device=self.accelerator.device)
            privates.flag_non_finite([q.grad for q in self.params if q.grad is not None], flag, self._one)
            return flag
        if grad_norm is None:  # FSDP: the norm of the DTensor gradients, as its clipping measures it
            grads = [q.grad for q in self.params if q.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else None
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor; the global value, the same on every rank
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def _step_if_finite(self, loss_mean, checked, flag: bool):
        """--nan_policy skip: the step, unless the loss or the gradients are not finite; then the update changes
        nothing (no step, no schedule, no EMA) and is counted as skipped. Skipped on the device where it can be:
        under fp16 the scaler skips it (and backs its scale off) as it does an overflow; an optimizer that takes
        GradScaler's skip flag (torch's fused ones) skips it itself. Any other reads the flag (a host sync)."""
        finite = torch.isfinite(loss_mean)
        if checked is not None:
            finite = finite & (checked == 0 if flag else torch.isfinite(checked))
        scaler = self.accelerator.scaler
        if self.plain_torch and scaler is not None:
            if self.max_grad_norm <= 0:  # clipping unscaled already; the scaler's flags exist from here on
                scaler.unscale_(self.inner_opt)
            privates.scaler_flag_non_finite(scaler, self.inner_opt, ~finite)
            return self._optimizer_step()
        if self.plain_torch and privates.skips_on_device(self.inner_opt):
            privates.step_unless(self.inner_opt, (~finite).float())
            return finite
        if not bool(finite):
            self._end_scaler_iteration()
            return False
        return self._optimizer_step()

    def _start_totals(self, loss_sum, n_sum):
        """Start the update's one all-reduce: the window's loss sum and item count over every rank (the preemption
        vote rides on it: no extra collective). Returns (totals, work); work is None on one process."""
        acc = self.accelerator
        totals = torch.stack(
            [
                _device_scalar(loss_sum, acc.device),
                _device_scalar(n_sum, acc.device),
                self.preemption.vote(),
                *self._out_of_memory(0.0),
            ]
        )
        if acc.num_processes == 1:
            return totals, None
        self.micro.voted = True
        return totals, torch.distributed.all_reduce(totals, async_op=True)

    def _finish_totals(self, pending):
        totals, work = pending
        if work is not None:
            work.wait()
            self.preemption.record(totals[2])
            if self.micro.enabled and (ranks := int(totals[3])):  # another rank ran out of memory (micro_batch.py)
                raise Agreed(ranks)
        return totals[0], totals[1]

    def _out_of_memory(self, value: float) -> list:
        """The out-of-memory count's slot of the update's all-reduce: only with --auto_micro_batch."""
        return [torch.full((), value, device=self.accelerator.device)] if self.micro.enabled else []

    def vote_out_of_memory(self) -> int:
        """This rank ran out of memory before the update's all-reduce: join it (the other ranks' is the same
        shape) with a count of 1; returns how many ranks ran out."""
        device = self.accelerator.device
        zero = torch.zeros((), device=device)
        totals = torch.stack([zero, zero, self.preemption.vote(), *self._out_of_memory(1.0)])
        torch.distributed.all_reduce(totals)
        self.preemption.record(totals[2])
        return int(totals[3])

    def _reduce_totals(self, loss_sum, n_sum):
        return self._finish_totals(self._start_totals(loss_sum, n_sum))

    def _items_per_rank(self, n_total):
        """K for the next update: N / world_size, at least 1 (a window without items divides by nothing)."""
        return (n_total / self.accelerator.num_processes).clamp(min=1)

    def _correct(self, n_total):
        """After DDP averaged (sum / K) over the ranks: multiply by K x world_size / N (N = n_total, this update's
        global count) for the mean over all N items; then K becomes this update's N / world_size. On a CPU an
        exact 1 (the same counts as the previous update) multiplies nothing; on a GPU that check would be a host
        sync, so the (cheap) multiply runs."""
        factor = self.reference * self.accelerator.num_processes / n_total.clamp(min=1)
        self.reference = self._items_per_rank(n_total)
        if factor.device.type == "cpu" and factor.item() == 1.0:
            return
        grads = [q.grad for q in self.params if q.grad is not None]
        if grads:
            privates.foreach_mul_(grads, factor)

    def _to_mean(self, n, world_size: int):
        """Scale the window's summed-loss gradients so far by world_size / n, and return that factor for the last
        micro-batch's loss. DDP: n is K, the previous update's items per rank (the same on every rank), and
        world_size 1; _correct turns DDP's average into the mean over every item. FSDP: n is the global count N,
        after the DTensor shards were averaged over ranks. Either way what a compressing comm hook sees (fp16: cast
        before the division) is of mean size, not item-count times larger (inf above fp16's 65504). clamp: a
        window with no items leaves the gradients at zero."""
        n = _device_scalar(n, self.accelerator.device)
        scale = world_size / n.clamp(min=1)
        grads = [q.grad for q in self.params if q.grad is not None]
        if grads:
            privates.foreach_mul_(grads, scale)
        return scale

    def _backward(self, loss):
        if not self.plain_torch:
            self.accelerator.backward(loss)
        elif self.accelerator.scaler is not None:
            self.accelerator.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self) -> bool | torch.Tensor:
        """Step the optimizer; True, False when fp16 loss scaling skipped the step (an overflow), or, under fp16 on
        plain torch, whether it stepped as a device flag (settle reads it later)."""
        scaler = self.accelerator.scaler
        if not self.plain_torch:
            self.optimizer.step()
            return not self.optimizer.step_was_skipped
        if scaler is None:
            self.inner_opt.step()
            return True
        # The scale only drops when an inf/nan gradient skipped the step: compared on the device. get_scale()
        # before and after was two host syncs per update; privates.scaler_scale is that tensor without the read.
        scale = privates.scaler_scale(scaler)
        scale = None if scale is None else scale.clone()  # None: a disabled scaler, which steps as given
        scaler.step(self.inner_opt)
        scaler.update()
        return True if scale is None else privates.scaler_scale(scaler) >= scale


def _device_scalar(value, device) -> torch.Tensor:
    """A 0-d float32 tensor of `value` (a count or a loss: a Python number or a tensor) on `device`, without a
    blocking copy: torch.as_tensor(5, device=cuda) builds the tensor on the host and copies it from pageable memory,
    which waits for every kernel queued before it (here: the window's forwards). A number goes in as a fill
    kernel's argument; a tensor is cast where it is (the same float32 value either way)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return torch.full((), value, dtype=torch.float32, device=device)


def registered_comm_hook(ddp) -> str | None:
    """The --ddp_comm_hook name of the hook registered on a DDP model ("none": DDP's own all-reduce), read back from
    the model rather than from the flags, so run_config.json says what runs; None without a DDP model."""
    if ddp is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    names = {
        default_hooks.fp16_compress_hook: "fp16",
        default_hooks.bf16_compress_hook: "bf16",
        powerSGD_hook.powerSGD_hook: "power_sgd",
        powerSGD_hook.batched_powerSGD_hook: "batched_power_sgd",
    }
    hooks = [names.get(hook, getattr(hook, "__name__", repr(hook))) for hook, _ in getattr(ddp, "_comm_hooks", [])]
    return ", ".join(hooks) or "none"
