"""The Trainer in-process, as in a notebook: the Python API, resume, EMA, files it writes."""

import json
import math
import os
import sys

import pytest
import torch
from helpers import RECIPES, assert_same_weights
from safetensors.torch import load_file, load_model

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments  # noqa: E402


def make(tmp_path, name="run", recipe_args=None, **kw):
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("disable_tqdm", True)
    kw.setdefault("save_steps", 0)
    args = TrainingArguments(output_dir=str(tmp_path / name), **kw)
    return Trainer(regression, args, recipe_args or regression.Args(), quiet=True)


def test_notebook_api(tmp_path):
    t = make(tmp_path, max_steps=5)
    batch = t.fetch_batch()
    assert batch["x"].shape == (16, 16)
    losses = t.overfit_batch(steps=60, batch=batch)
    assert losses[-1] < 0.2 * losses[0]
    ev = t.evaluate()
    assert ev["eval_samples"] == 64 and ev["eval_loss"] > 0
    assert isinstance(t.unwrapped_model, torch.nn.Sequential)


def test_fit_writes_run_files_and_plain_weights(tmp_path):
    t = make(tmp_path, max_steps=20, logging_steps=5)
    final = t.fit()
    out = t.args.output_dir
    cfg = json.load(open(os.path.join(out, "run_config.json")))
    assert cfg["num_processes"] == 1 and cfg["args"]["max_steps"] == 20 and "torch" in cfg["versions"]
    events = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [e for e in events if "loss" in e]
    assert [e["step"] for e in train] == [5, 10, 15, 20]
    assert all({"epoch", "elapsed_s", "learning_rate"} <= e.keys() for e in train)
    assert train[-1]["loss"] < train[0]["loss"]
    assert final["eval_samples"] == 64
    plain = regression.build_model(t.ctx)
    load_model(plain, os.path.join(out, "model.safetensors"))  # strict: no module./_orig_mod. prefixes
    assert_same_weights(plain.state_dict(), t.unwrapped_model.state_dict(), rtol=0, atol=0)


def test_resume_mid_epoch_gives_the_same_final_weights(tmp_path):
    # 256 samples / batch 16 = 16 updates per epoch: step 5 is mid-epoch. Dropout makes the RNG state matter.
    ra = regression.Args(dropout=0.2)
    full = make(tmp_path, "full", ra, max_steps=24, save_steps=5)
    full.fit()
    ckpt = os.path.join(full.args.output_dir, "checkpoints", "step_5")
    assert json.load(open(os.path.join(ckpt, "trainer_state.json")))["batch_in_epoch"] == 5
    resumed = make(tmp_path, "resumed", ra, max_steps=24, save_steps=5, resume_from_checkpoint=ckpt)
    assert resumed.global_step == 5
    resumed.fit()
    assert_same_weights(
        load_file(os.path.join(resumed.args.output_dir, "model.safetensors")),
        load_file(os.path.join(full.args.output_dir, "model.safetensors")),
        rtol=0,
        atol=0,
    )


def test_resume_latest_continues_in_place(tmp_path):
    first = make(tmp_path, "r", max_steps=10, save_steps=4)
    first.fit()
    again = make(tmp_path, "r", max_steps=14, save_steps=4, resume_from_checkpoint="latest")
    assert again.global_step == 10  # the final checkpoint at step 10 is the newest
    again.fit()
    steps = [json.loads(line)["step"] for line in open(os.path.join(again.args.output_dir, "metrics.jsonl"))]
    assert max(steps) == 14


def test_ema_weights_are_evaluated_and_saved(tmp_path):
    t = make(tmp_path, max_steps=30, ema_decay=0.9)
    t.fit()
    saved = load_file(os.path.join(t.args.output_dir, "model.safetensors"))
    ema = t.ema.module.state_dict()
    raw = t.unwrapped_model.state_dict()
    assert_same_weights(saved, {k: v for k, v in ema.items() if k in saved}, rtol=0, atol=0)
    assert not torch.equal(saved["0.weight"], raw["0.weight"])


def test_evaluation_uses_the_ema_weights(tmp_path):
    # README/docs: "--ema_decay: ... evaluation uses it". The eval loss the Trainer logs and returns is that of the
    # saved EMA weights, computed here by hand over the recipe's eval split, and not that of the trained weights.
    t = make(tmp_path, max_steps=30, ema_decay=0.9, logging_steps=30)
    final = t.fit()
    evald = regression.build_data(t.ctx)["eval"].tensors

    def eval_loss(weights):
        model = regression.build_model(t.ctx)
        model.load_state_dict(weights)
        with torch.no_grad():
            err = (model(evald["x"]) - evald["y"]) ** 2 * evald["mask"]
        return (err.sum() / evald["mask"].sum()).item()

    ema = eval_loss(load_file(os.path.join(t.args.output_dir, "model.safetensors")))
    raw = eval_loss(t.unwrapped_model.state_dict())
    assert abs(ema - raw) > 1e-3 * raw, (ema, raw)  # the two differ, so the check below can tell them apart
    assert final["eval_loss"] == pytest.approx(ema, rel=1e-5)
    assert t.evaluate()["eval_loss"] == pytest.approx(ema, rel=1e-5)
    logged = [json.loads(line) for line in open(os.path.join(t.args.output_dir, "metrics.jsonl"))]
    assert [r["eval_loss"] for r in logged if "eval_loss" in r][-1] == pytest.approx(ema, rel=1e-5)


def test_fp16_overflow_skips_are_counted_and_logged(tmp_path):
    # Accelerate gives no GradScaler on the CPU, so we put torch's own in its place: the Trainer's fp16 path
    # (scaler.step, overflow detection, skip counting, loss_scale logging) is the same on a GPU.
    t = make(tmp_path, max_steps=6, logging_steps=6, lr_scheduler_type="constant")
    t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    weight = t.unwrapped_model[0].weight
    overflow = {"on": False}
    weight.register_hook(lambda g: g * float("inf") if overflow["on"] else g)
    for step in range(6):
        overflow["on"] = step == 2
        before = weight.detach().clone()
        t.train_step()
        assert torch.equal(before, weight.detach()) == (step == 2)  # the overflowing update changed nothing
    assert t.progress.skipped_steps == 1
    event = t.log()
    assert event["skipped_steps"] == 1 and event["loss_scale"] == 2.0**9  # halved once by the overflow


def test_fp16_loss_scaling_clips_the_unscaled_gradients(tmp_path):
    # Clipping must see the true gradients (unscaled first), or a scale of 2**10 would make every clipped update
    # ~1000x too small. With a GradScaler and no overflow the run must train as the one without a scaler.
    runs = {}
    for scaled in (False, True):
        t = make(tmp_path, name=f"scaled{scaled}", max_steps=4, max_grad_norm=0.05, lr_scheduler_type="constant")
        if scaled:
            t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
        norms = []
        for _ in range(4):
            t.train_step()
            norms.append(float(t.updater.grad_norm))
        assert max(norms) > 0.05  # clipping did something
        runs[scaled] = (norms, {k: v.clone() for k, v in t.unwrapped_model.state_dict().items()})
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    assert_same_weights(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-7)


def test_the_callers_arguments_are_not_changed_and_a_second_trainer_scales_from_the_base(tmp_path):
    from accel_trainer import resolve_args

    values = dict(output_dir=str(tmp_path / "o"), max_steps=1, learning_rate=0.01, lr_scaling="linear",
                  lr_base_batch_size=4, per_device_train_batch_size=16, disable_tqdm=True, overwrite_output_dir=True)  # fmt: skip
    resolved = resolve_args(regression, values=values)
    first, second = Trainer(regression, resolved), Trainer(regression, resolved)
    assert resolved.targs.learning_rate == 0.01  # the resolved arguments keep the base value
    assert first.learning_rate == second.learning_rate == 0.01 * 16 / 4  # each scales from the base
    assert first.args.learning_rate == 0.01 and first.args is not resolved.targs  # the user's value, kept


def test_the_default_adamw_is_fused_where_torch_has_it_steps_like_the_loop_and_skips_fp16_overflows(tmp_path):
    from accel_trainer.optim import default_optimizer

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))

    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, weight_decay=0.1)
    fused_model, loop_model = model(), model()
    fused = default_optimizer(fused_model, args)
    assert fused.defaults["fused"] is True  # the CPU has torch's fused AdamW kernel
    # Decided by the training device, not by where the parameters are: under FSDP's low-memory loading they are on
    # the meta device on ranks > 0, and every rank must build the same optimizer.
    with torch.device("meta"):
        on_meta = model()
    assert default_optimizer(on_meta, args, torch.device("cpu")).defaults["fused"] is True
    loop = default_optimizer(loop_model, args)
    for group in loop.param_groups:
        group["fused"], group["foreach"] = False, False  # torch's per-tensor AdamW, a hand-written loop's default
    x = torch.randn(32, 8)
    for _ in range(5):
        for m, opt in ((fused_model, fused), (loop_model, loop)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(fused_model.state_dict(), loop_model.state_dict(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused_model[0].weight, model()[0].weight)  # it did train

    # fp16 loss scaling hands the fused kernel the scale and the overflow flag: an inf gradient changes nothing
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = {k: v.clone() for k, v in fused_model.state_dict().items()}
    fused_model[0].weight.register_hook(lambda g: g * float("inf"))
    scaler.scale(fused_model(x).square().mean()).backward()
    scaler.step(fused)
    scaler.update()
    assert_same_weights(before, fused_model.state_dict(), rtol=0, atol=0)
    assert scaler.get_scale() == 2.0**9


def test_a_log_row_takes_losses_of_any_float_dtype_and_shape(tmp_path):
    # log() stacks the window's losses and norms as they are when all are 0-d float32 (the usual case) and converts
    # them otherwise: a recipe's loss in bf16, or of shape (1,), must give the same row.
    from accel_trainer import Recipe

    rows = {}
    for kind, cast in (("fp32", lambda x: x), ("bf16", lambda x: x.bfloat16()), ("shape1", lambda x: x.reshape(1))):
        recipe = Recipe(
            name=f"regression_{kind}",
            Args=regression.Args,
            build_model=regression.build_model,
            build_data=regression.build_data,
            loss=lambda model, batch, cast=cast: (
                cast(regression.loss(model, batch)[0]),
                regression.loss(model, batch)[1],
            ),
        )
        args = TrainingArguments(output_dir=str(tmp_path / kind), max_steps=3, learning_rate=1e-2,
                                 per_device_train_batch_size=16, disable_tqdm=True, save_steps=0)  # fmt: skip
        t = Trainer(recipe, args, regression.Args(), quiet=True)
        for _ in range(3):
            t.train_step()
        rows[kind] = t.log()["loss"]
    assert rows["shape1"] == rows["fp32"]
    assert rows["bf16"] == pytest.approx(rows["fp32"], rel=1e-2)  # bf16 rounding of each loss


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_fp16_a_nan_batch_skipped_with_clipping_leaves_the_scaler_consistent(tmp_path, clip):
    # fp16 + --nan_policy skip + clipping: clipping unscales the gradients, and a skipped update must still end the
    # scaler's iteration, or the next update's unscale_ raises "unscale_() has already been called". The skip backs
    # the scale off as GradScaler does for a non-finite step; the good updates after it step and clip as usual.
    t = make(tmp_path, max_steps=6, max_grad_norm=clip, nan_policy="skip", lr_scheduler_type="constant")
    t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    weight = t.unwrapped_model[0].weight
    good = t.fetch_batch()
    bad = dict(good, x=torch.full_like(good["x"], float("nan")))
    for step, batch in enumerate([good, bad, good, good]):
        before = weight.detach().clone()
        loss = t.train_step(batch)
        assert torch.equal(before, weight.detach()) == (step == 1)  # only the NaN batch changed nothing
        assert math.isfinite(loss) == (step != 1)
    assert t.progress.skipped_steps == 1
    assert t.accelerator.scaler.get_scale() == 2.0**9  # halved once, by the NaN batch
    if clip:
        assert float(t.updater.grad_norm) > clip  # the updates after it were clipped (unscaled first)
    assert t.log()["skipped_steps"] == 1


def test_configure_and_every_builder_get_the_run_s_one_context_completed_as_set_up_learns(tmp_path):
    # Set-up flows one way: the context configure saw (before the Accelerator exists) is the one each builder gets,
    # completed with the Accelerator and then the run length, not a second context built beside it.
    from accel_trainer import Recipe

    seen = {}

    def keep(hook, fn):
        def wrapped(*a):
            ctx = a[-1]
            seen[hook] = (ctx, ctx.accelerator, ctx.num_training_steps)
            return fn(*a)

        return wrapped

    recipe = Recipe(
        build_model=keep("build_model", regression.build_model), build_data=keep("build_data", regression.build_data),
        loss=regression.loss, Args=regression.Args, defaults=regression.defaults,
        configure=keep("configure", regression.configure),
        build_scheduler=keep("build_scheduler", regression.build_scheduler), name="one_context",
    )  # fmt: skip
    t = Trainer.from_recipe(recipe, output_dir=str(tmp_path / "o"), max_steps=3, disable_tqdm=True, quiet=True)
    assert {id(ctx) for ctx, _, _ in seen.values()} == {id(t.ctx)}, "one RecipeContext per run"
    assert seen["configure"][1:] == (None, None)  # configure runs before the Accelerator exists
    assert seen["build_model"][1] is t.accelerator and seen["build_data"][1] is t.accelerator
    assert seen["build_scheduler"][2] == t.total_steps == 3 == t.ctx.num_training_steps
    assert t.ctx.targs is t.args and t.ctx.world_size == t.accelerator.num_processes == 1


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_dropped_trainer_frees_its_model_at_once(tmp_path, precision):
    """A notebook that builds a Trainer again, or a sweep of seeds, drops the last one: its model, optimizer and
    data (on a GPU, their memory) must go then, not at Python's next full garbage collection, which may come after
    the next Trainer has built its own (an H100 sweep of 5 seeds grew from 1434 to 1832 MB). Reference counting
    alone frees them when nothing points back at the Trainer: with checkpoints (written in the background where torch
    can), EMA, the profiler, evaluation and metrics on, and the automatic collection off. In mixed precision too,
    where Accelerate's autocast forward (a method of the model bound to itself) made every model refer to itself
    (bf16 here; under fp16, a GPU's, the optimizer wrapper referred to itself too: tests/test_privates.py's
    step_patch_without_cycle)."""
    import gc
    import weakref

    from accel_trainer import versions

    background = versions.problem("--save_async") is None  # torch 2.8 has no background writes

    def train(name):
        t = make(tmp_path, name, max_steps=4, save_steps=2, save_async=background, ema_decay=0.9, profile_steps="2-3",
                 mixed_precision=precision)  # fmt: skip
        t.fit()
        return weakref.ref(t), weakref.ref(t.unwrapped_model), weakref.ref(t.optimizer)

    train("warm")  # a process's first Trainer imports modules lazily, and an import can leave cycles of its own
    gc.collect()
    gc.disable()
    try:
        kept = [ref() is not None for ref in train("run")]
    finally:
        gc.enable()
    assert kept == [False, False, False]  # the Trainer, its model and its optimizer


def test_a_run_that_fails_keeps_the_profile_of_the_updates_it_did(tmp_path):
    """--profile_steps 1-6 and a loss that fails at a later update: the profiler stops on the way out of fit(),
    which writes the profile of the updates done (before, it stopped only at fit_end, which a failed run never
    reaches, and stayed running in the process)."""
    import dataclasses

    from accel_trainer import load_recipe

    base, calls = load_recipe(regression), []

    def loss(model, batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("the recipe's loss failed")
        return base.loss(model, batch)

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=8, profile_steps="1-6", disable_tqdm=True, save_steps=0
    )
    trainer = Trainer(dataclasses.replace(base, loss=loss), args, regression.Args(), quiet=True)
    with pytest.raises(RuntimeError, match="the recipe's loss failed"):
        trainer.fit()
    assert 2 <= trainer.global_step < 6
    assert (tmp_path / "run" / "profile" / "summary_rank0.txt").is_file()
