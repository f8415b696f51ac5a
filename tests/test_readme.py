"""The README's commands and code, taken from README.md as a reader copies them: the install and test lines that
.ci/run also reads (by their trailing comments), the command that runs the example offline, the complete recipe in
its code block (written to a file and run with `python`), and the lines that load the model it wrote."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT, env, user_env

README = os.path.join(ROOT, "README.md")


def readme() -> str:
    with open(README) as f:
        return f.read()


def command(comment: str) -> str:
    """The first line of README.md ending in `# <comment>...`, without the comment: what .ci/run's readme_command
    reads (`grep -E "^[^#]+#[[:space:]]*<comment>"`, then the comment cut off)."""
    for line in readme().splitlines():
        m = re.match(r"^([^#]+)#\s*" + re.escape(comment), line)
        if m:
            return m.group(1).strip()
    raise AssertionError(f"README.md has no command line ending in '# {comment}'")


def block(heading: str, lang: str = "python") -> str:
    """The first ```lang code block after the line `heading`."""
    text = readme()
    section = text[text.index(heading + "\n") :]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def metric_rows(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_readme_is_short():
    assert len(readme().splitlines()) <= 160  # the issue: "at most ~150 lines"


def test_install_line_is_the_editable_install_with_dev_extras_and_the_cpu_torch_hint():
    line = next(x for x in readme().splitlines() if re.match(r"^[^#]+#\s*install", x))
    assert command("install") == "pip install -e '.[dev]'"
    assert "--index-url https://download.pytorch.org/whl/cpu" in line  # CPU-only machines: torch's CPU build first
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert re.search(r"^dev = \[", f.read(), re.M), (
            "the README installs the [dev] extra: pyproject.toml must have it"
        )


@pytest.mark.slow
def test_the_test_command_runs_pytest_on_this_suite():
    # .ci/run evaluates the line and appends its own arguments, as here: collecting one file proves it is a pytest
    # command that finds this suite (the whole run is CI's job), and that it is the fast tier: this file's tests
    # that run in pytest's process are collected, the ones that start processes (this one) are left to `-m slow`.
    cmd = shlex.split(command("run the tests")) + ["--collect-only", "tests/test_readme.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tests/test_readme.py::test_the_readme_is_short" in proc.stdout, proc.stdout[-2000:]
    assert "test_the_test_command_runs_pytest_on_this_suite" not in proc.stdout, proc.stdout[-2000:]
    assert "deselected" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_the_example_command_trains_offline_as_written(tmp_path):
    # Run verbatim (its relative paths included) in an empty folder that sees the repository's recipes/.
    os.symlink(os.path.join(ROOT, "recipes"), tmp_path / "recipes")
    cmd = command("run the example")
    assert cmd.startswith("python recipes/"), cmd
    argv = [sys.executable] + shlex.split(cmd)[1:]
    # In a user's environment (harness.user_env), as the README's recipe below: the README's commands are run as a
    # reader runs them.
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=user_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / shlex.split(cmd)[shlex.split(cmd).index("--output_dir") + 1]
    losses = [r["loss"] for r in metric_rows(out) if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_the_readme_recipe_trains_and_its_model_loads_as_the_readme_says(tmp_path):
    (tmp_path / "my_recipe.py").write_text(block("## Write a recipe"))
    # The first of the README's three ways to run it, for a few steps.
    proc = subprocess.run(
        [sys.executable, "my_recipe.py", "--output_dir", "out/my", "--max_steps", "40", "--logging_steps", "5"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=user_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in metric_rows(tmp_path / "out" / "my") if "loss" in r]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], losses  # it trains
    assert (tmp_path / "out" / "my" / "model.safetensors").exists()
    # "how to load the model": the README's lines, then the loaded model's eval loss is the run's final one.
    load = block("## What a run writes")
    check = (
        "\nimport torch\n"
        "x = torch.linspace(-3, 3, 1024).unsqueeze(1)\n"
        "with torch.no_grad():\n"
        "    print('MSE', torch.nn.functional.mse_loss(model(x), torch.sin(x)).item())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", load + check], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=user_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    mse = float(proc.stdout.split("MSE")[-1])
    final_eval = [r["eval_loss"] for r in metric_rows(tmp_path / "out" / "my") if "eval_loss" in r][-1]
    assert abs(mse - final_eval) <= 1e-5 * max(1.0, final_eval), (mse, final_eval)


def numbers(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text))  # not the 16 of fp16


def test_the_results_table_quotes_the_current_numbers_of_docs_benchmarks():
    """Each figure in the README's results column is one of docs/benchmarks.md's Summary table, which holds the
    current numbers (its other sections also keep earlier ones): a re-measurement updates both or the test fails."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        summary = f.read().split("## Summary\n", 1)[1].split("\n## ", 1)[0]
    section = readme().split("## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 8, section
    stale = {row[0].strip(): sorted(numbers(row[1]) - numbers(summary)) for row in rows}
    assert not {k: v for k, v in stale.items() if v}, stale
