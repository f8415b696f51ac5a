"""What one optimizer update asks of the host, counted on a CPU the way a GPU would feel it: every value read back
to the host (`.item()`, `float()`, `bool()` of a tensor: aten._local_scalar_dense, a host-device sync on a GPU) and
every tensor made from host values or copied across devices (aten.lift_fresh, a cross-device _to_copy/copy_: a
host-to-device copy on a GPU, blocking from pageable memory). torch.cuda.set_sync_debug_mode has no CPU twin, so a
TorchDispatchMode counts the ops the update dispatches; the counts are kept here so that a new sync shows up."""

import sys
from collections import Counter

import pytest
import torch
from helpers import RECIPES
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Recipe, Trainer, TrainingArguments  # noqa: E402


class HostTraffic(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.counts["reads"] += 1
        elif name in ("lift_fresh", "lift_fresh_copy"):
            self.counts["copies"] += 1
        elif name in ("_to_copy", "copy_"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
            if len(devices) > 1:
                self.counts["copies"] += 1
        return func(*args, **kwargs)


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
    # name: (Trainer arguments, the recipe's loss, fp16 loss scaling, host reads per update, copies per update)
    "fp32": (dict(), regression.loss, False, 0, 0),
    "accumulation, int counts": (dict(gradient_accumulation_steps=2), int_count_loss, False, 0, 0),
    "fp16 clipped": (dict(max_grad_norm=0.05), regression.loss, True, 1, 0),
    "fp16 unclipped, int counts": (dict(gradient_accumulation_steps=2), int_count_loss, True, 1, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_update_asks_the_host_for_no_more_than_it_needs(tmp_path, case):
    # fp16: the one read is whether GradScaler skipped the step (the scheduler and the EMA must know on the host);
    # get_scale() before and after the step was two. Counts as Python ints: no copy of a host value before the
    # window's last backward (on a GPU torch.as_tensor(n, device=cuda) waited for the forward to finish).
    kw, loss, fp16, reads, copies = CASES[case]
    t = trainer(tmp_path, case.replace(" ", "_").replace(",", ""), loss, **kw)
    if fp16:  # Accelerate gives no GradScaler on a CPU: torch's own, on the same code path as a GPU's
        t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accumulation = t.args.gradient_accumulation_steps
    windows = [[t.fetch_batch() for _ in range(accumulation)] for _ in range(4)]
    t.model.train()
    t.update(windows[0])  # the first update (lazy state: the scaler's scale, the optimizer's moments)
    for window in windows[1:]:
        with HostTraffic() as traffic:
            t.update(window)
        assert dict(traffic.counts) == {k: v for k, v in (("reads", reads), ("copies", copies)) if v}, case
