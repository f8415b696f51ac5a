"""What a new user meets in the first hour (issue 40, item 4): each case run as a user runs it, with a recipe written
the way people write them. Every test here failed before its fix."""

import json
import os
import re
import sys

import pytest
import torch
from helpers import RECIPES, metrics, run

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments, UserError  # noqa: E402
from accel_trainer import run as run_recipe  # noqa: E402

RUN_IT = """
if __name__ == "__main__":
    import sys

    from accel_trainer import run

    run(sys.modules[__name__])
"""


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


IMAGES = """
import datasets
import PIL.Image
import torch
from torch import nn

# A dataset of PIL images as `datasets` gives them (CIFAR-10's `img` column), handed over without a transform.
images = [PIL.Image.new("RGB", (4, 4), (i, 0, 0)) for i in range(32)]
data = datasets.Dataset.from_dict({"img": images, "label": [i % 10 for i in range(32)]})


def build_model(ctx):
    return nn.Linear(48, 10)


def build_data(ctx):
    return {"train": data}


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch["img"].flatten(1)), batch["label"]), len(batch["label"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_pil_images_without_a_transform_are_one_line_naming_the_transform(workers, tmp_path):
    """Before: torch's default collate failed in a 63-line traceback ("batch must contain tensors, numpy arrays,
    numbers, dicts or lists; found <class 'PIL.PngImagePlugin.PngImageFile'>")."""
    recipe = tmp_path / "pictures.py"
    recipe.write_text(IMAGES + RUN_IT)
    args = ["--output_dir", tmp_path / "o", "--dataloader_num_workers", workers, "--disable_tqdm"]
    proc = run(str(recipe), args, check=False, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = error_lines(proc)
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr
    assert errors[0].startswith("error: Recipe pictures: its samples hold PIL images (PIL."), errors[0]
    assert "with_transform" in errors[0] and "AutoImageProcessor" in errors[0], errors[0]
    assert not (tmp_path / "o" / "model.safetensors").exists()


SORTED = """
import torch
from torch import nn

# An eval split sorted by label, as CIFAR-10's test split is: 10 labels x 20 samples.
x = torch.zeros(200, 1)
y = torch.arange(200).div(20, rounding_mode="floor").float().unsqueeze(1)
data = torch.utils.data.TensorDataset(x, y)


def build_model(ctx):
    return nn.Linear(1, 1)


def build_data(ctx):
    return {"train": data, "eval": data}


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y), len(x)
"""


@pytest.mark.slow
def test_max_eval_samples_draws_from_the_whole_split_the_same_on_any_world_size(tmp_path):
    """--max_eval_samples took the first N: of a label-sorted split, the first label alone (CIFAR-10's test split:
    all airplanes, accuracy 0.0). It draws N with --seed, the same N on 1 and 2 processes and in every evaluation."""
    recipe = tmp_path / "sorted_eval.py"
    recipe.write_text(SORTED + RUN_IT)
    common = ["--max_eval_samples", 20, "--learning_rate", 0, "--max_steps", 2, "--eval_steps", 1, "--save_steps", 0]
    common += ["--disable_tqdm", "--per_device_eval_batch_size", 3, "--seed", 7]
    evals = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        batch = ["--per_device_train_batch_size", 8 // world]
        run(str(recipe), ["--output_dir", out] + common + batch, nproc=world, timeout=300)
        evals[world] = [(r["eval_samples"], r["eval_loss"]) for r in metrics(str(out)) if "eval_loss" in r]
    assert len(evals[1]) == len(evals[2]) == 2, evals  # after update 1, and the final one
    assert evals[2] == [(n, pytest.approx(loss, rel=1e-6)) for n, loss in evals[1]], evals
    samples, eval_loss = evals[1][0]
    # The model predicts its bias, the same for every sample: the eval loss is the spread of the drawn labels
    # around it. The first 20 samples are all label 0 (a loss near 0); a draw over the ten labels spreads over them.
    assert samples == 20 and eval_loss > 2.0, evals
    assert all(e == evals[1][0] for e in evals[1]), evals  # every evaluation the same samples


def train(out, *flags) -> list[dict]:
    """The regression recipe on 1 process, in this process as `python recipes/regression.py` runs it: 256 samples,
    batch 32, 8 updates per epoch. Returns its metrics.jsonl rows."""
    run_recipe(regression, ["--output_dir", str(out), "--per_device_train_batch_size", "32", "--disable_tqdm"]
               + [str(f) for f in flags])  # fmt: skip
    return metrics(str(out))


def eval_steps_of(rows) -> list[int]:
    return [r["step"] for r in rows if "eval_loss" in r]


def checkpoint_steps(out) -> list[int]:
    folder = out / "checkpoints"
    return sorted(int(d.split("_")[1]) for d in os.listdir(folder)) if folder.exists() else []


def test_transformers_eval_and_save_strategies_run_as_in_transformers(tmp_path):
    """--eval_strategy / --save_strategy, as the README promises transformers' names: before, argparse's usage dump
    and 'unrecognized arguments'. As in transformers: steps every --eval_steps (unset: --logging_steps, here the
    recipe's 5), epoch at each epoch's end whatever --eval_steps says, no for none during training; here the run's
    end is evaluated (and, unless no, checkpointed) too."""
    rows = train(tmp_path / "a", "--num_train_epochs", 2, "--eval_strategy", "steps", "--eval_steps", 3,
                 "--save_strategy", "epoch", "--save_steps", 3)  # fmt: skip
    assert eval_steps_of(rows) == [3, 6, 9, 12, 15, 16] and checkpoint_steps(tmp_path / "a") == [8, 16]
    rows = train(tmp_path / "b", "--num_train_epochs", 2, "--eval_strategy", "epoch", "--eval_steps", 3,
                 "--save_strategy", "no", "--save_steps", 3)  # fmt: skip
    assert eval_steps_of(rows) == [8, 16] and checkpoint_steps(tmp_path / "b") == []
    rows = train(tmp_path / "c", "--num_train_epochs", 2, "--eval_strategy", "no", "--save_strategy", "steps",
                 "--save_steps", 6)  # fmt: skip
    assert eval_steps_of(rows) == [16] and checkpoint_steps(tmp_path / "c") == [6, 12, 16]
    rows = train(tmp_path / "d", "--num_train_epochs", 2, "--eval_strategy", "steps", "--save_strategy", "no")
    assert eval_steps_of(rows) == [5, 10, 15, 16]
    # and from Python, TrainingArguments takes them (before: TypeError: unexpected keyword argument 'eval_strategy')
    args = TrainingArguments(output_dir=str(tmp_path / "e"), eval_strategy="steps", eval_steps=4, max_steps=8,
                             save_strategy="no", disable_tqdm=True)  # fmt: skip
    Trainer(regression, args, regression.Args(), quiet=True).fit()
    assert eval_steps_of(metrics(str(tmp_path / "e"))) == [4, 8] and checkpoint_steps(tmp_path / "e") == []


def test_early_stopping_stops_after_patience_evaluations_without_improvement_and_stays_stopped(tmp_path, capsys):
    """--early_stopping_patience N, as transformers' EarlyStoppingCallback: the run stops after N evaluations in a
    row that do not improve --metric_for_best_model (default eval_loss). At learning rate 0 the first evaluation
    is the best and none after improves on it: with patience 2 the run stops at the third, step 3 of 16, and ends
    as after its last update; resumed, it stays stopped."""
    out = tmp_path / "o"
    flags = ["--learning_rate", 0, "--num_train_epochs", 2, "--eval_strategy", "steps", "--eval_steps", 1,
             "--early_stopping_patience", 2, "--save_steps", 100]  # fmt: skip
    rows = train(out, *flags)
    assert max(r["step"] for r in rows) == 3 and eval_steps_of(rows) == [1, 2, 3, 3], rows  # then the final one
    assert "accel-trainer: stopping early at step 3: 2 evaluation(s) in a row did not improve loss (best: " in (
        capsys.readouterr().out
    )
    assert checkpoint_steps(out) == [3] and (out / "model.safetensors").is_file()
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 1
    rows = train(out, *flags, "--resume_from_checkpoint", "latest")
    assert max(r["step"] for r in rows) == 3 and not [r for r in rows if "loss" in r and r["step"] > 3]


def test_load_best_model_at_end_saves_and_evaluates_the_best_evaluations_weights(tmp_path):
    """--load_best_model_at_end: the run's model is the best evaluation's, and the final evaluation evaluates it.
    With --greater_is_better on eval_loss, training makes every evaluation after the first worse: the best is an
    early one, not the last update's."""
    from safetensors.torch import load_file

    out = tmp_path / "o"
    rows = train(out, "--max_steps", 6, "--eval_strategy", "steps", "--eval_steps", 2, "--load_best_model_at_end",
                 "--greater_is_better", "true", "--save_steps", 3)  # fmt: skip
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["metric"] == "eval_loss" and best["step"] < 6, best
    final, last_update = (
        load_file(out / "model.safetensors"),
        load_file(out / "checkpoints" / "step_6" / "model.safetensors"),
    )
    assert all(torch.equal(final[k], v) for k, v in load_file(out / "best" / "model.safetensors").items())
    assert not all(torch.equal(final[k], v) for k, v in last_update.items())  # the checkpoint keeps the last update
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6, 6] and evals[-1]["eval_loss"] == pytest.approx(best["value"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, line",
    [
        (["--evaluation_strategy", "steps"], "error: --evaluation_strategy is transformers' argument; here it is "
         "--eval_strategy (its name since transformers 4.46)."),
        (["--fp16"], "error: --fp16 is transformers' argument; here it is --mixed_precision fp16."),
        (["--save_strategy", "best"], "error: --save_strategy: 'best' is not one here: the best evaluation's model "
         "is kept in output_dir/best/ with --metric_for_best_model"),
        (["--eval_strategy", "sometimes"], "error: --eval_strategy: 'sometimes' is not one of no, steps, epoch."),
        (["--early_stopping_patience", 2, "--eval_strategy", "no"], "error: --early_stopping_patience: counts "
         "evaluations during training: --eval_strategy steps or epoch."),
    ],
    ids=["evaluation_strategy", "fp16", "save_strategy_best", "unknown_strategy", "patience_without_evaluations"],
)  # fmt: skip
def test_a_transformers_name_without_its_meaning_here_is_one_line_naming_the_equivalent(flags, line, tmp_path):
    """Before: argparse's usage (every flag, some 50 lines), then 'unrecognized arguments'."""
    recipe = os.path.join(RECIPES, "regression.py")
    proc = run(recipe, ["--output_dir", tmp_path / "o", *flags], check=False, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip().split(": ", 1)[1].startswith(line), proc.stderr
    assert not (tmp_path / "o").exists()


def test_in_python_a_transformers_argument_is_one_user_error_naming_the_keyword(tmp_path):
    """Before: `TrainingArguments(evaluation_strategy=...)` was Python's TypeError; the README promises one
    UserError line naming keywords."""
    with pytest.raises(UserError) as e:
        TrainingArguments(output_dir=str(tmp_path), evaluation_strategy="steps")
    assert str(e.value) == "evaluation_strategy is transformers' argument; here it is eval_strategy (its name " \
                           "since transformers 4.46)."  # fmt: skip
    with pytest.raises(UserError) as e:
        Trainer.from_recipe(regression, output_dir=str(tmp_path), fp16=True)
    assert str(e.value) == "fp16 is transformers' argument; here it is mixed_precision='fp16'."
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(UserError) as e:
        TrainingArguments(output_dir=str(tmp_path), learning_rat=0.1)
    assert str(e.value) == "TrainingArguments takes no argument learning_rat: dataclasses.fields(TrainingArguments) " \
                           "lists the ones it takes."  # fmt: skip
    with pytest.raises(UserError) as e:
        Trainer.from_recipe(regression, output_dir=str(tmp_path), save_strategy="best")
    assert str(e.value).startswith("save_strategy: 'best' is not one here"), e.value
    assert "--" not in str(e.value) and "save_strategy='steps'" in str(e.value), e.value


@pytest.mark.slow
def test_early_stopping_and_the_best_model_at_end_on_two_processes(tmp_path):
    """Both on 2 processes (DDP): every rank stops at the same evaluation and loads the same best weights (a rank
    deciding alone would leave the others waiting in the next collective). With --greater_is_better on eval_loss,
    which training lowers, the first evaluation is the best and the two after it do not improve: stop at step 3."""
    from safetensors.torch import load_file

    out = tmp_path / "o"
    flags = ["--output_dir", out, "--per_device_train_batch_size", 16, "--num_train_epochs", 2, "--eval_strategy",
             "steps", "--eval_steps", 1, "--early_stopping_patience", 2, "--load_best_model_at_end",
             "--greater_is_better", "true", "--save_steps", 100, "--disable_tqdm"]  # fmt: skip
    proc = run("regression.py", flags, nproc=2, timeout=300)
    assert proc.stdout.count("accel-trainer: stopping early at step 3") == 1, proc.stdout[-3000:]
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 1
    final, best = load_file(out / "model.safetensors"), load_file(out / "best" / "model.safetensors")
    last_update = load_file(out / "checkpoints" / "step_3" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in best.items())
    assert not all(torch.equal(final[k], v) for k, v in last_update.items())


CHATTY = """
import logging
import os
import warnings

import datasets
import transformers


def build_model(ctx):
    warnings.warn("the recipe's libraries warn of a change", FutureWarning)
    logging.getLogger("transformers.example").error("an error on rank %d", ctx.process_index)  # never hidden
    # a new head on a saved encoder: transformers' load report (the classifier is MISSING) and its progress bar
    return transformers.BertForSequenceClassification.from_pretrained(os.environ["TINY_BERT"], num_labels=2)


def build_data(ctx):
    rows = datasets.Dataset.from_dict({"x": list(range(64))})
    data = rows.map(lambda r: {"input_ids": [r["x"] % 30 + 1] * 4, "labels": r["x"] % 2})  # datasets' progress bar
    return {"train": data.with_format("torch", columns=["input_ids", "labels"])}


def loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss, len(batch["labels"])
"""


@pytest.mark.slow
def test_the_ranks_other_than_the_main_one_are_quiet_but_say_their_errors(tmp_path):
    """Before, every rank printed transformers' load report, the FutureWarnings and datasets' progress bars: on 2
    processes, each twice. As transformers.Trainer quiets its replicas (--log_level_replica), the other ranks now
    keep their warnings and progress bars to themselves; an error logged there still shows."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "tiny-bert")
    recipe = tmp_path / "chatty.py"
    recipe.write_text(CHATTY + RUN_IT)
    flags = ["--output_dir", tmp_path / "o", "--max_steps", 2, "--save_steps", 0, "--disable_tqdm"]
    proc = run(str(recipe), flags, nproc=2, timeout=300, extra_env={"TINY_BERT": str(tmp_path / "tiny-bert")})
    out = proc.stdout + proc.stderr
    assert out.count("BertForSequenceClassification LOAD REPORT") == 1, out[-4000:]
    assert out.count("FutureWarning: the recipe's libraries warn of a change") == 1, out[-4000:]
    # the libraries' progress bars: once (at most: a release may drop one), not once per rank
    assert out.count("Map: 100%") <= 1 and out.count("Loading weights: 100%") <= 1, out[-4000:]
    assert "an error on rank 0" in out and "an error on rank 1" in out, out[-4000:]


NO_PARAMETERS = """
import torch
from torch import nn

x = torch.randn(64, 8)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def build_model(ctx):
    {model}


def build_data(ctx):
    return {{"train": data}}


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y), len(x)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, last",
    [
        ("return nn.Identity()", "error: the model from build_model has no parameters: return the module to train."),
        ("raise RuntimeError('a bug in the recipe')", None),
    ],
    ids=["error_line", "bug"],
)
def test_accel_trainer_launch_ends_with_the_ranks_error_line_and_the_exit_code(model, last, tmp_path):
    """Under `accel-trainer launch`, a rank's one `error:` line was followed by torch elastic's ChildFailedError
    traceback (40 lines: the launcher's frames and a table per rank). The wrapper leaves that report out and ends
    with the exit codes and the ranks' error line; a recipe's bug keeps its own traceback, above that line."""
    import subprocess

    from helpers import ROOT, env, free_port

    recipe = tmp_path / "failing.py"
    recipe.write_text(NO_PARAMETERS.format(model=model) + RUN_IT)
    cmd = [sys.executable, "-m", "accel_trainer.cli", "launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
           str(recipe), "--output_dir", str(tmp_path / "o")]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and "ChildFailedError" not in proc.stdout, proc.stdout[-4000:]
    # Each failed rank's code, as torch elastic reported it: exit code 1, or the signal that ended a rank whose
    # peer failed first (SIGTERM from the agent; seen: SIGABRT, "terminate called without an active exception").
    failed = r"accel-trainer launch: the run failed \(exit 1; rank \d: (exit code 1|killed by SIG[A-Z]+)(, rank \d: " \
             r"(exit code 1|killed by SIG[A-Z]+))?\): "  # fmt: skip
    if last is not None:  # the ranks' line, once, after the exit codes: nothing else after it
        assert "Traceback" not in proc.stdout, proc.stdout[-4000:]
        assert lines[-1] == last and re.fullmatch(failed + "the ranks' error line follows", lines[-2]), lines[-3:]
    else:  # a rank's own traceback is kept
        assert "RuntimeError: a bug in the recipe" in proc.stdout, proc.stdout[-4000:]
        assert re.fullmatch(failed + "see the output above", lines[-1]), lines[-3:]


LORA = """
import os

import peft
import torch
import transformers


def build_model(ctx):
    base = transformers.AutoModelForSequenceClassification.from_pretrained(os.environ["TINY_BERT"], num_labels=2)
    if os.environ.get("NO_LORA"):
        return base
    config = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query", "value"])
    return peft.get_peft_model(base, config)


def build_data(ctx):
    ids = torch.arange(64 * 4).remainder(30).add(1).view(64, 4)
    data = torch.utils.data.TensorDataset(ids, torch.arange(64) % 2)
    return {"train": data, "eval": data}


def loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss, len(labels)
"""


def start_and_end(stdout: str) -> tuple[str, str]:
    start, end = [line for line in stdout.splitlines() if line.startswith("accel-trainer: ")]
    return start, end


@pytest.mark.slow
def test_a_lora_run_counts_what_trains_and_its_end_line_names_the_adapter_folder_and_how_peft_loads_it(
    tmp_path, monkeypatch
):
    """The start line counts trainable and frozen parameters; the end line of a peft run named model.safetensors,
    which a PeftModel's folder does not hold, and safetensors.torch.load_model to load it. It names the adapter
    folder and peft's AutoPeftModelFor... (the task type in adapter_config.json), which loads it as written."""
    import peft
    import transformers
    from safetensors.torch import load_file

    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "tiny-bert")
    recipe = tmp_path / "lora.py"
    recipe.write_text(LORA + RUN_IT)
    out = tmp_path / "o"
    environ = {"TINY_BERT": str(tmp_path / "tiny-bert")}
    proc = run(str(recipe), ["--output_dir", out, "--max_steps", 2, "--save_steps", 0, "--disable_tqdm"],
               extra_env=environ)  # fmt: skip
    start, end = start_and_end(proc.stdout)
    monkeypatch.setenv("TINY_BERT", environ["TINY_BERT"])
    import importlib.util

    spec = importlib.util.spec_from_file_location("lora_recipe", recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainable, total = module.build_model(None).get_nb_trainable_parameters()  # peft's own count
    assert f"; model {trainable:,} trainable + {total - trainable:,} frozen parameters; " in start, start
    assert str(out / "model.safetensors") not in end and not (out / "model.safetensors").exists(), end
    assert f"the model is the peft adapter folder {out} (adapter_model.safetensors, adapter_config.json)" in end, end
    hint = end.split("load it with ", 1)[1]
    assert hint.startswith(f"peft.AutoPeftModelForSequenceClassification.from_pretrained({str(out)!r})"), hint
    loaded = eval(hint.split(" or ")[0], {"peft": peft})  # the line a user pastes
    saved = load_file(out / "adapter_model.safetensors")
    state = peft.get_peft_model_state_dict(loaded)
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in saved)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["peft", "transformers"])
def test_load_best_model_at_end_loads_a_peft_adapter_and_a_transformers_folder(lora, tmp_path):
    """--load_best_model_at_end reads best/ as it was written: a peft model's adapter folder, a transformers
    model's save_pretrained folder. The final model is best/'s, not the last update's (the best is an early
    evaluation: --greater_is_better on a loss that training lowers)."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "tiny-bert")
    recipe = tmp_path / "lora.py"
    recipe.write_text(LORA + RUN_IT)
    out = tmp_path / "o"
    environ = {"TINY_BERT": str(tmp_path / "tiny-bert")} | ({} if lora else {"NO_LORA": "1"})
    flags = ["--output_dir", out, "--max_steps", 4, "--eval_strategy", "steps", "--eval_steps", 1,
             "--load_best_model_at_end", "--greater_is_better", "true", "--learning_rate", 1e-2, "--save_steps", 0,
             "--disable_tqdm"]  # fmt: skip
    run(str(recipe), flags, extra_env=environ)
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert json.loads((out / "best" / "best.json").read_text())["step"] < 4
    final, best = load_file(out / weights), load_file(out / "best" / weights)
    assert final.keys() == best.keys() and all(torch.equal(final[k], best[k]) for k in best)
    evals = [r for r in metrics(str(out)) if "eval_loss" in r]
    best_value = json.loads((out / "best" / "best.json").read_text())["value"]
    assert evals[-1]["eval_loss"] == pytest.approx(best_value, rel=1e-5) and evals[-2]["eval_loss"] != best_value
