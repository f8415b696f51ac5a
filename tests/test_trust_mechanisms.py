"""The mechanisms that close issue 39's classes, each tried in-process with inputs crafted by hand (not by the
checkpoint writer's functions): one safe reader for every file someone else could have written; an output folder
that is never inside another run; a superseded folder never moved into an existing name; a checkpoint's listed
files checked by their own format's size before they are hashed; a checkpoint's record of the run's arguments
never read when its values are no run's; every argument of the wrong type or range one line.
The same classes launched as real runs, 1 process and FSDP, are the catalogue in test_checkpoint_trust.py."""

import fcntl
import json
import os
import sys
import time

import pytest
from helpers import RECIPES

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer, TrainingArguments, safe_read  # noqa: E402
from accel_trainer.checkpointing import folder as ckpt_folder  # noqa: E402
from accel_trainer.checkpointing.folder import CheckpointError  # noqa: E402
from accel_trainer.checkpointing.verify import verify_checkpoint  # noqa: E402
from accel_trainer.errors import UserError  # noqa: E402


def make(out, **kw):
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("disable_tqdm", True)
    return Trainer(regression, TrainingArguments(output_dir=str(out), **kw), regression.Args(), quiet=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run with checkpoints at steps 4, 8 and 12."""
    out = tmp_path_factory.mktemp("trust") / "run"
    make(out, max_steps=12, save_steps=4).fit()
    return out


def copy_run(trained, dst):
    import shutil

    shutil.copytree(trained, dst)
    return dst


def manifest_edit(folder, change):
    """The manifest rewritten by hand (json, not the writer's write_manifest)."""
    path = folder / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ the one safe reader
def text(content):
    return lambda p: p.write_bytes(content if isinstance(content, bytes) else content.encode())


def sparse(size):
    return lambda p: (p.write_bytes(b""), os.truncate(p, size))


@pytest.mark.parametrize(
    "make_it, reason",
    [
        (os.mkfifo, "not a regular file"),  # open() of a FIFO blocks until a writer comes
        (lambda p: os.symlink("/dev/zero", p), "a symbolic link, not followed"),  # a device never ends
        (lambda p: os.symlink("/etc/hostname", p), "a symbolic link, not followed"),
        (sparse(1 << 40), "more than the"),  # a sparse terabyte
        (text('{"a": 1, "a": 2}'), "appears twice"),
        (text("[" * 100_000 + "]" * 100_000), "nested too deep"),
        (text(b"\xff\xfe{}"), "not UTF-8|Expecting value|unexpected"),
        (text('{"a": 1' + "0" * 400 + "}"), "integer of 401 digits, beyond the 64 bits"),  # OverflowError downstream
        (text('{"a": 18446744073709551616}'), "beyond the 64 bits"),
        (text('{"a": 1}'), None),
    ],
)
def test_the_safe_reader_refuses_what_would_block_read_without_end_or_mislead(tmp_path, make_it, reason):
    path = tmp_path / "f.json"
    make_it(path)
    started = time.monotonic()
    if reason is None:
        assert safe_read.read_json(str(path)) == {"a": 1}
    else:
        with pytest.raises((OSError, ValueError), match=reason):
            safe_read.read_json(str(path))
    assert time.monotonic() - started < 30  # bounded (a blocking open or a read to the end never returns)


# ------------------------------------------------------------------------------------ an output folder of its own
@pytest.mark.parametrize("where", ["checkpoints/step_8", "checkpoints/new", "checkpoints/step_8/model", "best/x"])
def test_an_output_dir_inside_a_run_or_a_checkpoint_is_refused_and_nothing_is_written(trained, tmp_path, where):
    """A second run pointed into a run's checkpoints/ (or best/) wrote its lock and model into a checkpoint, and set
    aside checkpoints of a run still writing them (its lock is on the folder above, so no lock refused it)."""
    out = copy_run(trained, tmp_path / "run")
    (out / "best").mkdir(exist_ok=True)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(UserError, match=r"output_dir\W.* (is a checkpoint folder|lies in .*(checkpoints|best)/)"):
        make(out / where, max_steps=4, overwrite_output_dir=True)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


@pytest.mark.parametrize("resume", ["auto", None])
@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/nested/run", "best"])
def test_a_run_folder_inside_this_runs_entries_is_never_deleted_or_written_into(trained, tmp_path, where, resume):
    """A run on X/checkpoints, then one on X with 'auto' (no checkpoint: it starts over) deleted the first run's folder
    while its lock was held; --overwrite_output_dir deleted it too. Refused, whatever the flags; nothing changes."""
    x = tmp_path / "x"
    x.mkdir()
    inner = copy_run(trained, x / where)  # a run of its own (its lock file and run_config.json)
    (x / "metrics.jsonl").write_text("")  # X held an attempt that died before its first checkpoint
    before = sorted(str(p.relative_to(x)) for p in x.rglob("*"))
    with open(inner / ".accel-trainer.lock", "a+") as held:  # that run is running (lock.py's flock)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        kw = {"resume_from_checkpoint": "auto"} if resume else {"overwrite_output_dir": True}
        with pytest.raises(UserError, match=r"holds another run's output folder"):
            make(x, max_steps=4, **kw)
    assert sorted(str(p.relative_to(x)) for p in x.rglob("*")) == before


def test_a_lock_file_that_is_a_link_or_holds_a_crafted_record_is_one_line(trained, tmp_path):
    out = copy_run(trained, tmp_path / "run")
    os.remove(out / ".accel-trainer.lock")
    os.symlink(tmp_path / "elsewhere", out / ".accel-trainer.lock")
    with pytest.raises(UserError, match=r"\.accel-trainer\.lock is a symbolic link.*Remove the link"):
        make(out, max_steps=16, resume_from_checkpoint="latest")
    os.remove(out / ".accel-trainer.lock")
    # held by a run whose record is no record (nested past the parser's recursion): "in use", not a RecursionError
    fd = os.open(out / ".accel-trainer.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"[" * 4000)
        with pytest.raises(UserError, match=r"is in use by another run"):
            make(out, max_steps=16, resume_from_checkpoint="latest")
    finally:
        os.close(fd)


def test_newer_checkpoints_are_never_moved_into_a_name_that_is_already_there(trained, tmp_path, monkeypatch):
    """The superseded folder was made with exist_ok=True under a name of the second: a link planted under the next
    second's name took the run's checkpoints out of the output folder (a FIFO there: [Errno 17])."""
    out = copy_run(trained, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setattr(ckpt_folder.time, "strftime", lambda fmt, *a: "20261205-120000")
    os.symlink(outside, out / "checkpoints" / "superseded-20261205-120000")
    os.mkfifo(out / "checkpoints" / "superseded-20261205-120000-")
    make(out, max_steps=4, resume_from_checkpoint=str(out / "checkpoints" / "step_4"))
    assert os.listdir(outside) == []
    aside = [p for p in (out / "checkpoints").iterdir() if p.is_dir() and not p.is_symlink() and "superseded" in p.name]
    assert len(aside) == 1 and sorted(os.listdir(aside[0])) == ["step_12", "step_8"]
    assert oct(aside[0].stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------- listed files, read by their format
def test_a_listed_file_nothing_reads_is_not_hashed(trained, tmp_path):
    """A manifest may list a sparse file of a terabyte with its true size: hashing it never ended (nothing printed)."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    with open(folder / "notes.dat", "wb") as f:
        f.truncate(1 << 40)
    manifest_edit(folder, lambda m: m["files"].update({"notes.dat": {"size": 1 << 40, "sha256": "0" * 64}}))
    said = []
    started = time.monotonic()
    verify_checkpoint(str(folder), log=said.append)
    assert time.monotonic() - started < 60
    assert any("notes.dat is listed in manifest.json but nothing reads it; ignored" in s for s in said), said


@pytest.mark.parametrize("victim", ["model.safetensors", "trainer_state.json"])
def test_a_listed_file_larger_than_its_format_says_is_refused_before_it_is_hashed(trained, tmp_path, victim):
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    with open(folder / victim, "r+b") as f:
        f.truncate(1 << 36)  # 64 GiB, sparse: its hash would read them all
    manifest_edit(folder, lambda m: m["files"][victim].update(size=1 << 36))
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"{victim} is (not a readable safetensors file|\d+ bytes, more than)"):
        verify_checkpoint(str(folder))
    assert time.monotonic() - started < 60


# ---------------------------------------------------------------------- the run's record, and the arguments' types
def test_a_record_of_values_no_run_has_is_refused_and_latest_takes_nothing_from_it(trained, tmp_path):
    """`latest` skipped a checkpoint whose run_args.json held a batch size of 16.0, then took the run's arguments from
    it all the same (a traceback deep in the loader); by folder it resumed with them."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    record = json.loads((folder / "run_args.json").read_text())
    training = record["state"]["training"] if "training" in record.get("state", {}) else None
    assert training is not None, record
    training["per_device_train_batch_size"] = 16.0
    (folder / "run_args.json").write_text(json.dumps(record))
    manifest_edit(folder, lambda m: m["files"]["run_args.json"].update(
        size=(folder / "run_args.json").stat().st_size, sha256=sha256(folder / "run_args.json")))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"run_args.json: 'per_device_train_batch_size' holds 16.0"):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))
    resumed = Trainer(regression, TrainingArguments(output_dir=str(out), resume_from_checkpoint="latest",
                                                    disable_tqdm=True, max_steps=12), quiet=True)  # fmt: skip
    assert resumed.global_step == 8
    assert type(resumed.args.per_device_train_batch_size) is int


@pytest.mark.parametrize(
    "field, value",
    [
        ("per_device_train_batch_size", 16.0),
        ("per_device_train_batch_size", True),
        ("max_steps", "12"),
        ("max_grad_norm", float("nan")),
        ("learning_rate", float("inf")),
        ("learning_rate", -1.0),
        ("seed", 2**32),
        ("adam_beta1", 1.0),
        ("lr_scheduler_type", "bogus"),
        ("max_steps", 10**400),  # OverflowError: int too large to convert to float
        ("learning_rate", 10**400),
        ("per_device_train_batch_size", 2**64),
        ("max_steps", -7),  # was taken as -1 (unset): trained by epochs
        ("max_train_samples", 0),
    ],
)
def test_a_keyword_of_the_wrong_type_or_range_is_one_line_naming_it(tmp_path, field, value):
    with pytest.raises(UserError, match=rf"{field}"):
        TrainingArguments(output_dir=str(tmp_path), **{field: value})


@pytest.mark.parametrize("make_it", [os.mkfifo, lambda p: os.symlink("/nonexistent", p), os.mkdir])
def test_a_trainer_state_that_is_no_regular_file_is_named_as_such(trained, tmp_path, make_it):
    """A FIFO (or a dangling link, a folder) as trainer_state.json was "not a checkpoint of ours (missing)"."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    os.remove(folder / "trainer_state.json")
    make_it(folder / "trainer_state.json")
    with pytest.raises(CheckpointError, match=r"trainer_state.json is not a regular file .*; refused"):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))


@pytest.mark.parametrize(
    "file, field",
    [("trainer_state.json", "best_metric"), ("trainer_state.json", "items_per_rank"), ("run_args.json", "seed")],
)
def test_a_number_beyond_64_bits_in_a_checkpoint_is_refused_and_latest_takes_the_one_before(
    trained, tmp_path, file, field
):
    """A 400-digit integer in trainer_state.json raised OverflowError in the checks (math.isfinite): a traceback, and
    `latest` did not fall back to the checkpoint before."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    raw = (folder / file).read_text()
    doc = json.loads(raw)
    (doc["state"]["training"] if file == "run_args.json" else doc)[field] = 0
    crafted = json.dumps(doc).replace(f'"{field}": 0', f'"{field}": 1' + "0" * 400)
    (folder / file).write_text(crafted)
    manifest_edit(folder, lambda m: m["files"][file].update(size=len(crafted), sha256=sha256(folder / file)))
    with pytest.raises(CheckpointError, match=r"beyond the 64 bits"):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))
    resumed = make(out, max_steps=12, resume_from_checkpoint="latest")
    assert resumed.global_step == 8


def test_an_arguments_file_key_that_is_no_name_is_one_line(tmp_path, capsys):
    from accel_trainer.flags import parse_args

    path = tmp_path / "args.yaml"
    path.write_text(f"output_dir: {tmp_path / 'o'}\n1: 2\n")  # a YAML key may be a number: TypeError in the parser
    with pytest.raises(SystemExit) as stopped:
        parse_args(None, [str(path)])
    assert stopped.value.code != 0
    assert "the key '1' is no argument name" in capsys.readouterr().err


# ------------------------------------------------------------------ settings the run's arguments fix, as saved
def _default_optimizer_recipe():
    """regression without its build_optimizer: the Trainer's AdamW, whose settings are the run's arguments."""
    import types

    recipe = types.ModuleType("regression_default_optimizer")
    recipe.__dict__.update({k: v for k, v in vars(regression).items() if k not in ("build_optimizer", "__name__")})
    return recipe


@pytest.fixture(scope="module")
def trained_default(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust_default") / "run"
    Trainer(_default_optimizer_recipe(), TrainingArguments(output_dir=str(out), max_steps=8, save_steps=4,
            learning_rate=1e-2, weight_decay=0.1, per_device_train_batch_size=16, disable_tqdm=True),
            regression.Args(), quiet=True).fit()  # fmt: skip
    return out


@pytest.mark.parametrize(
    "file, change, said",
    [
        ("optimizer.json", lambda s: s["param_groups"][0].update(weight_decay=100.0), "weight_decay is 100.0"),
        ("optimizer.json", lambda s: s["param_groups"][0].update(initial_lr=5.0), "initial_lr is 5.0"),
        ("optimizer.json", lambda s: s["param_groups"][0].update(eps=0.5), "eps is 0.5"),
        ("optimizer.json", lambda s: s["param_groups"][0]["betas"]["@tuple"].__setitem__(1, 0.5), "betas.1 is 0.5"),
        ("scheduler.json", lambda s: s.update(base_lrs=[5.0] * len(s["base_lrs"])), r"base_lrs \[5.0"),
    ],
)
def test_settings_the_runs_arguments_fix_are_refused_when_a_checkpoint_holds_others(
    trained_default, tmp_path, file, change, said
):
    """optimizer.json's weight decay, base learning rate, eps and betas (scheduler.json's base_lrs) were loaded as
    they were: a crafted checkpoint trained on with settings no argument gave, silently. The Trainer's optimizer
    and schedule hold the run's arguments for the whole run: another value is refused, `latest` falls back."""
    out = copy_run(trained_default, tmp_path / "run")
    folder = out / "checkpoints" / "step_8"
    doc = json.loads((folder / file).read_text())
    change(doc["state"])
    (folder / file).write_text(json.dumps(doc))
    manifest_edit(folder, lambda m: m["files"][file].update(
        size=(folder / file).stat().st_size, sha256=sha256(folder / file)))  # fmt: skip
    recipe = _default_optimizer_recipe()
    with pytest.raises(CheckpointError, match=said):
        Trainer(recipe, TrainingArguments(output_dir=str(out), resume_from_checkpoint=str(folder), max_steps=12,
                disable_tqdm=True), quiet=True)  # fmt: skip
    resumed = Trainer(recipe, TrainingArguments(output_dir=str(out), resume_from_checkpoint="latest", max_steps=8,
                      disable_tqdm=True), quiet=True)  # fmt: skip
    assert resumed.global_step == 4


def test_a_learning_rate_changed_with_allow_args_change_is_the_one_trained_with(trained_default, tmp_path):
    """--allow_args_change --learning_rate 0.1 on a resume was accepted and noted, then torch's load put the
    checkpoint's rate back (scheduler base_lrs, each group's initial_lr): the run trained on at 0.01, silently."""
    out = copy_run(trained_default, tmp_path / "run")
    folder = out / "checkpoints" / "step_4"  # mid-schedule: its learning rate is not 0
    saved = json.loads((folder / "optimizer.json").read_text())["state"]["param_groups"]
    assert saved[0]["lr"] > 0
    again = Trainer(_default_optimizer_recipe(), TrainingArguments(output_dir=str(out), resume_from_checkpoint=str(folder),
                    learning_rate=0.1, weight_decay=0.2, max_steps=12, allow_args_change=True, disable_tqdm=True),
                    quiet=True)  # fmt: skip
    schedule = getattr(again.scheduler, "scheduler", again.scheduler)
    assert schedule.base_lrs == [0.1] * len(saved)
    groups = again.optimizer.param_groups
    assert [g["initial_lr"] for g in groups] == [0.1] * len(saved)
    # the schedule's rate at step 4 of this run's 12 (linear, no warm-up), at the new base rate
    assert [g["lr"] for g in groups] == pytest.approx([0.1 * (12 - 4) / 12] * len(saved))
    assert groups[0]["weight_decay"] == 0.2 and saved[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("forged", [5.0, -3.0])
def test_the_current_learning_rate_comes_from_the_schedule_not_the_checkpoint(trained, tmp_path, forged):
    """A crafted 'lr' in optimizer.json (the recipe's own optimizer, the Trainer's schedule) trained the first resumed
    update at that rate (eval_loss 148 against 0.61) while metrics.jsonl logged the schedule's rate."""
    rates = []
    for name, lr in (("plain", None), ("forged", forged)):
        out = copy_run(trained, tmp_path / name)
        folder = out / "checkpoints" / "step_8"
        if lr is not None:
            doc = json.loads((folder / "optimizer.json").read_text())
            doc["state"]["param_groups"][0]["lr"] = lr
            (folder / "optimizer.json").write_text(json.dumps(doc))
            manifest_edit(folder, lambda m: m["files"]["optimizer.json"].update(
                size=(folder / "optimizer.json").stat().st_size, sha256=sha256(folder / "optimizer.json")))  # fmt: skip
        resumed = make(out, max_steps=12, resume_from_checkpoint=str(folder))
        rates.append([g["lr"] for g in resumed.optimizer.param_groups])
    assert rates[0] == rates[1] and 0 < rates[0][0] < 1e-2


@pytest.mark.parametrize("value", [10**400, 2**64 - 1, 1.5])
def test_a_recipe_argument_is_held_to_its_type_as_the_trainers_are(tmp_path, value):
    """A 400-digit (or 2**64 - 1) --data_seed was accepted and failed in torch's manual_seed with a traceback."""
    from accel_trainer.resolve import resolve_args

    with pytest.raises(UserError, match=r"data_seed: .* is not an integer"):
        resolve_args(regression, values={"output_dir": str(tmp_path), "data_seed": value})


def _forge(folder, file, change):
    doc = json.loads((folder / file).read_text())
    change(doc["state"])
    (folder / file).write_text(json.dumps(doc))
    manifest_edit(folder, lambda m: m["files"][file].update(
        size=(folder / file).stat().st_size, sha256=sha256(folder / file)))  # fmt: skip


def test_latest_past_a_refused_checkpoint_names_the_one_resumed_and_keeps_its_arguments(trained, tmp_path, capsys):
    """`latest` skipped step_8 (refused when checked against the run) and resumed step_4, but the start line said
    "resumed from .../step_8"; and the run's arguments, taken from step_8's record, were used for step_4's run."""
    out = copy_run(trained, tmp_path / "run")
    _forge(out / "checkpoints" / "step_12", "scheduler.json", lambda s: s.update(base_lrs=[5.0]))
    args = dict(output_dir=str(out), resume_from_checkpoint="latest", max_steps=12, disable_tqdm=True)
    Trainer(regression, TrainingArguments(**args))
    printed = capsys.readouterr()
    start = [line for line in (printed.out + printed.err).splitlines() if line.startswith("accel-trainer: regression")]
    assert start and start[0].endswith(f"resumed from {out / 'checkpoints' / 'step_8'}"), start
    out = copy_run(trained, tmp_path / "run2")
    _forge(out / "checkpoints" / "step_12", "scheduler.json", lambda s: s.update(base_lrs=[5.0]))
    _forge(out / "checkpoints" / "step_8", "run_args.json", lambda s: s["training"].update(warmup_steps=5))
    with pytest.raises(CheckpointError, match=r"step_8, was written with other arguments"):
        Trainer(regression, TrainingArguments(**{**args, "output_dir": str(out)}), quiet=True)


@pytest.mark.parametrize(
    "value, said", [(8.0, "global_step 8.0, where an integer belongs"), (None, "global_step None")]
)
def test_a_counter_of_another_type_is_named_with_its_value(trained, tmp_path, value, said):
    """ "global_step": 8.0 read "lacks global_step (integers)": the field is there, holding a float."""
    out = copy_run(trained, tmp_path / "run")
    folder = out / "checkpoints" / "step_12"
    doc = json.loads((folder / "trainer_state.json").read_text())
    doc["global_step"] = value
    (folder / "trainer_state.json").write_text(json.dumps(doc))
    manifest_edit(folder, lambda m: m["files"]["trainer_state.json"].update(
        size=(folder / "trainer_state.json").stat().st_size, sha256=sha256(folder / "trainer_state.json")))  # fmt: skip
    with pytest.raises(CheckpointError, match=said):
        make(out, max_steps=16, resume_from_checkpoint=str(folder))
