"""A feature that needs newer torch/Accelerate releases than the package's lower bounds (accel_trainer/versions.py)
is refused at start-up in one line naming the releases it needs, on every rank, before anything trains; on releases
that have it, the same launch runs it. .ci/versions runs this file on the oldest and the newest releases (and by
hand on torch 2.11): on the oldest the FSDP launch below must be refused, on the others it must shard
(tests/test_sharding.py then checks FSDP itself, on the releases that run it)."""

import sys

import pytest
from helpers import call, launcher, run_config

from accel_trainer import versions

REG = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--disable_tqdm"]


@pytest.mark.slow
def test_fsdp_runs_or_is_refused_in_one_line_naming_the_releases_it_needs(tmp_path):
    out = tmp_path / "run"
    proc = call(launcher("fsdp") + ["recipes/regression.py", "--output_dir", str(out)] + REG, timeout=300)
    needed = versions.problem("FSDP")
    if needed is None:  # releases that run FSDP2: it shards
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert run_config(str(out))["topology"]["distributed_type"] == "FSDP"
        return
    # each rank's own one line, no traceback from the ranks (torchrun's elastic agent then reports the failed
    # workers with its own traceback, which is the launcher's, not ours). Once one rank has exited, the agent stops
    # the other: on a loaded machine it may not have come as far as its line (seen in CI: one line of two).
    text = proc.stdout + proc.stderr
    ranks = text.split("torch/distributed/elastic")[0]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and 1 <= len(errors) <= 2 and set(errors) == {f"error: {needed}"}, text[-3000:]
    assert "Traceback" not in ranks, text[-3000:]
    assert not (out / "model.safetensors").exists()  # nothing trained


def test_the_refusal_names_what_is_installed_and_what_is_needed(monkeypatch):
    installed = {"torch": (2, 9, 1), "accelerate": (1, 15, 0)}
    monkeypatch.setattr(versions, "release", lambda package: installed[package])
    line = versions.problem("FSDP")
    assert line.startswith("FSDP on this torch 2.9.1 needs torch >= 2.11 (") and "\n" not in line
    assert "accelerate" not in line.split("(")[0]  # the release that suffices is not blamed
    assert line.endswith("upgrade (torch >= 2.11), or run without FSDP (DDP: a config without distributed_type FSDP).")
    installed.update(torch=(2, 11, 0), accelerate=(1, 12, 0))
    assert versions.problem("FSDP").startswith("FSDP on this accelerate 1.12.0 needs accelerate >= 1.14 (")
    installed.update(accelerate=(1, 15, 0))
    assert versions.problem("FSDP") is None


def test_release_reads_local_builds():
    import torch

    # "2.13.0+cpu", "2.8.0+cu128": the local part is not a release number
    assert versions.release("torch")[:2] == tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.slow
def test_save_async_runs_or_is_refused_in_one_line_before_training(tmp_path):
    # torch 2.8 (the oldest release .ci/versions runs) has no DefaultStager: before, the first checkpoint crashed
    # with an ImportError traceback after the training before it
    out = tmp_path / "run"
    proc = call(
        [sys.executable, "recipes/regression.py", "--output_dir", str(out), "--save_async", "--save_steps", "1"] + REG,
        timeout=300,
    )
    needed = versions.problem("--save_async")
    if needed is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (out / "checkpoints" / "step_2").is_dir()
        return
    assert proc.returncode == 1 and proc.stderr == f"error: {needed}\n", proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()  # refused before the first update


def test_the_save_async_refusal_names_the_release_it_needs(monkeypatch):
    installed = {"torch": (2, 8, 0)}
    monkeypatch.setattr(versions, "release", lambda package: installed[package])
    line = versions.problem("--save_async")
    assert line.startswith("--save_async on this torch 2.8.0 needs torch >= 2.9 (") and "\n" not in line
    assert line.endswith("or drop --save_async (checkpoints are then written while training waits).")
    installed.update(torch=(2, 9, 0))
    assert versions.problem("--save_async") is None
