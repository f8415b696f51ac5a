"""A resumed run continues the run it resumes: the arguments come from that run's own record.

Every checkpoint holds `run_args.json`: the run's resolved training arguments (but those about one invocation:
where to write, what to resume, how to report) and the recipe's. Resolving a resumed run's arguments
(resolve.resolve_args) reads the record of the checkpoint it will resume:

    our defaults  <  the recipe's defaults  <  its configure  <  the resumed run's record  <  what the user gave

- An argument the user left out takes the record's value: `--resume_from_checkpoint latest` alone continues the run
  with its learning rate, schedule, precision, seed, run length and recipe arguments (before, the learning rate
  came back from the checkpoint's optimizer and the schedule from the new defaults, and run_config.json recorded a
  learning rate that never trained).
- One the user gave again with another value that changes the numbers (NUMBERS) is refused in one line naming each
  difference, unless --allow_args_change: the run is then another one from that update on. Another run length is
  a note (the schedule is computed for it); the global batch has its own check (resume.resumed_position, which lets
  the per-device batch change with the world); a recipe argument given with another value is a note (a data path
  moved to another machine is the same data).
"""

from __future__ import annotations

import os
import re

from .. import faults, safe_read
from ..errors import ArgumentError
from ..field_types import value_problem
from . import codec
from .counters import record_contradiction
from .folder import STATE_FILE, list_checkpoints
from .state import RECORD_FILE

# Arguments about this invocation, never taken from the record.
INVOCATION = frozenset({
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "push_to_hub", "hub_model_id",
    "allow_global_batch_change", "allow_args_change", "report_to", "run_name", "disable_tqdm", "log_level_replica",
    "ddp_timeout", "peak_tflops", "profile_steps", "dataloader_num_workers", "use_cpu", "save_async",
})  # fmt: skip
# Arguments whose change makes the resumed run other numbers than the run it continues.
NUMBERS = frozenset({
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "lr_scheduler_type", "warmup_ratio", "warmup_steps", "seed", "mixed_precision", "ema_decay", "nan_policy",
    "lr_scaling", "lr_base_batch_size", "max_train_samples", "dataloader_drop_last", "ddp_comm_hook",
    "powersgd_rank", "fsdp_reduce_dtype", "sync_batchnorm",
})  # fmt: skip
RUN_LENGTH = frozenset({"max_steps", "num_train_epochs"})


def of(targs, rargs, world_size: int) -> dict:
    """The record a checkpoint of this run holds (with the world it ran on: the per-device batch is of it)."""
    from dataclasses import asdict, is_dataclass

    training = {k: v for k, v in targs.to_dict().items() if k not in INVOCATION}
    recipe = asdict(rargs) if is_dataclass(rargs) else {}
    return {"training": training, "recipe": recipe, "world_size": world_size}


def read(path: str) -> dict | None:
    """The record in checkpoint `path`, or None when it has none that reads (verify.py names what is wrong)."""
    try:
        doc = safe_read.read_json(os.path.join(path, RECORD_FILE))
        state = codec.decode(doc["state"])
    except (OSError, ValueError, TypeError, KeyError, RecursionError, codec.DecodeError):
        return None
    ok = isinstance(state, dict) and all(isinstance(state.get(k), dict) for k in ("training", "recipe"))
    if not ok or problem(state) is not None:
        return None
    try:  # a record that contradicts its checkpoint's trainer state is not the run's (counters.py refuses it)
        trainer_state = safe_read.read_json(os.path.join(path, STATE_FILE), 1 << 20)
    except (OSError, ValueError):
        return state  # verify.py names what is wrong with it
    return None if record_contradiction(trainer_state, state) else state


def problem(record: dict) -> str | None:
    """What makes a record's training arguments no values a run could have had (a number of the wrong type, out of
    its range: 16.0 as a batch size, "0.01" as a learning rate), or None. A checkpoint whose record has one is
    refused (verify.py) and never read for arguments (a `latest` that skipped it took its values all the same)."""
    from ..args import BOUNDS, TrainingArguments

    for name, value in record["training"].items():
        if name not in INVOCATION and (wrong := value_problem(TrainingArguments, name, value, BOUNDS)):
            return f"'{name}' holds {wrong}"
    return None


def find(spec: str | None, output_dir: str) -> tuple[str, dict] | None:
    """(checkpoint, its record) that a resume with `spec` will take, as far as can be told before it is verified:
    a folder, or for latest/auto the newest checkpoint of output_dir with a record (verification may still fall
    back to an older one: the Trainer then checks its record is the same)."""
    if faults.restart_count() > 0:  # an elastic restart continues its own run (resume.effective_resume_spec)
        spec = "auto" if spec in (None, "latest", "auto") else f"auto:{spec}"
    if not spec:
        return None
    if spec in ("latest", "auto") or spec.startswith("auto:"):
        for path in reversed(list_checkpoints(output_dir)):
            if (record := read(path)) is not None:
                return path, record
        return find(spec[5:], output_dir) if spec.startswith("auto:") else None
    record = read(spec) if os.path.isdir(spec) else None
    return (spec, record) if record is not None else None


def apply(targs, rargs, given: frozenset, found: tuple[str, dict], world_size: int | None = None) -> list[str]:
    """Take the record's values for what the user left out; refuse a given value that changes the numbers
    (unless --allow_args_change). Returns note lines for what the user changed that is allowed. On another number
    of processes than the run had (`world_size`), a per-device train batch left out keeps the run's global batch
    (the record's is that of the run's world)."""
    path, record = found
    where = os.path.join(path, RECORD_FILE)
    refused, notes = [], []
    per_device = "per_device_train_batch_size"
    written_by = record.get("world_size")
    moved = type(written_by) is int and world_size is not None and written_by != world_size and per_device not in given
    for name, value in record["training"].items():
        if name in INVOCATION or not hasattr(targs, name) or (moved and name == per_device):
            continue
        mine = getattr(targs, name)
        if name not in given:
            setattr(targs, name, value)
        elif not _same(name, mine, value):
            if name in NUMBERS and not targs.allow_args_change:
                refused.append(f"--{name} {_shown(mine)} (the run: {_shown(value)})")
            elif name in NUMBERS or name in RUN_LENGTH:
                notes.append(f"--{name} {_shown(mine)} (the run: {_shown(value)})")
    for name, value in record["recipe"].items():
        if rargs is None or not hasattr(rargs, name):
            continue
        if wrong := value_problem(type(rargs), name, value):
            raise ArgumentError(
                f"{where}: the recipe argument '{name}' holds {wrong}: not a value the run could have had (an edited "
                f"or damaged record). Resume from another checkpoint."
            )
        if name not in given:
            setattr(rargs, name, value)
        elif getattr(rargs, name) != value:
            notes.append(f"--{name} {_shown(getattr(rargs, name))} (the run: {_shown(value)})")
    if moved and isinstance(record["training"].get(per_device), int):
        accumulation = targs.gradient_accumulation_steps
        batch = record["training"][per_device] * written_by * record["training"].get("gradient_accumulation_steps", 1)
        if batch % (world_size * accumulation) == 0:  # else the global batch check names what to pass (resume.py)
            targs.per_device_train_batch_size = batch // (world_size * accumulation)
            notes.append(f"--{per_device} {targs.per_device_train_batch_size} on {world_size} process(es) (the run: "
                         f"{record['training'][per_device]} on {written_by}: the same global batch)")  # fmt: skip
    if refused:
        raise ArgumentError(
            f"{'; '.join(refused)}: a resumed run continues the run it resumes, whose arguments are in {where}. Drop "
            f"{'this flag' if len(refused) == 1 else 'these flags'} to continue it as it was, or pass "
            "--allow_args_change to go on with the new values (the run then differs from an uninterrupted one)."
        )
    if notes:
        notes = [f"note: resuming {path} with {', '.join(notes)}; every other argument as the run had it."]
    return notes


def _same(name: str, a, b) -> bool:
    if name == "mixed_precision":  # None and "no" both mean full precision
        return (a or "no") == (b or "no")
    if isinstance(a, tuple) or isinstance(b, tuple):
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else False
    return a == b and type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


def _shown(value) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return re.sub(r"\s+", " ", text)[:80]
