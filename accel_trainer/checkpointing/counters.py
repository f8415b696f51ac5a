"""The counters a checkpoint stores, each derived from how far the run is: a checkpoint whose files disagree (a value
edited under a re-hashed manifest, a file of another checkpoint given this one's step) is refused before anything is
loaded (verify.py calls check_counters; a refusal is one line naming the file and the field, and `latest` falls back
to the checkpoint before). What the loop does, and so what each file must say, from trainer_state.json's
g = global_step (updates run, skipped ones included), k = skipped_steps and d = debug_steps (progress.py):

- the applied updates are g - k: an update skipped by fp16 loss scaling or --nan_policy skip steps neither the
  optimizer nor the scheduler (update.py);
- scheduler.json: the loop steps the scheduler once per applied update, and torch's LRScheduler is at last_epoch 0
  once built (its initial step), so last_epoch is g - k; a notebook's overfit_batch holds the schedule, so after d
  debugging updates it is between g - k - d and g - k. _step_count, where the scheduler counts (LambdaLR), is
  last_epoch + 1; 0 where its own step() does not (CosineAnnealingWarmRestarts);
- optimizer: a parameter's `step` counts the applied updates in which it had a gradient (torch skips a parameter
  without one; a frozen one has no state; a step skipped on the device is taken back), so none is above g - k, and
  the largest is g - k: some parameter (an output layer, an embedding) has a gradient in every update. One more
  is allowed when updates were skipped: a checkpoint written before any update applied builds the state with
  torch's zero-lr step (get_optimizer_state_dict), which counts one;
- the data position: batch_in_epoch is a window boundary (a multiple of gradient_accumulation_steps); every
  update but a notebook's moves it by one window, and an epoch ends after at least one, so in epoch 0 it is
  (g - d) windows, and after it g - d is at least the epochs plus its windows. Not exact past epoch 0: the loader's
  length is not in the checkpoint, and it may change on a resume (another world with dataloader_drop_last, other
  data). Not derived at all after a resume went on with another global batch (--allow_global_batch_change moves
  the position to the samples seen: global_batch_changed_at);
- micro_batch_size: set only by --auto_micro_batch halving the loader's batch (micro_batch.py), so only with the
  flag in the run's arguments and below the per-device batch;
- run_args.json: the batch, accumulation and world of the run that wrote trainer_state.json.
"""

from __future__ import annotations

import os

from . import state as ckpt_state
from .folder import STATE_FILE, CheckpointError


def _int(value) -> bool:
    return type(value) is int


def check_counters(path: str, state: dict, decoded: dict):
    """`state`: trainer_state.json (check_state checked its integers); `decoded`: {file name: its decoded state}
    for the JSON state files, the optimizer's tensor references left as their names."""
    step, skipped = state["global_step"], state.get("skipped_steps", 0)
    debug = state.get("debug_steps") or 0
    applied = step - skipped
    said = f"global_step {step}, skipped_steps {skipped}" + (f", debug_steps {debug}" if debug else "")
    _check_scheduler(path, decoded.get(ckpt_state.SCHEDULER_FILE), applied, debug, said)
    _check_optimizer(path, decoded.get(ckpt_state.OPTIMIZER_FILE), applied, skipped, said)
    _check_position(path, state, step - debug, said)
    _check_record(path, state, decoded.get(ckpt_state.RECORD_FILE))


def _refuse(path: str, file: str, what: str, said: str, other: str = STATE_FILE):
    raise CheckpointError(
        f"Checkpoint {path}: {os.path.join(path, file)} holds {what}, which {said} ({os.path.join(path, other)}) "
        "cannot have: its files do not belong together (an edited file, or one of another checkpoint). Resume from "
        "another checkpoint."
    )


def _check_scheduler(path: str, sched, applied: int, debug: int, said: str):
    if not isinstance(sched, dict) or not _int(last := sched.get("last_epoch")):
        return  # a recipe's scheduler without torch's counter (ChainedScheduler): nothing to derive
    if not applied - debug <= last <= applied:
        expected = applied if not debug else f"{applied - debug} to {applied}"
        _refuse(
            path,
            ckpt_state.SCHEDULER_FILE,
            f"last_epoch {last} ({expected} scheduler steps expected)",
            f"the run at {said}",
        )
    count = sched.get("_step_count")
    if _int(count) and count not in (0, last + 1):
        _refuse(path, ckpt_state.SCHEDULER_FILE, f"_step_count {count} ({last + 1} expected)", f"the run at {said}")


def _optimizer_steps(path: str, optim) -> dict:
    """{parameter: its `step`} of the per-parameter states whose count can be read: a number in optimizer.json, or
    a one-element tensor of optimizer.safetensors (a sharded run's are in its shards: not read here)."""
    states = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(states, dict):
        return {}
    found = {name: s["step"] for name, s in states.items() if isinstance(s, dict) and "step" in s}
    refs = {name: v for name, v in found.items() if isinstance(v, str)}
    steps = {n: float(v) for n, v in found.items() if type(v) in (int, float) or hasattr(v, "numel") and v.numel() == 1}
    whole = os.path.join(path, ckpt_state.OPTIMIZER_TENSORS)
    if refs and os.path.isfile(whole):
        from safetensors import safe_open

        with safe_open(whole, framework="pt") as f:
            held = set(f.keys())
            for name, ref in refs.items():
                if ref in held and f.get_slice(ref).get_shape() in ([], [1]):
                    steps[name] = float(f.get_tensor(ref).reshape(()))
    return steps


def _check_optimizer(path: str, optim, applied: int, skipped: int, said: str):
    steps = _optimizer_steps(path, optim)
    if not steps:
        return
    top = applied + (skipped > 0)  # the zero-lr step's one (the module's docstring)
    name = next((n for n, v in steps.items() if not 0 <= v <= top), None) or max(steps, key=steps.get)
    if not 0 <= steps[name] <= top or steps[name] < applied:
        kind = "at most" if steps[name] > applied else "the largest of any parameter"
        where = (
            ckpt_state.OPTIMIZER_TENSORS if isinstance(optim["state"][name]["step"], str) else ckpt_state.OPTIMIZER_FILE
        )
        _refuse(
            path, where, f"state.{name}.step {steps[name]:g} ({applied} optimizer steps, {kind})", f"the run at {said}"
        )


def _check_position(path: str, state: dict, moved: int, said: str):
    """`moved`: the updates that moved the data position (all but a notebook's)."""
    if state.get("global_batch_changed_at") is not None:
        return
    epoch, batch, accumulation = state["epoch"], state["batch_in_epoch"], state["gradient_accumulation_steps"]
    windows, rest = divmod(batch, accumulation)
    wrong = None
    if rest:
        wrong = f"batch_in_epoch {batch}, not a multiple of gradient_accumulation_steps {accumulation}"
    elif epoch == 0 and windows != moved:
        wrong = f"batch_in_epoch {batch} in epoch 0 ({moved * accumulation} expected)"
    elif epoch and moved < epoch + windows:
        wrong = f"epoch {epoch}, batch_in_epoch {batch} (each epoch takes an update at least)"
    if wrong:
        _refuse(path, STATE_FILE, wrong, f"the run at {said}")


def record_contradiction(state: dict, record) -> tuple[str, str, str, str] | None:
    """Where run_args.json (`record`) and trainer_state.json (`state`) disagree: (the file, what it holds, what the
    other says, the other file), or None. record.read takes no arguments from a record that contradicts its state."""
    training = record.get("training") if isinstance(record, dict) else None
    if not isinstance(training, dict) or not isinstance(state, dict):
        return None
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_processes")
    said = ", ".join(f"{k} {state.get(k)}" for k in keys)
    for key, theirs in zip(keys, [training.get(k) for k in keys[:2]] + [record.get("world_size")]):
        if theirs is not None and theirs != state.get(key):
            what = f"{'world_size' if key == 'num_processes' else key} {theirs}"
            return ckpt_state.RECORD_FILE, what, f"the run at {said}", STATE_FILE
    size, per_device = state.get("micro_batch_size"), state.get("per_device_train_batch_size")
    if size is not None and (
        training.get("auto_micro_batch") is not True or not (_int(size) and _int(per_device)) or size >= per_device
    ):
        what = f"micro_batch_size {size} (only --auto_micro_batch sets one, halving the per-device batch {per_device})"
        return (
            STATE_FILE,
            what,
            f"a run with auto_micro_batch {training.get('auto_micro_batch')!r}",
            ckpt_state.RECORD_FILE,
        )
    return None


def _check_record(path: str, state: dict, record):
    if found := record_contradiction(state, record):
        _refuse(path, *found)
