"""Checkpoints in-process (1 process): the manifest, verification of truncated/corrupt/malicious/incompatible
checkpoints, `latest` falling back to the previous good one, `auto`, and the NaN policies."""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from helpers import RECIPES, env
from safetensors.torch import load_file

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments  # noqa: E402
from accel_trainer.checkpointing.folder import CheckpointError, write_manifest  # noqa: E402
from accel_trainer.errors import UserError  # noqa: E402
from accel_trainer.logwindow import NonFiniteLossError  # noqa: E402


def make(out, recipe=regression, recipe_args=None, **kw):
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("disable_tqdm", True)
    kw.setdefault("logging_steps", 2)
    args = TrainingArguments(output_dir=str(out), **kw)
    return Trainer(recipe, args, recipe_args or regression.Args(), quiet=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run with checkpoints at steps 4, 8, 12 (the last is the final one)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    make(out, max_steps=12, save_steps=4).fit()
    return out


def copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def rehash(folder):
    """What an attacker (or a careless tool) does: rewrite the manifest to match altered files."""
    state = json.load(open(os.path.join(folder, "trainer_state.json")))
    write_manifest(str(folder), state)


def test_manifest_lists_every_file_with_size_and_sha256(trained):
    root = trained / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_12", "step_4", "step_8"]  # no .tmp_step_* left behind
    m = json.load(open(root / "step_8" / "manifest.json"))
    assert (m["step"], m["epoch"], m["batch_in_epoch"], m["num_processes"]) == (8, 0, 8, 1)
    on_disk = sorted(f for f in os.listdir(root / "step_8") if f != "manifest.json")
    assert sorted(m["files"]) == on_disk
    assert on_disk == ["model.safetensors", "optimizer.json", "optimizer.safetensors", "rng_state_0.json",
                       "run_args.json", "scheduler.json", "trainer_state.json"]  # fmt: skip
    for name, meta in m["files"].items():
        data = open(root / "step_8" / name, "rb").read()
        assert meta["size"] == len(data) and meta["sha256"] == hashlib.sha256(data).hexdigest()


def test_truncated_newest_checkpoint_named_and_latest_falls_back(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path / "run")
    model = out / "checkpoints" / "step_12" / "model.safetensors"
    os.truncate(model, os.path.getsize(model) // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        make(out, max_steps=16, save_steps=4, resume_from_checkpoint=str(out / "checkpoints" / "step_12"))
    t = make(out, max_steps=16, save_steps=4, resume_from_checkpoint="latest")
    assert t.global_step == 8
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step_12" in err and "truncated" in err
    assert "resuming from" in err and "step_8" in err


def test_corrupt_file_same_size_is_named(trained, tmp_path):
    out = copy_run(trained, tmp_path / "run")
    opt = out / "checkpoints" / "step_8" / "optimizer.safetensors"
    data = bytearray(open(opt, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(opt, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors is corrupt \(sha256"):
        make(out, max_steps=16, resume_from_checkpoint=str(out / "checkpoints" / "step_8"))


def test_all_checkpoints_bad_is_an_error_not_a_fresh_start(trained, tmp_path):
    out = copy_run(trained, tmp_path / "run")
    for step in (4, 8, 12):
        os.remove(out / "checkpoints" / f"step_{step}" / "manifest.json")
    for spec in ("latest", "auto"):
        with pytest.raises(CheckpointError, match="none of the 3 checkpoint"):
            make(out, max_steps=16, resume_from_checkpoint=spec)


class _Payload:
    """Unpickling this calls os.system: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["optimizer.bin", "random_states_0.pkl", "optimizer/.metadata"])
def test_a_pickle_in_a_checkpoint_is_refused_unread(trained, tmp_path, victim):
    """A checkpoint holds JSON and safetensors only: a pickle in it, listed in the manifest under a name the older
    format used, is refused before anything reads it, and its code does not run."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    marker = tmp_path / "pwned"
    (folder / victim).parent.mkdir(exist_ok=True)
    payload = io.BytesIO()
    torch.save({"state": _Payload(str(marker))}, payload)
    (folder / victim).write_bytes(payload.getvalue())
    rehash(folder)  # the manifest matches: safety must not rest on the hashes
    # The payload is live: an unsafe load (weights_only=False) in another process runs it.
    subprocess.run(
        [sys.executable, "-c", f"import torch; torch.load({str(folder / victim)!r}, weights_only=False)"],
        timeout=120,
        capture_output=True,
    )
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=rf"{re.escape(victim)} is a file of the older, pickle-based") as e:
        make(out, max_steps=16, resume_from_checkpoint=str(folder))
    assert "nothing in it was read" in str(e.value) and not marker.exists()
    # 'latest' refuses it too and falls back to step_8
    t = make(out, max_steps=16, resume_from_checkpoint="latest")
    assert t.global_step == 8 and not marker.exists()


def test_other_model_shape_is_refused_naming_tensor(trained):
    # ... and nothing of the run that wrote the checkpoint is overwritten: its run_config.json stays its record
    record = (trained / "run_config.json").read_bytes()
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors does not fit this model \(0\.weight: \(32, 16\) "
        r"in the checkpoint, \(64, 16\)",
    ):
        make(
            trained,
            regression,
            regression.Args(hidden_size=64),
            max_steps=16,
            resume_from_checkpoint=str(trained / "checkpoints" / "step_8"),
        )
    assert (trained / "run_config.json").read_bytes() == record


def test_another_global_batch_is_refused(trained, tmp_path):
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_8"
    state = json.load(open(folder / "trainer_state.json"))
    state["num_processes"] = 2
    json.dump(state, open(folder / "trainer_state.json", "w"))
    shutil.copy(folder / "rng_state_0.json", folder / "rng_state_1.json")  # each writing rank's RNG state
    record = json.load(open(folder / "run_args.json"))
    record["state"]["world_size"] = 2  # a 2-process run's record says so (checkpointing/counters.py)
    json.dump(record, open(folder / "run_args.json", "w"))
    write_manifest(str(folder), state)
    # 2 processes x 16 then, 1 x 16 now: another world size is fine, another global batch is not
    # the Python API names the keyword (the command line: --allow_global_batch_change)
    with pytest.raises(
        CheckpointError, match=r"global batch of 32 .* this run's is 16.*allow_global_batch_change=True"
    ):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))


def test_auto_starts_fresh_without_checkpoint_and_resumes_with_one(tmp_path):
    out = tmp_path / "run"
    t = make(out, max_steps=6, save_steps=4, resume_from_checkpoint="auto")
    assert t.global_step == 0
    os.makedirs(out / "checkpoints" / ".tmp_step_8")  # a save that was killed
    t.fit()
    t = make(out, max_steps=10, save_steps=4, resume_from_checkpoint="auto")
    assert t.global_step == 6  # the final checkpoint; the stale .tmp folder is ignored and removed
    assert not (out / "checkpoints" / ".tmp_step_8").exists()
    # an attempt that died before its first checkpoint left logs only: auto starts over in place
    other = tmp_path / "died_early"
    os.makedirs(other)
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    assert make(other, max_steps=4, resume_from_checkpoint="auto").global_step == 0
    assert not (other / "metrics.jsonl").exists()


def _nan_recipe(at_update: int):
    """regression, with the loss of the `at_update`-th update (1-based) made NaN."""
    calls = {"n": 0}

    def loss(model, batch):
        value, n = regression.loss(model, batch)
        calls["n"] += torch.is_grad_enabled()  # updates only: the recipe check's call before the first is no_grad
        return (value * float("nan") if calls["n"] == at_update else value), n

    rec = types.SimpleNamespace(
        **{
            k: getattr(regression, k)
            for k in ("Args", "build_model", "build_data", "eval_step", "build_metrics", "defaults")
        }
    )
    rec.loss, rec.name = loss, "regression_nan"
    return rec


def test_nan_stop_names_the_step_and_writes_no_checkpoint_after_it(tmp_path):
    out = tmp_path / "run"
    t = make(out, _nan_recipe(6), max_steps=12, save_steps=4, logging_steps=5)
    with pytest.raises(NonFiniteLossError, match="Loss is nan at step 6"):
        t.fit()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_4"]  # the save at step 8 stopped first
    assert not (out / "model.safetensors").exists()


def test_nan_skip_skips_and_counts(tmp_path):
    out = tmp_path / "run"
    t = make(out, _nan_recipe(6), max_steps=12, save_steps=0, logging_steps=4, nan_policy="skip")
    t.fit()
    assert t.progress.skipped_steps == 1 and t.global_step == 12
    events = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [e for e in events if "loss" in e]
    assert [e["skipped_steps"] for e in train] == [0, 1, 1]
    assert all(torch.isfinite(v).all() for v in load_file(out / "model.safetensors").values())


def _nan_grad_recipe(at_update: int):
    """regression, with a finite loss whose gradient is NaN at the `at_update`-th update (1-based): sqrt'(0) = inf
    times d(0 * w)/dw = 0."""
    rec = _nan_recipe(0)
    calls = {"n": 0}

    def loss(model, batch):
        value, n = regression.loss(model, batch)
        calls["n"] += torch.is_grad_enabled()  # updates only: the recipe check's call before the first is no_grad
        if calls["n"] == at_update:
            value = value + (model[0].weight * 0).sum().sqrt()
        return value, n

    rec.loss = loss
    return rec


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_nan_gradient_with_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, max_grad_norm):
    out = tmp_path / "run"
    # The checkpoint is due at the very update whose gradient is NaN (its loss, computed before, is finite).
    kw = dict(max_steps=12, save_steps=3, logging_steps=5, save_total_limit=1, max_grad_norm=max_grad_norm)
    t = make(out, _nan_grad_recipe(6), **kw)
    # Without clipping no norm is computed: the check is a flag from one fused pass over the gradients.
    what = r"The gradient norm is nan" if max_grad_norm else r"A gradient is not finite"
    with pytest.raises(NonFiniteLossError, match=what + r" \(loss [0-9.]+\) at step 6; the run stops"):
        t.fit()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_3"]  # the last good one, not replaced
    good = load_file(out / "checkpoints" / "step_3" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in good.values())


def test_nan_gradient_with_finite_loss_is_skipped_under_skip(tmp_path):
    out = tmp_path / "run"
    kw = dict(max_steps=12, save_steps=4, logging_steps=4, nan_policy="skip", max_grad_norm=0.0)
    t = make(out, _nan_grad_recipe(6), **kw)
    t.fit()
    assert t.progress.skipped_steps == 1 and t.global_step == 12
    for f in (out / "model.safetensors", out / "checkpoints" / "step_8" / "model.safetensors"):
        assert all(torch.isfinite(v).all() for v in load_file(f).values())


def test_best_model_is_kept_apart_from_the_checkpoint_limit(tmp_path):
    # A small noisy train set and a large constant learning rate: the eval loss is best at step 20, not at the end.
    kw = dict(save_steps=4, eval_steps=4, save_total_limit=1, lr_scheduler_type="constant", learning_rate=0.2)
    ra = regression.Args(num_train_samples=32, noise=0.5)
    out = tmp_path / "run"
    make(out, regression, ra, max_steps=24, metric_for_best_model="eval_loss", **kw).fit()
    evals = [json.loads(line) for line in open(out / "metrics.jsonl") if "eval_loss" in line]
    best = min(evals, key=lambda e: e["eval_loss"])
    meta = json.load(open(out / "best" / "best.json"))
    assert (meta["step"], meta["metric"], meta["value"]) == (best["step"], "eval_loss", best["eval_loss"])
    assert best["step"] < 24
    assert sorted(os.listdir(out / "checkpoints")) == ["step_24"]  # the limit applies to checkpoints only
    # best/model.safetensors holds the weights evaluated at that step: a run stopped there ends with the same bytes
    again = tmp_path / "again"
    make(again, regression, ra, max_steps=best["step"], **kw).fit()
    assert open(again / "model.safetensors", "rb").read() == open(out / "best" / "model.safetensors", "rb").read()
    with pytest.raises(Exception, match="metric_for_best_model accuracy: the evaluation gives no such metric"):
        make(tmp_path / "bad", max_steps=4, eval_steps=2, metric_for_best_model="accuracy").fit()


def test_tied_tensor_may_be_missing_only_when_tied(tmp_path):
    # A safetensors file keeps one name of a shared tensor: fine for a model whose two names are one tensor,
    # refused for a model where they are two (the check must not wave through a really missing tensor).
    from safetensors.torch import save_model

    from accel_trainer.checkpointing.load import check_tensors, file_tensors

    def check_compatible(folder, model):
        file = os.path.join(folder, "model.safetensors")
        check_tensors(folder, file, file_tensors(folder, file), model.state_dict())

    class LM(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    save_model(LM(tied=True), str(tmp_path / "model.safetensors"))
    assert len(load_file(tmp_path / "model.safetensors")) == 1  # the shared tensor is stored once
    check_compatible(str(tmp_path), LM(tied=True))
    with pytest.raises(CheckpointError, match="missing tensors head.weight"):
        check_compatible(str(tmp_path), LM(tied=False))


@pytest.mark.slow
def test_compiled_model_with_ema_saves_plain_names(tmp_path):
    # --torch_compile wraps the model (`_orig_mod.`); the EMA copy, model.safetensors and best/model.safetensors
    # must hold the plain model's names, loadable with safetensors.torch.load_model into a freshly built model.
    from safetensors.torch import load_model

    out = tmp_path / "run"
    kw = dict(torch_compile=True, ema_decay=0.9, eval_steps=2, metric_for_best_model="eval_loss")
    make(out, max_steps=4, save_steps=0, **kw).fit()
    for path in (out / "model.safetensors", out / "best" / "model.safetensors"):
        fresh = regression.build_model(types.SimpleNamespace(args=regression.Args()))
        load_model(fresh, str(path))  # strict: no missing or unexpected names
        assert torch.equal(fresh.state_dict()["0.weight"], load_file(path)["0.weight"])


def test_resaving_a_step_never_leaves_it_missing(trained, tmp_path, monkeypatch):
    # A resumed finished run writes its last step again. Killed between taking the old folder away and putting the
    # new one in place (here: the rename of the new folder fails), the complete step_12 must still be found.
    import accel_trainer.checkpointing.resume as ckpt

    out = copy_run(trained, tmp_path / "run")
    real_replace = os.replace

    def killed_at_commit(src, dst):
        if os.path.basename(str(src)) == ".tmp_step_12":
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    t = make(out, max_steps=12, save_steps=4, resume_from_checkpoint="latest")
    monkeypatch.setattr(ckpt.os, "replace", killed_at_commit)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert ckpt.resolve_resume_path("latest", str(out)) == str(out / "checkpoints" / "step_12")
    # the copy set aside is back in place; the interrupted new one is the .tmp_ folder the next resume removes
    assert sorted(os.listdir(out / "checkpoints")) == [".tmp_step_12", "step_12", "step_4", "step_8"]


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(trained, tmp_path, capsys):
    # Resumed from step 4 with steps 8 and 12 of the first attempt present, then stopped after its own step 8:
    # `latest` must be this run's step 8, not the first attempt's step 12, and nothing is deleted.
    import accel_trainer.checkpointing.resume as ckpt

    out = copy_run(trained, tmp_path / "run")
    old12 = load_file(out / "checkpoints" / "step_12" / "model.safetensors")
    t = make(out, max_steps=12, save_steps=4, resume_from_checkpoint=str(out / "checkpoints" / "step_4"))

    def stop(trainer, path):
        if trainer.global_step == 8:
            raise KeyboardInterrupt("killed")

    t.on("checkpoint_written", stop)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    assert ckpt.resolve_resume_path("latest", str(out)) == str(out / "checkpoints" / "step_8")
    assert "newer than step_4, which this run resumes from" in capsys.readouterr().err
    aside = [d for d in os.listdir(out / "checkpoints") if d.startswith("superseded")]
    assert len(aside) == 1 and sorted(os.listdir(out / "checkpoints" / aside[0])) == ["step_12", "step_8"]
    kept = load_file(out / "checkpoints" / aside[0] / "step_12" / "model.safetensors")
    assert all(torch.equal(old12[k], kept[k]) for k in old12)


def test_auto_restart_moves_aside_a_best_model_it_cannot_compare_against(tmp_path, capsys):
    # An earlier attempt (no checkpoint) kept best/ for another metric: this one cannot go on comparing against it,
    # so best/ is moved aside, said on stderr, not deleted. (Same metric: kept, tests/test_fault_tolerance.py.)
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    (out / "best" / "best.json").write_text(json.dumps({"step": 10, "metric": "eval_mse", "value": 0.5}))
    (out / "best" / "model.safetensors").write_bytes(b"earlier")
    make(out, max_steps=2, metric_for_best_model="eval_loss", resume_from_checkpoint="auto")
    (aside,) = [d for d in os.listdir(out) if d.startswith("best.previous-")]
    assert (out / aside / "model.safetensors").read_bytes() == b"earlier" and not (out / "best").exists()
    assert f"moved to {out / aside}" in capsys.readouterr().err


def test_a_checkpoint_from_elsewhere_does_not_write_over_a_finished_run_or_itself(trained, tmp_path):
    """Resuming another folder's checkpoint is a run of its own in output_dir: into a folder that holds a finished
    run it is refused as a new run would be (before, that run's model and logs were replaced), and a checkpoint
    that overlaps output_dir is refused (before, the run wrote its model over the checkpoint's)."""
    finished = copy_run(trained, tmp_path / "finished")
    before = {p: (finished / p).read_bytes() for p in ("model.safetensors", "run_config.json", "metrics.jsonl")}
    source = str(trained / "checkpoints" / "step_4")
    with pytest.raises(UserError, match=r"holds a previous run \(metrics.jsonl, run_config.json, checkpoints"):
        make(finished, max_steps=12, resume_from_checkpoint=source)
    assert {p: (finished / p).read_bytes() for p in before} == before
    # --overwrite_output_dir: the finished run is deleted, and the resumed one continues from step 4
    trainer = make(finished, max_steps=12, resume_from_checkpoint=source, overwrite_output_dir=True)
    assert trainer.global_step == 4 and not (finished / "model.safetensors").exists()
    assert not (finished / "checkpoints").exists()

    copy = copy_run(trained / "checkpoints" / "step_8", tmp_path / "step_8")
    for out in (copy, copy / "inside"):
        with pytest.raises(UserError, match="overlap: the run would write into the checkpoint it resumes from"):
            make(out, max_steps=12, resume_from_checkpoint=str(copy))
    assert sorted(os.listdir(copy)) == sorted(os.listdir(trained / "checkpoints" / "step_8"))


DEEP = "[" * 100_000 + "]" * 100_000  # parses past Python's recursion limit


@pytest.mark.parametrize(
    "file, content, message",
    [
        ("manifest.json", "[1, 2]", r"manifest.json is unreadable \(not a JSON object with a 'files' object\)"),
        ("manifest.json", DEEP, r"manifest.json is unreadable \(ValueError: JSON nested too deep to parse\)"),
        ("trainer_state.json", DEEP, r"trainer_state.json is unreadable \(ValueError: JSON nested too deep"),
        ("trainer_state.json", {"skipped_steps": "x"}, r"trainer_state.json holds skipped_steps 'x', which no run"),
        ("trainer_state.json", {"global_step": -4}, r"holds global_step -4, skipped_steps 0, which no run writes"),
        ("trainer_state.json", {"batch_in_epoch": -1, "epoch": -1}, r"holds epoch -1, batch_in_epoch -1, which"),
        ("trainer_state.json", {"best_metric": "abc"}, r"holds best_metric 'abc', which no run writes"),
        ("trainer_state.json", {"best_metric": float("nan")}, r"holds best_metric nan, which no run writes"),
        ("trainer_state.json", {"best_metric": 1.0, "best_step": 99}, r"holds best_step 99, which no run writes"),
    ],
)
def test_a_crafted_manifest_or_trainer_state_is_one_line_and_latest_skips_it(trained, tmp_path, file, content, message):
    """JSON someone else wrote: not a traceback from a list where an object belongs, a nesting deeper than the
    parser's recursion, or a value of the wrong type in a field the resume reads; nor a silent resume of values
    no run writes (a negative step made step_-4 folders; a NaN best never let best/ be written)."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    if isinstance(content, dict):
        state = json.load(open(folder / file))
        json.dump({**state, **content}, open(folder / file, "w"))
        rehash(folder)  # the manifest matches: the values themselves are refused
    else:
        state = json.load(open(folder / "trainer_state.json"))
        (folder / file).write_text(content)
        if file == "trainer_state.json":
            write_manifest(str(folder), state)  # the manifest lists the crafted file as it is
    with pytest.raises(CheckpointError, match=message):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))
    trainer = make(out, max_steps=16, resume_from_checkpoint="latest")  # the newest good one instead
    assert trainer.global_step == 8


@pytest.mark.parametrize("victim", ["rng_state_0.json", "optimizer.json", "scheduler.json", "model.safetensors"])
def test_a_checkpoint_without_a_file_every_checkpoint_holds_is_refused_even_with_a_matching_manifest(
    trained, tmp_path, victim
):
    """Accelerate's load_state skipped a missing RNG file with a log line (the resumed run drew other random
    numbers, silently), and a missing optimizer was a bare "[Errno 2]" naming no checkpoint."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    os.remove(folder / victim)
    rehash(folder)
    with pytest.raises(CheckpointError, match=rf"manifest.json lists no {re.escape(victim)}\b.*: it cannot continue"):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))


def test_an_ema_that_does_not_continue_is_said_and_one_of_another_shape_is_refused(trained, tmp_path, capsys):
    """Before: a checkpoint without EMA weights restarted the EMA of an --ema_decay run without a word, an EMA
    checkpoint resumed without --ema_decay ended it without a word, and EMA weights of another shape were a
    RuntimeError traceback out of safetensors."""
    out = copy_run(trained, tmp_path / "run")
    args = TrainingArguments(
        output_dir=str(out), max_steps=16, ema_decay=0.9, resume_from_checkpoint="latest", allow_args_change=True
    )  # the run had no EMA: adding one is a change of its numbers
    Trainer(regression, args, regression.Args())
    assert (
        "has no ema.safetensors (written without --ema_decay): the EMA starts from its weights"
        in capsys.readouterr().out
    )

    ema_run = tmp_path / "ema"
    make(ema_run, max_steps=4, save_steps=4, ema_decay=0.9).fit()
    folder = ema_run / "checkpoints" / "step_4"
    args = TrainingArguments(output_dir=str(ema_run), max_steps=8, resume_from_checkpoint="latest", ema_decay=0.0,
                             allow_args_change=True)  # fmt: skip
    Trainer(regression, args, regression.Args())
    assert "ema.safetensors end here: this run has no --ema_decay" in capsys.readouterr().out

    from safetensors.torch import save_file

    ema = load_file(folder / "ema.safetensors")
    grown = {k: torch.zeros(*(d + 1 for d in v.shape)) for k, v in ema.items()}
    save_file(grown, folder / "ema.safetensors", metadata={"step": "4"})  # of this checkpoint, but of another shape
    rehash(folder)
    with pytest.raises(CheckpointError, match=r"ema.safetensors does not fit this model.s EMA \(0.weight: \(33, 17\)"):
        make(ema_run, max_steps=8, ema_decay=0.9, resume_from_checkpoint="latest")


def test_another_seed_in_the_middle_of_an_epoch_is_refused(trained, tmp_path):
    """The epoch's order is a function of (seed, epoch): continued with another --seed, the rest of the epoch
    would repeat some samples and skip others (before: accepted without a word)."""
    out = copy_run(trained, tmp_path / "run")
    step_4 = str(out / "checkpoints" / "step_4")
    with pytest.raises(UserError, match=r"seed=7 \(the run: 42\): a resumed run continues the run it resumes"):
        make(out, max_steps=16, seed=7, resume_from_checkpoint=step_4)  # another seed at all: the run's record
    with pytest.raises(CheckpointError, match=r"written with seed=42 in the middle of epoch 0; this run's seed=7 "):
        make(out, max_steps=16, seed=7, resume_from_checkpoint=step_4, allow_args_change=True)
    assert make(out, max_steps=16, seed=42, resume_from_checkpoint=str(out / "checkpoints" / "step_4")).global_step == 4


def test_a_checkpoint_of_the_older_pickle_format_is_one_line(trained, tmp_path):
    """accel-trainer <= 0.2 wrote Accelerate's save_state folders (pickles) with a manifest of format 1: refused
    in one line naming what to do, nothing in it read."""
    old = tmp_path / "old" / "step_8"
    old.mkdir(parents=True)
    files = {}
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "trainer_state.json"):
        data = json.dumps({"global_step": 8}).encode() if name.endswith(".json") else b"\x80\x02}q\x00."
        (old / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (old / "manifest.json").write_text(json.dumps({"format": 1, "step": 8, "files": files}))
    with pytest.raises(CheckpointError, match=r"says format 1: written by an older accel-trainer .* reads no pickle"):
        make(tmp_path / "new", max_steps=16, resume_from_checkpoint=str(old))


def test_a_run_folder_or_a_file_given_for_a_checkpoint_names_what_to_pass(trained, tmp_path):
    """Before: "not a checkpoint of ours (trainer_state.json missing)" naming no fix, and "no such folder" for a
    file that exists."""
    out = tmp_path / "new"
    with pytest.raises(CheckpointError, match=rf"it is a run's output_dir: pass {re.escape(str(trained))}/checkpoints/"
                       r"step_12, or 'latest' with output_dir="):  # fmt: skip
        make(out, max_steps=16, resume_from_checkpoint=str(trained))
    with pytest.raises(CheckpointError, match=r"model.safetensors': a file, not a folder. Pass a checkpoint folder"):
        make(out, max_steps=16, resume_from_checkpoint=str(trained / "model.safetensors"))


def _frozen_base_recipe(width: int = 256, base_seed: int = 0):
    """regression with a wide frozen first layer (a pretrained base, drawn from `base_seed`) and a small head that
    trains: what fine-tuning a LoRA adapter looks like to a checkpoint."""
    from accel_trainer.recipe import Recipe

    def build_model(ctx):
        torch.manual_seed(base_seed)  # the base is the same however the run's seed is set: as from_pretrained
        base = torch.nn.Linear(16, width)
        base.requires_grad_(False)
        return torch.nn.Sequential(base, torch.nn.Tanh(), torch.nn.Linear(width, 4))

    return Recipe(build_model=build_model, build_data=regression.build_data, loss=regression.loss,
                  Args=regression.Args, name="frozen_base")  # fmt: skip


def test_a_frozen_base_is_not_in_the_checkpoints_and_resumes_bit_identically(tmp_path):
    """A checkpoint holds what trains (the head, its optimizer state) and the frozen base's fingerprints, not the
    base (before: the whole base in every checkpoint); resumed, the run ends with the uninterrupted run's bytes. A
    base that build_model builds otherwise (other weights) is refused in one line."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    make(whole, _frozen_base_recipe(), max_steps=12, save_steps=4).fit()
    trainer = make(cut, _frozen_base_recipe(), max_steps=12, save_steps=4)
    trainer.on(
        "checkpoint_written", lambda t, path: (_ for _ in ()).throw(KeyboardInterrupt) if t.global_step == 8 else None
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    folder = cut / "checkpoints" / "step_8"
    held = load_file(folder / "model.safetensors")
    assert sorted(held) == ["2.bias", "2.weight"]  # the frozen 0.weight and 0.bias are not there
    assert json.load(open(folder / "frozen.json"))["state"].keys() == {"0.bias", "0.weight"}
    model_bytes = os.path.getsize(whole / "model.safetensors")
    assert os.path.getsize(folder / "model.safetensors") < model_bytes / 4  # the head: 1028 of 5380 parameters
    make(cut, _frozen_base_recipe(), max_steps=12, save_steps=4, resume_from_checkpoint="latest").fit()
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"frozen parameters \(2, e.g. 0.bias\) differ from those .*frozen.json"):
        make(tmp_path / "other", _frozen_base_recipe(base_seed=1), max_steps=16, resume_from_checkpoint=str(folder))


@pytest.mark.slow
def test_a_resume_reads_no_pickle(trained, tmp_path):
    """Nothing in a checkpoint goes through an unpickler: resumed in a process where torch.load, pickle.load and a
    pickle.Unpickler over a file raise (tests/tripwire_recipe.py), the run resumes and trains on. (Until 0.2 the
    optimizer, scheduler and RNG states were pickles: this run failed at the first of them.)"""
    out = copy_run(trained, tmp_path / "run")
    recipe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tripwire_recipe.py")
    proc = subprocess.run(
        [sys.executable, recipe, "--output_dir", str(out), "--max_steps", "16", "--save_steps", "4",
         "--per_device_train_batch_size", "16", "--resume_from_checkpoint", str(out / "checkpoints" / "step_8")],
        capture_output=True, text=True, timeout=240, env=env(),
    )  # fmt: skip
    assert proc.returncode == 0 and "tripwire" not in proc.stderr, proc.stderr[-3000:]
    assert "Resumed from" in proc.stderr + proc.stdout


def test_a_resume_continues_with_the_runs_own_arguments(tmp_path, capsys):
    """Resumed with only resume_from_checkpoint, the run continues with its learning rate, warm-up, schedule, seed,
    length and recipe arguments (before: the defaults, silently; run_config.json recorded a learning rate that never
    trained), and ends with the uninterrupted run's bytes; another value of one that changes the numbers is refused
    in one line naming it, unless allow_args_change; another length is a note."""
    kw = dict(learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="cosine", seed=7, max_steps=12, save_steps=4)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    make(whole, regression, regression.Args(hidden_size=24), **kw).fit()
    trainer = make(cut, regression, regression.Args(hidden_size=24), **kw)
    trainer.on("checkpoint_written", lambda t, p: (_ for _ in ()).throw(KeyboardInterrupt) if t.global_step == 4 else 0)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    args = TrainingArguments(output_dir=str(cut), resume_from_checkpoint="latest", disable_tqdm=True)
    resumed = Trainer(regression, args, quiet=True)  # nothing else given
    assert (resumed.args.learning_rate, resumed.args.warmup_steps, resumed.args.seed) == (3e-3, 3, 7)
    assert resumed.recipe_args.hidden_size == 24 and resumed.total_steps == 12
    resumed.fit()
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    config = json.load(open(cut / "run_config.json"))
    assert config["learning_rate"]["used"] == 3e-3
    with pytest.raises(UserError, match=r"learning_rate=0.1 \(the run: 0.003\); seed=1 \(the run: 7\): a resumed run"):
        make(cut, learning_rate=0.1, seed=1, max_steps=12, resume_from_checkpoint="latest")
    again = Trainer(regression, TrainingArguments(output_dir=str(cut), learning_rate=0.1, max_steps=16, disable_tqdm=True,
                    resume_from_checkpoint="latest", allow_args_change=True))  # fmt: skip
    assert again.args.learning_rate == 0.1 and again.args.warmup_steps == 3
    assert "with --learning_rate 0.1 (the run: 0.003), --max_steps 16 (the run: 12)" in capsys.readouterr().out


def _channels_last_recipe():
    """A conv net in channels_last (as recipes/cifar.py lays its net out) trained by the default optimizer, torch's
    fused AdamW, whose kernel reads a parameter's state tensors as flat memory in the parameter's own layout."""
    from accel_trainer.recipe import Recipe

    def build_model(ctx):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 2))
        return net.to(memory_format=torch.channels_last)

    def build_data(ctx):
        g = torch.Generator().manual_seed(0)
        images, labels = torch.randn(64, 3, 6, 6, generator=g), torch.randint(0, 2, (64,), generator=g)
        return {"train": torch.utils.data.TensorDataset(images.contiguous(memory_format=torch.channels_last), labels)}

    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), len(y)

    return Recipe(build_model=build_model, build_data=build_data, loss=loss, name="channels_last")


def test_a_channels_last_model_resumes_bit_identically_under_the_fused_optimizer(tmp_path):
    """The optimizer's state tensors come back in their parameters' layout. A checkpoint keeps tensors contiguous
    (safetensors); loaded as they were, fused AdamW read a channels_last weight's moments in another element order
    and the resumed run trained on other numbers, silently."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    kw = dict(max_steps=6, save_steps=3, per_device_train_batch_size=8, mixed_precision="no")
    trainer = Trainer(_channels_last_recipe(), TrainingArguments(output_dir=str(whole), **kw), quiet=True)
    assert trainer.optimizer.optimizer.defaults.get("fused"), "the test needs the fused optimizer"
    trainer.fit()
    stopped = Trainer(_channels_last_recipe(), TrainingArguments(output_dir=str(cut), **kw), quiet=True)
    stopped.on("checkpoint_written", lambda t, path: (_ for _ in ()).throw(KeyboardInterrupt))  # killed at step 3
    with pytest.raises(KeyboardInterrupt):
        stopped.fit()
    Trainer(_channels_last_recipe(), TrainingArguments(output_dir=str(cut), resume_from_checkpoint="latest", **kw),
            quiet=True).fit()  # fmt: skip
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
