"""The Python API (issue 31): its errors name keyword arguments, not flags, as one UserError of one line; fit()
after the README's debugging cells trains the whole run; a run says in one line what it is and, at the end, where
its model is and how to load it; ctx.build_once gives every rank (and a resume) the same artifact."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import RECIPES, ROOT, env, launch_cmd, user_env, weights
from safetensors.torch import load_model

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments, UserError  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


def python_error(make) -> UserError:
    """The error `make()` raises, checked to be what the Python API promises: one UserError, one line, no flags,
    no chain of the internal exceptions that led to it."""
    with pytest.raises(UserError) as info:
        make()
    e = info.value
    text = str(e)
    assert "\n" not in text and "--" not in text, text
    assert e.__cause__ is None and e.__suppress_context__, "an internal exception chain reaches the user"
    return e


def test_rerunning_a_notebook_cell_names_the_keywords_not_the_flags(tmp_path):
    out = str(tmp_path / "nb")
    Trainer(regression, TrainingArguments(output_dir=out, max_steps=2), regression.Args(), quiet=True).fit()
    again = python_error(
        lambda: Trainer(regression, TrainingArguments(output_dir=out, max_steps=2), regression.Args(), quiet=True)
    )
    assert "overwrite_output_dir=True" in str(again) and "resume_from_checkpoint='latest'" in str(again)
    again = python_error(lambda: Trainer.from_recipe(regression, output_dir=out, max_steps=2, quiet=True))
    assert "overwrite_output_dir=True" in str(again)
    # and the keyword it names does start over
    Trainer.from_recipe(regression, output_dir=out, max_steps=2, overwrite_output_dir=True, quiet=True).fit()


def test_a_bad_keyword_value_and_a_bad_checkpoint_name_the_keyword(tmp_path):
    e = python_error(lambda: Trainer.from_recipe(regression, output_dir=str(tmp_path), nan_policy="sometimes"))
    assert str(e).startswith("nan_policy: 'sometimes' is not one of stop, skip"), e
    assert isinstance(e, ValueError)  # ArgumentError: a ValueError too, as before
    missing = str(tmp_path / "nope")
    e = python_error(lambda: Trainer.from_recipe(regression, output_dir=str(tmp_path), resume_from_checkpoint=missing))
    assert f"resume_from_checkpoint={missing!r}: no such folder" in str(e), e


DATASET_RECIPE = """
import torch
from torch.utils.data import TensorDataset
def build_model(ctx):
    return torch.nn.Linear(2, 1)
def build_data(ctx):
    return TensorDataset(torch.randn(8, 2))
def loss(model, batch):
    return model(batch[0]).pow(2).mean(), len(batch[0])
"""


@pytest.mark.slow
def test_build_data_returning_a_dataset_is_one_line_on_both_entry_points(tmp_path):
    recipe = tmp_path / "dataset_recipe.py"
    recipe.write_text(DATASET_RECIPE)
    e = python_error(lambda: Trainer.from_recipe(str(recipe), output_dir=str(tmp_path / "py"), quiet=True))
    assert "build_data returned a TensorDataset" in str(e) and "{'train'" in str(e), e
    proc = subprocess.run(
        [sys.executable, "-m", "accel_trainer.cli", "train", str(recipe), "--output_dir", str(tmp_path / "cli")],
        capture_output=True, text=True, timeout=120, env=env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "build_data returned a TensorDataset" in proc.stderr


def test_fit_after_the_readme_debugging_cells_trains_the_whole_run_from_the_built_state(tmp_path, capsys):
    # The README's cell order: train_step, overfit_batch, then fit(). The debugging updates used to count towards
    # max_steps: fit() trained what was left (none past the run length) and returned the overfit model's metrics.
    def build(name):
        return Trainer.from_recipe(regression, output_dir=str(tmp_path / name), max_steps=30, save_steps=0)

    debugged = build("debugged")
    debugged.train_step(debugged.fetch_batch())
    losses = debugged.overfit_batch(steps=40)  # past max_steps on their own
    assert debugged.global_step == 41 and losses[-1] < losses[0]
    capsys.readouterr()
    after_debug = debugged.fit()
    assert "the 41 debugging update(s) (train_step, overfit_batch) are undone" in capsys.readouterr().out
    fresh = build("fresh").fit()
    assert debugged.global_step == 30 and after_debug == fresh, (after_debug, fresh)
    rows = [json.loads(line) for line in open(tmp_path / "debugged" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [5, 10, 15, 20, 25, 30]  # every update of the run, logged
    a, b = weights(str(tmp_path / "debugged")), weights(str(tmp_path / "fresh"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def start_and_end_lines(stdout: str) -> tuple[str, str]:
    lines = [line for line in stdout.splitlines() if line.startswith("accel-trainer: ")]
    assert len(lines) == 2, stdout[-3000:]  # printed once: by the main process only
    return lines[0], lines[1]


@pytest.mark.slow
def test_a_run_says_what_it_is_at_start_and_where_its_model_is_at_the_end(tmp_path):
    out = tmp_path / "o"
    argv = [os.path.join(RECIPES, "regression.py"), "--output_dir", str(out), "--max_steps", "6", "--save_steps", "3"]
    proc = subprocess.run(
        launch_cmd(1) + argv + ["--disable_tqdm"], capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, end = start_and_end_lines(proc.stdout)
    assert "world 1 = 1 machine(s) x 1 process(es)" in start and "global batch 16 = 16 x 1 accumulation x 1" in start
    assert "6 updates; precision no; sharding none" in start and f"output {out}; a new run" in start
    model = str(out / "model.safetensors")
    assert f"the model is {model}" in end and f"safetensors.torch.load_model(model, {model!r})" in end
    # the hint loads it: into the model the recipe builds
    from accel_trainer.recipe import RecipeContext

    args = regression.Args()
    built = regression.build_model(RecipeContext(args=args, targs=TrainingArguments(), world_size=1))
    load_model(built, model)
    proc = subprocess.run(
        launch_cmd(1) + argv[:-4] + ["--max_steps", "9", "--save_steps", "3", "--resume_from_checkpoint", "latest"],
        capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, end = start_and_end_lines(proc.stdout)
    assert f"resumed from {out / 'checkpoints' / 'step_6'}" in start and "9 updates" in start


@pytest.mark.slow
def test_build_once_gives_every_rank_and_the_resume_the_same_artifact(tmp_path):
    # 2 processes: the start and end lines of a 2-process run are checked here too (one multi-process test).
    out = tmp_path / "o"
    recipe = os.path.join(TESTS, "artifact_recipe.py")
    common = [recipe, "--output_dir", str(out), "--save_steps", "3", "--disable_tqdm", "--once"]

    def launch(*extra):
        proc = subprocess.run(
            launch_cmd(2) + common + list(extra), capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    def seen(rank, attempt):
        with open(out / "seen" / f"rank{rank}_{attempt}.json") as f:
            return json.load(f)

    start, end = start_and_end_lines(launch("--max_steps", "3").stdout)
    assert "world 2 = 1 machine(s) x 2 process(es)" in start and "sharding none (DDP replicas)" in start, start
    assert f"the model is {out / 'model.safetensors'}" in end
    first = [seen(r, "new") for r in (0, 1)]
    assert first[0] == first[1] and first[0]["resuming"] is False and first[0]["resume_from"] is None
    start, _ = start_and_end_lines(launch("--max_steps", "6", "--resume_from_checkpoint", "latest").stdout)
    resumed = [seen(r, "resumed") for r in (0, 1)]
    step_3 = str(out / "checkpoints" / "step_3")
    assert f"resumed from {step_3}" in start
    assert all(s == {"vocab": first[0]["vocab"], "resuming": True, "resume_from": step_3} for s in resumed), resumed


LAUNCH_FROM_A_NOTEBOOK = """
import torch
from accel_trainer import notebook_launcher

def train():
    import os
    from accelerate import PartialState  # what a Trainer in the process builds first
    state = PartialState(cpu=True)
    print(f"rank {state.process_index} of {state.num_processes}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")

print("kernel threads", torch.get_num_threads())
notebook_launcher(train, num_processes=2, use_port="{port}")
"""


@pytest.mark.slow
def test_notebook_launcher_on_a_cpu_says_cpu_processes_and_warns_nothing(tmp_path):
    # It printed "Launching training on 2 CUDAs." on a machine without a GPU, and each process warned that
    # OMP_NUM_THREADS was unset.
    from helpers import free_port

    script = tmp_path / "launch.py"
    script.write_text(LAUNCH_FROM_A_NOTEBOOK.replace("{port}", str(free_port())))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=user_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "CUDA" not in output and "OMP_NUM_THREADS/MKL_NUM_THREADS unset" not in output, output
    # Each process its share of the kernel's threads (1 on a 2-core machine; tests/test_user_conditions.py).
    share = max(1, int(re.search(r"kernel threads (\d+)", proc.stdout).group(1)) // 2)
    assert f"Launching training on 2 CPU processes (no GPU here), OMP_NUM_THREADS={share} each" in proc.stdout
    # Two processes print to one pipe: their lines can run together ("...=1rank 1 of 2, ..."), so find, not split.
    assert sorted(re.findall(r"rank \d of 2, OMP_NUM_THREADS=\d+", proc.stdout)) == [
        f"rank 0 of 2, OMP_NUM_THREADS={share}",
        f"rank 1 of 2, OMP_NUM_THREADS={share}",
    ]


def test_notebook_launcher_names_an_omp_num_threads_that_is_not_a_number(monkeypatch):
    # It launched, and each process that built a Trainer failed in Accelerate's int() of it: a ValueError traceback.
    from accel_trainer import notebook_launcher

    monkeypatch.setenv("OMP_NUM_THREADS", "four")
    e = python_error(lambda: notebook_launcher(print, num_processes=2))
    assert "OMP_NUM_THREADS='four' is not a number of threads" in str(e) and "unset it" in str(e)


def test_the_end_lines_load_hint_loads_what_was_saved(tmp_path):
    # The hint is phrased from what is on disk: a plain module's safetensors file, or a save_pretrained folder.
    import safetensors.torch
    import transformers

    from accel_trainer.runlog import how_to_load

    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, num_labels=3
    )
    saved = transformers.BertForTokenClassification(config)
    saved.save_pretrained(tmp_path / "hf")
    hint = how_to_load(str(tmp_path / "hf"))
    assert hint == f"transformers.BertForTokenClassification.from_pretrained({str(tmp_path / 'hf')!r})"
    loaded = eval(hint, {"transformers": transformers})  # the line a user would paste
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))
    plain = torch.nn.Linear(2, 1)
    safetensors.torch.save_model(plain, str(tmp_path / "model.safetensors"))
    hint = how_to_load(str(tmp_path / "model.safetensors"))
    model = torch.nn.Linear(2, 1)
    eval(hint.split(" into ")[0], {"safetensors": safetensors, "model": model})
    assert torch.equal(model.weight, plain.weight)
