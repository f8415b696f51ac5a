"""Resume on another world size: a checkpoint written by 2 processes continues on 1 and one written by 1 continues
on 2 (same global batch), completes, and trains on exactly the samples the uninterrupted run on that world size
does, update by update: every remaining sample of the epoch once. A different global batch is refused unless
--allow_global_batch_change. Real launches, world size asserted."""

import os

import pytest
from helpers import assert_same_weights, run, run_config, weights

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ids_recipe.py")
# 256 samples, global batch 16: 16 updates per epoch; step 10 is mid-epoch, 24 crosses into epoch 1.
COMMON = ["--max_steps", "24", "--save_steps", "5", "--mask_prob", "0.3", "--logging_steps", "4",
          "--disable_tqdm", "--num_eval_samples", "16"]  # fmt: skip
PER_DEVICE = {1: "16", 2: "8"}


def launch(out, nproc, *extra, check=True):
    args = ["--output_dir", str(out), "--record_dir", str(out), "--per_device_train_batch_size", PER_DEVICE[nproc]]
    return run(RECIPE, args + COMMON + list(extra), nproc=nproc, check=check)


def updates(out, nproc) -> list[set]:
    """The samples of each update (the union of the ranks' micro-batches of that update), in order."""
    per_rank = []
    for rank in range(nproc):
        with open(os.path.join(out, f"rank{rank}.txt")) as f:
            per_rank.append([{int(i) for i in line.split()} for line in f])
    assert len({len(r) for r in per_rank}) == 1
    return [set().union(*parts) for parts in zip(*per_rank)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = {n: tmp_path_factory.mktemp(f"full{n}") for n in (1, 2)}
    for n in (1, 2):
        launch(out[n], n)
        assert run_config(out[n])["num_processes"] == n
    assert updates(out[1], 1) == updates(out[2], 2)  # the same global batches on 1 and 2 processes
    return out


@pytest.mark.parametrize("written, resumed", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_sees_each_remaining_sample_once(uninterrupted, tmp_path, written, resumed):
    checkpoint = uninterrupted[written] / "checkpoints" / "step_10"
    proc = launch(tmp_path, resumed, "--resume_from_checkpoint", str(checkpoint))
    assert run_config(tmp_path)["num_processes"] == resumed
    assert f"written by {written} processes" in proc.stdout
    after = updates(tmp_path, resumed)
    reference = updates(uninterrupted[resumed], resumed)
    assert len(after) == 14 and after == reference[10:]  # steps 11..24, update by update
    # epoch 0: the 10 updates before the checkpoint and the 6 after it cover the 256 samples exactly once
    epoch0 = reference[:10] + after[:6]
    assert sorted(i for u in epoch0 for i in u) == list(range(256))
    # weights, optimizer and schedule carried over: the final model is the uninterrupted run's (float tolerance:
    # the gradient sums are reduced in another order)
    assert_same_weights(weights(str(tmp_path)), weights(str(uninterrupted[resumed])), rtol=1e-5, atol=1e-6)


def test_another_global_batch_is_refused_unless_allowed(uninterrupted, tmp_path):
    checkpoint = str(uninterrupted[2] / "checkpoints" / "step_10")
    args = ["--output_dir", str(tmp_path / "a"), "--per_device_train_batch_size", "8"] + COMMON
    proc = run(RECIPE, args + ["--resume_from_checkpoint", checkpoint], nproc=1, check=False)
    assert proc.returncode == 1 and "global batch of 16" in proc.stderr and "this run's is 8" in proc.stderr
    assert "--allow_global_batch_change" in proc.stderr and "Traceback" not in proc.stderr
    args[1] = str(tmp_path / "b")
    proc = run(RECIPE, args + ["--resume_from_checkpoint", checkpoint, "--allow_global_batch_change"], nproc=1)
    assert "at step 10 (epoch 0, batch 20" in proc.stdout  # 160 samples seen = 20 micro-batches of 8
