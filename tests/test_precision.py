"""Default mixed precision follows what the hardware runs fast, asked of torch (accel_trainer/precision.py): each
answer of the capability checks is faked, so every kind of machine is tested on this one. The CIFAR recipe's
presets used to pick bf16 on every CPU, 10x slower on an AVX2-only CPU (measured, issue 15 item 14)."""

import sys
from types import MappingProxyType

import pytest
import torch
from helpers import RECIPES

sys.path.insert(0, RECIPES)
import cifar  # noqa: E402

from accel_trainer import precision, resolve_args  # noqa: E402

# torch.cpu.get_capabilities() of three CPUs (only the keys that matter) and oneDNN's bf16 answer on each.
ZEN4 = ({"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}, True)
SAPPHIRE_RAPIDS = ({"architecture": "x86_64", "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}, True)
GRAVITON3 = ({"architecture": "aarch64", "neon": True, "bf16": True, "sve_bf16": True}, True)
AVX2_ONLY = ({"architecture": "x86_64", "avx2": True, "avx512_f": False, "avx512_bf16": False}, False)
# Skylake-SP: AVX512 without bf16 instructions; oneDNN says yes (it emulates bf16 there), which is not fast.
SKYLAKE = ({"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, True)


def fake_cpu(monkeypatch, cpu):
    capabilities, onednn_bf16 = cpu
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: MappingProxyType(capabilities))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)


def fake_gpu(monkeypatch, capability):
    """A CUDA GPU of this compute capability, as torch.cuda reports it (bf16 natively from 8.0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # torch's own answer: True from 8.0, and below that only when emulation is counted (its default)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0) or including_emulation
    )
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))


@pytest.mark.parametrize(
    "cpu, expected",
    [(ZEN4, "bf16"), (SAPPHIRE_RAPIDS, "bf16"), (GRAVITON3, "bf16"), (AVX2_ONLY, "no"), (SKYLAKE, "no")],
    ids=["zen4", "sapphire_rapids", "graviton3", "avx2_only", "skylake_avx512"],
)
def test_cpu_default_is_bf16_only_with_bf16_instructions(monkeypatch, cpu, expected):
    fake_cpu(monkeypatch, cpu)
    assert precision.training_device() == torch.device("cpu")
    assert precision.fast_mixed_precision("cpu") == expected


@pytest.mark.parametrize(
    "capability, expected, fp8",
    [((9, 0), "bf16", True), ((8, 9), "bf16", True), ((8, 0), "bf16", False), ((7, 0), "fp16", False),
     ((7, 5), "fp16", False), ((6, 1), "no", False)],
    ids=["h100", "l4", "a100", "v100", "t4", "pascal"],
)  # fmt: skip
def test_cuda_default_follows_compute_capability(monkeypatch, capability, expected, fp8):
    fake_gpu(monkeypatch, capability)
    assert precision.training_device() == torch.device("cuda")
    assert precision.fast_mixed_precision("cuda") == expected
    assert precision.has_fp8("cuda") is fp8
    assert precision.training_device(use_cpu=True) == torch.device("cpu")  # --use_cpu on a GPU machine


def cifar_precision(argv):
    targs, _, _ = resolve_args(cifar, argv)
    return targs.mixed_precision


@pytest.mark.parametrize("preset", ["small", "default"])
def test_cifar_presets_take_the_fast_precision_of_the_device(monkeypatch, preset):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    fake_cpu(monkeypatch, AVX2_ONLY)
    assert cifar_precision(["--preset", preset]) == "no"  # was bf16 for --preset small: 10x slower there
    fake_cpu(monkeypatch, ZEN4)
    assert cifar_precision(["--preset", preset]) == "bf16"
    assert cifar_precision(["--preset", preset, "--mixed_precision", "no"]) == "no"  # the user's choice wins
    fake_gpu(monkeypatch, (7, 0))
    assert cifar_precision(["--preset", preset]) == "fp16"
    fake_cpu(monkeypatch, AVX2_ONLY)  # the CPU's answer under --use_cpu, whatever the GPU does
    fake_gpu(monkeypatch, (9, 0))
    assert cifar_precision(["--preset", preset, "--use_cpu"]) == "no"
    assert cifar_precision(["--preset", preset]) == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # a launcher config's precision also wins
    assert cifar_precision(["--preset", preset]) is None  # left unset: Accelerate reads the config's


def test_fp8_is_refused_without_fp8_tensor_cores(monkeypatch, tmp_path):
    from accel_trainer import TrainingArguments, UserError
    from accel_trainer.accel import build_accelerator

    fake_gpu(monkeypatch, (8, 0))  # an A100: bf16, no fp8
    with pytest.raises(UserError, match="compute capability >= 8.9"):
        build_accelerator(TrainingArguments(output_dir=str(tmp_path), mixed_precision="fp8"))


# ------------------------------------------------------------------------------------ fp8: which layers converted
class Float8Linear(torch.nn.Linear):
    """Stands for torchao's class of that name (what Accelerate's AO backend puts in place of an nn.Linear)."""


class TELinear(torch.nn.Module):
    """Stands for transformer_engine.pytorch.Linear (not an nn.Linear subclass)."""


TELinear.__name__, TELinear.__module__ = "Linear", "transformer_engine.pytorch.module.linear"


def test_fp8_layers_are_counted_and_a_model_without_any_is_refused():
    from accel_trainer import UserError

    net = cifar.CifarNet((16, 64, 128))  # its one Linear, 128 -> 10, is one no backend converts
    with pytest.raises(UserError, match="converted none of this model's 1 Linear layers"):
        precision.check_fp8_layers(net, "AO")
    ao = torch.nn.Sequential(
        torch.nn.Linear(16, 32), Float8Linear(32, 32), Float8Linear(32, 32), torch.nn.Linear(32, 4)
    )
    assert precision.check_fp8_layers(ao, "AO") == {"converted": 2, "linear": 4, "backend": "AO"}
    te = torch.nn.Sequential(TELinear(), TELinear(), torch.nn.Linear(32, 10), torch.nn.LayerNorm(4))
    assert precision.fp8_layers(te) == {"converted": 2, "linear": 3}
