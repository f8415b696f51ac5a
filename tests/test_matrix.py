"""The combination matrix: features combined the way users combine them, as real runs of the shipped recipes.

Every pair of factor values below is in at least one run (a pairwise covering array, tests/pairwise.py). A pair the
product cannot hold is either not meaningful (the flag does nothing there: a DDP hook without DDP, SyncBatchNorm
without BatchNorm or without a second process, DataLoader workers with a recipe that batches on the device, an
elastic restart of one process) or refused on purpose, which test_refused_* check (one line, exit 1, no traceback).

Every run asserts: exit 0; model.safetensors loads with safetensors.torch.load_model (strict) into a freshly built
model; every number in metrics.jsonl is finite; run_config.json records the precision, world size and distributed
type asked for. Lifecycles: a plain run; SIGKILL after update 3 (checkpoint at 2) then `--resume_from_checkpoint
latest`; the same but resumed on another world size (1 <-> 2 processes); an elastic restart (rank 1 exits after
update 3 under --max_restarts 1). Each interrupted run is compared with the row's uninterrupted run:

- bit-identical where docs/fault-tolerance.md promises it: CPU, fp32, same world size, no torch.compile, no
  DataLoader workers;
- float32 tolerance (rtol 1e-4, atol 1e-5) where the math says equal: fp32, no fp16 gradient compression, and for
  the BatchNorm net no change of world size (per-rank batch statistics and augmentation streams);
- otherwise within LOOSE (bf16 autocast, fp16 gradient compression): Adam moves a weight by at most ~lr per update,
  so 4 updates at lr <= 1e-2 differ by less than 0.05; the BatchNorm net resumed on another world size normalises
  over other batches (another trajectory): within BATCHNORM_WORLD (0.2), a sanity bound only.

Run alone with `pytest -m matrix`; rows run PARALLEL at a time (env MATRIX_JOBS, default 2).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from helpers import ELASTIC_ENV, RECIPES, ROOT, env, launcher, run_config
from pairwise import pairwise
from procs import Launch
from safetensors.torch import load_file, load_model

from accel_trainer.cluster.cluster_config import RESTART_SAFE_ENV

pytestmark = [pytest.mark.matrix, pytest.mark.slow]

FACTORS = {
    "model": ["reg", "gpt2", "bert", "cifar"],
    "lifecycle": ["plain", "kill", "world", "elastic"],
    "world": ["1", "ddp", "fsdp"],
    "precision": ["no", "bf16"],
    "accumulation": [1, 2],
    "compile": [False, True],
    "ema": [False, True],
    "hook": ["none", "fp16"],
    "sync_bn": [False, True],
    "grad_ckpt": [False, True],
    "workers": [0, 2],
    "clip": [False, True],
    "nan_policy": ["stop", "skip"],
    "save_limit": [None, 1],
    "lr_scaling": ["none", "sqrt"],
    "profile": [False, True],
}
TRANSFORMERS = ("gpt2", "bert")

# Pairs the product refuses on purpose (tested below, not run in the matrix): (factor, value) pairs with a message.
REFUSED = {
    (("world", "fsdp"), ("ema", True)): "--ema_decay is not supported with FSDP",
    (("model", "reg"), ("grad_ckpt", True)): "--gradient_checkpointing needs a transformers model",
    (("model", "cifar"), ("grad_ckpt", True)): "--gradient_checkpointing needs a transformers model",
    (("world", "ddp"), ("sync_bn", True)): "--sync_batchnorm needs CUDA GPUs",  # on CPU processes, as here
    (("world", "fsdp"), ("sync_bn", True)): "--sync_batchnorm needs CUDA GPUs",
    (("world", "fsdp"), ("hook", "fp16")): "--ddp_comm_hook fp16 compresses DDP's gradient all-reduce",
}


# Pairs that run, covered by a run of their own instead of in the rows (so that the rows stay cheap): the smallest
# row holding the pair, asserted like every row (test_pairs_run_alone).
RUN_ALONE = {
    # A cold torch.compile under FSDP takes minutes on 2 loaded cores. It failed until sharding's check looked for the
    # FSDP root on the compiled wrapper, which Accelerate shards (found by this matrix).
    (("world", "fsdp"), ("compile", True)): "regression recipe",
}


def allowed(row: dict) -> bool:
    """Whether a (partial) row can be run: each rule applies once the factors it names are in the row."""
    g = row.get
    rules = [
        # refused on purpose (REFUSED)
        not (g("world") == "fsdp" and g("ema")),
        not (g("world") == "fsdp" and g("compile")),  # RUN_ALONE
        not (g("grad_ckpt") and g("model") in ("reg", "cifar")),
        # not meaningful: the flag does nothing there
        not (g("hook") == "fp16" and g("world") == "fsdp"),  # REFUSED
        not (g("hook") == "fp16" and g("world") == "1"),  # a DDP communication hook without DDP: nothing to do
        not (g("sync_bn") and g("world") in ("ddp", "fsdp")),  # refused on CPU processes; a GPU-only test
        not (g("sync_bn") and g("lifecycle") in ("world", "elastic")),  # ... and so on the 2-process resume
        not (g("sync_bn") and g("model") in ("reg", "gpt2", "bert")),  # only a BatchNorm net has something to sync
        not (g("workers") and g("model") == "cifar"),  # the CIFAR recipe batches on the device, no DataLoader
        not (g("lifecycle") == "elastic" and g("world") == "1"),  # torchrun restarts a group of processes
    ]
    return all(rules)


def cost(name, value) -> int:
    """Ties in the generator go to cheaper runs: torch.compile and interrupted lifecycles cost the most time."""
    return {("compile", True): 3, ("lifecycle", "kill"): 2, ("lifecycle", "world"): 2, ("lifecycle", "elastic"): 1,
            ("world", "ddp"): 1, ("world", "fsdp"): 1}.get((name, value), 0)  # fmt: skip


# torch.compile is most of the matrix's time: a cold compile in every process of a row, again on a new world size.
# Its pairs are held by the fewest rows that can (4: one per model and per lifecycle), seeds the generator completes,
# each on one process where its pairs allow (the elastic row needs two: the model cheapest to compile, with the DDP
# hook). docs/benchmarks.md has the matrix's CPU time with these seeds and without.
COMPILE_ROWS = [
    {"compile": True, "model": "reg", "lifecycle": "elastic", "world": "ddp", "hook": "fp16"},
    {"compile": True, "model": "cifar", "lifecycle": "kill", "world": "1", "sync_bn": True},
    {"compile": True, "model": "gpt2", "lifecycle": "world", "world": "1"},
    {"compile": True, "model": "bert", "lifecycle": "plain", "world": "1"},
]
ROWS = pairwise(FACTORS, allowed, cost, seeds=COMPILE_ROWS)
MAX_STEPS, SAVE_STEPS, FAULT_AT = 6, 2, 3  # checkpoints at 2, 4, 6; faults after update 3: resume from step 2
LOOSE = dict(rtol=5e-2, atol=5e-2)
BATCHNORM_WORLD = dict(rtol=0.2, atol=0.2)  # another trajectory, not another rounding: only "close" is promised
FP32 = dict(rtol=1e-4, atol=1e-5)
DEADLINE = 600  # seconds one launch may take on a loaded 2-core machine (a cold torch.compile takes minutes there)
PROCESSES = {"1": 1, "ddp": 2, "fsdp": 2}
DISTRIBUTED_TYPE = {"1": "NO", "ddp": "MULTI_CPU", "fsdp": "FSDP"}
OTHER_WORLD = {"1": "ddp", "ddp": "1", "fsdp": "1"}


def row_id(i: int, row: dict) -> str:
    """e.g. 05-gpt2-1-fp32-kill+compile,ckpt,skip,w2,lim1,acc2 (what is on besides the defaults)."""
    short = {"compile": "compile", "ema": "ema", "sync_bn": "syncbn", "grad_ckpt": "ckpt", "clip": "clip",
             "profile": "prof", "workers": "w2", "save_limit": "lim1"}  # fmt: skip
    on = [s for k, s in short.items() if row[k]]
    on += ["fp16hook"] * (row["hook"] == "fp16") + ["skip"] * (row["nan_policy"] == "skip")
    on += ["sqrt"] * (row["lr_scaling"] == "sqrt") + ["acc2"] * (row["accumulation"] == 2)
    precision = "fp32" if row["precision"] == "no" else row["precision"]
    return f"{i:02d}-{row['model']}-{row['world']}-{precision}-{row['lifecycle']}+{','.join(on)}"


IDS = [row_id(i, r) for i, r in enumerate(ROWS)]


# ------------------------------------------------------------------------------------------------ inputs
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny inputs written by the test: a GPT-2 config (tied embeddings) and a tokenizer, a BERT classifier, text
    files, a GLUE-style folder, a learnable CIFAR in the Hub layout."""
    from cifar_fixtures import make_tiny_cifar
    from text_fixtures import make_glue_folder, make_text_files, make_tiny_bert, make_tiny_gpt2

    d = tmp_path_factory.mktemp("matrix_inputs")
    train, valid = make_text_files(str(d / "text"))
    return SimpleNamespace(
        root=d,
        reg=raw_regression_files(str(d / "reg")),
        gpt2=make_tiny_gpt2(str(d / "gpt2"), weights=False),
        bert=make_tiny_bert(str(d / "bert")),
        glue=make_glue_folder(str(d / "glue")),
        train=train,
        valid=valid,
        cifar=make_tiny_cifar(str(d / "cifar"))["hub"],
    )


def raw_regression_files(folder: str) -> tuple[str, str]:
    """JSON lines for recipes/regression.py with targets in the thousands (prices, counts: regression targets are
    often not normalised), 256 train and 64 eval samples. With the recipe's batch of 128, each rank's summed
    gradient of the output bias is ~64 samples x 2 x 1000: larger than float16 can hold (65504)."""
    os.makedirs(folder)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 4, generator=g)
    paths = []
    for split, n in (("train", 256), ("eval", 64)):
        x = torch.randn(n, 16, generator=g)
        y = 1000 + 10 * torch.tanh(x @ w) + torch.randn(n, 4, generator=g)
        paths.append(os.path.join(folder, f"{split}.jsonl"))
        with open(paths[-1], "w") as fh:
            fh.writelines(json.dumps({"x": a.tolist(), "y": b.tolist()}) + "\n" for a, b in zip(x, y))
    return tuple(paths)


def recipe_args(row: dict, world: str, f, out: str) -> tuple[str, list[str]]:
    """(recipe file, its flags) for this row on `world`: the same global batch on any world size."""
    n, acc = PROCESSES[world], row["accumulation"]
    cache = os.path.join(out + ".cache")  # one per run: no two runs write the same datasets cache at once
    model = row["model"]
    if model == "reg":
        script = "regression.py"
        args = ["--train_file", f.reg[0], "--eval_file", f.reg[1], "--global_batch_size", 128]
    elif model == "gpt2":
        script = "causal_lm.py"
        args = ["--config_name", f.gpt2, "--tokenizer_name", f.gpt2, "--train_file", f.train, "--validation_file",
                f.valid, "--cache_dir", cache, "--block_size", 16, "--max_eval_samples", 8,
                "--per_device_eval_batch_size", 2, "--sample_max_new_tokens", 4, "--learning_rate", 1e-3,
                "--adam_epsilon", 1e-6, "--per_device_train_batch_size", 8 // n]  # fmt: skip
    elif model == "bert":
        script = "glue.py"
        args = ["--model_name_or_path", f.bert, "--dataset_name", f.glue, "--task_name", "mrpc", "--cache_dir",
                cache, "--max_seq_length", 32, "--pad_to_multiple_of", 32, "--warmup_steps", 0, "--learning_rate",
                1e-3, "--per_device_eval_batch_size", 4, "--per_device_train_batch_size", 8 // n]  # fmt: skip
    else:
        script = "cifar.py"
        args = ["--dataset", f.cifar, "--cache_dir", cache, "--preset", "small", "--widths", "8,16,16",
                "--batch_size", 16, "--eval_batch_size", 20]  # fmt: skip
    args += ["--output_dir", out, "--max_steps", MAX_STEPS, "--save_steps", SAVE_STEPS, "--logging_steps", 1,
             "--eval_steps", 3, "--seed", 1, "--disable_tqdm", "--mixed_precision", row["precision"],
             "--gradient_accumulation_steps", acc, "--max_grad_norm", 0.5 if row["clip"] else 0,
             "--nan_policy", row["nan_policy"]]  # fmt: skip
    flags = {"compile": ["--torch_compile"], "ema": ["--ema_decay", 0.9], "sync_bn": ["--sync_batchnorm"],
             "grad_ckpt": ["--gradient_checkpointing"], "profile": ["--profile_steps", "2-3"]}  # fmt: skip
    for key, extra in flags.items():
        args += extra if row[key] else []
    args += ["--ddp_comm_hook", row["hook"]] if row["hook"] != "none" else []
    args += ["--dataloader_num_workers", row["workers"]] if row["workers"] else []
    args += ["--save_total_limit", row["save_limit"]] if row["save_limit"] else []
    base = {"reg": 128, "cifar": 16}.get(model, 8)  # the global batch without accumulation: sqrt(accumulation) x lr
    args += ["--lr_scaling", row["lr_scaling"], "--lr_base_batch_size", base] if row["lr_scaling"] != "none" else []
    return os.path.join(RECIPES, script), [str(a) for a in args]


# ------------------------------------------------------------------------------------------------ running
def launch(row, world, f, out, *extra, fault_env=None, max_restarts=0) -> dict:
    """One launch of the row's recipe through tests/matrix_recipe.py: {"rc", "log", "out", "world", "seconds"}."""
    script, args = recipe_args(row, world, f, out)
    fault_env = dict(fault_env or {}, MATRIX_RECIPE=script, HF_DATASETS_CACHE=out + ".cache")
    if max_restarts:  # rows run in parallel: each elastic launch its own rendezvous (helpers.ELASTIC_ENV)
        fault_env.update(ELASTIC_ENV)
    t0 = time.monotonic()
    cmd = launcher(world, max_restarts) + [os.path.join(ROOT, "tests", "matrix_recipe.py")] + args + list(extra)
    run = Launch(cmd, out + ".log", env=env(**fault_env), cwd=ROOT, deadline=DEADLINE)
    try:
        rc = run.wait()  # the whole process tree is killed afterwards
    except subprocess.TimeoutExpired:
        rc = 124
    return {"rc": rc, "log": run.output(None), "out": out, "world": world, "seconds": time.monotonic() - t0}


def interrupted(row, f, d) -> list[dict]:
    """The row's lifecycle, launch by launch (the plain lifecycle has none besides the uninterrupted run)."""
    out, world, life = str(d / "interrupted"), row["world"], row["lifecycle"]
    if life == "elastic":
        env = {"MATRIX_EXIT_AT": str(FAULT_AT), RESTART_SAFE_ENV: "1"}
        return [launch(row, world, f, out, fault_env=env, max_restarts=1)]
    if life in ("kill", "world"):
        killed = launch(row, world, f, out, fault_env={"MATRIX_KILL_AT": str(FAULT_AT)})
        if killed["rc"] == 0:
            return [killed]
        resumed_on = OTHER_WORLD[world] if life == "world" else world
        return [killed, launch(row, resumed_on, f, out, "--resume_from_checkpoint", "latest")]
    return []


@pytest.fixture(scope="module")
def played(request, files, tmp_path_factory):
    """Start every selected row (its uninterrupted run, and its lifecycle's launches) on a pool of PARALLEL
    workers, most expensive first; each test waits for its own row. {row id: (uninterrupted future, lifecycle
    future)}."""
    chosen = {item.callspec.params.get("rid") for item in request.session.items if hasattr(item, "callspec")}
    selected = [i for i, rid in enumerate(IDS) if rid in chosen]
    pool = ThreadPoolExecutor(max_workers=int(os.environ.get("MATRIX_JOBS", "2")))
    futures = {}
    start = time.monotonic()
    for i in sorted(selected, key=lambda i: -sum(cost(k, v) for k, v in ROWS[i].items())):
        row, d = ROWS[i], tmp_path_factory.mktemp(f"row{i:02d}")
        futures[IDS[i]] = (
            pool.submit(launch, row, row["world"], files, str(d / "reference")),
            pool.submit(interrupted, row, files, d),
        )
    yield futures
    pool.shutdown(wait=True)
    print(f"\nmatrix: {len(selected)} rows in {time.monotonic() - start:.0f} s")


# ------------------------------------------------------------------------------------------------ asserts
def fresh_model(row, f):
    if row["model"] == "reg":
        sys.path.insert(0, RECIPES)
        import regression

        return regression.build_model(SimpleNamespace(args=regression.Args()))
    if row["model"] == "cifar":
        sys.path.insert(0, RECIPES)
        import cifar

        return cifar.CifarNet((8, 16, 16))
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if row["model"] == "gpt2" else AutoModelForSequenceClassification
    return auto.from_config(AutoConfig.from_pretrained(f.gpt2 if row["model"] == "gpt2" else f.bert))


def finite_numbers(value, where=""):
    if isinstance(value, bool) or isinstance(value, str) or value is None:
        return
    if isinstance(value, (int, float)):
        assert math.isfinite(value), f"{where} = {value}"
    elif isinstance(value, dict):
        for k, v in value.items():
            finite_numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            finite_numbers(v, f"{where}[{i}]")


def assert_run(row, f, result: dict, world: str):
    """What every finished run must hold."""
    out, log = result["out"], result["log"][-6000:]
    assert result["rc"] == 0, f"{out}: exit {result['rc']}\n{log}"
    load_model(fresh_model(row, f), os.path.join(out, "model.safetensors"))  # strict: no missing, no unexpected
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    assert rows and rows[-1]["step"] == MAX_STEPS
    for r in rows:
        finite_numbers(r, f"metrics.jsonl step {r.get('step')}")
    if row["nan_policy"] == "skip":
        assert [r["skipped_steps"] for r in rows if "loss" in r][-1] == 0  # nothing non-finite here to skip
    config = run_config(out)
    assert config["num_processes"] == PROCESSES[world]
    assert config["topology"]["distributed_type"] == DISTRIBUTED_TYPE[world]
    assert config["topology"]["mixed_precision"] == row["precision"] == config["args"]["mixed_precision"]
    # the comm hook DDP runs (read back from the DDP model) is the one asked for, also behind torch.compile's wrapper
    assert config["ddp_comm_hook"] == (row["hook"] if world == "ddp" else None)
    if row["save_limit"]:
        assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [f"step_{MAX_STEPS}"]


def tolerance(row) -> dict | None:
    """None: bit-identical promised (docs/fault-tolerance.md); else the tolerance the math allows."""
    same_world = row["lifecycle"] != "world"
    if same_world and row["precision"] == "no" and not row["compile"] and not row["workers"]:
        return None
    if row["model"] == "cifar" and not same_world:
        return BATCHNORM_WORLD  # per-rank BatchNorm statistics and augmentation streams change with the world size
    return FP32 if row["precision"] == "no" and row["hook"] == "none" else LOOSE


@pytest.mark.parametrize("rid", IDS)
def test_matrix_row(rid, played, files):
    row = ROWS[IDS.index(rid)]
    ref_future, life_future = played[rid]
    reference = ref_future.result()
    assert_run(row, files, reference, row["world"])
    launches = life_future.result()
    if row["lifecycle"] == "plain":
        return
    final = launches[-1]
    if row["lifecycle"] in ("kill", "world"):
        assert len(launches) == 2, f"the killed run exited {launches[0]['rc']} instead of dying:\n{launches[0]['log']}"
        assert launches[0]["rc"] != 0
        assert (
            f"Resumed from {launches[0]['out']}/checkpoints/step_{SAVE_STEPS} at step {SAVE_STEPS}" in final["log"]
        ), final["log"][-4000:]
        assert_run(row, files, final, OTHER_WORLD[row["world"]] if row["lifecycle"] == "world" else row["world"])
    else:
        assert_run(row, files, final, row["world"])
        assert "[matrix fault] rank 1 exits" in final["log"] and "Resumed from" in final["log"], final["log"][-4000:]
    a, b = (load_file(os.path.join(r["out"], "model.safetensors")) for r in (final, reference))
    tol = tolerance(row)
    assert a.keys() == b.keys()
    for k in a:
        if tol is None:
            assert torch.equal(a[k], b[k]), f"{k}: not bit-identical to the uninterrupted run"
        else:
            torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("pair", list(REFUSED), ids=lambda p: f"{p[0][0]}={p[0][1]}+{p[1][0]}={p[1][1]}")
def test_refused_pairs_say_so_in_one_line(pair, files, tmp_path):
    """A pair the product refuses on purpose: exit 1, one line naming it on each rank, no traceback, nothing
    written."""
    (a, va), (b, vb) = pair
    row = {**ROWS[0], "model": "cifar", "world": "1", "ema": False, "grad_ckpt": False, "sync_bn": False, a: va, b: vb}
    out = str(tmp_path / "refused")
    result = launch(row, row["world"], files, out)
    log = result["log"]
    assert result["rc"] != 0, log[-4000:]
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors and all(REFUSED[pair] in e for e in errors), log[-4000:]
    # no traceback from a process of the run ("[rankN]: " under accelerate launch, whose launcher then prints
    # torchrun's own report of the failed workers: a ChildFailedError traceback of accelerate's, not ours)
    assert not re.search(r"^Traceback" if row["world"] == "1" else r"^\[rank\d+\]: Traceback", log, re.M), log[-4000:]
    assert not os.path.exists(out) or not os.listdir(out)
    shutil.rmtree(out + ".cache", ignore_errors=True)


@pytest.mark.parametrize("pair", list(RUN_ALONE), ids=lambda p: f"{p[0][0]}={p[0][1]}+{p[1][0]}={p[1][1]}")
def test_pairs_run_alone(pair, files, tmp_path):
    """A RUN_ALONE pair on the regression recipe, with every other factor at its first value, asserted like a row."""
    (a, va), (b, vb) = pair
    row = {factor: values[0] for factor, values in FACTORS.items()} | {"model": "reg", a: va, b: vb}
    assert allowed({k: v for k, v in row.items() if (k, v) not in pair}), row
    assert_run(row, files, launch(row, row["world"], files, str(tmp_path / "alone")), row["world"])
