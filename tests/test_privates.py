"""Every Accelerate/torch private the package uses (accel_trainer/privates.py) still exists and still is what the
package takes it for, on the installed releases: one case per use, run on real objects (an Accelerator with prepared
objects, a compiled module, a GradScaler, a fully_shard-ed module), so a release that removes or changes one fails
the case named after that use. .ci/versions runs this file on the oldest and the newest supported releases (and
`bash .ci/versions torch-2.11` on torch 2.11)."""

import functools
import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import env

from accel_trainer import privates


@pytest.fixture
def accelerator():
    """A real CPU Accelerator holding one of everything save_state writes, started and left from clean state."""
    from accelerate import Accelerator

    privates.reset_accelerate_state(partial=True)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    counter = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda d: None)
    acc.register_for_checkpointing(counter)
    acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    yield SimpleNamespace(acc=acc, model=model, opt=opt, sched=sched, loader=loader, counter=counter)
    privates.reset_accelerate_state(partial=True)


def check_reset_accelerate_state(accelerator):
    from accelerate.state import AcceleratorState, GradientState, PartialState

    assert AcceleratorState._shared_state and GradientState._shared_state
    privates.reset_accelerate_state()
    assert not AcceleratorState._shared_state and not GradientState._shared_state
    assert PartialState._shared_state  # the process group's state stays unless asked
    privates.reset_accelerate_state(partial=True)
    assert not PartialState._shared_state


def check_state_mixed_precision(accelerator):
    assert privates.state_mixed_precision(accelerator.acc.state) == "no"


def check_mark_partial_state_fsdp(accelerator):
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    privates.mark_partial_state_fsdp()
    assert PartialState().distributed_type == DistributedType.FSDP
    assert AcceleratorState().distributed_type == DistributedType.FSDP  # re-read from PartialState's shared state


def check_take_autocast_forward(accelerator):
    from accelerate import Accelerator

    privates.reset_accelerate_state()
    try:
        model = Accelerator(cpu=True, mixed_precision="bf16").prepare(torch.nn.Linear(2, 2))
        original = privates.take_autocast_forward(model)
        assert original is not None and original.__func__ is torch.nn.Linear.forward and original.__self__ is model
        assert "_original_forward" not in model.__dict__
        assert model(torch.ones(1, 2)).dtype == torch.float32  # Accelerate's wrapper itself stays until replaced
        assert privates.take_autocast_forward(torch.nn.Linear(2, 2)) is None  # no wrapper: nothing to take
    finally:
        privates.reset_accelerate_state()


def check_step_patch_without_cycle(accelerator):
    import gc
    import weakref

    from accelerate.optimizer import AcceleratedOptimizer

    model = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    wrapped = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False, scaler=scaler)
    privates.step_patch_without_cycle(wrapped)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    wrapped.step()  # Accelerate's fp16 step through the patch: the step ran, so it was not skipped
    assert not wrapped.step_was_skipped and wrapped.optimizer.step == wrapped._optimizer_original_step_method
    dropped = weakref.ref(wrapped)
    gc.disable()
    try:
        del wrapped
        assert dropped() is None  # freed by reference counting alone
    finally:
        gc.enable()


def check_uncompiled(accelerator):
    model = torch.nn.Linear(2, 2)
    assert privates.uncompiled(torch.compile(model)) is model  # nothing compiles until it is called
    assert privates.uncompiled(model) is model


def check_scaler_scale(accelerator):
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scale = privates.scaler_scale(scaler)
    assert scale is None  # not created until the first scale(); a disabled scaler answers None too
    scaler.scale(torch.ones(1, requires_grad=True))
    scale = privates.scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == 8.0


def check_flag_non_finite(accelerator):
    grads = [torch.ones(2), torch.ones(3, dtype=torch.bfloat16)]
    flag = torch.zeros(())
    privates.flag_non_finite(grads, flag, torch.ones(()))
    assert flag.item() == 0.0 and all(torch.equal(g, torch.ones_like(g)) for g in grads)  # left as they were
    grads[1][0] = float("nan")
    privates.flag_non_finite(grads, flag, torch.ones(()))
    assert flag.item() == 1.0


def fused_adamw_after_one_step():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        if not opt.state:
            opt.step()
    return model, opt


def check_skips_on_device(accelerator):
    assert privates.skips_on_device(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True))
    assert not privates.skips_on_device(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))


def check_step_unless(accelerator):
    model, opt = fused_adamw_after_one_step()
    before = [p.detach().clone() for p in model.parameters()]
    privates.step_unless(opt, torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped: nothing moved
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())  # nor the step counts
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    privates.step_unless(opt, torch.zeros(()))
    assert not torch.equal(before[0], model.weight) and opt.state[model.weight]["step"].item() == 2


def check_scaler_flag_non_finite(accelerator):
    model, opt = fused_adamw_after_one_step()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    before = model.weight.detach().clone()
    privates.scaler_flag_non_finite(scaler, opt, torch.tensor(True))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(before, model.weight) and scaler.get_scale() == 4.0  # skipped and backed off


def check_foreach_mul_(accelerator):
    tensors = [torch.ones(2), torch.ones(3)]
    privates.foreach_mul_(tensors, torch.tensor(3.0))
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in tensors)


def check_foreach_copy_(accelerator):
    tensors = [torch.zeros(2), torch.zeros(3)]
    privates.foreach_copy_(tensors, [torch.ones(2), torch.ones(3)])
    assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)


def check_fused_optimizer_device_types(accelerator):
    types = privates.fused_optimizer_device_types()
    assert isinstance(types, list | tuple) and "cuda" in types


def check_mkldnn_bf16_supported(accelerator):
    assert isinstance(privates.mkldnn_bf16_supported(), bool)


def check_inductor_config(accelerator):
    assert isinstance(privates.inductor_config().cpp.weight_prepack, bool)


def check_batchnorm_base(accelerator):
    base = privates.batchnorm_base()
    for norm in (torch.nn.BatchNorm1d(2), torch.nn.BatchNorm2d(2), torch.nn.SyncBatchNorm(2)):
        assert isinstance(norm, base)
    assert not isinstance(torch.nn.LayerNorm(2), base)


# Needs a process group (a world of 1, in a child process) and fully_shard; the flight recorder needs the group too.
FSDP_CHILD = """
import json, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from accel_trainer import privates
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
model = fully_shard(torch.nn.Linear(2, 2), mesh=dist.device_mesh.init_device_mesh("cpu", (1,)), mp_policy=policy)
assert privates.fsdp_mixed_precision_policy(model) == policy, privates.fsdp_mixed_precision_policy(model)
dist.all_reduce(torch.ones(1))
assert isinstance(json.loads(privates.flight_recorder_json()), dict)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
ddp(torch.ones(1, 2))  # a forward with gradient sync on, whose backward never runs
privates.ddp_forget_forward(ddp)
ddp(torch.ones(1, 2)).sum().backward()  # and the next forward and backward run as usual
dist.destroy_process_group()
print("ok")
"""


@functools.cache
def fsdp_child() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", FSDP_CHILD],
        capture_output=True,
        text=True,
        env={**env(), "TORCH_FR_BUFFER_SIZE": "64"},
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def check_fsdp_mixed_precision_policy_and_flight_recorder_json_and_ddp_forget_forward(accelerator):
    out = fsdp_child()
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


CHECKS = {name[len("check_") :]: f for name, f in globals().items() if name.startswith("check_")}
# One child process checks the three uses that need a process group.
CHECKS["fsdp_mixed_precision_policy"] = CHECKS["flight_recorder_json"] = CHECKS["ddp_forget_forward"] = CHECKS.pop(
    "fsdp_mixed_precision_policy_and_flight_recorder_json_and_ddp_forget_forward"
)
USES = sorted(n for n, f in inspect.getmembers(privates, inspect.isfunction) if f.__module__ == privates.__name__)


def run_check(use, accelerator):
    try:
        CHECKS[use](accelerator)
    except (AttributeError, ImportError, TypeError, AssertionError) as e:
        pytest.fail(f"privates.{use}: the private it relies on is gone or changed in this release: {e!r}")


@pytest.mark.slow
@pytest.mark.parametrize("use", USES)
def test_each_private_use_still_works(use, accelerator):
    run_check(use, accelerator)


def test_every_use_has_a_case():
    assert sorted(set(CHECKS)) == USES


def test_a_removed_private_fails_naming_its_use(accelerator, monkeypatch):
    """What a release that drops one looks like: GradScaler without _get_scale_async, a torch without
    torch.nn.modules.batchnorm._BatchNorm."""
    monkeypatch.delattr(torch.amp.GradScaler, "_get_scale_async")
    with pytest.raises(pytest.fail.Exception, match=r"privates\.scaler_scale: .*_get_scale_async"):
        run_check("scaler_scale", accelerator)
    monkeypatch.delattr(torch.nn.modules.batchnorm, "_BatchNorm")
    with pytest.raises(pytest.fail.Exception, match=r"privates\.batchnorm_base: .*_BatchNorm"):
        run_check("batchnorm_base", accelerator)
