"""--torch_compile on a CPU with the CIFAR recipe's net: with inductor's oneDNN weight prepacking, torch 2.13.0's
generated code corrupted the heap (pytorch/pytorch#181618) in every run on this project's AVX512 CPUs; the Trainer
switches prepacking off (accel.inductor_on_cpu). Run in a fresh process: a heap corruption aborts the process.
On a CPU where the bug does not show, this passes with or without the setting."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, env

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

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


# Trainers of one recipe in one process, as a sweep of seeds in a notebook or bench/cifar.py's loop runs them, each
# 12 updates with the flags a user has by default (clipping at 1.0, a log row every 10 updates), in bf16 autocast
# (the mixed-precision forward, precision.AutocastForward, runs inside the compiled region). The update is
# capturable where the shapes are static: the forward is one graph (no break: a break is a host round trip and a
# graph CUDA graphs cannot record whole), the later updates and the second Trainer compile nothing again (dynamo
# guards on the modules' structure, not their identity), and torch.compile is called with the mode asked for.
TRAINERS = """
import json, sys, torch
from torch._dynamo.utils import counters
from torch.utils.data import TensorDataset
from accel_trainer import Recipe, Trainer, TrainingArguments

out, mode, precision, samples, drop_last, trainers = sys.argv[1:]
modes, compile = [], torch.compile
def spy(*args, **kwargs):  # what Accelerate's prepare() asks of torch.compile
    modes.append(kwargs.get("mode"))
    return compile(*args, **kwargs)
torch.compile = spy

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(int(samples), 8, generator=g), torch.randn(int(samples), 1, generator=g))

def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y), len(y)

recipe = Recipe(name="compiled_mlp", build_data=lambda ctx: {"train": data}, loss=loss,
                build_model=lambda ctx: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
seen = []
for seed in range(int(trainers)):
    args = TrainingArguments(output_dir=f"{out}/{seed}", torch_compile_mode=mode, use_cpu=True, seed=seed,
                             per_device_train_batch_size=16, max_steps=12, save_steps=0, disable_tqdm=True,
                             mixed_precision=precision, dataloader_drop_last=drop_last == "drop")
    Trainer(recipe, args).fit()
    seen.append({"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())})
print("COUNTS " + json.dumps({"runs": seen, "modes": modes}))
"""


def trainers(tmp_path, mode: str, precision: str, samples: int, drop_last: bool, n: int) -> tuple[dict, str]:
    args = [str(tmp_path / mode), mode, precision, str(samples), "drop" if drop_last else "keep", str(n)]
    proc = subprocess.run(
        [sys.executable, "-c", TRAINERS, *args],
        capture_output=True, text=True, env={**env(), "TORCH_LOGS": "recompiles"}, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line[len("COUNTS ") :]), proc.stdout + proc.stderr


def test_a_second_trainer_of_the_recipe_compiles_nothing_and_the_update_is_one_graph(tmp_path):
    counts, said = trainers(tmp_path, "max-autotune-no-cudagraphs", "bf16", samples=64, drop_last=True, n=2)
    first, second = counts["runs"]
    assert first == second == {"graphs": 1, "breaks": 0}, counts  # one graph in all, compiled once, no break
    assert "Recompiling function" not in said, said[-3000:]  # TORCH_LOGS=recompiles names every recompile
    assert counts["modes"] == ["max-autotune-no-cudagraphs"] * 2  # the mode reached torch.compile


def test_what_cuda_graphs_cannot_take_is_one_note_line_each(tmp_path):
    # 70 = 4 x 16 + 6: each epoch ends in a batch of another shape; and this is a CPU, which has no CUDA graphs
    counts, said = trainers(tmp_path, "reduce-overhead", "no", samples=70, drop_last=False, n=1)
    notes = [line for line in said.splitlines() if line.startswith("note: --torch_compile_mode")]
    assert notes == [
        "note: --torch_compile_mode reduce-overhead records CUDA graphs, which need a CUDA device: on cpu inductor "
        "compiles as in its default mode, without them.",
        "note: --torch_compile_mode reduce-overhead: each epoch's last batch holds 6 samples on some rank, another "
        "shape, which is compiled and recorded anew; --dataloader_drop_last keeps one shape.",
    ], said[-3000:]
    assert counts["modes"] == ["reduce-overhead"]
