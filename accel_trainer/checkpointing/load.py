"""Loading a verified checkpoint (verify.py) into the run, on every rank: what state.py wrote, each part checked
against what this run holds before it is set -- tensor names, shapes and dtypes against the model's and the
optimizer's, the scheduler's and scaler's fields against theirs -- so that a checkpoint of another model or a
file of another run is one line naming the file, not an error inside torch, or a resume with other numbers.

A sharded checkpoint (FSDP2: DCP safetensors shards) loads into a run on any number of processes, sharded or not:
DCP matches tensors by name and global offsets (torch's HuggingFaceStorageReader reads the shards' headers: JSON,
no pickle). A full checkpoint (model.safetensors) loads into a run without FSDP on any number of processes.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from .. import optim
from ..errors import why
from . import state as ckpt_state
from .folder import EMA_FILE, CheckpointError
from .tensors import read_header, sharded_tensors
from .verify import check_state, is_sharded_checkpoint, read_state_file

_plain_key = ckpt_state.plain_key


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_tensors(path: str, where: str, found: dict, state: dict, what: str = "this model"):
    """The tensors `found` in a checkpoint ({name: (shape, dtype)}) are those of `state` (a model's state dict;
    DTensors: their global shapes): the same names (tied aliases aside), shapes and dtypes."""
    expected = {_plain_key(k): (tuple(v.shape), _dtype(v)) for k, v in state.items()}
    found = {_plain_key(k): v for k, v in found.items()}
    problems = [_differs(k, found[k], expected[k], what) for k in expected if k in found and found[k] != expected[k]]
    missing = sorted(set(expected) - set(found) - _tied_aliases(state, found))
    extra = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected tensors {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path}: {where} does not fit {what} ({'; '.join(problems[:5])}). "
            "Resume with the model arguments the checkpoint was written with."
        )


def _differs(name: str, found: tuple, expected: tuple, what: str) -> str:
    """How a tensor of the checkpoint differs from this run's: its shape, or its dtype (e.g. int8 weights)."""
    i = 0 if found[0] != expected[0] else 1
    return f"{name}: {found[i]} in the checkpoint, {expected[i]} in {what}"


def _tied_aliases(state: dict, found: dict) -> set[str]:
    """Names the checkpoint may lack because they are tied: the model's tensor under that name shares its storage
    with a tensor the checkpoint holds (GPT-2's lm_head.weight is its input embedding; a checkpoint keeps one name
    of a shared tensor). A name that is not tied in this model stays required, so a checkpoint of an untied model
    still fits only an untied one."""
    from accelerate.utils import id_tensor_storage

    groups: dict = {}
    for k, v in state.items():
        local = v.to_local() if hasattr(v, "to_local") else v  # a DTensor's storage is its local shard's
        if local.numel() == 0:  # empty tensors have no storage to share
            continue
        groups.setdefault((id_tensor_storage(local), local.storage_offset(), tuple(local.shape)), []).append(
            _plain_key(k)
        )
    aliases = set()
    for names in groups.values():
        if len(names) > 1 and any(n in found for n in names):
            aliases.update(n for n in names if n not in found)
    return aliases


def file_tensors(path: str, file: str) -> dict:
    """{name: (shape, dtype)} from a safetensors header (the verifier read the data)."""
    return read_header(path, file, None, scan=False)[0]


def shard_files(path: str, folder: str) -> list[str]:
    full = os.path.join(path, folder)
    return sorted(os.path.join(full, n) for n in os.listdir(full)) if os.path.isdir(full) else []


# ----------------------------------------------------------------------------------------------------- loading
# Two phases, so that every rank agrees before anything is set (resume.py): check() reads and checks every part
# against the run and sets nothing of it -- a refusal there leaves the run as it was, and `latest` can fall back
# to the checkpoint before --; apply() then sets them (DCP's loads are collectives under FSDP).
@dataclass
class Plan:
    path: str
    saved: dict  # the trainer state
    sharded: bool  # a sharded checkpoint
    model: object  # the model as its state dict is loaded (the FSDP model, or the plain one)
    opt: object  # the torch optimizer
    template: dict  # get_optimizer_state_dict of this run's optimizer
    frozen: dict  # the frozen parameters' fingerprints (frozen.json), or {}
    optimizer_shards: dict  # {name: (global shape, dtype)} of the optimizer's sharded tensors
    scheduler: object
    scaler: object
    rng: dict | None  # this rank's RNG states, or None for a rank the writing run did not have
    ema: object
    settings: dict | None  # optim.run_settings, put back after the load (--allow_args_change)


def check(accelerator, path: str, model, optimizer, scheduler, ema=None, args_changed=False) -> Plan:
    """Phase 1, every rank: read and check everything load_checkpoint sets; nothing of the run is set (but the
    optimizer's state, built empty with a zero-lr step where it had none, as torch's get_optimizer_state_dict
    does). CheckpointError naming the file and the field. The settings the run's arguments fix (optim.run_settings)
    must be the checkpoint's, unless `args_changed` (--allow_args_change): then this run's are kept."""
    from accelerate.utils import DistributedType

    sharded_run = accelerator.distributed_type == DistributedType.FSDP
    saved = check_state(path)
    step = saved["global_step"]
    sharded = is_sharded_checkpoint(path)
    if sharded_run and not sharded:
        raise CheckpointError(
            f"Checkpoint {path} was written without FSDP (one full model.safetensors); resuming it sharded is not "
            "supported. Resume it with the launch it was written with (DDP), or start a new FSDP run."
        )
    plain = model if sharded_run else accelerator.unwrap_model(model, keep_torch_compile=False)
    opt = ckpt_state.inner(optimizer)
    # The optimizer's state as this run holds it, the template its checkpoint must fit. First: for an optimizer with
    # no state yet, torch builds it with a zero-lr step, which must not act on weights already loaded.
    template = ckpt_state.state_dict_api("get_optimizer_state_dict", plain, opt)
    frozen = _check_weights(path, plain, sharded)
    settings = optim.run_settings(opt, getattr(scheduler, "scheduler", scheduler))  # Accelerate's wrapper, or not
    fixed = () if args_changed else tuple({k for g in settings["groups"] for k in g})
    optimizer_shards = _check_optimizer(path, template, step, sharded, fixed)
    fixed = ("base_lrs",) if settings["base_lrs"] is not None and not args_changed else ()
    _check_fields(path, ckpt_state.SCHEDULER_FILE, step, scheduler, saved, fixed)
    if accelerator.scaler is not None:
        _check_fields(path, ckpt_state.SCALER_FILE, step, accelerator.scaler, saved)
    rng = None
    if accelerator.process_index < saved["num_processes"]:  # a rank the writing run did not have keeps its seed
        file = os.path.join(path, ckpt_state.RNG_FILE.format(rank=accelerator.process_index))
        rng = read_state_file(path, file, step)
        try:
            ckpt_state.check_rng_states(rng)
        except ValueError as e:
            raise CheckpointError(f"Checkpoint {path}: {file} {e}; resume from another checkpoint.") from None
    if ema is not None and os.path.isfile(os.path.join(path, EMA_FILE)):
        file = os.path.join(path, EMA_FILE)
        check_tensors(path, file, file_tensors(path, file), ema.module.state_dict(), "this model's EMA")
    return Plan(path, saved, sharded, plain, opt, template, frozen, optimizer_shards, scheduler, accelerator.scaler,
                rng, ema, settings if args_changed else None)  # fmt: skip


def apply(plan: Plan, say=None):
    """Phase 2, every rank: set what check() checked."""
    path, step = plan.path, plan.saved["global_step"]
    load_weights(path, plan.model, plan.sharded, plan.frozen)
    load_optimizer(path, plan.model, plan.opt, plan.template, step, plan.optimizer_shards)
    plan.scheduler.load_state_dict(read_state_file(path, os.path.join(path, ckpt_state.SCHEDULER_FILE), step))
    schedule = getattr(plan.scheduler, "scheduler", plan.scheduler)  # Accelerate's wrapper, or not
    if plan.settings is not None:
        optim.keep_run_settings(plan.opt, schedule, plan.settings)
    optim.set_scheduled_lrs(plan.opt, schedule)
    if plan.scaler is not None:
        plan.scaler.load_state_dict(read_state_file(path, os.path.join(path, ckpt_state.SCALER_FILE), step))
    if plan.rng is not None:
        note = ckpt_state.set_rng_states(plan.rng)
        if note and say is not None:
            say(f"note: {note}.")
    if plan.ema is not None and os.path.isfile(os.path.join(path, EMA_FILE)):
        from safetensors.torch import load_model

        load_model(plan.ema.module, os.path.join(path, EMA_FILE), device="cpu")
        # The file holds the averaged weights only. AveragedModel copies the weights instead of averaging while its
        # n_averaged is 0, so a resumed EMA would restart from the current weights: set it to the updates applied
        # (every stepped update averaged once; fp16- and NaN-skipped ones did not).
        plan.ema.n_averaged.fill_(step - plan.saved.get("skipped_steps", 0))


def load_checkpoint(accelerator, path: str, model, optimizer, scheduler, ema=None, say=None) -> dict:
    """check() then apply() on this rank; returns the trainer state. (resume.py runs the two with an agreement of
    every rank between them.)"""
    plan = check(accelerator, path, model, optimizer, scheduler, ema)
    apply(plan, say)
    return plan.saved


def _check_weights(path: str, model, sharded: bool) -> dict:
    """The checkpoint's weights fit `model` (names, shapes, dtypes; a frozen base's fingerprints); returns the
    frozen parameters' fingerprints ({} when the checkpoint holds every weight)."""
    if sharded:
        found = sharded_tensors(path, shard_files(path, ckpt_state.SHARDED_MODEL), scan=False)
        aliases = ckpt_state.tied_aliases(model)
        state = ckpt_state.state_dict_api("get_model_state_dict", model)
        check_tensors(
            path,
            os.path.join(path, ckpt_state.SHARDED_MODEL),
            found,
            {k: v for k, v in state.items() if k not in aliases},
        )
        return {}
    file = os.path.join(path, ckpt_state.MODEL_FILE)
    found, state = file_tensors(path, file), model.state_dict()
    frozen = _check_frozen(path, model)
    found.update({k: (tuple(state[k].shape), _dtype(state[k])) for k in frozen})  # rebuilt by build_model
    check_tensors(path, file, found, state)
    return frozen


def load_weights(path: str, model, sharded: bool, frozen: dict | None = None):
    """The model's weights: model.safetensors (tied weights restored; a frozen base left as build_model built it),
    or the DCP shards into the model as it is in this run (sharded over any number of processes, or whole)."""
    if not sharded:
        from safetensors.torch import load_model

        file = os.path.join(path, ckpt_state.MODEL_FILE)
        missing, _ = load_model(model, file, strict=False, device="cpu")
        if set(missing) - set(frozen or {}):  # checked first: a tie this model does not have
            raise CheckpointError(f"Checkpoint {path}: {file} lacks {sorted(set(missing) - set(frozen or {}))[:3]}.")
        return

    # names without wrapper prefixes, this rank's shards; a tied alias shares its tensor with the name loaded
    state = ckpt_state.state_dict_api("get_model_state_dict", model)
    aliases = ckpt_state.tied_aliases(model)
    to_load = {k: v for k, v in state.items() if torch.is_tensor(v) and k not in aliases}
    _dcp_load(path, os.path.join(path, ckpt_state.SHARDED_MODEL), to_load)
    ckpt_state.state_dict_api("set_model_state_dict", model, state)


def _check_frozen(path: str, model) -> dict:
    """A checkpoint of a model with frozen parameters holds their fingerprints (frozen.json), not them: the model
    build_model built here must have the same ones (the same base weights), or the resumed run is another."""
    file = os.path.join(path, ckpt_state.FROZEN_FILE)
    if not os.path.isfile(file):
        return {}
    saved = read_state_file(path, file, check_state(path)["global_step"])
    live = ckpt_state.fingerprints(model, saved) if isinstance(saved, dict) else {}
    if not isinstance(saved, dict) or live != saved:
        differ = sorted(k for k in saved if live.get(k) != saved[k]) if isinstance(saved, dict) else ["everything"]
        raise CheckpointError(
            f"Checkpoint {path}: the model's frozen parameters ({len(saved)}, e.g. {differ[0]}) differ from those "
            f"{file} records: build_model must build the model the checkpoint was trained on (the same base weights); "
            "the checkpoint holds what trained, not them."
        )
    return saved


def _check_optimizer(path: str, template: dict, step: int, sharded: bool, fixed=()) -> dict:
    """optimizer.json and its tensors against `template` (get_optimizer_state_dict of this run's optimizer): each
    tensor where the template has one, of its (global) shape and dtype; the same parameters in each state and param
    group, each group's settings of the kinds this optimizer has (a flag as it is here; a number finite); step counts
    between 0 and global_step; the group settings named in `fixed` as they are here. Returns the sharded tensors'
    {name: (global shape, dtype)}."""
    from safetensors import safe_open

    file = os.path.join(path, ckpt_state.OPTIMIZER_FILE)
    whole = os.path.join(path, ckpt_state.OPTIMIZER_TENSORS)
    found = file_tensors(path, whole) if os.path.isfile(whole) else {}
    shards = shard_files(path, ckpt_state.SHARDED_OPTIMIZER)
    in_shards = sharded_tensors(path, shards, scan=False) if shards else {}
    # placeholders of each tensor's shape and dtype (no data), and the values of the one-element ones (step counts)
    held = {n: torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for n, (shape, dtype) in
            {**found, **in_shards}.items()}  # fmt: skip
    if found:
        with safe_open(whole, framework="pt") as f:
            held.update({n: f.get_tensor(n) for n, (shape, _) in found.items() if math.prod(shape) == 1})
    used: set = set()
    state = read_state_file(path, file, step, held, used)
    problem = _unlike(state, template, step, "", fixed)
    if problem is None and used != set(held):
        problem = f"tensors it does not use ({sorted(set(held) - used)[:3]})"
    if problem is not None:
        raise CheckpointError(
            f"Checkpoint {path}: {file} does not fit this run's optimizer: {problem}. Resume with the model and "
            "optimizer the checkpoint was written with."
        )
    return in_shards


def _unlike(saved, live, step: int, where: str, fixed=()) -> str | None:
    """Where `saved` (an optimizer state dict as the checkpoint holds it) is not of `live`'s make, or None."""
    here = where or "the state"
    if torch.is_tensor(live):
        if not torch.is_tensor(saved):
            return f"{here} is {type(saved).__name__}, a tensor here"
        if (tuple(saved.shape), saved.dtype) != (tuple(live.shape), live.dtype):
            return f"{here} is {tuple(saved.shape)} {_dtype(saved)}, {tuple(live.shape)} {_dtype(live)} here"
        if where.endswith(".step") and saved.numel() == 1 and not saved.is_meta:
            value = float(saved)
            if not (math.isfinite(value) and 0 <= value <= step):
                return f"{here} is {value}, not a step count of a run at step {step}"
        return None
    if isinstance(live, dict):
        # a parameter that never had a gradient has no state in the checkpoint; here it has one (torch's zero-lr step)
        missing_ok = where == "state"
        if isinstance(saved, dict) and where.startswith("param_groups.") and "initial_lr" not in live:
            # an LR scheduler adds initial_lr to each group; an optimizer loaded before its scheduler is built
            # (load_resharded in a notebook) has none yet: a finite number is taken, as torch's load takes it
            lr = saved.get("initial_lr", 0.0)
            if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr):
                return f"{here}.initial_lr is {str(lr)[:40]}, not a learning rate"
            saved = {k: v for k, v in saved.items() if k != "initial_lr"}
        if not isinstance(saved, dict) or set(saved) - set(live) or (set(live) - set(saved) and not missing_ok):
            keys = sorted(map(str, set(saved) ^ set(live)))[:4] if isinstance(saved, dict) else type(saved).__name__
            return f"{here} holds other entries ({keys})"
        for k in saved:
            problem = _unlike(saved[k], live[k], step, f"{where}.{k}" if where else str(k), fixed)
            if problem:
                return problem
        return None
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            return f"{here} is not {len(live)} entries long"
        if where.endswith(".params"):
            return None if list(saved) == list(live) else f"{here} names other parameters"
        for i, (a, b) in enumerate(zip(saved, live)):
            problem = _unlike(a, b, step, f"{where}.{i}", fixed)
            if problem:
                return problem
        return None
    number = (int, float)
    if isinstance(live, number) and not isinstance(live, bool):
        if not isinstance(saved, number) or isinstance(saved, bool):
            return f"{here} is {str(saved)[:40]}, a number here"
        if math.isfinite(live) and not math.isfinite(saved):
            return f"{here} is {saved}"
        if where.endswith(".step") and not 0 <= saved <= step:
            return f"{here} is {saved}, not a step count of a run at step {step}"
        group_key = re.fullmatch(r"param_groups\.\d+\.([^.]+)(\.\d+)?", where)  # betas: param_groups.0.betas.1
        if group_key and group_key.group(1) in fixed and saved != live:
            return f"{here} is {saved}, {live} as this run's arguments set it"
        return None
    if type(saved) is not type(live) and saved is not None and live is not None:
        return f"{here} is {str(saved)[:40]}, {str(live)[:40]} here"
    # A flag or a name of a param group (nesterov, foreach, ...): one of another value is an optimizer of another
    # make. Deeper, in a value a recipe's optimizer keeps there (a lookahead's `started`), it is state.
    if re.fullmatch(r"param_groups\.\d+\.[^.]+", where) and saved != live:
        return f"{here} is {str(saved)[:40]}, {str(live)[:40]} here"
    return None


def load_optimizer(path: str, model, opt, template: dict, step: int, in_shards: dict):
    """Phase 2 of the optimizer: its tensors (whole ones from optimizer.safetensors, sharded ones by DCP into the
    template's), then set_optimizer_state_dict."""
    from safetensors.torch import load_file

    from . import codec

    whole = os.path.join(path, ckpt_state.OPTIMIZER_TENSORS)
    tensors = load_file(whole) if os.path.isfile(whole) else {}
    live: dict = {}
    codec.encode(template, live)
    for name, t in tensors.items():  # in the layout of this run's (its parameter's): a file's tensors are contiguous,
        held = live.get(name)  # and a fused optimizer reads a channels_last weight's moments as flat memory
        if torch.is_tensor(held) and not ckpt_state.is_dtensor(held) and held.shape == t.shape:
            if held.stride() != t.stride():
                tensors[name] = torch.empty_like(held, dtype=t.dtype, device=t.device).copy_(t)
    if in_shards:
        to_load = {n: live[n] for n in in_shards}
        _dcp_load(path, os.path.join(path, ckpt_state.SHARDED_OPTIMIZER), to_load)
        tensors.update(to_load)
    file = os.path.join(path, ckpt_state.OPTIMIZER_FILE)
    state = read_state_file(path, file, step, tensors)
    try:
        ckpt_state.state_dict_api("set_optimizer_state_dict", model, opt, state)
    except Exception as e:  # noqa: BLE001 - the optimizer refused the state: the checkpoint's, named
        raise CheckpointError(f"Checkpoint {path}: the optimizer cannot load {file} ({why(e)}).") from None


def _dcp_load(path: str, folder: str, state: dict):
    """DCP's load of the shards in `folder` into `state`'s tensors, through torch's safetensors reader."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(folder), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is a BaseException: named, not a traceback
        raise CheckpointError(f"Checkpoint {path}: {folder} cannot be loaded ({why(e)}).") from None


def _check_fields(path: str, name: str, step: int, target, saved_state: dict, fixed=()):
    """A scheduler's or GradScaler's state: the fields the object has, of their kinds, numbers finite where the
    object's are (load_state_dict would take any dict into the object's __dict__); a schedule's count of steps
    not past the run's updates; the fields named in `fixed` as they are here."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"Checkpoint {path}: {file} is missing; this run has a {type(target).__name__} to restore."
        )
    saved, live = read_state_file(path, file, step), target.state_dict()
    wrong = sorted(map(str, set(saved) ^ set(live))) if isinstance(saved, dict) else ["everything"]
    wrong += [k for k in set(saved) & set(live) if not same_kind(saved[k], live[k])] if not wrong else []
    steps = saved.get("last_epoch") if isinstance(saved, dict) and not wrong else None
    if type(steps) is int and not -1 <= steps <= step + 1:  # once per update that stepped, at most
        wrong.append(f"last_epoch {steps} (the run is at step {step})")
    wrong += [f"{k} {saved[k]} ({live[k]} here)" for k in fixed if not wrong and saved[k] != live[k]]
    if wrong:
        raise CheckpointError(
            f"Checkpoint {path}: {file} does not hold the state of this run's {type(target).__name__} "
            f"({', '.join(map(str, wrong[:5]))}): a state of another kind or run. Resume with the scheduler the "
            "checkpoint was written with, or from another checkpoint."
        )


def same_kind(a, b) -> bool:
    """`a` (a checkpoint's) is a value of `b`'s kind: a number (finite where b is), a flag, a list as long, ..."""
    number = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b)
    if isinstance(a, number) and isinstance(b, number):
        return math.isfinite(a) or not math.isfinite(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_kind(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_kind(a[k], b[k]) for k in a)
    return a is None or b is None or type(a) is type(b)


def load_resharded(path: str, model, optimizer=None) -> dict:
    """A checkpoint's weights (and optimizer state) into `model` as it is here -- FSDP-sharded over any number of
    processes, DDP-wrapped or plain on one process -- from a sharded or a full checkpoint (e.g. a 2-process FSDP
    checkpoint into a notebook's model). Every rank calls it (with several processes it is collective). Weights
    and optimizer state come back bit for bit. Returns the checkpoint's trainer state."""

    saved = check_state(path)
    sharded = is_sharded_checkpoint(path)
    opt = ckpt_state.inner(optimizer) if optimizer is not None else None
    template = ckpt_state.state_dict_api("get_optimizer_state_dict", model, opt) if opt is not None else None
    frozen = _check_weights(path, model, sharded)
    shards = _check_optimizer(path, template, saved["global_step"], sharded) if opt is not None else None
    load_weights(path, model, sharded, frozen)
    if opt is not None:
        load_optimizer(path, model, opt, template, saved["global_step"], shards)
    return saved


def check_model(path: str, model):
    """The checkpoint's weights are this model's tensors (names, shapes, dtypes), sharded checkpoint or not."""
    if is_sharded_checkpoint(path):
        found = sharded_tensors(path, shard_files(path, ckpt_state.SHARDED_MODEL), scan=False)
        where = os.path.join(path, ckpt_state.SHARDED_MODEL)
    else:
        where = os.path.join(path, ckpt_state.MODEL_FILE)
        found = file_tensors(path, where)
    check_tensors(path, where, found, model.state_dict())
