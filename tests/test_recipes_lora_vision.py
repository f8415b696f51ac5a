"""recipes/lora.py and recipes/vision.py (issue 40 item 2) as users run them: `python` and `accelerate launch` on
2 CPU processes (gloo), their output folders loaded back the ecosystem's way (peft's AutoPeftModel and PeftModel;
transformers' from_pretrained and pipeline), the LoRA run's checkpoints holding the adapter only, a LoRA run
killed with SIGKILL after a checkpoint and a vision run stopped after one, each resumed to the uninterrupted run's
bytes.

Nothing from the network or ../shared: a 2-layer, 32-wide BERT with a WordPiece tokenizer trained on the test's own
text and an MRPC-shaped GLUE folder (tests/text_fixtures.py), a 2-layer, 32-wide ViT of 16x16 images with its image
processor and a tiny CIFAR-10 in the Hub layout (tests/cifar_fixtures.py), all written by the test. The runs are
shared by the tests (module fixture) and started together: 1 and 2 processes of both recipes at once.
"""

import json
import os
import time
import types

import pytest
import torch
from cifar_fixtures import make_tiny_vit, tiny_arrays, write_hub_layout
from helpers import RECIPES, flags, launch_cmd, metrics, run_config
from procs import Launch
from safetensors.torch import load_file
from text_fixtures import ctx, load_recipe_module, make_glue_folder, make_tiny_bert, offline_env

from accel_trainer import Trainer, UserError

DEADLINE = 420  # seconds one launch may take on a loaded 2-core machine (they take about 10 s alone)
# 12 updates of a global batch of 8 (8 x 1 process, 4 x 2), a checkpoint every 4, fp32 (the exact-resume promise),
# no dropout (1 and 2 processes then make the same updates)
COMMON = dict(max_steps=12, save_steps=4, logging_steps=4, per_device_eval_batch_size=4, mixed_precision="no",
              warmup_ratio=0, seed=0, disable_tqdm=True)  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    cifar = str(root / "cifar10")
    write_hub_layout(cifar, tiny_arrays(96, 0), tiny_arrays(30, 1))
    cache = str(root / "cache")
    return {
        "root": root,
        "lora": dict(model_name_or_path=make_tiny_bert(str(root / "bert")), task_name="mrpc", cache_dir=cache,
                     dataset_name=make_glue_folder(str(root / "glue"), n_train=48, n_eval=13), lora_dropout=0,
                     learning_rate=1e-2),
        "vision": dict(model_name_or_path=make_tiny_vit(str(root / "vit")), dataset_name=cifar, cache_dir=cache,
                       learning_rate=1e-3),
    }  # fmt: skip


def start(script: str, out, world: int, values: dict, *extra, **extra_env) -> Launch:
    """`python SCRIPT` (world 1) or `accelerate launch` of 2 CPU processes, with a global batch of 8."""
    cmd = launch_cmd(world) + [script] + flags(output_dir=out, per_device_train_batch_size=8 // world, **COMMON,
                                                **values) + list(extra)  # fmt: skip
    env = offline_env(out.parent) | extra_env
    return Launch(cmd, f"{out}.log", env=env, cwd=str(out.parent), deadline=DEADLINE)


@pytest.fixture(scope="module")
def runs(assets):
    """{(recipe, world): output folder} of the uninterrupted runs, all four started at once."""
    started = {
        (recipe, world): start(os.path.join(RECIPES, f"{recipe}.py"), assets["root"] / f"{recipe}{world}", world,
                               assets[recipe])
        for recipe in ("lora", "vision") for world in (1, 2)
    }  # fmt: skip
    try:
        for launch in started.values():
            launch.wait_ok()
    finally:
        for launch in started.values():
            launch.stop()
    return {key: assets["root"] / f"{key[0]}{key[1]}" for key in started}


def assert_world(out, world: int):
    config = run_config(str(out))
    assert config["num_processes"] == world, config["topology"]
    if world == 2:
        assert config["topology"]["backend"] == "gloo", config["topology"]


def final_eval(out) -> dict:
    return [r for r in metrics(str(out)) if "eval_loss" in r][-1]


def recipe_args(module, values: dict):
    """The recipe's own Args from the values of a run (which also hold the Trainer's)."""
    return module.Args(**{k: v for k, v in values.items() if k in module.Args.__dataclass_fields__})


def evaluate(model, recipe: str, values: dict) -> dict:
    """The model's loss, accuracy (and F1 for MRPC) over the recipe's eval split, batches of 4 through the recipe's
    own build_data, collate and eval_step, as the run evaluates."""
    module = load_recipe_module(recipe)
    args = recipe_args(module, values)
    data = module.build_data(ctx(args))
    rows, collate = data["eval"], data.get("collate") or torch.utils.data.default_collate
    metric = next(iter(module.build_metrics(ctx(args)).values()))
    total, n = 0.0, 0
    for i in range(0, len(rows), 4):
        step = module.eval_step(model, collate([rows[j] for j in range(i, min(i + 4, len(rows)))]))
        total, n = total + float(step["loss"].double().sum()), n + int(step["n_items"].sum())
        metric.add_batch(predictions=step["predictions"], references=step["references"])
    return {"eval_loss": total / n, "eval_samples": n} | {f"eval_{k}": v for k, v in metric.compute().items()}


# --------------------------------------------------------------------------------------------------------- LoRA
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_lora_output_is_a_peft_adapter_folder_that_peft_loads_as_the_run_ended(runs, assets, world):
    """The output folder is peft's adapter folder with the tokenizer; AutoPeftModelForSequenceClassification (the
    base from adapter_config.json) and PeftModel.from_pretrained on the base load it with the run's final weights
    (the final checkpoint's, bit for bit) and give its final eval loss, accuracy and F1 on the eval split."""
    import peft
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, values = runs["lora", world], assets["lora"]
    assert_world(out, world)
    files = set(os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files, files
    assert "model.safetensors" not in files, files
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["task_type"], adapter["r"], adapter["lora_alpha"]) == (
        values["model_name_or_path"], "SEQ_CLS", 8, 16
    )  # fmt: skip
    auto = peft.AutoPeftModelForSequenceClassification.from_pretrained(str(out)).eval()
    base = AutoModelForSequenceClassification.from_pretrained(values["model_name_or_path"])
    on_base = peft.PeftModel.from_pretrained(base, str(out)).eval()
    final = load_file(out / "checkpoints" / "step_12" / "model.safetensors")  # what trains, as the run ended
    for model in (auto, on_base):
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in final.items())
        assert any("lora_B" in k and v.abs().sum() > 0 for k, v in final.items())  # trained: lora_B starts at 0
    run = final_eval(out)
    loaded = evaluate(auto, "lora", values)
    assert loaded == {**{k: run[k] for k in loaded}, "eval_loss": pytest.approx(run["eval_loss"], rel=1e-5)}
    assert loaded["eval_samples"] == 13
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    batch = tokenizer(["the cat sat on the mat"], ["a dog ran"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(auto(**batch).logits, on_base(**batch).logits)


@pytest.mark.slow
def test_lora_on_two_processes_trains_the_one_process_adapter(runs):
    """Same global batch, no dropout: the adapters of 1 and 2 processes agree to float tolerance."""
    one, two = (load_file(runs["lora", w] / "adapter_model.safetensors") for w in (1, 2))
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_lora_target_modules_that_match_nothing_are_one_line_naming_the_flag(assets):
    """peft's ValueError (no module of that name) becomes one UserError line naming the model's linear layers (a run
    prints it as `error: ...`)."""
    module = load_recipe_module("lora")
    values = {**assets["lora"], "lora_target_modules": "nosuch"}
    args = recipe_args(module, values)
    with pytest.raises(UserError) as e:
        module.build_model(ctx(args))
    message = str(e.value)
    assert "\n" not in message and "Pass --lora_target_modules names of its linear layers (" in message, message
    assert "key,query,value" in message and message.endswith(") or all-linear."), message


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_lora_checkpoints_hold_what_trains_and_the_frozen_bases_fingerprints(runs, assets, world):
    """Each checkpoint's model.safetensors holds exactly the parameters that train (the adapter and the new head),
    frozen.json names every frozen parameter of the base, and no checkpoint is more than a fifth of the base's
    size (here the adapter and head are 2,114 of 28,388 parameters). Before (issue 40): the whole base each time."""
    module = load_recipe_module("lora")
    values = assets["lora"]
    args = recipe_args(module, values)
    model = module.build_model(ctx(args))  # the model the run trains
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trains and all("lora_" in n or "modules_to_save" in n for n in trains), trains
    base_bytes = os.path.getsize(os.path.join(values["model_name_or_path"], "model.safetensors"))
    steps = sorted(os.listdir(runs["lora", world] / "checkpoints"))
    assert steps == ["step_12", "step_4", "step_8"], steps
    for step in steps:
        folder = runs["lora", world] / "checkpoints" / step
        assert set(load_file(folder / "model.safetensors")) == trains, step
        assert set(json.loads((folder / "frozen.json").read_text())["state"]) == frozen, step
        assert os.path.getsize(folder / "model.safetensors") < base_bytes / 5, step
        assert os.path.getsize(folder / "optimizer.safetensors") < base_bytes / 2, step  # moments of what trains


SLOW_LORA = """
import os
import sys
import time

sys.path.insert(0, {recipes!r})
from lora import Args, build_data, build_metrics, build_model, defaults, eval_step, loss, name  # noqa: E402, F401


def on_update_end(trainer):  # from update 4 on, STEP_DELAY s per update: the test kills it before its end
    if trainer.global_step >= 4:
        time.sleep(float(os.environ.get("STEP_DELAY", "0")))


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
"""


@pytest.mark.slow
def test_lora_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_bytes(runs, assets, tmp_path):
    """SIGKILL (every process of the launch) once the step-4 checkpoint is written, on 1 and 2 processes at once;
    `--resume_from_checkpoint latest` then loads the adapter and its optimizer state from the checkpoint, checks
    the base that build_model built again against frozen.json, and ends with the uninterrupted run's adapter,
    byte for byte, and its final metrics."""
    script = tmp_path / "slow_lora.py"
    script.write_text(SLOW_LORA.format(recipes=RECIPES))
    outs = {world: tmp_path / f"killed{world}" for world in (1, 2)}
    killed = {w: start(str(script), outs[w], w, assets["lora"], STEP_DELAY="2") for w in outs}
    try:
        waiting, deadline = set(killed), time.monotonic() + DEADLINE
        while waiting:  # each killed as soon as its step-4 checkpoint is complete (its manifest is written last)
            for world in sorted(waiting):
                launch = killed[world]
                launch.tree()  # keep track of the launch's processes while they live
                assert launch.proc.poll() is None, (
                    f"exited {launch.proc.returncode} before it was killed:\n{launch.output()}"
                )
                if (outs[world] / "checkpoints" / "step_4" / "manifest.json").exists():
                    launch.kill()
                    launch.wait()
                    launch.no_process_left()
                    waiting.discard(world)
            assert time.monotonic() < deadline, f"no step-4 checkpoint within {DEADLINE} s"
            time.sleep(0.05)
    finally:
        for launch in killed.values():
            launch.stop()
    for out in outs.values():
        assert not (out / "adapter_model.safetensors").exists()  # killed before the end
    resumed = {w: start(str(script), outs[w], w, assets["lora"], "--resume_from_checkpoint", "latest") for w in outs}
    try:
        logs = {w: launch.wait_ok() for w, launch in resumed.items()}
    finally:
        for launch in resumed.values():
            launch.stop()
    for world, out in outs.items():
        assert f"Resumed from {out / 'checkpoints'}" in logs[world], logs[world][-3000:]  # not started afresh
        reference = runs["lora", world]
        assert (out / "adapter_model.safetensors").read_bytes() == (
            reference / "adapter_model.safetensors"
        ).read_bytes()
        assert final_eval(out) | {"elapsed_s": 0} == final_eval(reference) | {"elapsed_s": 0}


# ------------------------------------------------------------------------------------------------------- vision
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_vision_output_loads_with_from_pretrained_and_the_image_classification_pipeline(runs, assets, world):
    """The output folder is a save_pretrained folder with the image processor the recipe handed over:
    AutoModelForImageClassification.from_pretrained loads the run's final weights (the final checkpoint's, bit for
    bit) with the dataset's class names and gives the run's final eval loss and accuracy; AutoImageProcessor loads
    the processor as given; pipeline("image-classification") classifies an image of the dataset as the model does."""
    import datasets
    from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

    out, values = runs["vision", world], assets["vision"]
    assert_world(out, world)
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= files, files
    model = AutoModelForImageClassification.from_pretrained(str(out)).eval()
    assert [model.config.id2label[i] for i in range(10)] == CLASSES
    final = load_file(out / "checkpoints" / "step_12" / "model.safetensors")
    state = model.state_dict()
    assert final.keys() == state.keys() and all(torch.equal(state[k], v) for k, v in final.items())
    run = final_eval(out)
    loaded = evaluate(model, "vision", values)
    assert loaded == {**{k: run[k] for k in loaded}, "eval_loss": pytest.approx(run["eval_loss"], rel=1e-5)}
    assert loaded["eval_samples"] == 30
    given = AutoImageProcessor.from_pretrained(values["model_name_or_path"]).to_dict()
    assert AutoImageProcessor.from_pretrained(str(out)).to_dict() == given
    image = datasets.load_dataset(values["dataset_name"], cache_dir=values["cache_dir"])["test"][0]["img"]
    classify = pipeline("image-classification", model=str(out), device="cpu")
    with torch.no_grad():
        probs = model(**AutoImageProcessor.from_pretrained(str(out))(image, return_tensors="pt")).logits.softmax(-1)[0]
    top = classify(image, top_k=1)[0]
    assert top["label"] == CLASSES[int(probs.argmax())] and top["score"] == pytest.approx(float(probs.max()), rel=1e-5)


def test_vision_reads_images_through_a_transform_and_mirrors_about_half_the_training_images(assets):
    """build_data hands over datasets of PIL images with the image processor as their transform (nothing decoded
    or stored ahead), and the processor itself; `loss` mirrors about half of a training batch's images, and none of
    a batch from the eval split or with --no_horizontal_flip."""
    module = load_recipe_module("vision")
    values = assets["vision"]
    args = recipe_args(module, values)
    data = module.build_data(ctx(args))
    processor = data["tokenizer"]
    assert type(processor).__name__.startswith("ViTImageProcessor"), processor
    for split in ("train", "eval"):
        stored = data[split].with_format(None)[:64]  # the rows as stored: PIL images
        assert type(stored["img"][0]).__module__.startswith("PIL"), stored["img"][0]
        rows = data[split][:64]
        assert torch.equal(rows["pixel_values"], processor(stored["img"], return_tensors="pt")["pixel_values"])
        assert rows["labels"].tolist() == stored["label"] and rows["flip"].tolist() == [split == "train"] * len(
            stored["label"]
        )
    seen = []

    def model(pixel_values, labels):
        seen.append(pixel_values)
        return types.SimpleNamespace(loss=torch.zeros(()))

    train, test = data["train"][:64], data["eval"][:30]
    unflipped = {**train, "flip": torch.zeros(64, dtype=torch.bool)}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for batch in (train, test, unflipped):
            assert module.loss(model, batch)[1] == len(batch["labels"])
    for batch, pixels in zip((train, test, unflipped), seen):
        mirrored = [
            bool(torch.equal(p, r.flip(-1))) and not torch.equal(p, r) for p, r in zip(pixels, batch["pixel_values"])
        ]
        kept = [bool(torch.equal(p, r)) for p, r in zip(pixels, batch["pixel_values"])]
        assert all(m or k for m, k in zip(mirrored, kept))
        assert (16 <= sum(mirrored) <= 48) if batch is train else not any(mirrored), sum(mirrored)


def test_vision_interrupted_after_a_checkpoint_resumes_to_the_uninterrupted_runs_bytes(assets, tmp_path):
    """The random flips are drawn in `loss`, at the update, from the generator a checkpoint holds (drawn in the
    transform, a batch ahead of the update, they came before the checkpoint and a resumed run drew them again:
    other bytes), and the images come through the transform from the checkpoint's place in the epoch: a run
    stopped after its step-4 checkpoint and resumed ends with the uninterrupted run's weights, byte for byte (the
    Python API, in this process)."""
    module = load_recipe_module("vision")
    values = {**COMMON, **assets["vision"], "per_device_train_batch_size": 8, "max_steps": 8}

    def trainer(out, **extra):
        return Trainer.from_recipe(module, quiet=True, output_dir=str(out), **values, **extra)

    trainer(tmp_path / "whole").fit()
    cut = trainer(tmp_path / "cut")
    cut.on("checkpoint_written", lambda t, path: (_ for _ in ()).throw(KeyboardInterrupt) if t.global_step == 4 else 0)
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    trainer(tmp_path / "cut", resume_from_checkpoint="latest").fit()
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()
