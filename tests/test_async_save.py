"""--save_async (accel_trainer/checkpointing/async_writer.py): the checkpoints are the synchronous ones byte for byte, a resumed
run is bit-identical, a failed background write stops the run at the next update with one line, and FSDP2 on two
gloo processes. (SIGKILL during a background write, 1 and 2 processes: tests/test_fault_tolerance.py.)
`bash .ci/versions torch-2.11` runs this file on torch 2.11, whose DefaultStager closes itself after each stage."""

import json
import os
import shutil
import sys
import threading
import time

import pytest
from helpers import FSDP2, RECIPES, ROOT, launch_cmd, run_config
from procs import Launch
from test_checkpoint import make

from accel_trainer.checkpointing import async_writer
from accel_trainer.checkpointing.folder import list_checkpoints


def files_of(out, step) -> dict:
    return json.load(open(os.path.join(out, "checkpoints", f"step_{step}", "manifest.json")))["files"]


def contents(file):
    """A safetensors file's metadata and tensors, as bytes."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}


def final_bytes(out) -> bytes:
    return open(os.path.join(out, "model.safetensors"), "rb").read()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    make(d / "sync", max_steps=8, save_steps=4).fit()
    make(d / "async", max_steps=8, save_steps=4, save_async=True).fit()
    return d


def test_async_checkpoints_are_the_sync_ones_byte_for_byte(runs):
    for step in (4, 8):  # every file's size and sha256 (model, optimizer, scheduler, RNG, trainer state)
        assert files_of(runs / "async", step) == files_of(runs / "sync", step)
    assert final_bytes(runs / "async") == final_bytes(runs / "sync")
    assert sorted(os.listdir(runs / "async" / "checkpoints")) == ["step_4", "step_8"]  # no .tmp_step_* left


def test_a_run_resumed_from_an_async_checkpoint_is_bit_identical(runs, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(runs / "async" / "checkpoints" / "step_4", out / "checkpoints" / "step_4")
    make(out, max_steps=8, save_steps=4, save_async=True, resume_from_checkpoint="latest").fit()
    assert final_bytes(out) == final_bytes(runs / "sync")


def test_a_stager_that_closes_itself_after_staging_as_torch_2_11s_does_writes_every_checkpoint(
    runs, tmp_path, monkeypatch
):
    """torch 2.11's DefaultStager closes itself at the end of stage(); 2.13's does not. A stager kept across
    checkpoints then failed at the second one with KeyError: <class 'type'> (seen on an H100 with torch 2.11, then
    on a CPU). Here 2.13's stager is made to close itself the same way, through its public close()."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager.stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self.close()
        return staged

    monkeypatch.setattr(DefaultStager, "stage", stage_then_close)
    make(tmp_path / "run", max_steps=8, save_steps=4, save_async=True).fit()
    for step in (4, 8):
        assert files_of(tmp_path / "run", step) == files_of(runs / "sync", step)
    assert final_bytes(tmp_path / "run") == final_bytes(runs / "sync")


def test_a_failed_background_write_stops_the_run_at_the_next_update(tmp_path, monkeypatch):
    # The second checkpoint's background write fails (as a permission error would): the run stops at the update
    # boundary after it is known, with one line naming the checkpoint; the first checkpoint is `latest`, intact.
    real, calls = async_writer.AsyncWriter._write_files, []

    def failing(self, tmp, *a):
        calls.append(tmp)
        if len(calls) == 2:
            raise PermissionError(13, "Permission denied", tmp)
        return real(self, tmp, *a)

    monkeypatch.setattr(async_writer.AsyncWriter, "_write_files", failing)
    trainer = make(tmp_path / "run", max_steps=40, save_steps=4, save_async=True)
    with pytest.raises(async_writer.CheckpointWriteError) as e:
        trainer.fit()
    message = str(e.value)
    assert "\n" not in message and ".tmp_step_8 in the background failed (PermissionError" in message, message
    assert "the previous checkpoint is intact" in message
    # It stops at the first update boundary after the background thread reported the failure: on a loaded machine the
    # thread may report it a few updates after step 8, but never later than the next save (step 12), which waits for
    # the pending write.
    assert 8 <= trainer.global_step <= 12
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path / "run")] == ["step_4"]
    assert not os.path.exists(tmp_path / "run" / "model.safetensors")


def test_a_failed_write_is_reported_even_at_the_end_of_fit(tmp_path, monkeypatch):
    def failing(self, tmp, *a):
        raise PermissionError(13, "Permission denied", tmp)

    monkeypatch.setattr(async_writer.AsyncWriter, "_write_files", failing)
    with pytest.raises(async_writer.CheckpointWriteError, match="step_4 in the background failed"):
        make(tmp_path / "run", max_steps=4, save_steps=4, save_async=True).fit()
    assert list_checkpoints(tmp_path / "run") == []


def test_a_background_write_that_never_ends_is_given_up_after_the_timeout(tmp_path, monkeypatch):
    # Every wait for a background write is bounded (--ddp_timeout): a write that hangs (a dead file system) ends the
    # run with one line after that long, and is never committed, even if it ends later.
    release, real = threading.Event(), async_writer.AsyncWriter._write_files

    def hung(self, tmp, *a):
        release.wait(60)
        return real(self, tmp, *a)

    monkeypatch.setattr(async_writer.AsyncWriter, "_write_files", hung)
    trainer = make(tmp_path / "run", max_steps=4, save_steps=4, save_async=True, ddp_timeout=2)
    started = time.monotonic()
    try:
        with pytest.raises(async_writer.CheckpointWriteError, match="still being written in the background after 2 s"):
            trainer.fit()
        assert time.monotonic() - started < 60
    finally:
        release.set()
    for t in threading.enumerate():  # the abandoned write ends: it must not commit then
        if t.name == "accel-trainer-checkpoint":
            t.join(30)
    assert list_checkpoints(tmp_path / "run") == []


# ------------------------------------------------------------------------------------------- FSDP2, 2 processes
FLAGS = ["--max_steps", "8", "--save_steps", "4", "--logging_steps", "1", "--mask_prob", "0.3",
         "--per_device_train_batch_size", "8", "--disable_tqdm"]  # fmt: skip


@pytest.mark.slow
def test_fsdp2_async_checkpoints_hold_the_sync_data_and_resume_bit_identical(tmp_path):
    script = os.path.join(RECIPES, "regression.py")
    out = {n: tmp_path / n for n in ("sync", "async", "resumed")}

    def launch(name, *extra):
        cmd = launch_cmd(2, mode=FSDP2) + [script, "--output_dir", str(out[name]), *FLAGS, *extra]
        return Launch(cmd, str(tmp_path / f"{name}.log"), cwd=ROOT, deadline=240)

    started = [launch("sync"), launch("async", "--save_async")]
    try:
        for r in started:
            assert r.wait() == 0, r.output()
        config = run_config(out["async"])
        assert (config["num_processes"], config["topology"]["distributed_type"]) == (2, "FSDP")
        for step in (4, 8):  # the same files holding the same data: each rank's DCP shards, the optimizer's files
            a, s = files_of(out["async"], step), files_of(out["sync"], step)
            assert a.keys() == s.keys() and f"model/shard-00002.step_{step}.safetensors" in a
            for rel in a:  # DCP's shards: the same tensors and header (safetensors orders its metadata as it hashes)
                folders = [out[n] / "checkpoints" / f"step_{step}" / rel for n in ("async", "sync")]
                same = a[rel] == s[rel] or rel.endswith(".safetensors") and contents(folders[0]) == contents(folders[1])
                assert same, rel
        assert final_bytes(out["async"]) == final_bytes(out["sync"])
        shutil.copytree(out["async"] / "checkpoints" / "step_4", out["resumed"] / "checkpoints" / "step_4")
        started.append(launch("resumed", "--save_async", "--resume_from_checkpoint", "latest"))
        assert started[-1].wait() == 0, started[-1].output()
        assert final_bytes(out["resumed"]) == final_bytes(out["sync"])
    finally:
        for r in started:
            r.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
