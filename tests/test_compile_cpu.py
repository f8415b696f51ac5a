"""--torch_compile on a CPU with the CIFAR recipe's net: with inductor's oneDNN weight prepacking, torch 2.13.0's
generated code corrupted the heap (pytorch/pytorch#181618) in every run on this project's AVX512 CPUs; the Trainer
switches prepacking off (accel.inductor_on_cpu). Run in a fresh process: a heap corruption aborts the process.
On a CPU where the bug does not show, this passes with or without the setting."""

import json
import os
import subprocess
import sys

from helpers import ROOT, env

RUN = """
import json, sys, torch
sys.path.insert(0, "recipes")
import cifar
from torch.utils.data import TensorDataset
from accel_trainer import Recipe, Trainer, TrainingArguments

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 3, 32, 32, generator=g), torch.randint(0, 10, (1024,), generator=g))

def loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y), len(y)

recipe = Recipe(
    name="compiled_cifarnet",
    build_model=lambda ctx: cifar.CifarNet((32, 64, 128)).to(memory_format=torch.channels_last),
    build_data=lambda ctx: {"train": data},
    loss=loss,
)
args = TrainingArguments(output_dir=sys.argv[1], torch_compile=sys.argv[2] == "compile", use_cpu=True,
                         per_device_train_batch_size=512, max_steps=2, save_steps=0, logging_steps=1,
                         disable_tqdm=True, mixed_precision="no")
Trainer(recipe, args, quiet=True).fit()
"""


def train(out, mode):
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(out), mode], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, f"{mode} run exited {proc.returncode}: {proc.stderr[-3000:]}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
    with open(os.path.join(out, "run_config.json")) as f:
        return losses, json.load(f)["process"]["inductor"]


def test_compiled_cifarnet_trains_on_a_cpu_like_eager(tmp_path):
    compiled, setting = train(tmp_path / "compiled", "compile")
    eager, no_setting = train(tmp_path / "eager", "eager")
    assert setting == {"cpp.weight_prepack": False} and no_setting is None
    assert len(compiled) == 2
    assert all(abs(a - b) < 1e-4 for a, b in zip(compiled, eager)), (compiled, eager)  # fp32: rounding apart


# The recipe check (preflight.py) runs its forward passes on the eager module: through the compiled one, its
# train-mode forward under no_grad would be a graph of its own, and the first real update a recompile (on an H100:
# 2 of the CIFAR run's recompiles, ~10 s each). 2 updates of one shape, with no evaluation, need the one graph the
# training forward compiles; TORCH_LOGS=recompiles (torch's documented log) names every recompile.
ONE_GRAPH = """
import sys, torch
from torch.utils.data import TensorDataset
from accel_trainer import Recipe, Trainer, TrainingArguments

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))

def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y), len(y)

recipe = Recipe(name="compiled_mlp", build_data=lambda ctx: {"train": data}, loss=loss,
                build_model=lambda ctx: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
args = TrainingArguments(output_dir=sys.argv[1], torch_compile=True, use_cpu=True, per_device_train_batch_size=16,
                         max_steps=2, save_steps=0, logging_steps=1, disable_tqdm=True, mixed_precision="no")
Trainer(recipe, args, quiet=True).fit()
"""


def test_the_recipe_check_adds_no_graph_to_a_compiled_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", ONE_GRAPH, str(tmp_path / "out")],
        capture_output=True, text=True, env={**env(), "TORCH_LOGS": "recompiles"}, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Recompiling function" not in proc.stderr, proc.stderr[-3000:]
