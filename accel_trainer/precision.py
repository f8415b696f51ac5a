"""Which mixed precision a device runs fast, asked of torch at run time: the one place where a default precision
is chosen from the hardware (recipes/cifar.py's presets, the wizard's offer, the fp8 check of build_accelerator).
And how a prepared model runs in the run's mixed precision (AutocastForward, update_autocast).

Never from what the machine that wrote the code had: a preset tuned on a CPU with AVX512-BF16 ran many times
slower in bf16 on an AVX2-only CPU (docs/cifar.md), which has no bf16 arithmetic (oneDNN converts every value to
fp32 and back).
"""

from __future__ import annotations

import weakref

import torch
from accelerate.utils import convert_to_fp32

from . import privates
from .errors import UserError

# CPU instruction sets with bf16 arithmetic, as torch.cpu.get_capabilities() names them: x86 AVX512-BF16 (Cooper
# Lake, Zen 4 and newer) and AMX-BF16 (Sapphire Rapids and newer); Arm's BF16 extension (Neoverse V1/N2, Graviton3).
# An AVX512 CPU without them (Skylake, Ice Lake) passes oneDNN's own check, which counts emulated bf16: not fast.
CPU_BF16_INSTRUCTIONS = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def training_device(use_cpu: bool = False) -> torch.device:
    """The kind of device a run trains on: the CPU when asked (--use_cpu) or when torch sees no accelerator."""
    accelerator = None if use_cpu else torch.accelerator.current_accelerator(check_available=True)
    return accelerator if accelerator is not None else torch.device("cpu")


def has_fast_bf16(device) -> bool:
    """The device computes in bf16 natively (not emulated)."""
    kind = torch.device(device).type
    if kind == "cuda":
        # Compute capability >= 8.0, or ROCm. Without including_emulation=False torch also says yes for a V100 or
        # a T4, which run bf16 through fp32 units.
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if kind == "xpu":
        return torch.xpu.is_available() and torch.xpu.is_bf16_supported()
    if kind == "cpu":
        capabilities = torch.cpu.get_capabilities()
        native = any(capabilities.get(name, False) for name in CPU_BF16_INSTRUCTIONS)
        return native and privates.mkldnn_bf16_supported()  # and oneDNN (convs, matmuls) uses it
    return False


def has_fp8(device) -> bool:
    """fp8 tensor cores: CUDA compute capability >= 8.9 (Ada, Hopper and newer). An fp8 backend is needed too."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def fast_mixed_precision(device) -> str:
    """The default mixed precision for `device`: "bf16" where it computes bf16 natively; "fp16" (with the
    Trainer's loss scaling) on a CUDA GPU with tensor cores but no bf16 (V100, T4); else "no" (fp32).
    Never fp8: it needs a backend and layers it converts, so it is asked for with --mixed_precision fp8."""
    device = torch.device(device)
    if has_fast_bf16(device):
        return "bf16"
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (7, 0):
        return "fp16"
    return "no"


# --------------------------------------------------------------------------------------------------------- fp8
def _is_fp8_linear(module) -> bool:
    """A linear layer an fp8 backend put in place of an nn.Linear: torchao's Float8Linear, MS-AMP's FP8Linear,
    TransformerEngine's Linear / LayerNormLinear / LayerNormMLP / GroupedLinear. By class, so that no backend
    has to be importable to ask."""
    cls = type(module)
    name = cls.__name__.lower()
    if "float8" in name or "fp8" in name:
        return True
    return cls.__module__.startswith("transformer_engine") and ("linear" in name or name == "layernormmlp")


def fp8_layers(model) -> dict:
    """How many of the model's linear layers run in fp8: {"converted": n, "linear": all linear layers}."""
    converted = linear = 0
    for module in model.modules():
        fp8 = _is_fp8_linear(module)
        converted += fp8
        linear += fp8 or isinstance(module, torch.nn.Linear)
    return {"converted": converted, "linear": linear}


def check_fp8_layers(model, backend: str) -> dict:
    """After Accelerate's prepare() under --mixed_precision fp8: the count of fp8 layers, or a UserError when there
    are none. Accelerate converts only nn.Linear layers with in and out features divisible by 16, and torchao also
    keeps the first and last in bf16: on other models the run would silently be bf16 (measured on the CIFAR net,
    whose only Linear is 256 -> 10; GPT-2's Conv1D layers are not nn.Linear either)."""
    counts = {**fp8_layers(model), "backend": backend}
    if counts["converted"] == 0:
        raise UserError(
            f"--mixed_precision fp8: the fp8 backend ({backend}) converted none of this model's {counts['linear']} "
            "Linear layers, so the run would train in bf16 under an fp8 label. Backends convert nn.Linear layers "
            "whose in and out features are multiples of 16 (torchao keeps the first and last in bf16). Use "
            "--mixed_precision bf16, or a model with such layers."
        )
    return counts


# ------------------------------------------------------------------------------------------- autocast forward
class AutocastForward:
    """A prepared model's forward in bf16/fp16: the model's own forward under the run's autocast, its half-precision
    outputs returned in fp32, as Accelerate's prepare() makes it (evaluation, a handler's or a notebook's own call
    of the model), with two differences.

    It holds the model by a weak reference. Accelerate's is a method bound to the model and stored on it (with
    `_original_forward`, another), so every model referred to itself, and a dropped Trainer's model (on a GPU, its
    memory) lived on until Python's next full garbage collection, under the next Trainer of a notebook or a sweep.

    Inside an autocast region it adds nothing. The update runs the recipe's loss under the run's autocast
    (update_autocast), as a hand-written mixed-precision loop runs its forward and loss: autocast's own rules then
    cast what each op needs (a loss in fp32), and no output the loss may never read is cast to fp32 (a language
    model's logits beside its loss)."""

    def __init__(self, module, forward, autocast):
        self.module, self.forward, self.autocast = weakref.ref(module), forward, autocast
        # The device type as a plain string: under torch.compile an attribute of the autocast object is no value
        # dynamo can pass to is_autocast_enabled, a graph break at the top of every compiled forward
        # (tests/test_compile_cpu.py).
        self.device = str(autocast.device)

    def __call__(self, *args, **kwargs):
        module = self.module()
        if torch.is_autocast_enabled(self.device):
            return self.forward(module, *args, **kwargs)
        with self.autocast:
            out = self.forward(module, *args, **kwargs)
        return convert_to_fp32(out)

    def __deepcopy__(self, memo):  # a copy of the model (the EMA's) runs its own weights
        module = self.module()
        return AutocastForward(memo.get(id(module), module), self.forward, self.autocast)


def own_autocast_forward(accelerator, model) -> bool:
    """After prepare(): Accelerate's bf16/fp16 forward on the model replaced by an AutocastForward; False where it put
    none, or another (fp8 backends wrap it again), which stays as it is."""
    if accelerator.mixed_precision not in ("bf16", "fp16"):
        return False
    module = accelerator.unwrap_model(model, keep_torch_compile=False)
    original = privates.take_autocast_forward(module)
    if original is None:
        return False
    module.forward = AutocastForward(module, original.__func__, update_autocast(accelerator))
    return True


def update_autocast(accelerator):
    """The run's autocast, as Accelerate builds it for its forward (a torch.autocast to enter around a forward and
    its loss), or None in fp32."""
    from accelerate.utils import get_mixed_precision_context_manager

    if not accelerator.native_amp:
        return None
    return get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
