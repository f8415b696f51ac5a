"""Loading a verified checkpoint (verify.py) into the run, on every rank: what state.py wrote, each part checked
against what this run holds before it is set -- tensor names, shapes and dtypes against the model's and the
optimizer's, the scheduler's and scaler's fields against theirs -- so that a checkpoint of another model or a
file of another run is one line naming the file, not an error inside torch, or a resume with other numbers.

A sharded checkpoint (FSDP2: DCP safetensors shards) loads into a run on any number of processes, sharded or not:
DCP matches tensors by name and global offsets (torch's HuggingFaceStorageReader reads the shards' headers: JSON,
no pickle). A full checkpoint (model.safetensors) loads into a run without FSDP on any number of processes.
"""

from __future__ import annotations

import os

import torch

from . import state as ckpt_state
from .folder import EMA_FILE, CheckpointError
from .verify import check_state, is_sharded_checkpoint, read_header, read_state_file, sharded_tensors, why


def _plain_key(name: str) -> str:
    """A tensor name without the wrappers' prefixes (DDP `module.`, torch.compile `_orig_mod.`)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


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
def load_checkpoint(accelerator, path: str, model, optimizer, scheduler, ema=None, say=None) -> dict:
    """Restore everything state.py wrote into this run (every rank); returns the trainer state. `model`: the model
    being trained (wrapped or not)."""
    from accelerate.utils import DistributedType
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

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
    template = get_optimizer_state_dict(plain, opt)
    load_weights(path, plain, sharded)
    load_optimizer(path, plain, opt, template, step, sharded)
    _load_fields(path, ckpt_state.SCHEDULER_FILE, step, scheduler)
    if accelerator.scaler is not None:
        _load_fields(path, ckpt_state.SCALER_FILE, step, accelerator.scaler)
    rank = accelerator.process_index
    if rank < saved["num_processes"]:  # a rank the writing run did not have keeps its seeded generators
        file = os.path.join(path, ckpt_state.RNG_FILE.format(rank=rank))
        try:
            note = ckpt_state.set_rng_states(read_state_file(path, file, step))
        except ValueError as e:
            raise CheckpointError(f"Checkpoint {path}: {file} {e}; resume from another checkpoint.") from None
        if note and say is not None:
            say(f"note: {note}.")
    if ema is not None and os.path.isfile(os.path.join(path, EMA_FILE)):
        from safetensors.torch import load_model

        file = os.path.join(path, EMA_FILE)
        check_tensors(path, file, file_tensors(path, file), ema.module.state_dict(), "this model's EMA")
        load_model(ema.module, file, device="cpu")
        # The file holds the averaged weights only. AveragedModel copies the weights instead of averaging while its
        # n_averaged is 0, so a resumed EMA would restart from the current weights: set it to the updates applied
        # (every stepped update averaged once; fp16- and NaN-skipped ones did not).
        ema.n_averaged.fill_(step - saved.get("skipped_steps", 0))
    return saved


def load_weights(path: str, model, sharded: bool):
    """The model's weights: model.safetensors (tied weights restored), or the DCP shards into the model as it is
    in this run (sharded over any number of processes, or whole)."""
    if not sharded:
        from safetensors.torch import load_model

        file = os.path.join(path, ckpt_state.MODEL_FILE)
        found, state = file_tensors(path, file), model.state_dict()
        frozen = _check_frozen(path, model)
        found.update({k: (tuple(state[k].shape), _dtype(state[k])) for k in frozen})  # rebuilt by build_model
        check_tensors(path, file, found, state)
        missing, _ = load_model(model, file, strict=False, device="cpu")
        if set(missing) - set(frozen):  # check_tensors compared every name first: a tie this model does not have
            raise CheckpointError(f"Checkpoint {path}: {file} lacks {sorted(set(missing) - set(frozen))[:3]}.")
        return
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    where = os.path.join(path, ckpt_state.SHARDED_MODEL)
    state = get_model_state_dict(model)  # names without wrapper prefixes, this rank's shards
    check_tensors(path, where, sharded_tensors(path, shard_files(path, ckpt_state.SHARDED_MODEL), scan=False), state)
    _dcp_load(path, where, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    set_model_state_dict(model, state)


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


def load_optimizer(path: str, model, opt, template: dict, step: int, sharded: bool):
    """optimizer.json and its tensors, checked against `template` (get_optimizer_state_dict of this run's
    optimizer): every tensor of the checkpoint is one of the template's, with its (global) shape and dtype, and
    the param groups name the same parameters; then set_optimizer_state_dict."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from . import codec

    file = os.path.join(path, ckpt_state.OPTIMIZER_FILE)
    live: dict = {}
    codec.encode(template, live)
    whole = os.path.join(path, ckpt_state.OPTIMIZER_TENSORS)
    found = file_tensors(path, whole) if os.path.isfile(whole) else {}
    shards = shard_files(path, ckpt_state.SHARDED_OPTIMIZER)
    in_shards = sharded_tensors(path, shards, scan=False) if shards else {}
    for name, (shape, dtype) in {**found, **in_shards}.items():
        mine = live.get(name)
        if mine is None or (tuple(mine.shape), _dtype(mine)) != (shape, dtype):
            have = "none" if mine is None else f"{tuple(mine.shape)} {_dtype(mine)}"
            raise CheckpointError(
                f"Checkpoint {path}: the optimizer state {name} ({shape} {dtype} in {ckpt_state.OPTIMIZER_FILE}'s "
                f"tensors) does not fit this run's optimizer ({have}): a state of another model or optimizer. "
                "Resume with the model and optimizer the checkpoint was written with."
            )
    tensors = load_file(whole) if found else {}
    if in_shards:
        to_load = {n: live[n] for n in in_shards}
        _dcp_load(path, os.path.join(path, ckpt_state.SHARDED_OPTIMIZER), to_load)
        tensors.update(to_load)
    used: set = set()
    state = read_state_file(path, file, step, tensors, used)
    groups = lambda s: [g.get("params") for g in s.get("param_groups", [])] if isinstance(s, dict) else None  # noqa: E731
    if used != set(tensors) or not isinstance(state, dict) or groups(state) != groups(template):
        raise CheckpointError(
            f"Checkpoint {path}: {file} does not fit this run's optimizer (its param groups name other parameters, "
            "or its tensors do not belong to it). Resume with the model and optimizer the checkpoint was written with."
        )
    try:
        set_optimizer_state_dict(model, opt, state)
    except Exception as e:  # noqa: BLE001 - the optimizer refused the state: the checkpoint's, named
        raise CheckpointError(f"Checkpoint {path}: the optimizer cannot load {file} ({why(e)}).") from None


def _dcp_load(path: str, folder: str, state: dict):
    """DCP's load of the shards in `folder` into `state`'s tensors, through torch's safetensors reader."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(folder), no_dist=not dist.is_initialized())
    except Exception as e:  # noqa: BLE001 - verified shards that DCP still refuses: named, not a traceback
        raise CheckpointError(f"Checkpoint {path}: {folder} cannot be loaded ({why(e)}).") from None


def _load_fields(path: str, name: str, step: int, target):
    """A scheduler's or GradScaler's state: the fields the object has, of their kinds (load_state_dict would take
    any dict into the object's __dict__), then loaded."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"Checkpoint {path}: {file} is missing; this run has a {type(target).__name__} to restore."
        )
    saved, live = read_state_file(path, file, step), target.state_dict()
    wrong = sorted(set(saved) ^ set(live)) if isinstance(saved, dict) else ["everything"]
    wrong += [k for k in set(saved) & set(live) if not _same_kind(saved[k], live[k])] if not wrong else []
    if wrong:
        raise CheckpointError(
            f"Checkpoint {path}: {file} does not hold the fields of this run's {type(target).__name__} "
            f"({', '.join(map(str, wrong[:5]))}): a state of another kind. Resume with the scheduler the checkpoint "
            "was written with."
        )
    try:
        target.load_state_dict(saved)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"Checkpoint {path}: {file} cannot be loaded ({why(e)}).") from None


def _same_kind(a, b) -> bool:
    number = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b)
    if isinstance(a, number) and isinstance(b, number):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_kind(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same_kind(a[k], b[k]) for k in a)
    return a is None or b is None or type(a) is type(b)


def load_resharded(path: str, model, optimizer=None) -> dict:
    """A checkpoint's weights (and optimizer state) into `model` as it is here -- FSDP-sharded over any number of
    processes, DDP-wrapped or plain on one process -- from a sharded or a full checkpoint (e.g. a 2-process FSDP
    checkpoint into a notebook's model). Every rank calls it (with several processes it is collective). Weights
    and optimizer state come back bit for bit. Returns the checkpoint's trainer state."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    saved = check_state(path)
    sharded = is_sharded_checkpoint(path)
    template = get_optimizer_state_dict(model, ckpt_state.inner(optimizer)) if optimizer is not None else None
    load_weights(path, model, sharded)
    if optimizer is not None:
        load_optimizer(path, model, ckpt_state.inner(optimizer), template, saved["global_step"], sharded)
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
