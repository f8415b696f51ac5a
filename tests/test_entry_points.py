"""One run from every entry point: `python recipes/x.py`, `accel-trainer train recipes/x.py` and the Python API
(`Trainer.from_recipe`, and the README's `Trainer(recipe, TrainingArguments(...), recipe.Args())`) resolve a
recipe's arguments the same way, for every shipped recipe; and every recipe answers --help."""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest
from cifar_fixtures import make_tiny_cifar, make_tiny_vit
from helpers import RECIPES, ROOT, env
from test_token_classification import make_config as make_tokcls_config
from test_token_classification import make_data as make_tokcls_data
from text_fixtures import load_recipe_module, make_glue_folder, make_text_files, make_tiny_bert, make_tiny_gpt2

from accel_trainer import Trainer, TrainingArguments

RECIPE_FILES = sorted(glob.glob(os.path.join(RECIPES, "*.py")))
RECIPE_NAMES = [
    os.path.basename(f)[:-3] for f in RECIPE_FILES if "if __name__ ==" in open(f).read()
]  # runnable recipes (cifar_data.py is the CIFAR recipe's data module)


def test_every_recipe_module_is_covered():
    shipped = {"regression", "cifar", "glue", "causal_lm", "token_classification", "lora", "vision"}
    assert set(RECIPE_NAMES) == shipped, RECIPE_NAMES


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_recipe_answers_help_with_every_field_and_its_default(name):
    proc = subprocess.run(
        [sys.executable, os.path.join(RECIPES, f"{name}.py"), "--help"],
        capture_output=True, text=True, timeout=120, env=env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    module = load_recipe_module(name)
    for cls in [TrainingArguments] + ([module.Args] if hasattr(module, "Args") else []):
        for f in dataclasses.fields(cls):
            assert f"--{f.name}" in text, f"--{f.name} missing from {name}.py --help"
    # recipe defaults are shown as the defaults, e.g. regression's learning rate
    for key, value in (getattr(module, "defaults", None) or {}).items():
        i = text.index(f"--{key} ", text.index("options:"))  # its entry, not the usage line
        shown = re.search(r"\(default: ([^)]*)\)", text[i:]).group(1)  # every entry ends with its default
        assert shown == str(value), (key, value, shown)


# ------------------------------------------------------------------------------------ the same run, every way
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("entry")
    train, valid = make_text_files(str(root / "text"))
    return {
        "cifar": make_tiny_cifar(str(root / "cifar"))["hub"],
        "cache": str(root / "cache"),
        "bert": make_tiny_bert(str(root / "tiny-bert")),
        "glue": make_glue_folder(str(root / "glue"), n_train=16, n_eval=8),
        "gpt2": make_tiny_gpt2(str(root / "tiny-gpt2")),
        "text": {"train": train, "valid": valid},
        "tokcls": {"model": make_tokcls_config(str(root / "tokcls-bert")), **make_tokcls_data(str(root / "tokcls"))},
        "vit": make_tiny_vit(str(root / "tiny-vit")),
    }


def user_values(name, data) -> dict:
    """What a user sets for one run of each recipe: training and recipe fields, including one equal to a recipe
    default (a preset must not override it) and a recipe field that a `configure` reads."""
    common = {"max_steps": 1, "save_steps": 0, "disable_tqdm": True, "seed": 3}
    return common | {
        "regression": {"hidden_size": 8, "learning_rate": 1e-2, "global_batch_size": 32},
        "cifar": {"dataset": data["cifar"], "cache_dir": data["cache"], "preset": "small", "widths": "8,8,8",
                  "batch_size": 40, "eval_batch_size": 30, "num_train_epochs": 9.9, "mixed_precision": "no"},
        "glue": {"model_name_or_path": data["bert"], "dataset_name": data["glue"], "cache_dir": data["cache"],
                 "per_device_train_batch_size": 4},
        "causal_lm": {"model_name_or_path": data["gpt2"], "train_file": data["text"]["train"],
                      "validation_file": data["text"]["valid"], "block_size": 16, "cache_dir": data["cache"],
                      "sample_max_new_tokens": 0},
        "token_classification": {"config_name": data["tokcls"]["model"], "tokenizer_name": data["tokcls"]["model"],
                                 "dataset_name": data["tokcls"]["folder"], "cache_dir": data["cache"],
                                 "per_device_train_batch_size": 4},
        "lora": {"model_name_or_path": data["bert"], "dataset_name": data["glue"], "cache_dir": data["cache"],
                 "lora_r": 4, "per_device_train_batch_size": 4},
        "vision": {"model_name_or_path": data["vit"], "dataset_name": data["cifar"], "cache_dir": data["cache"],
                   "horizontal_flip": False, "per_device_train_batch_size": 4},
    }[name]  # fmt: skip


def as_flags(values: dict) -> list[str]:
    return [s for k, v in values.items() for s in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def resolved(out) -> tuple[dict, dict]:
    with open(os.path.join(out, "run_config.json")) as f:
        cfg = json.load(f)
    args = {k: v for k, v in cfg["args"].items() if k != "output_dir"}
    return args, cfg["recipe_args"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_command_line_and_python_api_resolve_the_same_arguments(name, data, tmp_path):
    values = user_values(name, data)
    script = os.path.join(RECIPES, f"{name}.py")
    runs = {"python": [sys.executable, script]}
    if name == "regression":  # the console script calls the same run(); once is enough to show it (CI time)
        runs["accel-trainer"] = [sys.executable, "-m", "accel_trainer.cli", "train", script]
    for how, cmd in runs.items():
        proc = subprocess.run(
            cmd + as_flags(values | {"output_dir": str(tmp_path / how)}),
            capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    recipe = load_recipe_module(name)
    Trainer.from_recipe(recipe, output_dir=str(tmp_path / "api"), quiet=True, **values)
    cli = resolved(tmp_path / "python")
    if "accel-trainer" in runs:
        assert resolved(tmp_path / "accel-trainer") == cli
    assert resolved(tmp_path / "api") == cli
    # The recipe's defaults and presets did apply, and the user's values won over them.
    args, recipe_args = cli
    for k, v in values.items():
        assert (args | (recipe_args or {}))[k] == v, k
    if name == "regression":
        assert args["per_device_train_batch_size"] == 32  # configure: --global_batch_size over 1 process
    if name == "cifar":
        assert args["learning_rate"] == 11.5 and args["per_device_train_batch_size"] == 40  # defaults, configure


@pytest.mark.slow
def test_the_readme_notebook_form_is_the_command_line_run(tmp_path):
    # README: Trainer(regression, TrainingArguments(output_dir=..., max_steps=200), regression.Args()). It used to
    # train at TrainingArguments' learning rate (5e-5) instead of the recipe's (1e-2).
    regression = load_recipe_module("regression")
    out = tmp_path / "nb"
    t = Trainer(regression, TrainingArguments(output_dir=str(out), max_steps=200), regression.Args(), quiet=True)
    assert t.args.learning_rate == regression.defaults["learning_rate"] == 1e-2
    proc = subprocess.run(
        [sys.executable, os.path.join(RECIPES, "regression.py"), "--output_dir", str(tmp_path / "cli"),
         "--max_steps", "200", "--disable_tqdm"],
        capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    nb_args, nb_recipe = resolved(out)
    cli_args, cli_recipe = resolved(tmp_path / "cli")
    assert nb_recipe == cli_recipe
    assert {k: v for k, v in nb_args.items() if k != "disable_tqdm"} == {
        k: v for k, v in cli_args.items() if k != "disable_tqdm"
    }


def test_an_unknown_keyword_is_named(tmp_path):
    from accel_trainer.errors import ArgumentError

    with pytest.raises(ArgumentError, match="learning_rat"):
        Trainer.from_recipe(load_recipe_module("regression"), output_dir=str(tmp_path), learning_rat=0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "missing.py"], "Recipe file missing.py does not exist"),
        (["train", "recipes/regression.py", "--learning_rat", "1"], "--learning_rat"),
    ],
)
def test_accel_trainer_train_bad_input_is_one_line(argv, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "accel_trainer.cli"] + argv + ["--output_dir", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, env=env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode in (1, 2) and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
