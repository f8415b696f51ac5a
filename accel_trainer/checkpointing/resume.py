"""Resume policy: which checkpoint a run continues from (a folder, `latest`, `auto`, skipping a bad newest one
with the reason), whether it fits this run (the model's tensor names and shapes, the global batch, a stream's
world size), where this rank is in the epoch for any world size (resumed_position), and loading it, resharding
a sharded (FSDP/DCP) checkpoint to any number of processes (load_resharded).
"""

from __future__ import annotations

import os
import sys

from safetensors import safe_open
from safetensors.torch import load_model

from .. import privates
from ..faults import restart_count
from .folder import (
    EMA_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoints_root,
    list_checkpoints,
    read_state,
    remove_stale_tmp,
    restore_set_aside,
    set_aside_newer,
)
from .verify import DCP_META, check_dcp_storage, is_sharded_checkpoint, read_dcp_metadata, verify_checkpoint, why


def _plain_key(name: str) -> str:
    """A tensor name without the wrappers' prefixes (DDP `module.`, torch.compile `_orig_mod.`)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


def check_compatible(path: str, model):
    """The checkpoint was written for a model with these tensor names and shapes. (Another world size is the
    Trainer's to judge: it re-computes the position in the data from the samples seen.)"""
    file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(file):
        return  # e.g. a sharded (FSDP) state: accelerate checks it while loading
    with safe_open(file, framework="pt") as f:
        found = {_plain_key(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    _check_shapes(path, file, found, model)


def _check_shapes(path: str, where: str, found: dict, model):
    """The tensor names and shapes `found` in a checkpoint are this model's (DTensors: their global shapes)."""
    state = model.state_dict()
    expected = {_plain_key(k): tuple(v.shape) for k, v in state.items()}
    problems = [
        f"{k}: {found[k]} in the checkpoint, {expected[k]} in this model"
        for k in expected
        if k in found and found[k] != expected[k]
    ]
    missing, extra = (
        sorted(set(expected) - set(found) - _tied_aliases(state, found)),
        sorted(set(found) - set(expected)),
    )
    if missing:
        problems.append(f"missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected tensors {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path}: {where} does not fit this model ({'; '.join(problems[:5])}). "
            "Resume with the model arguments the checkpoint was written with."
        )


def _tied_aliases(state: dict, found: dict) -> set[str]:
    """Names the checkpoint may lack because they are tied: the model's tensor under that name shares its storage
    with a tensor the checkpoint holds (GPT-2's lm_head.weight is its input embedding; Accelerate's save keeps
    one name of a shared tensor, clean_state_dict_for_safetensors). A name that is not tied in this model stays
    required, so a checkpoint of an untied model still fits only an untied one."""
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


# ------------------------------------------------------------------------------------------------------ resolving
def _say(msg: str):
    print(msg, file=sys.stderr, flush=True)


def resolve_resume_path(spec: str, output_dir: str, log=_say) -> str | None:
    """The verified folder `--resume_from_checkpoint` names: a folder, 'latest' (the newest good checkpoint in
    output_dir; an error if there is none) or 'auto' (the same, but None when there is no checkpoint at all).
    A bad newest checkpoint is skipped with a message naming the problem; the previous good one is used."""
    if spec.startswith("auto:"):  # an elastic restart of a run started from another folder: newest here first
        return resolve_resume_path("auto", output_dir, log) or resolve_resume_path(spec[5:], output_dir, log)
    if spec in ("latest", "auto"):
        for path in restore_set_aside(output_dir):
            log(f"Restored {path}: killed while the same step was being written again.")
        found = list_checkpoints(output_dir)
        if not found:
            if spec == "auto":
                return None
            ran = any(os.path.exists(os.path.join(output_dir, f)) for f in (MODEL_FILE, "run_config.json"))
            raise CheckpointError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_root(output_dir)}. "
                + (
                    previous_run_advice(output_dir)
                    if ran
                    else "Drop the flag to start a new run, or pass the folder of a checkpoint."
                )
            )
        errors = []
        for path in reversed(found):
            try:
                verify_checkpoint(path, log)
            except CheckpointError as e:
                errors.append(str(e))
                log(f"warning: skipping checkpoint {path}: {e}")
                continue
            if errors:
                log(
                    f"warning: resuming from {path}, the newest usable checkpoint ({len(errors)} newer one(s) "
                    "skipped, see above)."
                )
            return path
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: none of the {len(found)} checkpoint(s) in "
            f"{checkpoints_root(output_dir)} is usable; the newest: {errors[0]}"
        )
    if not os.path.isdir(spec):
        what = "a file, not a folder" if os.path.exists(spec) else "no such folder"
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: {what}. Pass a checkpoint folder "
            f"(output_dir/checkpoints/step_<N>), 'latest' or 'auto'."
        )
    if not os.path.isfile(os.path.join(spec, STATE_FILE)):
        steps = list_checkpoints(spec)  # the run's output_dir given instead of one of its checkpoints
        fix = (
            f"it is a run's output_dir: pass {steps[-1]}, or 'latest' with --output_dir {spec}"
            if steps
            else "pass a folder output_dir/checkpoints/step_<N> that accel-trainer wrote"
        )
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: not a checkpoint of ours ({STATE_FILE} missing): {fix}."
        )
    verify_checkpoint(spec, log)
    return spec


def previous_run_advice(output_dir: str) -> str:
    """What to do with an output_dir that holds a run, naming only ways that work: `latest` where a checkpoint
    can be continued, never for a run without one (`latest` would then refuse, advising to drop the flag)."""
    if list_checkpoints(output_dir):
        return (
            "Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to delete it and start "
            "over, or another --output_dir."
        )
    model = os.path.join(output_dir, MODEL_FILE)
    if os.path.isfile(model):
        return (
            f"That run finished and has no checkpoint to continue from; its model is {model}. To train again, pass "
            "--overwrite_output_dir (deletes that run) or another --output_dir."
        )
    return (
        "It has no checkpoint to continue from (it stopped before its first save): pass --overwrite_output_dir to "
        "delete it and start over, or another --output_dir."
    )


def effective_resume_spec(spec: str | None) -> str | None:
    """On an elastic restart the newest checkpoint of this run wins over whatever the command line said: the
    group restarts with the same arguments and must continue, not start over (or from the original folder)."""
    if restart_count() > 0:
        return "auto" if spec in (None, "latest", "auto") else f"auto:{spec}"
    return spec


def resolve_on_main(accelerator, spec: str, output_dir: str) -> str | None:
    """resolve_resume_path on the main process only (one reader of the files); the others get its answer, or
    its error, so that every rank resumes from the same folder or every rank stops with the same message."""
    if accelerator.num_processes == 1:
        return resolve_resume_path(spec, output_dir)
    from accelerate.utils import broadcast_object_list

    answer = [None, None]
    if accelerator.is_main_process:
        try:
            answer = [resolve_resume_path(spec, output_dir), None]
        except CheckpointError as e:
            answer = [None, str(e)]
        except Exception as e:  # a bug: the others stop with its name instead of waiting at the broadcast
            broadcast_object_list(
                [None, f"--resume_from_checkpoint {spec}: the main process failed ({why(e)})."], from_process=0
            )
            raise
    broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        raise CheckpointError(answer[1])
    return answer[0]


# ------------------------------------------------------------------------------------------------------- resuming
def resume(accelerator, path: str, args, model, optimizer, *, ema=None, streaming=False, say=_say) -> tuple[dict, int]:
    """Load the verified checkpoint `path` into the run, on every rank; returns (its trainer state, this rank's
    micro-batch position in the epoch: resumed_position). The main process then tidies output_dir for the run
    that continues: interrupted writes removed, newer checkpoints set aside (`say` prints the first)."""
    saved = read_state(path)
    position = resumed_position(saved, path, args, accelerator.num_processes, streaming)
    _check_ema(path, ema, say if accelerator.is_main_process else lambda line: None)
    state = load_checkpoint(accelerator, path, model, optimizer, ema=ema)
    if accelerator.is_main_process:
        for stale in remove_stale_tmp(args.output_dir):
            say(f"Removed {stale}: a checkpoint whose writing was interrupted.")
        moved, aside = set_aside_newer(args.output_dir, state["global_step"])
        if moved:  # said even when quiet: checkpoints were moved
            _say(
                f"warning: moved {', '.join(os.path.basename(p) for p in moved)} to {aside}: newer than "
                f"step_{state['global_step']}, which this run resumes from, so `latest` would prefer them over "
                "this run's own checkpoints. Delete that folder if you do not need it."
            )
    return state, position


def _check_ema(path: str, ema, say) -> None:
    """The checkpoint's EMA weights (--ema_decay) checked against the model like model.safetensors; an EMA that does
    not continue is said in one line: a checkpoint without one (the EMA starts from its weights) or a run without
    --ema_decay (the average ends), where before the EMA restarted or ended without a word."""
    file = os.path.join(path, EMA_FILE)
    if ema is None:
        if os.path.isfile(file):
            say(f"note: the EMA weights in {file} end here: this run has no --ema_decay.")
        return
    if not os.path.isfile(file):
        say(
            f"note: checkpoint {path} has no {EMA_FILE} (written without --ema_decay): the EMA starts from its weights."
        )
        return
    with safe_open(file, framework="pt") as f:
        found = {_plain_key(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    _check_shapes(path, file, found, ema.module)


def resumed_position(saved: dict, path: str, args, world: int, streaming: bool = False) -> int:
    """This rank's micro-batch position in the epoch for a checkpoint written by any world size. The order of
    an epoch's samples is a function of (seed, epoch) only, and each global micro-batch is the next
    per_device x processes samples of it, so the samples already seen are batch_in_epoch x per_device x
    processes: the same samples on any world size. Exact when the global batch is unchanged; the per-rank
    random streams are not (a rank that did not exist restarts from the seed)."""
    if streaming and saved["num_processes"] != world:
        raise CheckpointError(
            f"Checkpoint {path} was written by {saved['num_processes']} processes reading their own parts of "
            f"the stream; this run has {world}. A stream's position cannot move to another world size: resume "
            f"on {saved['num_processes']} processes."
        )
    old_micro = saved["per_device_train_batch_size"] * saved["num_processes"]
    old_global = old_micro * saved["gradient_accumulation_steps"]
    new_micro = args.per_device_train_batch_size * world
    new_global = new_micro * args.gradient_accumulation_steps
    if old_global != new_global and not args.allow_global_batch_change:
        raise CheckpointError(
            f"Checkpoint {path} was written with a global batch of {old_global} (per_device_train_batch_size="
            f"{saved['per_device_train_batch_size']} x gradient_accumulation_steps="
            f"{saved['gradient_accumulation_steps']} x {saved['num_processes']} processes); this run's is "
            f"{new_global}. Keep the global batch (e.g. --per_device_train_batch_size "
            f"{old_global // (args.gradient_accumulation_steps * world) or 1} on {world} processes), or pass "
            "--allow_global_batch_change to continue with another (not exact: see docs/fault-tolerance.md)."
        )
    if saved["batch_in_epoch"] and saved.get("seed", args.seed) != args.seed:  # older checkpoints lack the seed
        raise CheckpointError(
            f"Checkpoint {path} was written with --seed {saved['seed']} in the middle of epoch {saved['epoch']}; "
            f"this run's --seed {args.seed} orders that epoch otherwise, so some of its samples would be trained on "
            f"twice and others not at all. Resume with --seed {saved['seed']} (or from a checkpoint at an epoch's "
            "end, where another seed orders the epochs after it)."
        )
    seen = saved["batch_in_epoch"] * old_micro  # samples of this epoch already trained on
    window = new_micro * args.gradient_accumulation_steps
    return seen // window * args.gradient_accumulation_steps  # whole updates; exact when the batch is kept


# -------------------------------------------------------------------------------------------------------- loading
def load_checkpoint(accelerator, path: str, model, optimizer=None, ema=None) -> dict:
    """Restore everything save_checkpoint wrote (the folder was verified by resolve_*); returns the trainer state.
    `model`: the model being trained (wrapped or not), to check tensor names and shapes against first.

    A sharded checkpoint (written under FSDP: DCP folders) loads into an FSDP run on any number of processes
    with accelerator.load_state (DCP reshards), and into a run without FSDP (e.g. 2 FSDP processes -> 1) with
    load_resharded for the model and optimizer plus Accelerate's own loading of the rest. A full checkpoint
    (model.safetensors, a rank-local optimizer.bin) cannot be sharded into an FSDP run: refused."""
    from accelerate.utils import DistributedType

    sharded_run = accelerator.distributed_type == DistributedType.FSDP
    state = read_state(path)
    if is_sharded_checkpoint(path):
        check_compatible_sharded(path, model)
        if sharded_run:
            accelerator.load_state(path)
        else:
            load_sharded_into_unsharded(accelerator, path, model, optimizer)
    else:
        if sharded_run:
            raise CheckpointError(
                f"Checkpoint {path} was written without FSDP (one full model.safetensors and rank 0's optimizer "
                "state); resuming it sharded is not supported. Resume it with the launch it was written with (DDP), "
                "or start a new FSDP run."
            )
        check_compatible(path, model)
        accelerator.load_state(path)
    if ema is not None and os.path.isfile(os.path.join(path, EMA_FILE)):
        # "cpu", not "cpu:0": Accelerate gives multi-process CPU runs the device cpu:0, which safetensors refuses.
        device = "cpu" if accelerator.device.type == "cpu" else str(accelerator.device)
        load_model(ema.module, os.path.join(path, EMA_FILE), device=device)
        # The file holds the averaged weights only. AveragedModel copies the weights instead of averaging while its
        # n_averaged is 0, so a resumed EMA would restart from the current weights: set it to the updates applied
        # (every stepped update averaged once; fp16- and NaN-skipped ones did not).
        ema.n_averaged.fill_(state["global_step"] - state.get("skipped_steps", 0))
    return state


def load_sharded_into_unsharded(accelerator, path: str, model, optimizer):
    """A sharded checkpoint into a run without FSDP: the model and optimizer by DCP (load_resharded, exact bit for
    bit), then what accelerator.load_state restores besides, with Accelerate's own function (scheduler, sampler,
    scaler, this rank's RNG state; a rank the writing run did not have keeps its seeded RNG). Accelerate's
    load_state itself cannot: without FSDP it looks for model.safetensors and optimizer.bin."""
    from accelerate.checkpointing import load_accelerator_state

    load_resharded(path, model, optimizer)
    # Accelerate's lists of prepared schedulers and data loaders, as load_state passes them (privates.prepared).
    held = privates.prepared(accelerator)
    load_accelerator_state(
        path,
        [],
        [],
        held["schedulers"],
        held["dataloaders"],
        accelerator.process_index,
        accelerator.scaler,
        "cpu",
    )


def load_resharded(path: str, model, optimizer=None, scheduler=None):
    """Restore the model (and optimizer, scheduler) of a sharded checkpoint into `model` as it is in this run:
    FSDP-sharded over any number of processes, DDP-wrapped or plain on one process. Every rank calls it (with
    several processes it is collective). Weights and optimizer state (AdamW's step, moments) come back bit for
    bit; what cannot move to another world size is the per-rank RNG state and a data position counted in
    per-rank micro-batches -- the caller decides about those. On the same world size, accelerator.load_state
    restores everything (it runs the same DCP load for model and optimizer)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folders = [f"{FSDP_MODEL_NAME}_0"] + ([f"{OPTIMIZER_NAME}_0"] if optimizer is not None else [])
    for folder in folders:  # torch's plain pickle.load reads them next: also when called on an unverified folder
        file = os.path.join(path, folder, DCP_META)
        check_dcp_storage(path, file, read_dcp_metadata(path, file))
    state = {"model": get_model_state_dict(model)}  # names without wrapper prefixes, this rank's shapes
    dcp.load(state, checkpoint_id=os.path.join(path, f"{FSDP_MODEL_NAME}_0"))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        opt = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> torch optimizer
        # get_optimizer_state_dict creates AdamW's state (a zero-lr step) so DCP has tensors to load into
        state = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=os.path.join(path, f"{OPTIMIZER_NAME}_0"))
        set_optimizer_state_dict(model, opt, state["optimizer"])
    if scheduler is not None:
        sched = getattr(scheduler, "scheduler", scheduler)  # AcceleratedScheduler -> torch scheduler
        sched.load_state_dict(torch.load(os.path.join(path, f"{SCHEDULER_NAME}.bin"), weights_only=True))


def check_compatible_sharded(path: str, model):
    """check_compatible's tensor names and shapes for a sharded checkpoint, from its DCP metadata (global
    shapes): a checkpoint of another model is an error naming the differences, not a failure deep inside DCP.
    Call after check_dcp_metadata_safe (this unpickles the model's `.metadata` with the same allow-list)."""
    from accelerate.utils.constants import FSDP_MODEL_NAME

    file = os.path.join(path, f"{FSDP_MODEL_NAME}_0", DCP_META)
    meta = read_dcp_metadata(path, file)
    found = {k.split(".", 1)[1]: tuple(v.size) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    _check_shapes(path, os.path.dirname(file), found, model)
