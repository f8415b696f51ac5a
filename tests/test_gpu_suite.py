"""bench/gpu.py in its CPU reduced mode: every row of the suite gets a status, the CUDA-only ones say so, and the
rows that run on a CPU produce their numbers through the real recipes (tiny settings).

torch.compile is left out here (--skip): compiling cold costs ~30 s on this 2-core machine, more than the rest of
the suite; `python bench/gpu.py --cpu` runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import RECIPES, ROOT, env, metrics


def test_gpu_suite_cpu_mode_reports_every_row(tmp_path):
    out = tmp_path / "suite"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--cpu", "--out", str(out), "--skip", "torch_compile"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "suite.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert report["mode"] == "cpu-reduced"
    assert list(rows) == ["cifar_5_seeds", "bf16", "fp16", "fp8", "torch_compile", "overhead", "peak_memory"]
    for name, row in rows.items():
        assert row["status"] == "ok" or row["status"].startswith(("skipped: ", "failed: ")), (name, row)
        assert name in proc.stdout  # the printed table has the row too
    # CUDA-only checks are skipped, and say why
    assert rows["fp16"]["status"].startswith("skipped: needs CUDA")
    assert rows["fp8"]["status"].startswith("skipped: needs CUDA")
    assert rows["torch_compile"]["status"] == "skipped: --skip"
    # what a CPU can run did run, with numbers from the real runs
    for name in ("cifar_5_seeds", "bf16", "overhead", "peak_memory"):
        assert rows[name]["status"] == "ok", (name, rows[name])
    cifar = rows["cifar_5_seeds"]["metrics"]
    assert cifar["seeds"] == 2 and 0 <= cifar["accuracy_mean"] <= 1 and cifar["images_per_s_mean"] > 0
    assert rows["bf16"]["metrics"]["mixed_precision"] == "bf16" and rows["bf16"]["metrics"]["skipped_steps"] == 0
    overhead = rows["overhead"]["metrics"]  # bench/overhead.py's like-for-like loops
    assert overhead["device"] == "cpu" and overhead["steps"] == 100
    assert (
        min(overhead[f"{k}_ms_per_step"] for k in ("plain", "accelerate", "trainer", "defaults", "plain_defaults")) > 0
    )
    # on a CPU in fp32 the Trainer does the hand-written loop's arithmetic: the same weights, bit for bit
    assert set(overhead["final_weights"].values()) == {"bit-identical"}, overhead["final_weights"]
    assert min(overhead["peak_memory_mb"].values()) > 0
    assert rows["peak_memory"]["metrics"]["peak_memory_mb"] > 0
    assert all(r.get("met") is None for r in rows.values())  # goals are judged on a GPU only


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", os.path.join(ROOT, "bench", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_row_model_has_layers_the_fp8_backends_convert(suite, tmp_path):
    # The fp8 row used to train the CIFAR net, whose only Linear (256 -> 10) both backends skip: "ok" meant bf16.
    # Its tiny Llama must have layers that Accelerate's own torchao filter converts (features divisible by 16, not
    # the first or last Linear) and that TransformerEngine's convert_model converts (features divisible by 16).
    import torch
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers
    from transformers import AutoConfig, AutoModelForCausalLM

    def converted(model):
        first_last = find_first_last_linear_layers(model)
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        ao = sum(filter_linear_layers(m, n, first_last) for n, m in linears)
        te = sum(m.in_features % 16 == 0 and m.out_features % 16 == 0 for _, m in linears)
        return ao, te

    sys.path.insert(0, RECIPES)
    import cifar

    folder, text = suite.tiny_llama(str(tmp_path))
    llama = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert converted(llama) == (13, 14)  # 4 attention + 3 MLP projections x 2 layers; lm_head (vocab) is not
    assert converted(cifar.CifarNet((64, 256, 256))) == (0, 0)


def test_fp8_row_command_runs(suite, tmp_path):
    # The row's command line, on the CPU in fp32 (fp8 needs a GPU with compute capability >= 8.9): the recipe
    # builds the tiny Llama from its config, trains, and run_config.json has the fp8_layers entry (None here).
    cmd, out = suite.fp8_command(SimpleNamespace(out=str(tmp_path)), "no", steps=4)
    proc = subprocess.run(cmd + ["--use_cpu"], capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = json.loads(open(os.path.join(out, "run_config.json")).read())
    assert config["topology"]["mixed_precision"] == "no" and config["fp8_layers"] is None
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    assert losses


def test_torch_compile_compiles_where_flops_are_counted(tmp_path):
    # On every H100/H200 the peak is known, so the first update counts its FLOPs. Under torch.utils.flop_counter's
    # dispatch mode dynamo does not trace, and it marked the model's code as skipped for the rest of the process:
    # --torch_compile compiled 0 graphs on a GPU. --peak_tflops takes the same path on a CPU.
    from torch._dynamo.utils import counters  # dynamo's own graph count (private; no public counter exists)

    sys.path.insert(0, RECIPES)
    import regression

    from accel_trainer import Trainer

    before = counters["stats"]["unique_graphs"]
    t = Trainer.from_recipe(regression, output_dir=str(tmp_path), peak_tflops=1.0, torch_compile=True, max_steps=4,
                            logging_steps=2, save_steps=0, quiet=True, disable_tqdm=True)  # fmt: skip
    t.fit()
    assert counters["stats"]["unique_graphs"] > before, dict(counters["stats"])
    forward = 2 * 16 * (16 * 32 + 32 * 4)  # the MLP of tests/test_observability.py's MFU test: the same count
    assert t.meter.flops_per_update == forward + 2 * 16 * 32 * 4 * 2 + 2 * 16 * 16 * 32
    assert all(m["mfu"] > 0 for m in metrics(t.args.output_dir) if "loss" in m)
