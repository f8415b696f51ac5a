"""Optional dependencies are extras: a plain `pip install accel-trainer` pulls neither matplotlib (`[report]`) nor
pillow (`[cifar]`), and a command or recipe whose extra is missing says so in one line, exits non-zero, and shows
no traceback. A missing module is simulated in the child the way Python sees an uninstalled one: a None entry in
sys.modules (importlib.util.find_spec returns None, `import` raises ModuleNotFoundError), set by a sitecustomize."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
import tomllib
from helpers import RECIPES, ROOT, env

PYPROJECT = os.path.join(ROOT, "pyproject.toml")


def _name(requirement: str) -> tuple[str, set[str], str]:
    """(normalised name, requested extras, marker) of a requirement string."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?[^;]*(?:;(.*))?$", requirement)
    assert m, requirement
    extras = {e.strip().lower() for e in (m.group(2) or "").split(",") if e.strip()}
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), extras, m.group(3) or ""


def _pulled(requirements: list[str]) -> set[str]:
    """Every distribution these requirements install, read from the installed packages' metadata. Conservative:
    any marker but an extra's counts as true, so the set can only be larger than what pip installs here."""
    seen: dict[str, set[str]] = {}
    todo = [_name(r) for r in requirements]
    while todo:
        name, extras, _ = todo.pop()
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: its own dependencies cannot be read (named in the set all the same)
        for r in reqs:
            dep = _name(r)
            wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", dep[2])
            if not wanted or {w.lower() for w in wanted} & extras:
                todo.append(dep)
    return set(seen)


def test_a_plain_install_pulls_neither_matplotlib_nor_pillow():
    project = tomllib.load(open(PYPROJECT, "rb"))["project"]
    pulled = _pulled(project["dependencies"])
    assert {"torch", "accelerate", "transformers", "numpy", "psutil"} <= pulled  # the walk did walk
    assert not {"matplotlib", "pillow"} & pulled, sorted(pulled)
    extras = project["optional-dependencies"]
    assert "matplotlib" in _pulled(extras["report"]) and "pillow" in _pulled(extras["cifar"])
    # CI installs `.[dev]`: it must hold every extra, so the suite runs the commands and recipes that need them.
    dev = {e for r in extras["dev"] if _name(r)[0] == "accel-trainer" for e in _name(r)[1]}
    assert set(extras) - {"dev"} <= dev, dev


def missing(tmp_path, *modules: str) -> dict:
    """The tests' child environment with `modules` not installed, as far as Python in the child can tell."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\nfor m in " + json.dumps(list(modules)) + ":\n    sys.modules[m] = None\n"
    )
    e = env()
    e["PYTHONPATH"] = str(site) + os.pathsep + e["PYTHONPATH"]
    return e


def assert_one_line_naming(proc: subprocess.CompletedProcess, extra: str):
    err = proc.stderr.strip()
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(err.splitlines()) == 1, err[-3000:]
    assert f"pip install 'accel-trainer[{extra}]'" in err, err


@pytest.mark.slow
def test_report_without_matplotlib_is_one_line_naming_the_report_extra(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "epoch": 0, "elapsed_s": s / 10, "loss": 1 / s}) + "\n" for s in (1, 2, 3))
    )
    out = tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, "-m", "accel_trainer.cli", "report", str(run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=missing(tmp_path, "matplotlib"),
        cwd=ROOT,
    )
    assert_one_line_naming(proc, "report")
    assert "matplotlib" in proc.stderr and not out.exists()


@pytest.mark.slow
def test_cifar_without_pillow_is_one_line_naming_the_cifar_extra(tmp_path):
    from cifar_fixtures import tiny_arrays, write_hub_layout  # writes PNGs with Pillow, here in the test process

    write_hub_layout(str(tmp_path / "hub"), tiny_arrays(20, 0), tiny_arrays(10, 1))
    args = ["--dataset", str(tmp_path / "hub"), "--cache_dir", str(tmp_path / "cache"), "--preset", "small"]
    args += ["--output_dir", str(tmp_path / "o"), "--max_steps", "1", "--disable_tqdm", "--mixed_precision", "no"]
    proc = subprocess.run(
        [sys.executable, os.path.join(RECIPES, "cifar.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=missing(tmp_path, "PIL"),
        cwd=ROOT,
    )
    assert_one_line_naming(proc, "cifar")
    assert "Pillow" in proc.stderr
