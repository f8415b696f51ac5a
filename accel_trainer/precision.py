"""Which mixed precision a device runs fast, asked of torch at run time: the one place where a default precision
is chosen from the hardware (recipes/cifar.py's presets, the wizard's offer, the fp8 check of build_accelerator).

Never from what the machine that wrote the code had: a preset tuned on a CPU with AVX512-BF16 ran 10x slower in
bf16 on an AVX2-only CPU, which has no bf16 arithmetic (oneDNN converts every value to fp32 and back).
"""

from __future__ import annotations

import torch

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
        return native and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # and oneDNN (convs, matmuls) uses it
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
