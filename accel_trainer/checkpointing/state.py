"""What a checkpoint holds besides trainer_state.json, and how each part is written and read back: no pickle.

    model.safetensors        the plain model's weights (tied weights once, as safetensors' save_model keeps them)
    model/                   sharded runs (FSDP2): the same weights as torch.distributed.checkpoint (DCP) shards in
                             safetensors (torch's HuggingFaceStorageWriter: each rank writes its own part)
    optimizer.json           the optimizer's state dict by parameter name (torch's get_optimizer_state_dict: the same
                             form for every world, so a checkpoint moves between 1 process, DDP and FSDP), its
                             tensors referenced by name (codec.py)
    optimizer.safetensors    those of its tensors that are whole on every rank (all of them without FSDP)
    optimizer/               sharded runs: its sharded tensors, as DCP safetensors shards
    scheduler.json, scaler.json (fp16), rng_state_<rank>.json (each rank's random generators)
    run_args.json            the run's arguments, which a resumed run continues with (record.py)
    frozen.json              a model with frozen parameters (a LoRA adapter on a pretrained base): their names and
                             fingerprints; model.safetensors then holds what trains and the buffers, not the frozen
                             base, which build_model builds again (checked against the fingerprints on resume)

Each JSON file is {"format", "step", "state"}: the step of the checkpoint it belongs to, so that a file copied in
from another checkpoint is named, not loaded (verify.py). Accelerate's save_state/load_state are not used: their
files are pickles (torch.save), load_state reads them a second time after any check of ours, and it skips a missing
or broken RNG file with an info-level log line (a resumed run with other random numbers, silently).

Writing is split for --save_async: capture() takes everything at this update in the training thread (the small
files' contents, and the model and optimizer state dicts, whose tensors the async writer copies off the training
ones); write_small() and write_tensors() write them, the latter possibly in a background thread.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

import numpy as np
import torch

from . import codec

FORMAT = 2
MODEL_FILE = "model.safetensors"
SHARDED_MODEL = "model"
OPTIMIZER_FILE = "optimizer.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
SHARDED_OPTIMIZER = "optimizer"
SCHEDULER_FILE = "scheduler.json"
SCALER_FILE = "scaler.json"
RNG_FILE = "rng_state_{rank}.json"
FROZEN_FILE = "frozen.json"
RECORD_FILE = "run_args.json"  # the run's arguments (record.py)


@dataclass
class Captured:
    """One update's state, taken in the training thread."""

    step: int
    sharded: bool
    weights: dict | None  # the model's state dict (sharded: this rank's DTensors, tied aliases left out; else on
    # the main process only)
    optimizer: dict | None  # get_optimizer_state_dict (sharded: DTensors; else on the main process only)
    small: dict  # file name -> state, written by this rank now (scheduler, scaler on the main process; its RNG)


def state_dict_api(name: str, *args, **kwargs):
    """torch.distributed.checkpoint.state_dict's function `name` called, then the collector's youngest generation
    collected: each call leaves a reference cycle holding the model (a recursive closure over the modules it
    visited, made while torch keeps the collector off), which would keep a dropped Trainer's model alive until a
    collection. (Cheap: the cycle is all the youngest generation holds.)"""
    import gc

    from torch.distributed.checkpoint import state_dict

    try:
        return getattr(state_dict, name)(*args, **kwargs)
    finally:
        gc.collect(0)


def plain_key(name: str) -> str:
    """A tensor name without the wrappers' prefixes (DDP `module.`, torch.compile `_orig_mod.`)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


def tied_aliases(model) -> set[str]:
    """The state-dict names of parameters the model holds under another name too (tied weights), all but the first
    of each in sorted order: the one name a checkpoint keeps them under, as save_weights does. From the modules, so
    the same on every rank (a rank's empty shard of a DTensor shares no storage to tell a tie by). safetensors
    refuses to write two names of one storage, as torch's HuggingFaceStorageWriter does for DCP shards."""
    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_key(name))
    return {n for group in names.values() for n in sorted(group)[1:]}


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def inner(optimizer):
    """The torch optimizer under Accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def capture(accelerator, model, optimizer, scheduler, step: int, sharded: bool, frozen: dict | None = None) -> Captured:
    """Every rank: what a checkpoint at this update holds. Collective under FSDP (the state dicts of a sharded model
    are read on every rank). `frozen`: the fingerprints of the model's frozen parameters as built (frozen());
    while they are unchanged, the checkpoint holds them, not the weights."""
    main = accelerator.is_main_process
    weights = optim = None
    small = {}
    if sharded:
        aliases = tied_aliases(model)  # one parameter under two names (GPT-2's lm_head.weight is its wte.weight)
        weights = {k: v for k, v in state_dict_api("get_model_state_dict", model).items() if k not in aliases}
        optim = state_dict_api("get_optimizer_state_dict", model, inner(optimizer))
    elif main:
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)
        weights = plain.state_dict()
        optim = state_dict_api("get_optimizer_state_dict", plain, inner(optimizer))
        if frozen and fingerprints(plain, frozen) == frozen:
            weights = {k: v for k, v in weights.items() if k not in frozen}
            small[FROZEN_FILE] = frozen
    small[RNG_FILE.format(rank=accelerator.process_index)] = rng_states()
    if main:
        small[SCHEDULER_FILE] = scheduler.state_dict()
        if accelerator.scaler is not None:
            small[SCALER_FILE] = accelerator.scaler.state_dict()
    return Captured(step, sharded, weights, optim, small)


def write_json(folder: str, name: str, step: int, state, tensors: dict | None = None):
    tree = codec.encode(state, tensors, "")
    with open(os.path.join(folder, name), "w") as f:
        f.write(codec.dumps({"format": FORMAT, "step": step, "state": tree}))


def write_small(folder: str, captured: Captured):
    for name, state in captured.small.items():
        write_json(folder, name, captured.step, state)


def write_tensors(folder: str, captured: Captured, main: bool, process_group=None):
    """The model and optimizer files (every rank under FSDP, the main process otherwise)."""
    step = captured.step
    if captured.sharded:
        tensors: dict = {}
        tree = codec.encode(captured.optimizer, tensors, "")
        plain = {k: v for k, v in tensors.items() if not is_dtensor(v)}
        _save_shards(os.path.join(folder, SHARDED_MODEL), captured.weights, process_group)
        sharded = {k: v for k, v in tensors.items() if is_dtensor(v)}
        if sharded:  # the same on every rank: an optimizer without state (SGD without momentum) has none
            _save_shards(os.path.join(folder, SHARDED_OPTIMIZER), sharded, process_group)
        if main:
            save_weights(plain, os.path.join(folder, OPTIMIZER_TENSORS), step)
            with open(os.path.join(folder, OPTIMIZER_FILE), "w") as f:
                f.write(codec.dumps({"format": FORMAT, "step": step, "state": tree}))
        return
    if not main:
        return
    save_weights(captured.weights, os.path.join(folder, MODEL_FILE), step)
    tensors = {}
    write_json(folder, OPTIMIZER_FILE, step, captured.optimizer, tensors)
    save_weights(tensors, os.path.join(folder, OPTIMIZER_TENSORS), step)


def name_shards(folder: str, step: int):
    """Name each DCP shard for the checkpoint it belongs to (`shard-<rank>.step_<N>.safetensors`; DCP's own name
    says neither, and its header says nothing of the step): a shard copied in from another checkpoint is then
    named by the verifier, not loaded. Main process, once every rank has written (torch's reader takes any name)."""
    for sub in (SHARDED_MODEL, SHARDED_OPTIMIZER):
        shards = os.path.join(folder, sub)
        for name in sorted(os.listdir(shards)) if os.path.isdir(shards) else []:
            if m := re.match(r"^shard-(\d{5})-model-\d{5}-of-\d{5}\.safetensors$", name):
                os.replace(
                    os.path.join(shards, name), os.path.join(shards, f"shard-{m.group(1)}.step_{step}.safetensors")
                )


def save_weights(state: dict, path: str, step: int):
    """`state` as one safetensors file: tensors that are one (tied weights) stored once, under the first name in
    sorted order (safetensors.torch.load_model restores the tie from the model); `step` is the file's only
    metadata (safetensors writes its metadata in hash order: a second key would make the bytes differ from one
    process to the next)."""
    from safetensors.torch import save_file

    groups: dict = {}
    for name in sorted(state):
        t = state[name]
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key if t.numel() else name, []).append(name)
    out = {names[0]: state[names[0]].detach().to("cpu").contiguous() for names in groups.values()}
    save_file(out, path, metadata={"step": str(step)})


def _save_shards(folder: str, state: dict, process_group):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    os.makedirs(folder, exist_ok=True)
    dcp.save(
        state,
        storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True),
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )


# ------------------------------------------------------------------------------------------------ frozen weights
def frozen(model) -> dict:
    """{state-dict name: fingerprint} of the model's frozen parameters (requires_grad False): the part of a model
    that fine-tuning does not change, e.g. the base under a LoRA adapter."""
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return fingerprints(model, names) if names else {}


def fingerprints(model, names) -> dict:
    """[shape, dtype, two checksums of the bits] per name: exact integer sums, the same on any device and in any
    reduction order, the second weighted by position (a permutation changes it)."""
    state = model.state_dict(keep_vars=True)
    return {n: _fingerprint(state[n].detach()) for n in sorted(names) if n in state}


def _fingerprint(t: torch.Tensor) -> list:
    flat = t.contiguous().view(-1)
    size = flat.element_size()
    bits = flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)  # 8 bytes: two int32s
    plain = weighted = 0
    chunk = 1 << 22  # int64 temporaries of bounded size; no sum of a chunk can overflow int64 (2**31 * 2**8 * 2**22)
    for start in range(0, bits.numel(), chunk):
        x = bits[start : start + chunk].to(torch.int64)
        position = torch.arange(start, start + x.numel(), device=x.device) % 251 + 1
        plain += int(x.sum())
        weighted += int((x * position).sum())
    return [list(t.shape), str(t.dtype).removeprefix("torch."), plain, weighted]


# ------------------------------------------------------------------------------------------------ random numbers
def rng_states() -> dict:
    """This process's random generators: Python's, NumPy's, torch's CPU one and the GPUs' (as Accelerate keeps)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def check_rng_states(states) -> None:
    """rng_states() as a checkpoint holds them, restorable: ValueError naming what is wrong. (This process's
    generators are set to them and back.)"""
    saved = rng_states()
    set_rng_states(states)
    set_rng_states(saved)


def set_rng_states(states: dict) -> str | None:
    """Restore rng_states(); raises ValueError naming what is wrong (every generator is checked before any is set).
    Returns a note when the GPUs' generators cannot continue (a checkpoint of another machine)."""
    need = {"python", "numpy", "torch"}
    if not isinstance(states, dict) or not need <= set(states) or set(states) - need - {"cuda"}:
        keys = sorted(map(str, states))[:6] if isinstance(states, dict) else type(states).__name__
        raise ValueError(f"holds {keys}, not the generators python, numpy, torch (and cuda)")
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.set_rng_state(states["torch"])
    except (TypeError, ValueError, RuntimeError, IndexError, OverflowError, KeyError) as e:
        random.setstate(saved[0]), np.random.set_state(saved[1]), torch.set_rng_state(saved[2])
        first = (str(e).strip().splitlines() or [""])[0][:150]
        raise ValueError(f"holds a random state that cannot be restored ({type(e).__name__}: {first})") from None
    cuda = states.get("cuda")
    if torch.cuda.is_available():
        if not isinstance(cuda, list) or len(cuda) != torch.cuda.device_count():
            return "the GPUs' random generators start from the seed (the checkpoint holds no state for them here)"
        torch.cuda.set_rng_state_all(cuda)
    return None
