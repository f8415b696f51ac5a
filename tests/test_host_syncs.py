"""What one optimizer update asks of the host, counted on a CPU the way a GPU would feel it: every value read back
to the host (`.item()`, `float()`, `bool()` of a tensor: aten._local_scalar_dense, a host-device sync on a GPU) and
every tensor made from host values or copied across devices (aten.lift_fresh, a cross-device _to_copy/copy_: a
host-to-device copy on a GPU, blocking from pageable memory). torch.cuda.set_sync_debug_mode has no CPU twin, so a
TorchDispatchMode counts the ops the update dispatches; the counts are kept here so that a new sync shows up.

A read is a sync when it waits for the update's own work: of a value one of its ops made. A read of an earlier
update's value (whether it stepped, under fp16 or --nan_policy skip) taken once this update's backward has reached
the parameters waits on a GPU for that earlier update alone, while this update's kernels stay queued: counted apart,
as `earlier`, and it must come after the backward."""

import copy
import sys
import types
import weakref
from collections import Counter

import pytest
import torch
from helpers import RECIPES
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Recipe, Trainer, TrainingArguments  # noqa: E402
from accel_trainer.optim import default_optimizer  # noqa: E402


class HostTraffic(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.made = {}  # id -> weak reference of every tensor this update's ops made
        self.backward_reached = False  # set by a hook on a parameter's gradient

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            made = self.made.get(id(args[0]))
            if made is not None and made() is args[0]:
                self.counts["reads"] += 1
            else:
                self.counts["earlier" if self.backward_reached else "earlier, before the backward"] += 1
        elif name in ("lift_fresh", "lift_fresh_copy"):
            self.counts["copies"] += 1
        elif name in ("_to_copy", "copy_"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
            if len(devices) > 1:
                self.counts["copies"] += 1
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = weakref.ref(t)
        return out


def int_count_loss(model, batch):
    loss, _ = regression.loss(model, batch)
    return loss, int(batch["x"].shape[0])  # a recipe may count its items as a Python int


def trainer(tmp_path, name, loss=regression.loss, **kw):
    recipe = Recipe(name=name, Args=regression.Args, build_model=regression.build_model,
                    build_data=regression.build_data, loss=loss)  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=10, learning_rate=1e-2, save_steps=0,
                             per_device_train_batch_size=16, disable_tqdm=True, lr_scheduler_type="constant", **kw)  # fmt: skip
    return Trainer(recipe, args, regression.Args(), quiet=True)


CASES = {
    # name: (Trainer arguments, the recipe's loss, fp16 loss scaling, reads per update: of its own values, of an
    # earlier update's)
    "fp32": (dict(), regression.loss, False, 0, 0),
    "fp32 unclipped": (dict(max_grad_norm=0.0), regression.loss, False, 0, 0),
    "accumulation, int counts": (dict(gradient_accumulation_steps=2), int_count_loss, False, 0, 0),
    "fp16 clipped": (dict(max_grad_norm=0.05), regression.loss, True, 0, 1),
    "fp16 unclipped, int counts": (dict(gradient_accumulation_steps=2, max_grad_norm=0.0), int_count_loss, True, 0, 1),
    "nan skip": (dict(nan_policy="skip"), regression.loss, False, 0, 1),
    "nan skip unclipped": (dict(nan_policy="skip", max_grad_norm=0.0), regression.loss, False, 0, 1),
    "fp16 nan skip unclipped": (dict(nan_policy="skip", max_grad_norm=0.0), regression.loss, True, 0, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_update_asks_the_host_for_no_more_than_it_needs(tmp_path, case):
    # fp16 and --nan_policy skip: whether the update stepped is known on the device first (GradScaler's skip, the
    # fused optimizer's); the scheduler and the skip count learn it from the next update, once its backward is
    # queued (get_scale() before and after the step was two reads of the update's own values, then one). Counts as
    # Python ints: no copy of a host value before the window's last backward (on a GPU torch.as_tensor(n,
    # device=cuda) waited for the forward to finish).
    kw, loss, fp16, reads, earlier = CASES[case]
    t = trainer(tmp_path, case.replace(" ", "_").replace(",", ""), loss, **kw)
    if fp16:  # Accelerate gives no GradScaler on a CPU: torch's own, on the same code path as a GPU's
        t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accumulation = t.args.gradient_accumulation_steps
    windows = [[t.fetch_batch() for _ in range(accumulation)] for _ in range(4)]
    t.model.train()
    t.update(windows[0])  # the first update (lazy state: the scaler's scale, the optimizer's moments)
    for window in windows[1:]:
        with HostTraffic() as traffic:
            hook = t.unwrapped_model[0].weight.register_hook(lambda g: setattr(traffic, "backward_reached", True))
            t.update(window)
            hook.remove()
        assert dict(traffic.counts) == {k: v for k, v in (("reads", reads), ("earlier", earlier)) if v}, case


def test_an_optimizer_that_cannot_skip_on_the_device_reads_whether_to_step(tmp_path):
    # --nan_policy skip with a recipe's own optimizer that takes no skip flag (not fused): the update must not step
    # on a non-finite loss, so it reads the check (one sync per update), as GradScaler does for such an optimizer.
    sgd = Recipe(name="sgd", Args=regression.Args, build_model=regression.build_model,
                 build_data=regression.build_data, loss=regression.loss,
                 build_optimizer=lambda model, ctx: torch.optim.SGD(model.parameters(), lr=1e-2))  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / "sgd"), max_steps=10, save_steps=0, nan_policy="skip",
                             per_device_train_batch_size=16, disable_tqdm=True)  # fmt: skip
    t = Trainer(sgd, args, regression.Args(), quiet=True)
    batch = t.fetch_batch()
    t.update([batch])
    with HostTraffic() as traffic:
        t.update([batch])
    assert dict(traffic.counts) == {"reads": 1}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not name.startswith("_record_function"):  # the optimizer's profiler markers
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_an_update_launches_no_kernel_a_hand_written_loop_does_not(tmp_path, clip):
    # The same update written by hand (the recipe's loss, backward, clip_grad_norm_ when clipping, the step, the
    # schedule, zero_grad) against the Trainer's, op by op. Beyond it, the Trainer's may detach the loss (a view: no
    # kernel) and, without clipping, check the gradients for --nan_policy stop in one fused pass into a zeroed flag;
    # it computes no gradient norm that nothing reads.
    t = trainer(tmp_path, f"ops{clip}", max_grad_norm=clip)
    model = copy.deepcopy(t.unwrapped_model)
    opt = default_optimizer(model, t.args)  # the Trainer's: fused AdamW, biases without weight decay
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # the constant schedule of trainer()
    batches = [t.fetch_batch() for _ in range(3)]
    t.model.train()
    counts = {}
    for name, update in (
        ("trainer", lambda batch: t.update([batch])),
        ("hand-written", lambda batch: hand_written_update(model, opt, sched, batch, clip)),
    ):
        update(batches[0])  # the optimizer's lazy state
        update(batches[1])
        with Ops() as ops:
            update(batches[2])
        counts[name] = ops.counts
    extra = {"detach": 1} if clip else {"detach": 1, "zeros": 1, "_amp_foreach_non_finite_check_and_unscale_": 1}
    assert dict(counts["trainer"] - counts["hand-written"]) == extra
    assert not counts["hand-written"] - counts["trainer"]


def hand_written_update(model, opt, sched, batch, clip):
    loss, _ = regression.loss(model, batch)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


class HiddenToo(torch.nn.Module):
    """The regression model returning its hidden features beside its prediction, as a transformers model returns
    hidden states or logits beside its loss: outputs a loss may never read."""

    def __init__(self, model):
        super().__init__()
        self.body, self.head = model[:3], model[3:]

    def forward(self, x):
        hidden = self.body(x)
        return self.head(hidden), hidden


def prediction_loss(model, batch):
    prediction, _ = model(batch["x"])
    err = (prediction.float() - batch["y"]) ** 2 * batch["mask"]
    n = batch["mask"].sum()
    return err.sum() / n.clamp(min=1), n


def test_a_bf16_update_casts_what_a_hand_written_autocast_loop_does(tmp_path):
    # A hand-written mixed-precision loop runs its forward and loss under autocast; Accelerate's forward wrapper
    # also cast every half-precision output to fp32 (and back in the backward), those the loss never reads too.
    recipe = Recipe(name="hidden", Args=regression.Args, build_model=lambda ctx: HiddenToo(regression.build_model(ctx)),
                    build_data=regression.build_data, loss=prediction_loss)  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / "bf16"), max_steps=10, learning_rate=1e-2, save_steps=0,
                             per_device_train_batch_size=16, disable_tqdm=True, lr_scheduler_type="constant",
                             mixed_precision="bf16")  # fmt: skip
    t = Trainer(recipe, args, regression.Args(dropout=0.0), quiet=True)
    model = copy.deepcopy(t.unwrapped_model)
    model.forward = types.MethodType(HiddenToo.forward, model)  # the copy's own forward, not the Trainer's
    opt = default_optimizer(model, t.args)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    def by_hand(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = prediction_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.args.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    batches = [t.fetch_batch() for _ in range(3)]
    t.model.train()
    counts = {}
    for name, update in (("trainer", lambda batch: t.update([batch])), ("hand-written", by_hand)):
        update(batches[0])
        update(batches[1])
        with Ops() as ops:
            update(batches[2])
        counts[name] = ops.counts
    assert dict(counts["trainer"] - counts["hand-written"]) == {"detach": 1}
    assert not counts["hand-written"] - counts["trainer"]
