"""Every use the package makes of an Accelerate or torch private, in one place, each with why no public API does it.

A release may rename or remove any of these without notice; tests/test_privates.py checks each one exists with the
kind used here (one case per use, named after it), so such a release fails a test that names the use rather than a
run deep inside a save or a resume. Nothing here is imported at package import: each function imports what it needs.
"""

# ------------------------------------------------------------------------------------------------ Accelerate


def reset_accelerate_state(*, partial: bool = False) -> None:
    """Start Accelerate's process-wide singletons anew (AcceleratorState, GradientState; PartialState too when
    `partial`). Why private: Accelerate has no public way to do it, and a second Trainer in the same notebook or test
    process would otherwise inherit the first one's precision, compile and accumulation settings."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=partial)
    GradientState._reset_state()


def state_mixed_precision(state) -> str:
    """The mixed precision AcceleratorState resolved ("no", "fp16", "bf16", "fp8"). Why private: the public
    `mixed_precision` property answers "fp8" only after its own fp8 checks; AcceleratorState.__init__ itself hands
    `_mixed_precision` to the FSDP plugin, and sharding.activate_fsdp repeats that step."""
    return state._mixed_precision


def mark_partial_state_fsdp() -> None:
    """Record FSDP as the distributed type in PartialState's shared state, as AcceleratorState.__init__ does for FSDP
    on accelerator devices. Why private: every later AcceleratorState() (the optimizer wrapper makes one) re-reads
    PartialState's distributed_type, and PartialState has no public setter; without it FSDP on CPU turns back into
    MULTI_CPU."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def take_autocast_forward(module):
    """The forward that Accelerate's prepare() wrapped in its bf16/fp16 autocast forward on `module` (a method
    bound to it), taken off the module (`_original_forward` removed; the wrapper stays until replaced), or None where
    prepare() put no such wrapper (fp32, or another wrapper on top of it, as fp8 backends put). Why private:
    Accelerate keeps the original forward as `module._original_forward` and recognises its wrapper by
    `ConvertOutputsToFp32`; its public unwrap_model(keep_fp32_wrapper=False) restores the original but also unwraps
    DDP and compiled models, which the Trainer keeps."""
    from types import MethodType

    from accelerate.utils.operations import ConvertOutputsToFp32

    wrapper, original = module.__dict__.get("forward"), module.__dict__.get("_original_forward")
    ours = isinstance(wrapper, MethodType) and isinstance(getattr(wrapper.__func__, "__wrapped__", None),
                                                           ConvertOutputsToFp32)  # fmt: skip
    if not (ours and isinstance(original, MethodType) and original.__self__ is module):
        return None
    del module._original_forward
    return original


def step_patch_without_cycle(optimizer) -> None:
    """Under fp16, Accelerate's optimizer wrapper (AcceleratedOptimizer) keeps its step patched to mark that the step
    ran (how it tells a step GradScaler skipped) as a closure over the wrapper itself: the wrapper referred to itself,
    so a dropped Trainer's optimizer (the model's weights and their state) lived until Python's next full garbage
    collection. Replaced by the same patch holding the wrapper by a weak reference; nothing where there is none (no
    scaler). Why private: the patch is Accelerate's `_optimizer_patched_step_method`, over
    `_optimizer_original_step_method`, setting `_accelerate_step_called`; no public API sets them."""
    import weakref

    if getattr(optimizer, "_optimizer_patched_step_method", None) is None:
        return
    wrapper, step = weakref.ref(optimizer), optimizer._optimizer_original_step_method

    def patched_step(*args, **kwargs):
        wrapper()._accelerate_step_called = True
        return step(*args, **kwargs)

    optimizer._optimizer_patched_step_method = patched_step


def uncompiled(model):
    """The module torch.compile wrapped (OptimizedModule._orig_mod), or `model` itself when it is not compiled.
    Why private: torch has no public accessor for a compiled module's original; Accelerate's own
    extract_model_from_parallel reads `_orig_mod` too, but also unwraps DDP/FSDP, which the callers need kept."""
    return getattr(model, "_orig_mod", model)


def fsdp_mixed_precision_policy(module):
    """The MixedPrecisionPolicy fully_shard applied to `module` (an FSDPModule). Why private: torch keeps it on the
    module's private FSDP state only (`_get_fsdp_state()._mp_policy`); no public getter exists."""
    return module._get_fsdp_state()._mp_policy


def scaler_scale(scaler):
    """GradScaler's scale tensor without a host read (None for a disabled scaler). Why private: the public
    get_scale() reads it to the host (a sync per call); `_get_scale_async` is GradScaler's own tensor read."""
    return scaler._get_scale_async()


def flag_non_finite(tensors, flag, one) -> None:
    """Set `flag` (a 0-d float32 tensor on their device, 0.0 before) to 1.0 if any of `tensors` holds an inf or a
    NaN, in one fused pass per dtype, on the device (no host read); `one`: a 0-d float32 1.0 there. Why private:
    torch has this check only as torch._amp_foreach_non_finite_check_and_unscale_, what GradScaler.unscale_ runs
    (here with a scale of 1.0, which leaves the tensors as they are); the public way, the norm
    (torch.nn.utils.get_total_norm), launches three kernels and allocates a tensor per input."""
    import torch

    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)


def skips_on_device(optimizer) -> bool:
    """Whether optimizer.step() can skip itself on the device, given GradScaler's flag (step_unless): torch's
    fused optimizers (Adam, AdamW, SGD, Adagrad with fused=True). Why private: GradScaler asks the same
    `_step_supports_amp_scaling` attribute; torch has no public way to ask."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer, found_inf) -> None:
    """optimizer.step(), which changes nothing (parameters, state, step counts) where `found_inf` (a 0-d float32
    tensor on the device) is 1.0, decided on the device. Why private: it is GradScaler's protocol with the
    optimizers of skips_on_device (the `grad_scale` and `found_inf` attributes step() reads, set around the call
    as GradScaler._maybe_opt_step sets them); torch has no public conditional step."""
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def scaler_flag_non_finite(scaler, optimizer, flag) -> None:
    """After scaler.unscale_(optimizer): count `flag` (a 0-d bool tensor: a non-finite loss) as an overflow, so that
    scaler.step skips the step and scaler.update backs the scale off, as for an inf gradient, on the device. Why
    private: GradScaler keeps the overflow flags unscale_ found in `_per_optimizer_states`, and has no public way to
    add one."""
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        found.add_(flag.to(found.device)).clamp_(max=1.0)  # 1.0 exactly: what a fused step's check compares with


def foreach_mul_(tensors, factor) -> None:
    """Multiply a list of tensors in place by one factor, in one kernel launch per group. Why private: torch's
    foreach ops are only exposed as `torch._foreach_*` (documented, in beta); a Python loop is one launch each."""
    import torch

    torch._foreach_mul_(tensors, factor)


def foreach_copy_(tensors, sources) -> None:
    """Copy a list of tensors into another in place, in one kernel launch per group (see foreach_mul_)."""
    import torch

    torch._foreach_copy_(tensors, sources)


def fused_optimizer_device_types() -> list:
    """The device types that have fused optimizer kernels. Why private: torch has no public way to ask
    (torch.utils._foreach_utils._get_fused_kernels_supported_devices is what torch.optim checks itself)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN (convs, matmuls on a CPU) runs bf16 natively. Why private: torch.backends.mkldnn has no public
    bf16 query; torch.ops.mkldnn._is_mkldnn_bf16_supported is what torch's own tests use."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def inductor_config():
    """torch._inductor.config, the module holding inductor's settings. Why private: inductor's settings live there
    only; torch.compile(options=...) cannot reach a compile Accelerate's prepare() starts."""
    import torch._inductor.config as inductor

    return inductor


def batchnorm_base():
    """torch.nn.modules.batchnorm._BatchNorm, the base of BatchNorm1d/2d/3d and SyncBatchNorm. Why private: torch
    has no public base class for them (listing the four would miss LazyBatchNorm* and subclasses)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def flight_recorder_json() -> str:
    """torch's Flight Recorder (the last collectives of this rank) as JSON. Why private: torch has no public way to
    read its recorder from Python (the public dump-on-timeout file is written by the NCCL watchdog only)."""
    import torch._C._distributed_c10d as c10d

    return c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)


def ddp_forget_forward(ddp) -> None:
    """Make a DistributedDataParallel forget a forward whose backward will not run (micro_batch.py: the ranks that
    did not run out of memory ran it with gradient sync on, and the update is redone). Why private: the reducer's
    `_reset_state` is what torch's own DDP._update_process_group calls; DDP has no public reset."""
    ddp.reducer._reset_state()
