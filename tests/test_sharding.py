"""FSDP2 on CPU/gloo through accel_trainer.sharding, with real 2-process launches (world size and distributed type
asserted by the worker, tests/sharding_worker.py), and the refusals.

- FSDP == DDP == 1 process over the same global batches: masked targets (items per micro-batch vary),
  accumulation 2, clipping active, across epoch boundaries; a regression MLP and a tiny GPT-2 (wrapped by
  `_no_split_modules`, tied embeddings).
- The sharding is real: DTensor parameters, each rank holds half; no gradient sync inside the window.
- Checkpoints: accelerator.save_state (DCP) on 2 processes -> load_state on 2: bit-identical continuation;
  -> load_resharded on 1 process: model and optimizer state bit-identical; model.safetensors loads into the
  plain model.
- The shipped accelerate_configs/gpu_1x8_fsdp_bf16.yaml (with use_cpu) launches and shards; bf16 params with
  fp32 reduction.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, env, free_port
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from accel_trainer import checkpoint as ckpt
from accel_trainer import sharding

WORKER = os.path.join(ROOT, "tests", "sharding_worker.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import sharding_worker  # noqa: E402


def launch(out: str, mode: str, *extra, config_file: str | None = None, timeout: float = 240):
    """Run the worker: mode 'single' (python, 1 process), 'ddp' or 'fsdp' (accelerate launch, 2 processes)."""
    args = [WORKER, "--out", out, "--expect", mode, "--world", "1" if mode == "single" else "2", *extra]
    if mode == "single":
        cmd = [sys.executable, *args]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2"]
        if config_file:
            launcher += ["--config_file", config_file]
        else:
            launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
            launcher += ["--use_fsdp", "--fsdp_version", "2"] if mode == "fsdp" else ["--multi_gpu"]
        cmd = launcher + ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(
            f"{mode} exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
        )
    log = os.path.join(out, "log.json")  # --load_resharded writes none
    if os.path.isfile(log):
        with open(log) as f:
            return json.load(f)
    return None


def weights(folder: str) -> dict:
    return load_file(os.path.join(folder, "model.safetensors"))


def assert_close_weights(a: dict, b: dict, atol: float, rtol: float = 1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def assert_equal_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


# ----------------------------------------------------------------------------------------- the regression MLP
@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlp")
    runs = {
        "fsdp": launch(str(d / "fsdp"), "fsdp", "--save_at", "3"),
        "ddp": launch(str(d / "ddp"), "ddp"),
        "single": launch(str(d / "single"), "single"),
    }
    runs["resume"] = launch(str(d / "resume"), "fsdp", "--save_at", "3", "--resume", str(d / "fsdp" / "ckpt"))
    launch(str(d / "reshard"), "single", "--load_resharded", str(d / "fsdp" / "ckpt"))
    return d, runs


def test_fsdp_equals_ddp_equals_one_process(mlp):
    d, runs = mlp
    assert [runs[m]["distributed_type"] for m in ("fsdp", "ddp", "single")] == ["FSDP", "MULTI_CPU", "NO"]
    for m in ("fsdp", "ddp"):
        # losses, gradient norms before clipping (sensitive to the item weighting: Adam's step is not) and the
        # learning rate (the scheduler stepped once per update, not once per process)
        for key in ("losses", "grad_norms", "lrs"):
            torch.testing.assert_close(runs[m][key], runs["single"][key], rtol=1e-5, atol=1e-7)
    assert max(runs["single"]["grad_norms"]) > 0.5  # --max_grad_norm 0.5: clipping was active
    assert_close_weights(weights(d / "fsdp"), weights(d / "ddp"), atol=1e-6)
    assert_close_weights(weights(d / "fsdp"), weights(d / "single"), atol=1e-6)


def test_fsdp_really_shards(mlp):
    _, runs = mlp
    ranks = runs["fsdp"]["per_rank"]
    assert len(ranks) == 2
    total = ranks[0]["params"]
    assert sum(r["params_local"] for r in ranks) == total  # disjoint shards that cover the model
    for r in ranks:
        assert r["sharded"] == "fsdp2" and r["world_size"] == 2
        assert r["params_local"] == total // 2  # every dim 0 of this MLP is even: exactly half each
        # AdamW's two moments of the local shard only, plus a 4-byte step counter per parameter tensor
        assert r["optimizer_bytes"] == 2 * r["param_bytes"] + 4 * 4


def test_exact_resume_after_dcp_checkpoint(mlp):
    d, runs = mlp
    assert len(runs["resume"]["losses"]) == 2  # updates 4 and 5, after loading the checkpoint of update 3
    assert runs["resume"]["losses"] == runs["fsdp"]["losses"][3:]
    assert_equal_weights(weights(d / "resume"), weights(d / "fsdp"))
    dcp_dirs = {p for p in os.listdir(d / "fsdp" / "ckpt")}
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= dcp_dirs  # sharded through DCP, not one full file
    assert ckpt.is_sharded_checkpoint(str(d / "fsdp" / "ckpt"))
    ckpt.check_compatible_sharded(str(d / "fsdp" / "ckpt"), sharding_worker.build_model("mlp"))
    wider = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with pytest.raises(ckpt.CheckpointError, match=r"0.weight: \(32, 16\) in the checkpoint, \(64, 16\) in this"):
        ckpt.check_compatible_sharded(str(d / "fsdp" / "ckpt"), wider)


def test_two_process_checkpoint_resumes_on_one(mlp):
    d, _ = mlp
    # the 1-process plain model + AdamW after load_resharded == what the 2-process run held at that update
    assert_equal_weights(weights(d / "reshard"), weights(d / "fsdp" / "ckpt_full"))
    mine = torch.load(d / "reshard" / "optimizer.pt", weights_only=True)
    theirs = torch.load(d / "fsdp" / "ckpt_full" / "optimizer.pt", weights_only=True)
    assert mine.keys() == theirs.keys() and len(mine) == 4
    for name in mine:
        assert mine[name].keys() == theirs[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k in mine[name]:
            assert torch.equal(mine[name][k], theirs[name][k]), (name, k)


def test_full_model_loads_into_plain_model(mlp):
    d, _ = mlp
    model = sharding_worker.build_model("mlp")
    missing, unexpected = load_model(model, d / "fsdp" / "model.safetensors")
    assert not missing and not unexpected
    torch.testing.assert_close(model[0].weight, weights(d / "single")["0.weight"], atol=1e-6, rtol=1e-5)


def test_dcp_metadata_check(mlp, tmp_path):
    d, _ = mlp
    folder = str(d / "fsdp" / "ckpt")
    manifest = {"files": {os.path.relpath(os.path.join(r, f), folder): {} for r, _, fs in os.walk(folder) for f in fs}}
    assert sum(f.endswith(".metadata") for f in manifest["files"]) == 2
    ckpt.check_dcp_metadata_safe(folder, manifest)  # DCP's own metadata passes

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "bad"
    (bad / "pytorch_model_fsdp_0").mkdir(parents=True)
    with open(bad / "pytorch_model_fsdp_0" / ".metadata", "wb") as f:
        pickle.dump(Payload(), f)
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded safely"):
        ckpt.check_dcp_metadata_safe(str(bad), {"files": {"pytorch_model_fsdp_0/.metadata": {}}})
    assert not marker.exists()


# -------------------------------------------------------------------------------------- a tiny transformers LM
def test_causal_lm_fsdp_equals_one_process(tmp_path):
    fsdp = launch(str(tmp_path / "fsdp"), "fsdp", "--model", "lm")
    single = launch(str(tmp_path / "single"), "single", "--model", "lm")
    info = fsdp["sharding"]
    assert info["wrap"] == "transformer blocks GPT2Block (from _no_split_modules)"
    assert info["params_local"] * 2 == info["params"]
    for key in ("losses", "grad_norms", "lrs"):
        torch.testing.assert_close(fsdp[key], single[key], rtol=1e-5, atol=1e-6)
    # Adam's step divides by sqrt of tiny second moments: 1e-5-level weight differences from the other
    # summation order on 2 processes (DDP shows the same against 1 process)
    a, b = weights(tmp_path / "fsdp"), weights(tmp_path / "single")
    assert_close_weights(a, b, atol=1e-4, rtol=1e-4)
    # tied lm_head/wte stored once, as safetensors' save_model stores it; loads into the plain model
    with safe_open(tmp_path / "fsdp" / "model.safetensors", "pt") as f:
        assert f.metadata().get("transformer.wte.weight") == "lm_head.weight"
    model = sharding_worker.build_model("lm")
    missing, unexpected = load_model(model, tmp_path / "fsdp" / "model.safetensors")
    assert not missing and not unexpected
    assert model.lm_head.weight is model.transformer.wte.weight


# ---------------------------------------------------------------------------- the shipped config, bf16 policy
def test_shipped_fsdp_config_shards_on_cpu_with_bf16_params_fp32_reduce(tmp_path):
    with open(os.path.join(ROOT, "accelerate_configs", "gpu_1x8_fsdp_bf16.yaml")) as f:
        text = f.read()
    assert "use_cpu: false" in text and "mixed_precision: bf16" in text
    config = tmp_path / "cpu_fsdp_bf16.yaml"
    config.write_text(text.replace("use_cpu: false", "use_cpu: true"))
    log = launch(str(tmp_path / "bf16"), "fsdp", "--reduce_dtype", "fp32", "--steps", "2", config_file=str(config))
    assert log["distributed_type"] == "FSDP" and log["sharding"]["world_size"] == 2
    assert log["mp_policy"] == {
        "master_dtype": "torch.float32",  # the sharded parameters the optimizer updates
        "compute_dtype": "torch.bfloat16",
        "param_dtype": "torch.bfloat16",
        "reduce_dtype": "torch.float32",
    }
    assert all(torch.isfinite(torch.tensor(log["losses"])))


# -------------------------------------------------------------------------------------- in-process: refusals
def test_refuse_deepspeed(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    sharding.refuse_deepspeed()  # nothing asked: no error
    sharding.refuse_deepspeed({"distributed_type": "MULTI_GPU"})
    with pytest.raises(sharding.ShardingError, match="Shard with FSDP instead"):
        sharding.refuse_deepspeed({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}}, "x.yaml ")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(sharding.ShardingError, match="fsdp_version: 2"):
        sharding.refuse_deepspeed()


def test_fsdp1_and_one_process_are_refused(monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(sharding.ShardingError, match="fsdp_version: 2"):
        sharding.fsdp_plugin()
    monkeypatch.setenv("FSDP_VERSION", "2")
    plugin = sharding.fsdp_plugin()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    with pytest.raises(sharding.ShardingError, match="1 process"):
        sharding.activate_fsdp(acc, plugin)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(sharding.ShardingError, match="not sharded"):
        sharding.assert_sharded(acc, model)  # a config that asks for FSDP and gets anything else is an error
    with pytest.raises(sharding.ShardingError, match="asks for FSDP"):
        sharding.prepare_sharded(acc, model, torch.optim.SGD(model.parameters(), lr=0.1))
    AcceleratorState._reset_state()
    GradientState._reset_state()


def test_ema_refused_under_fsdp():
    from accelerate.utils import DistributedType

    class Acc:
        distributed_type = DistributedType.FSDP

    sharding.refuse_ema(Acc(), 0.0)
    with pytest.raises(sharding.ShardingError, match="ema_decay"):
        sharding.refuse_ema(Acc(), 0.999)


def test_wrap_policy(monkeypatch):
    from accelerate import FullyShardedDataParallelPlugin

    monkeypatch.delenv("FSDP_AUTO_WRAP_POLICY", raising=False)
    mlp = sharding_worker.build_model("mlp")
    lm = sharding_worker.build_model("lm")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    assert sharding.configure_wrapping(plugin, lm) == "transformer blocks GPT2Block (from _no_split_modules)"
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    assert (
        sharding.configure_wrapping(plugin, mlp, wrap=[torch.nn.Linear])
        == "transformer blocks Linear (from the recipe)"
    )
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)  # no policy in the config
    assert sharding.configure_wrapping(plugin, mlp).startswith("size-based")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    with pytest.raises(sharding.ShardingError, match="no module of class GPT2Block"):
        sharding.configure_wrapping(plugin, mlp, wrap=["GPT2Block"])
    policy = sharding.mixed_precision_policy("bf16", "fp32")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert sharding.mixed_precision_policy("bf16", None) is None  # Accelerate's default: all bf16
