"""A sharded model's shards: checked (every parameter a DTensor over the whole world), counted per rank for
run_config.json and bench/memory.py, and gathered into the full model for model.safetensors and best/.
sharding.py, the seam that sets sharding up, checks with them; the Trainer, build.py and bench/memory.py import them
from here.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType, gather_object

from . import privates
from .checkpointing.folder import write_file_atomically
from .errors import UserError


class ShardingError(UserError):
    """A sharding configuration that cannot run as asked; the message names the problem and the fix."""


def _fsdp_root(model):
    return privates.uncompiled(model)  # torch.compile wraps the FSDP module


def assert_sharded(accelerator, model) -> dict:
    """Check that `model` is sharded by FSDP2 over every process of this world; raise ShardingError saying what
    it is instead. Returns what this rank holds: {"world_size", "fsdp_modules", "params", "params_local",
    "param_bytes_local", ...}."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    world = accelerator.num_processes
    # Accelerate compiles first and then shards the compiled wrapper (fsdp2_prepare_model), so under
    # --torch_compile the FSDP root is the wrapper itself, not its _orig_mod.
    root = model if isinstance(model, FSDPModule) else _fsdp_root(model)
    if accelerator.distributed_type != DistributedType.FSDP or not isinstance(root, FSDPModule):
        raise ShardingError(
            f"FSDP was asked for but the model is {type(root).__name__} under {accelerator.distributed_type.value}: "
            "it is not sharded (Accelerate falls back to DDP on CPU unless sharding.activate_fsdp is called)."
        )
    total = local = local_bytes = 0
    for name, p in root.named_parameters():
        if not isinstance(p, DTensor):
            raise ShardingError(f"FSDP: parameter {name} is a plain tensor, not sharded (every rank holds all of it).")
        if p.device_mesh.size() != world or not any(isinstance(pl, Shard) for pl in p.placements):
            raise ShardingError(
                f"FSDP: parameter {name} is placed {p.placements} on a mesh of {p.device_mesh.size()} processes; "
                f"expected sharded over all {world}."
            )
        total += p.numel()
        local += p.to_local().numel()
        local_bytes += p.to_local().numel() * p.element_size()
    fsdp_modules = sum(isinstance(m, FSDPModule) for m in root.modules())
    policy = privates.fsdp_mixed_precision_policy(root)  # what fully_shard applied
    return {
        "sharded": "fsdp2",
        "world_size": world,
        "fsdp_modules": fsdp_modules,  # modules fully_shard was applied to (a list shares one unit)
        "params": total,
        "params_local": local,
        "param_bytes_local": local_bytes,
        # the sharded parameters the optimizer updates, and the dtypes they are all-gathered / reduced in
        "master_dtype": str(next(root.parameters()).dtype).removeprefix("torch."),
        "param_dtype": str(policy.param_dtype or "as stored").removeprefix("torch."),
        "reduce_dtype": str(policy.reduce_dtype or "as param_dtype").removeprefix("torch."),
    }


# --------------------------------------------------------------------------------------------------- what it holds
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def rank_state_bytes(model, optimizer=None) -> dict:
    """Bytes this process holds now for parameters, gradients and optimizer state (the local shards under
    FSDP; everything under DDP/1 process). Gradients and optimizer state exist after the first step."""
    opt = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> torch optimizer
    params = [p for p in model.parameters()]
    out = {
        "param_bytes": sum(_local(p).numel() * p.element_size() for p in params),
        "grad_bytes": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_bytes": 0,
    }
    if opt is not None:
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    out["optimizer_bytes"] += _local(v).numel() * v.element_size()
    return out


def rank_holdings(accelerator, model, optimizer=None, sharding_info: dict | None = None) -> list[dict]:
    """rank_state_bytes of every rank (with prepare_sharded's sharding info), in rank order, on every rank:
    for run_config.json. Collective with several processes (Accelerate's gather_object): every rank calls it."""
    mine = rank_state_bytes(model, optimizer) | (sharding_info or {})
    return gather_object([mine]) if accelerator.num_processes > 1 else [mine]


# ---------------------------------------------------------------------------------------------------- refusals
# ----------------------------------------------------------------------------------------------- the full model
def full_state_dict(accelerator, model) -> dict:
    """The full, unsharded, prefix-free state dict on the main process ({} on the others). Collective under
    FSDP: every rank must call it. `accelerator.get_state_dict` gathers FSDP2 shards to rank 0 on the CPU."""
    if accelerator.distributed_type == DistributedType.FSDP:
        sd = accelerator.get_state_dict(model)
        return sd if accelerator.is_main_process else {}
    if not accelerator.is_main_process:
        return {}
    return accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()


def _tied_names(model) -> list[list[str]]:
    """Groups of state-dict names that are one tensor (tied weights, e.g. GPT-2's lm_head and wte)."""
    by_id: dict[int, list[str]] = {}
    root = _fsdp_root(model)
    for name, t in list(root.named_parameters(remove_duplicate=False)) + list(
        root.named_buffers(remove_duplicate=False)
    ):
        by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def save_full_model(accelerator, model, path: str, output_dir: str | None = None) -> str:
    """Write the full model as plain safetensors (no `module.`/`_orig_mod.` prefixes, loadable with
    `safetensors.torch.load_model` into the unwrapped model on one process). Every rank calls it; the main one
    writes (checkpoint.write_file_atomically: tmp file + rename, a full disk is one line naming the last good
    checkpoint of `output_dir`, by default the folder of `path`). Tied weights are stored once, under the name safetensors' save_model keeps (the
    first in sorted order), with the same `{dropped: kept}` metadata, so FSDP and DDP runs write the same keys."""
    from safetensors.torch import save_file

    accelerator.wait_for_everyone()
    sd = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        metadata = {"format": "pt"}
        for names in _tied_names(accelerator.unwrap_model(model, keep_torch_compile=False)):
            present = sorted(n for n in names if n in sd)
            for dropped in present[1:]:
                metadata[dropped] = present[0]
                del sd[dropped]
        sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
        write_file_atomically(
            path,
            lambda tmp: save_file(sd, tmp, metadata=metadata),
            output_dir or os.path.dirname(path),
            f"the model to {path}",
        )
    accelerator.wait_for_everyone()
    return path
