"""FSDP2 through the Trainer and the shipped recipes on CPU/gloo, with real 2-process launches. Every launch's
run_config.json says the world size and the distributed type it got (Accelerate on CPU silently gives DDP when
asked for FSDP; accel_trainer.sharding makes it shard) and what each rank holds.

- The wizard's CPU FSDP config (`accel-trainer config --cpu --processes-per-machine 2 --fsdp`), launched with
  `accel-trainer launch`, trains the regression recipe sharded. 2-process FSDP == 2-process DDP == 1 process over
  the same global batches: masked targets, accumulation 2, clipping active, two epoch boundaries. Under FSDP the
  recipe (tests/fault_recipe.py) checks that no gradient is reduced inside an accumulation window.
- SIGKILL mid-run under FSDP, resume from `latest`: the final model.safetensors is byte-identical.
- The final model.safetensors (and best/) is the full plain model; the last sharded (DCP) checkpoint loads into the
  plain model bit for bit; a 2-process FSDP checkpoint resumes on 1 process.
- A tiny GPT-2 from a config through recipes/causal_lm.py (FSDP from `accelerate launch --use_fsdp` flags):
  FSDP == 1 process, wrapped by `_no_split_modules`, the eval sample generated on every rank.
- The shipped accelerate_configs/gpu_1x8_fsdp_bf16.yaml (use_cpu, 2 processes) shards with bf16 parameters and
  fp32 gradient reduction.
- Refusals: DeepSpeed (wizard in tests/test_wizard.py, launch, Trainer), FSDP that would not shard, EMA under FSDP.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from helpers import FSDP2, RECIPES, ROOT, env, free_port, last_step, launch_cmd, metrics, run_config
from procs import Launch
from safetensors.torch import load_file, load_model, save_file

from accel_trainer import sharding, shards
from accel_trainer.checkpointing import folder as ckpt_folder
from accel_trainer.checkpointing import load as ckpt_load
from accel_trainer.checkpointing import verify as ckpt_verify

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

FAULT_RECIPE = os.path.join(ROOT, "tests", "fault_recipe.py")
TRIPWIRE = os.path.join(ROOT, "tests", "tripwire_recipe.py")  # regression, where unpickling a file raises
DEADLINE = 240  # seconds any launch may take on a loaded 2-core machine
# 256 samples, global batch 32 (8 per process x 2 processes x accumulation 2, or 16 x 1 x 2): 8 updates per epoch,
# so 20 updates cross two epoch boundaries. --max_grad_norm 0.8 is below the first updates' norms: clipping acts.
REG = ["--mask_prob", "0.3", "--gradient_accumulation_steps", "2", "--max_steps", "20", "--max_grad_norm", "0.8",
       "--logging_steps", "1", "--save_steps", "4", "--metric_for_best_model", "eval_loss", "--disable_tqdm"]  # fmt: skip
PER_DEVICE = {1: ["--per_device_train_batch_size", "16"], 2: ["--per_device_train_batch_size", "8"]}


def launch(cmd: list[str], log: str, env: dict | None = None) -> Launch:
    """One launch from the repository root, in its own session (tests/procs.py); its whole tree is killed at the end."""
    return Launch(cmd, log, env=env, cwd=ROOT, deadline=DEADLINE)


def fsdp_launcher(config_file: str) -> list[str]:
    """`accel-trainer launch --config_file <FSDP config>`, as a user runs it."""
    return [sys.executable, "-m", "accel_trainer.cli", "launch", "--config_file", config_file,
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]  # fmt: skip


def train_rows(out) -> list[dict]:
    return [r for r in metrics(out) if "loss" in r]


def assert_close_rows(a: list[dict], b: list[dict], keys=("loss", "grad_norm", "learning_rate")):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for key in keys:
        torch.testing.assert_close([r[key] for r in a], [r[key] for r in b], rtol=1e-5, atol=1e-7, msg=key)


def assert_same(a: dict, b: dict, atol: float, rtol: float = 1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------------------- the regression recipe, sharded
@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    """The wizard's CPU FSDP config; then, started together (they are mostly start-up time): FSDP, DDP and 1-process
    runs, and an FSDP run killed mid-epoch; then the killed run resumed from `latest`, and the FSDP run's
    mid-epoch checkpoint resumed on 1 process, both in processes where reading a pickle fails (tripwire_recipe.py):
    a checkpoint goes through no unpickler."""
    from accel_trainer.cli import main as cli

    d = tmp_path_factory.mktemp("reg")
    assert cli(["config", "--cpu", "--processes-per-machine", "2", "--fsdp", "--dir", str(d), "--name", "cpu_fsdp",
                "--no-interactive"]) == 0  # fmt: skip
    config = str(d / "cpu_fsdp.yaml")
    out = {name: str(d / name) for name in ("fsdp", "ddp", "single", "killed", "one")}
    script = os.path.join(RECIPES, "regression.py")
    started = {
        "fsdp": launch(
            fsdp_launcher(config) + [script, "--output_dir", out["fsdp"]] + REG + PER_DEVICE[2], out["fsdp"] + ".log"
        ),  # fmt: skip
        "ddp": launch(launch_cmd(2) + [script, "--output_dir", out["ddp"]] + REG + PER_DEVICE[2], out["ddp"] + ".log"),
        "single": launch(
            [sys.executable, script, "--output_dir", out["single"]] + REG + PER_DEVICE[1], out["single"] + ".log"
        ),  # fmt: skip
        "killed": launch(
            fsdp_launcher(config)
            + [FAULT_RECIPE, "--output_dir", out["killed"], "--faults", "step_delay=0.3"]
            + REG
            + PER_DEVICE[2],
            out["killed"] + ".log",
        ),  # fmt: skip
    }
    try:
        started["killed"].wait_until(lambda: last_step(out["killed"]) >= 6)  # checkpoint step_4 is written
        started["killed"].stop()
        killed_at = last_step(out["killed"])
        logs = {name: run.wait_ok() for name, run in started.items() if name != "killed"}
        # the 2-process FSDP run's checkpoint at update 4 (mid-epoch), continued on 1 process
        shutil.copytree(os.path.join(out["fsdp"], "checkpoints", "step_4"), os.path.join(out["one"], "checkpoints",
                        "step_4"))  # fmt: skip
        started["resumed"] = launch(fsdp_launcher(config) + [TRIPWIRE, "--output_dir", out["killed"],
                                    "--resume_from_checkpoint", "latest"] + REG + PER_DEVICE[2],
                                    out["killed"] + "-resumed.log")  # fmt: skip
        started["one"] = launch([sys.executable, TRIPWIRE, "--output_dir", out["one"], "--resume_from_checkpoint",
                                "latest"] + REG + PER_DEVICE[1], out["one"] + ".log")  # fmt: skip
        logs["resumed"], logs["one"] = started["resumed"].wait_ok(), started["one"].wait_ok()
    finally:
        for run in started.values():
            run.stop()
    return SimpleNamespace(out=out, logs=logs, killed_at=killed_at)


@pytest.mark.slow
def test_each_run_got_the_world_and_type_it_asked_for(reg):
    for name, world, kind in (("fsdp", 2, "FSDP"), ("ddp", 2, "MULTI_CPU"), ("single", 1, "NO"), ("killed", 2, "FSDP"),
                              ("one", 1, "NO")):  # fmt: skip
        config = run_config(reg.out[name])
        assert (config["num_processes"], config["topology"]["distributed_type"]) == (world, kind), name
        assert len(config["sharding"]) == world
    ranks = run_config(reg.out["fsdp"])["sharding"]
    total = ranks[0]["params"]
    assert total == sum(p.numel() for p in regression.build_model(SimpleNamespace(args=regression.Args())).parameters())
    for r in ranks:  # each rank holds its half of every parameter, as DTensor shards
        assert r["sharded"] == "fsdp2" and r["world_size"] == 2 and r["params_local"] * 2 == total
        assert r["wrap"].startswith("size-based") and r["master_dtype"] == "float32"
    assert "sharded" not in run_config(reg.out["ddp"])["sharding"][0]  # DDP: every rank holds all of it
    assert "accel-trainer launch: accelerate launch --config_file" in reg.logs["fsdp"]


@pytest.mark.slow
def test_fsdp_equals_ddp_equals_one_process(reg):
    fsdp, ddp, single = (train_rows(reg.out[n]) for n in ("fsdp", "ddp", "single"))
    assert len(single) == 20 and single[-1]["epoch"] == 2.5  # two epoch boundaries crossed
    assert max(r["grad_norm"] for r in single) > 0.8  # clipping acted (the norm is logged before clipping)
    # losses, gradient norms (sensitive to the item weighting, which Adam's step is not) and the learning rate (the
    # scheduler stepped once per update, not once per process)
    assert_close_rows(fsdp, single)
    assert_close_rows(ddp, single)
    evals = {n: [r for r in metrics(reg.out[n]) if "eval_loss" in r] for n in ("fsdp", "single")}
    assert [r["eval_samples"] for r in evals["fsdp"]] == [64, 64, 64]  # every eval sample once, gathered
    assert_close_rows(evals["fsdp"], evals["single"], keys=("eval_loss", "eval_mse"))
    w = {n: load_file(os.path.join(reg.out[n], "model.safetensors")) for n in ("fsdp", "ddp", "single")}
    assert_same(w["fsdp"], w["ddp"], atol=1e-6)
    assert_same(w["fsdp"], w["single"], atol=1e-6)


@pytest.mark.slow
def test_sigkill_under_fsdp_then_resume_from_latest_is_bit_identical(reg):
    assert 6 <= reg.killed_at < 8  # killed mid-epoch, after the checkpoint of update 4
    assert f"Resumed from {reg.out['killed']}/checkpoints/step_4 at step 4 (epoch 0, batch 8)." in reg.logs["resumed"]
    final = (open(os.path.join(reg.out[n], "model.safetensors"), "rb").read() for n in ("killed", "fsdp"))
    assert next(final) == next(final)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on this one process, no group: intended
def test_the_full_model_and_the_sharded_checkpoint(reg):
    fsdp = reg.out["fsdp"]
    model = regression.build_model(SimpleNamespace(args=regression.Args()))
    missing, unexpected = load_model(model, os.path.join(fsdp, "model.safetensors"))  # plain names, one process
    assert not missing and not unexpected
    assert json.load(open(os.path.join(fsdp, "best", "best.json")))["metric"] == "eval_loss"
    missing, unexpected = load_model(model, os.path.join(fsdp, "best", "model.safetensors"))  # gathered too
    assert not missing and not unexpected
    # The checkpoint of the last update: DCP shards of model and optimizer from both ranks, in the manifest.
    last = os.path.join(fsdp, "checkpoints", "step_20")
    assert ckpt_verify.verify_checkpoint(last)["num_processes"] == 2
    assert ckpt_verify.is_sharded_checkpoint(last)
    manifest = json.load(open(os.path.join(last, "manifest.json")))
    for folder in ("model", "optimizer"):  # each rank's shards (DCP in safetensors), no pickle
        shards = {f"{folder}/shard-0000{r}.step_20.safetensors" for r in (1, 2)}  # named for their step
        assert shards <= set(manifest["files"])
    assert not [f for f in manifest["files"] if not f.endswith((".json", ".safetensors"))]
    # ... loads into the plain model on this one process: exactly the weights the run ended with
    model, plain = (
        regression.build_model(SimpleNamespace(args=regression.Args())),
        load_file(f"{fsdp}/model.safetensors"),
    )
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt_load.load_resharded(last, model, optimizer)
    assert all(torch.equal(v, plain[k]) for k, v in model.state_dict().items())
    assert {s["step"].item() for s in optimizer.state.values()} == {20.0}
    wider = regression.build_model(SimpleNamespace(args=regression.Args(hidden_size=64)))
    with pytest.raises(
        ckpt_folder.CheckpointError, match=r"0.weight: \(32, 16\) in the checkpoint, \(64, 16\) in this"
    ):
        ckpt_load.check_model(last, wider)


@pytest.mark.slow
def test_a_two_process_fsdp_checkpoint_resumes_on_one_process(reg):
    assert "Resumed from" in reg.logs["one"] and "written by 2 processes: batch 8 there" in reg.logs["one"]
    # Exact: the weights and optimizer state loaded (DCP matches tensors by name and offset) and the data position.
    # Not exact: the sum over 2 ranks is in another order than on 1 (fp32 rounding), and per-rank random streams.
    one, fsdp = train_rows(reg.out["one"]), train_rows(reg.out["fsdp"])
    assert [r["step"] for r in one] == list(range(5, 21))
    assert_close_rows(one, fsdp[4:])
    assert_same(load_file(f"{reg.out['one']}/model.safetensors"), load_file(f"{reg.out['fsdp']}/model.safetensors"),
                atol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_sharded_checkpoint_safety(reg, tmp_path):
    step = os.path.join(reg.out["fsdp"], "checkpoints", "step_8")
    copy = tmp_path / "step_8"
    shutil.copytree(step, copy)
    shard = copy / "optimizer" / "shard-00002.step_8.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt_folder.CheckpointError, match="shard-00002.step_8.safetensors is corrupt"):
        ckpt_verify.verify_checkpoint(str(copy))
    # A chunk moved to another rank's place (its offsets rewritten in the shard's header, the manifest re-hashed):
    # the two ranks' chunks overlap, and the tensor would load with one part twice and another not at all.
    copy = tmp_path / "moved"
    shutil.copytree(step, copy)
    second = copy / "model" / "shard-00002.step_8.safetensors"
    tensors, header = load_file(second), json.loads(safe_metadata(second)["DCP_SHARDING_INFO"])
    header["0.weight"]["saved_offsets"] = [0, 0]
    save_file(tensors, second, metadata={**safe_metadata(second), "DCP_SHARDING_INFO": json.dumps(header)})
    rehash(copy)
    with pytest.raises(
        ckpt_folder.CheckpointError,
        match=r"the shards of 0.weight do not cover it exactly once \(chunks at \[0, 0\] in shard-00001",
    ):
        ckpt_verify.verify_checkpoint(str(copy))
    # a checkpoint written without FSDP cannot be resumed sharded: refused, not half-loaded
    fsdp_run = SimpleNamespace(distributed_type=DistributedType.FSDP)
    ddp_step = os.path.join(reg.out["ddp"], "checkpoints", "step_4")
    with pytest.raises(ckpt_folder.CheckpointError, match="written without FSDP"):
        model = regression.build_model(SimpleNamespace(args=regression.Args()))
        ckpt_load.load_checkpoint(fsdp_run, ddp_step, model, None, None)


def safe_metadata(file) -> dict:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.metadata()


def rehash(folder):
    """An attacker's re-hash of the manifest (sizes, sha256), by hand: the checks must not rest on the hashes."""
    manifest = json.load(open(folder / "manifest.json"))
    for rel in manifest["files"]:
        data = (folder / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


# ------------------------------------------------------------------------------- the CIFAR net: buffers, lookahead
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on this one process, no group: intended
def test_cifar_under_fsdp_resumes_bit_identically_after_sigkill(tmp_path):
    """The CIFAR recipe in fp32 under FSDP, SIGKILLed after update 3 and resumed from its checkpoint of update 2,
    ends with the uninterrupted run's model.safetensors exactly. Two things of its state are not parameters:
    BatchNorm running statistics (buffers: not sharded, one copy per rank, and DCP saves one rank's copy) and the
    lookahead's step count and averages (in the optimizer; an extra key of its state_dict was dropped by DCP).
    Before the fix the resumed run differed in every tensor that trains. 6 updates: the lookahead averages from the
    start and pulls at 5 and 6, after the resume."""
    from cifar_fixtures import make_tiny_cifar

    sys.path.insert(0, RECIPES)
    import cifar

    data = make_tiny_cifar(str(tmp_path / "data"))["hub"]
    out = {n: str(tmp_path / n) for n in ("whole", "killed")}

    def cifar_launch(name, log, *extra, **env_extra):
        args = [os.path.join(ROOT, "tests", "matrix_recipe.py"), "--output_dir", out[name], "--dataset", data,
                "--cache_dir", str(tmp_path / f"cache_{name}"), "--preset", "small", "--widths", "8,16,16",
                "--batch_size", "16", "--eval_batch_size", "20", "--max_steps", "6", "--save_steps", "2",
                "--gradient_accumulation_steps", "2", "--eval_steps", "3", "--logging_steps", "1", "--seed", "1",
                "--mixed_precision", "no", "--disable_tqdm", *extra]  # fmt: skip
        child = env(MATRIX_RECIPE=os.path.join(RECIPES, "cifar.py"), HF_DATASETS_CACHE=str(tmp_path / f"hf_{name}"),
                    **env_extra)  # fmt: skip
        return launch(launch_cmd(2, mode=FSDP2) + args, str(tmp_path / log), env=child)

    runs = [cifar_launch("whole", "whole.log"), cifar_launch("killed", "killed.log", MATRIX_KILL_AT="3")]
    try:
        assert runs[1].wait() != 0  # SIGKILLed after update 3
        runs.append(cifar_launch("killed", "resumed.log", "--resume_from_checkpoint", "latest"))
        logs = [runs[0].wait_ok(), runs[2].wait_ok()]
    finally:
        for r in runs:
            r.stop()
    assert f"Resumed from {out['killed']}/checkpoints/step_2 at step 2" in logs[1]
    for name in out:
        config = run_config(out[name])
        assert (config["num_processes"], config["topology"]["distributed_type"]) == (2, "FSDP")
    whole, resumed = (load_file(os.path.join(out[n], "model.safetensors")) for n in ("whole", "killed"))
    assert whole.keys() == resumed.keys()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), f"{k}: not bit-identical to the uninterrupted run"
    # The last checkpoint on one process (load_resharded, as a 2 FSDP -> 1 resume loads it): the lookahead's count
    # and averages come back from DCP; the last update copied the averages into the net, so they are its weights.
    net = cifar.CifarNet((8, 16, 16))
    ctx = SimpleNamespace(args=cifar.Args(), targs=SimpleNamespace(weight_decay=0.0), learning_rate=1.0,
                          global_batch_size=16, num_training_steps=6)  # fmt: skip
    opt = cifar.build_optimizer(net, ctx)
    cifar.build_scheduler(opt, ctx)  # its param groups as the run's (the scheduler's initial_lr): the check wants them
    ckpt_load.load_resharded(os.path.join(out["whole"], "checkpoints", "step_6"), net, opt)
    assert opt.step_count == 6
    ema, current = opt._pairs()
    frozen = sum(not p.requires_grad for p in net.parameters())  # constant: no average to keep
    assert len(ema) == sum(v.is_floating_point() for v in net.state_dict().values()) - frozen
    for avg, cur in zip(ema, current):
        assert torch.equal(avg, cur)
    assert all(torch.equal(v, whole[k]) for k, v in net.state_dict().items())


# ------------------------------------------------------------------------------- a tiny transformers causal LM
@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    from text_fixtures import make_text_files, make_tiny_gpt2

    d = tmp_path_factory.mktemp("lm")
    train, valid = make_text_files(str(d / "text"))
    config = make_tiny_gpt2(str(d / "tiny-gpt2-config"), weights=False)  # a config and a tokenizer: random init
    return SimpleNamespace(root=d, train=train, valid=valid, config=config, cache=str(d / "cache"))


def lm_args(f, out, *extra) -> list[str]:
    # 40 lines, global batch 16 in micro-batches of 8: 3 updates per epoch (the last one a single micro-batch), so
    # 6 updates cross an epoch boundary. Lines of different lengths, padding masked: items vary per micro-batch.
    # --adam_epsilon 1e-6: see tests/test_causal_lm.py (float noise of nearly cancelling gradients).
    return [os.path.join(RECIPES, "causal_lm.py"), "--output_dir", str(out), "--config_name", f.config,
            "--tokenizer_name", f.config, "--train_file", f.train, "--validation_file", f.valid, "--cache_dir", f.cache,
            "--packing", "false", "--block_size", "64", "--max_train_samples", "40", "--learning_rate", "1e-3",
            "--adam_epsilon", "1e-6", "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--save_steps",
            "0", "--eval_steps", "2", "--per_device_eval_batch_size", "3", "--sample_max_new_tokens", "6",
            "--seed", "3", "--disable_tqdm", *extra]  # fmt: skip


@pytest.mark.slow
def test_causal_lm_fsdp_equals_one_process(lm_files):
    f = lm_files
    out = {n: f.root / n for n in ("fsdp", "single")}
    # FSDP from the launcher's flags this time (what `accelerate launch --use_fsdp` sets in the environment)
    use_fsdp = launch_cmd(2, mode=FSDP2)
    runs = [
        launch(
            use_fsdp + lm_args(f, out["fsdp"], "--max_steps", "6", "--per_device_train_batch_size", "4"),
            str(out["fsdp"]) + ".log",
        ),  # fmt: skip
        launch(
            [sys.executable] + lm_args(f, out["single"], "--max_steps", "6", "--per_device_train_batch_size", "8"),
            str(out["single"]) + ".log",
        ),  # fmt: skip
    ]
    try:
        logs = [r.wait_ok() for r in runs]
    finally:
        for r in runs:
            r.stop()
    config = run_config(out["fsdp"])
    assert (config["num_processes"], config["topology"]["distributed_type"]) == (2, "FSDP")
    assert config["sharding"][0]["wrap"] == "transformer blocks GPT2Block (from _no_split_modules)"
    assert all(r["params_local"] * 2 == r["params"] for r in config["sharding"])
    fsdp, single = train_rows(out["fsdp"]), train_rows(out["single"])
    assert len(fsdp) == 6 and fsdp[-1]["epoch"] == 2.0
    assert_close_rows(fsdp, single)
    # The eval sample is generated by every rank (synced_gpus), printed by rank 0: 3 evaluations, no hang.
    assert logs[0].count("[sample @ step") == 3
    assert [r["eval_loss"] for r in metrics(out["fsdp"]) if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in metrics(out["single"]) if "eval_loss" in r], rel=1e-5)  # fmt: skip
    a, b = load_file(out["fsdp"] / "model.safetensors"), load_file(out["single"] / "model.safetensors")
    assert_same(a, b, atol=1e-5)
    # the full plain model, tied lm_head/wte stored once as safetensors' save_model does; loads on one process
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(f.config))
    missing, unexpected = load_model(model, out["fsdp"] / "model.safetensors")
    assert not missing and not unexpected and model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.slow
def test_shipped_fsdp_bf16_config_shards_on_cpu_with_fp32_reduction(lm_files, tmp_path):
    with open(os.path.join(ROOT, "accelerate_configs", "gpu_1x8_fsdp_bf16.yaml")) as fh:
        text = fh.read()
    assert "use_cpu: false" in text and "mixed_precision: bf16" in text and "num_processes: 8" in text
    config = tmp_path / "cpu_fsdp_bf16.yaml"
    config.write_text(text.replace("use_cpu: false", "use_cpu: true"))  # the same file, on CPU processes
    out = tmp_path / "bf16"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]  # fmt: skip
    run = launch(cmd + lm_args(lm_files, out, "--max_steps", "2", "--per_device_train_batch_size", "4",
                 "--fsdp_reduce_dtype", "fp32"), str(out) + ".log")  # fmt: skip
    run.wait_ok()
    config = run_config(out)
    assert (config["num_processes"], config["topology"]["distributed_type"]) == (2, "FSDP")
    assert config["topology"]["mixed_precision"] == "bf16"
    for r in config["sharding"]:  # fp32 master shards, all-gathered and computed in bf16, gradients reduced in fp32
        assert (r["master_dtype"], r["param_dtype"], r["reduce_dtype"]) == ("float32", "bfloat16", "float32")
        assert r["wrap"] == "transformer blocks GPT2Block (from _no_split_modules)"
    rows = train_rows(out)
    assert len(rows) == 2 and all(0 < r["loss"] < 20 and r["grad_norm"] > 0 for r in rows)


# ------------------------------------------------------------------------------------- refusals, in-process
def _fail(argv, capsys) -> str:
    from accel_trainer import run as run_recipe

    with pytest.raises(SystemExit) as e:
        run_recipe(regression, argv + ["--disable_tqdm"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def test_the_trainer_refuses_what_would_not_shard(tmp_path, monkeypatch, capsys):
    out = ["--output_dir", str(tmp_path / "o")]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` sets for a DeepSpeed config
    assert "Shard with FSDP instead" in _fail(out, capsys)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    assert "--fsdp_reduce_dtype applies to FSDP only" in _fail(out + ["--fsdp_reduce_dtype", "fp32"], capsys)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets for an FSDP config
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert "fsdp_version: 2" in _fail(out, capsys)
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert "this run has 1 process: there is nothing to shard over" in _fail(out, capsys)
    assert "--ema_decay is not supported with FSDP" in _fail(out + ["--ema_decay", "0.9"], capsys)
    assert not os.path.exists(tmp_path / "o")  # refused before anything was written


def test_launch_refuses_deepspeed_and_cpu_with_an_fsdp_config(tmp_path, capsys):
    from accel_trainer.cluster.launch import launch
    from accel_trainer.cluster.wizard import build_config

    fsdp, ds = tmp_path / "fsdp.yaml", tmp_path / "ds.yaml"
    build_config(1, 2, cpu=True, sharding="fsdp").to_yaml_file(str(fsdp))
    build_config(1, 2, sharding="deepspeed").to_yaml_file(str(ds))
    script = os.path.join(RECIPES, "regression.py")
    assert launch(["--config_file", str(ds), script]) == 2
    assert "The config asks for DeepSpeed" in capsys.readouterr().err
    assert launch(["--use_deepspeed", "--num_processes", "2", script]) == 2
    assert "--use_deepspeed asks for DeepSpeed" in capsys.readouterr().err
    assert launch(["--cpu", "--config_file", str(fsdp), script]) == 2  # accelerate would run ONE process, no FSDP
    assert "set `use_cpu: true` in the config" in capsys.readouterr().err


def test_wrap_policy_and_mixed_precision_policy(monkeypatch):
    from accelerate import FullyShardedDataParallelPlugin
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.delenv("FSDP_AUTO_WRAP_POLICY", raising=False)
    mlp = regression.build_model(SimpleNamespace(args=regression.Args()))
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16))

    def plugin(**kw):
        return FullyShardedDataParallelPlugin(fsdp_version=2, **kw)

    transformer = {"auto_wrap_policy": "transformer_based_wrap"}
    assert (
        sharding.configure_wrapping(plugin(**transformer), lm)
        == "transformer blocks GPT2Block (from _no_split_modules)"
    )
    assert (
        sharding.configure_wrapping(plugin(**transformer), mlp, wrap=[torch.nn.Linear])
        == "transformer blocks Linear (from the recipe)"
    )
    assert sharding.configure_wrapping(plugin(), mlp).startswith("size-based")  # no classes named: by size
    with pytest.raises(shards.ShardingError, match="no module of class GPT2Block"):
        sharding.configure_wrapping(plugin(**transformer), mlp, wrap=["GPT2Block"])
    # BERT's _no_split_modules names BertEmbeddings, which holds the input embedding that Accelerate makes a unit of
    # its own after the policy ran: sharding it twice failed at start-up, so only BertLayer is a block.
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(
        BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    assert "BertEmbeddings" in bert._no_split_modules
    bert_plugin = plugin(**transformer)
    assert sharding.configure_wrapping(bert_plugin, bert) == (
        "transformer blocks BertLayer (from _no_split_modules; not BertEmbeddings: holds the embeddings)"
    )
    assert bert_plugin.transformer_cls_names_to_wrap == ["BertLayer"]
    policy = sharding.mixed_precision_policy("bf16", "fp32")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert sharding.mixed_precision_policy("bf16", None) is None  # Accelerate's default: all bf16


def test_a_batchnorm_model_not_loaded_on_every_rank_is_refused_with_the_config_fix():
    # fsdp_cpu_ram_efficient_loading with a model whose weights exist on rank 0 only (transformers loads the others
    # on the meta device): our rank-0 broadcast has nothing to receive into, so the run stops naming the fix.
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    acc, plugin = SimpleNamespace(process_index=1, device=torch.device("cpu")), SimpleNamespace()
    with pytest.raises(shards.ShardingError, match="fsdp_cpu_ram_efficient_loading: false"):
        sharding._load_from_rank0_ourselves(acc, plugin, model)
