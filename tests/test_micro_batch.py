"""--auto_micro_batch (accel_trainer/micro_batch.py): out of memory in an update halves the micro-batch and doubles
the accumulation, agreed by every rank, and the update is redone from the same data; without the flag, one line.

The fault recipe's `oom_above=B[:R]` makes `loss` raise torch.OutOfMemoryError on a training batch of more than B
samples (on rank R only), as a forward on a GPU would."""

import json
import os

import pytest
import torch
from helpers import flags, run, weights

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_recipe.py")
COMMON = flags(max_steps=6, logging_steps=3, disable_tqdm=True, ddp_timeout=60, seed=3)


def _losses(out) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_out_of_memory_halves_the_micro_batch_and_gives_the_weights_of_a_run_started_small(tmp_path, nproc):
    # Rank 1 alone runs out on 2 processes: rank 0 must learn it at the update's all-reduce, not hang in DDP's.
    oom = "oom_above=4" if nproc == 1 else "oom_above=4:1"
    big, small = tmp_path / "big", tmp_path / "small"
    r = run(
        SCRIPT,
        ["--output_dir", big, "--faults", oom, "--auto_micro_batch", "--save_steps", 0, *COMMON]
        + flags(per_device_train_batch_size=8, gradient_accumulation_steps=2),
        nproc=nproc,
        timeout=240,
    )
    halved = [x for x in r.stdout.splitlines() if x.startswith("out of memory at micro-batch size 8 ")]
    assert len(halved) == 1, r.stdout + r.stderr  # once: the redone update and all later ones fit
    assert "halves it to 4 and accumulates 4 micro-batches per update (was 2)" in halved[0]
    assert "the update is redone from the same data" in halved[0]
    run(
        SCRIPT,
        ["--output_dir", small, "--save_steps", 0, *COMMON]
        + flags(per_device_train_batch_size=4, gradient_accumulation_steps=4),
        nproc=nproc,
        timeout=240,
    )
    a, b = weights(big), weights(small)
    assert a.keys() == b.keys()
    if nproc == 1:  # the same micro-batches in the same order: the same arithmetic
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert _losses(big) == _losses(small)
    else:
        # The same 32 samples per update, but Accelerate deals loader batch i to rank i mod 2: at 8 a rank holds
        # samples 0-7 (cut in 0-3, 4-7), started at 4 it holds 0-3 and 8-11. Each rank's fp32 gradient sum is the
        # same terms grouped otherwise, so the weights differ by float rounding (measured: 3e-8 after 6 updates
        # of lr 1e-2); a skipped, repeated or lost micro-batch moves them by ~1e-3.
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(_losses(big), _losses(small), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_out_of_memory_already_in_the_first_batch_check_halves_the_micro_batch_too(tmp_path):
    """On an H100 a forward of the first loader batch ran out of memory in the recipe check (no_grad), which ended
    the run with a traceback before --auto_micro_batch could act. The check now shrinks its own slice; the update
    halves the micro-batch as usual: the weights of a run started small."""
    big, small = tmp_path / "big", tmp_path / "small"
    r = run(SCRIPT, ["--output_dir", big, "--faults", "forward_oom_above=4", "--auto_micro_batch", "--save_steps", 0,
                     *COMMON] + flags(per_device_train_batch_size=8, gradient_accumulation_steps=2), timeout=240)  # fmt: skip
    assert "out of memory at micro-batch size 8 (rank 0: peak " in r.stdout, r.stdout + r.stderr
    assert "halves it to 4 and accumulates 4 micro-batches per update (was 2)" in r.stdout
    run(SCRIPT, ["--output_dir", small, "--save_steps", 0, *COMMON]
        + flags(per_device_train_batch_size=4, gradient_accumulation_steps=4), timeout=240)  # fmt: skip
    a, b = weights(big), weights(small)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_one_rank_out_of_memory_in_its_last_micro_batch_redoes_the_update_with_buffers_in_step(tmp_path):
    """Rank 1 of 2 runs out in the window's last micro-batch (the one DDP syncs) of update 1, once; rank 0 had run
    that forward. The model has a buffer, which DDP broadcasts in a window's first forward: the redo must start
    with the same collectives on both ranks (a mismatch hangs until --ddp_timeout or mixes values)."""
    big, small = tmp_path / "big", tmp_path / "small"
    one = flags(per_device_train_batch_size=8, gradient_accumulation_steps=2)
    r = run(SCRIPT, ["--output_dir", big, "--faults", "oom_once=1:2,buffer=1", "--auto_micro_batch", *COMMON, *one,
                     "--save_steps", 0], nproc=2, timeout=240)  # fmt: skip
    assert "out of memory at micro-batch size 8 (1 of 2 ranks)" in r.stdout, r.stdout + r.stderr
    small_args = flags(per_device_train_batch_size=4, gradient_accumulation_steps=4, save_steps=0)
    run(SCRIPT, ["--output_dir", small, "--faults", "buffer=1", *COMMON, *small_args], nproc=2, timeout=240)
    a, b = weights(big), weights(small)
    for k in a:  # the bound of the test above, for the same reason
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_resume_after_a_halving_keeps_the_halved_size(tmp_path):
    """Killed after update 4 (checkpoint at 3, after the halving at update 1); resumed without the flag, the batch
    of 8 would run out again: the checkpoint's size is used, and the run ends with the uninterrupted one's weights."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    args = ["--faults", "oom_above=4", *COMMON] + flags(per_device_train_batch_size=8, save_steps=3)
    first = run(SCRIPT, ["--output_dir", out, "--auto_micro_batch", *args, "--faults", "oom_above=4,exit_at=0:4"],
                check=False, timeout=240)  # fmt: skip
    assert first.returncode == 3, first.stdout + first.stderr
    with open(out / "checkpoints" / "step_3" / "trainer_state.json") as f:
        assert json.load(f)["micro_batch_size"] == 4
    resumed = run(SCRIPT, ["--output_dir", out, "--resume_from_checkpoint", "latest", *args], timeout=240)
    assert "micro-batch size 4 (halved by --auto_micro_batch in the checkpoint's run)" in resumed.stdout
    run(SCRIPT, ["--output_dir", whole, "--auto_micro_batch", *args], timeout=240)
    a, b = weights(out), weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["oom_above", "forward_oom_above"])  # in the update; already in the first check
def test_out_of_memory_without_the_flag_is_one_line_naming_the_micro_batch_peak_and_flag(tmp_path, fault):
    r = run(SCRIPT, ["--output_dir", tmp_path / "run", "--faults", f"{fault}=4", *COMMON]
            + flags(per_device_train_batch_size=8), check=False, timeout=240)  # fmt: skip
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    line = errors[0]
    assert line.startswith("error: Out of memory in an update at a micro-batch of 8 samples (rank 0, peak "), line
    assert f" MiB on cpu): test fault: 8 samples do not fit ({fault}" in line and "Pass --auto_micro_batch" in line
    if fault == "forward_oom_above":  # CUDA's long line, cut after a whole sentence
        assert "(forward_oom_above). Tried to allocate 1024.00 MiB. GPU 0 has " in line, line
        assert "of which 78.47 GiB is free. Pass --auto_micro_batch" in line, line


@pytest.mark.slow
def test_out_of_memory_at_one_sample_stops_in_one_line(tmp_path):
    r = run(SCRIPT, ["--output_dir", tmp_path / "run", "--faults", "oom_above=0", "--auto_micro_batch", *COMMON]
            + flags(per_device_train_batch_size=2), check=False, timeout=240)  # fmt: skip
    assert "halves it to 1 and accumulates 2 micro-batches per update (was 1)" in r.stdout, r.stdout + r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0].startswith("error: Out of memory at a micro-batch of 1 sample with --auto_micro_batch"), errors
    assert "nothing is left to halve" in errors[0]


@pytest.mark.parametrize("size", ["4", 0, 2.5])
def test_a_checkpoint_micro_batch_size_that_is_not_a_positive_integer_is_one_line(size):
    from types import SimpleNamespace

    from accel_trainer.errors import UserError
    from accel_trainer.micro_batch import MicroBatches

    args = SimpleNamespace(auto_micro_batch=True, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    accelerator = SimpleNamespace(distributed_type=None, num_processes=1)
    with pytest.raises(UserError, match=r"micro_batch_size .* not a positive integer or null"):
        MicroBatches(args, accelerator).load_state_dict({"micro_batch_size": size})
