"""The README's notebook example, executed as written in a real Jupyter kernel (nbclient + ipykernel), in the
order a person debugs: build, fetch_batch, train_step, overfit_batch, fit, a second Trainer in the same kernel,
then notebook_launcher with 2 processes whose run records a world of 2; in the environment a user's kernel has
(harness.user_env: torch's default threads on every core, no OMP_NUM_THREADS, MKL_NUM_THREADS or
TOKENIZERS_PARALLELISM). There the launch hung forever (issue 40): the kernel's second run is wide enough for torch to
run its ops on its OpenMP thread pool, and the forked workers blocked on that pool, which a fork does not copy."""

import json
import os
import re

import nbformat
import pytest
from harness import USER_UNSET
from helpers import ROOT, user_env
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)


def readme_notebook_cells() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Notebooks and debugging") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return [cell.strip() for cell in re.split(r"\n\s*\n", code) if cell.strip()]  # a cell per paragraph


def test_readme_notebook_example_runs_in_a_real_kernel(tmp_path):
    cells = readme_notebook_cells()
    assert any("notebook_launcher(train, num_processes=2)" in c for c in cells)
    setup = f"import os, sys\nsys.path.insert(0, {ROOT!r})"
    checks = [
        # overfit_batch: the loss on one batch falls by more than half
        "assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])",
        "print('LOSSES', losses[0], losses[-1])",
        f"import torch\nprint('KERNEL', torch.get_num_threads(), [os.environ.get(v) for v in {USER_UNSET!r}])",
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in [setup] + cells + checks]
    # Each cell bounded: a hang fails the test, and the kernel's whole process group (the workers too) is killed.
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute(
        env=user_env()
    )
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    kernel = next(o["text"] for o in nb.cells[-1]["outputs"] if "KERNEL" in o.get("text", ""))
    threads, unset = re.fullmatch(r"KERNEL (\d+) (.*)\n", kernel).groups()
    assert unset == str([None] * len(USER_UNSET)), kernel  # none of the tidy settings reached the kernel
    assert int(threads) > 1 or (os.cpu_count() or 1) == 1, kernel  # torch's default: every core (the hang needs 2)

    def run_config(name):
        with open(tmp_path / "out" / name / "run_config.json") as f:
            return json.load(f)

    first, second, launched = run_config("nb"), run_config("nb2"), run_config("nb3")
    assert first["num_processes"] == 1 and first["args"]["learning_rate"] == 1e-2  # the recipe's, as on the CLI
    assert first["args"]["max_steps"] == 200 and (tmp_path / "out" / "nb" / "model.safetensors").exists()
    assert second["num_processes"] == 1 and second["recipe_args"]["hidden_size"] == 4096
    assert launched["num_processes"] == 2 and launched["topology"]["distributed_type"] == "MULTI_CPU"
    assert launched["recipe_args"]["hidden_size"] == 4096
    assert (tmp_path / "out" / "nb3" / "model.safetensors").exists()
