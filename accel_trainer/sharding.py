"""Sharded training (FSDP2) through Accelerate, on GPUs and on CPU/gloo, and the refusal of DeepSpeed.

The seam the Trainer calls, in order (docs/sharding.md has the whole integration plan):

    plugin = fsdp_plugin(mixed_precision, reduce_dtype)       # None unless the launcher/config asks for FSDP
    acc = Accelerator(..., fsdp_plugin=plugin)
    activate_fsdp(acc, plugin)                                 # CPU: Accelerate's own FSDP2 path, see below
    (model, opt, sched), info = prepare_sharded(acc, model, opt, sched, wrap=recipe_classes)
    ...                                                        # training: acc.no_sync, acc.clip_grad_norm_
    shards.save_full_model(acc, model, "model.safetensors")    # every rank: gathers the shards (shards.py)

Why `activate_fsdp`: Accelerate 1.15 decides the distributed type in `AcceleratorState.__init__`, and only turns
a multi-device world into `DistributedType.FSDP` for accelerator devices (MULTI_GPU, MULTI_XPU, ...). On CPU the
same plugin and the same launcher environment give `MULTI_CPU`, and `prepare()` silently wraps the model in DDP
(measured: 2 processes, `Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`).
Nothing else in Accelerate's FSDP2 code is GPU-only: `fully_shard` builds its default device mesh on the CPU
over gloo, and gloo does the reduce-scatter/all-gather. So we set the two fields the state would have set on a
GPU (`distributed_type`, `fsdp_plugin`) right after the Accelerator is built; from there `prepare()`
(`_prepare_fsdp2` -> `fsdp2_prepare_model`), `no_sync`, `clip_grad_norm_`, `save_state`/`load_state` (DCP) and
`get_state_dict` run Accelerate's own FSDP2 code, the code a GPU run uses -- which is what the CPU tests test.
The alternative, calling `fully_shard` ourselves, would leave `save_state`, `clip_grad_norm_` and `no_sync` on
their DDP branches, i.e. a second code path that GPUs never run. `PartialState` (process group, barriers,
gather) reads FSDP then too, as on GPUs; its collectives and barriers treat FSDP and MULTI_CPU alike.
As on GPUs, the FSDP type stays in the process's PartialState: one sharded Accelerator per process.

A run that asks for FSDP and would get anything else (one process, FSDP1, an unsharded model) is an error that
says why (`ShardingError`), never a silent fallback to DDP.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType

from . import privates, versions
from .shards import ShardingError, assert_sharded

# Size-based wrapping for models without transformer blocks to name: every submodule over this many parameters
# becomes its own FSDP unit (all-gathered just before its forward, freed after). Smaller models are one unit.
DEFAULT_MIN_NUM_PARAMS = 1_000_000
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


# ------------------------------------------------------------------------------------------------------ DeepSpeed
DEEPSPEED_REFUSAL = (
    "{where}asks for DeepSpeed, which accel-trainer does not support: on this kind of machine it cannot be run "
    "or tested (Accelerate 1.15 gives each CPU process its own world of 1 under DeepSpeed). Shard with FSDP "
    "instead -- `accel-trainer config --fsdp` writes an accelerate config with `distributed_type: FSDP` and "
    "`fsdp_version: 2` (ZeRO-3 ~ FSDP full sharding) -- or train with DDP (no sharding)."
)


def deepspeed_requested(config: dict | None = None) -> bool:
    """True when an accelerate config (a loaded yaml dict) or the launcher's environment asks for DeepSpeed."""
    if config is not None:
        return str(config.get("distributed_type", "")).upper() == "DEEPSPEED" or bool(config.get("deepspeed_config"))
    return _flag("ACCELERATE_USE_DEEPSPEED")


def refuse_deepspeed(config: dict | None = None, where: str = "") -> None:
    """Raise ShardingError when DeepSpeed is asked for. `where` names the source, e.g. 'Config file x.yaml '.
    For the wizard (--deepspeed), `accel-trainer launch` (its config file) and the Trainer (the environment)."""
    if deepspeed_requested(config):
        raise ShardingError(DEEPSPEED_REFUSAL.format(where=where or "This run "))


def launch_problems(launch_args, config=None) -> list[str]:
    """What is wrong, sharding-wise, with `accelerate launch` flags (parsed by accelerate's own parser) given with
    `config` (a loaded ClusterConfig or None), beyond config_problems: --use_deepspeed, and --cpu with an FSDP
    config -- accelerate then runs its simple launcher, i.e. one process without FSDP, silently."""
    problems = []
    if getattr(launch_args, "use_deepspeed", False):
        problems.append(DEEPSPEED_REFUSAL.format(where="--use_deepspeed "))
    fsdp_config = config is not None and "FSDP" in str(getattr(config, "distributed_type", "")).upper()
    if getattr(launch_args, "cpu", False) and fsdp_config:
        problems.append(
            "--cpu with an FSDP config makes accelerate start ONE process without FSDP (its simple launcher). Drop "
            "--cpu and set `use_cpu: true` in the config (`accel-trainer config --cpu --fsdp` writes it)."
        )
    return problems


# ----------------------------------------------------------------------------------------------------- the plugin
def plugin_for(args):
    """The run's sharding from its arguments and the launcher's environment: the FSDP plugin for Accelerator(), or
    None without FSDP. DeepSpeed, a flag that needs FSDP without it and one FSDP cannot run with are refused."""
    refuse_deepspeed()
    plugin = fsdp_plugin(args.mixed_precision, args.fsdp_reduce_dtype)
    if plugin is None and args.fsdp_reduce_dtype is not None:
        raise ShardingError(
            "--fsdp_reduce_dtype applies to FSDP only, and this run is not launched with FSDP: launch with an FSDP "
            "config (`accel-trainer config --fsdp`), or drop the flag."
        )
    refuse_ema(args.ema_decay, sharded=plugin is not None)
    return plugin


def fsdp_requested() -> bool:
    """The launcher's environment asks for FSDP (`accelerate launch` with an FSDP config or --use_fsdp)."""
    return _flag("ACCELERATE_USE_FSDP")


def mixed_precision_policy(mixed_precision: str | None, reduce_dtype: str | None):
    """FSDP2's MixedPrecisionPolicy: parameters all-gathered (and computed) in `mixed_precision`, gradients
    reduce-scattered in `reduce_dtype`; None leaves Accelerate's default (both in `mixed_precision`).
    bf16 with reduce_dtype='fp32' is the usual choice: bf16 compute, gradient sums without bf16 rounding."""
    if reduce_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if reduce_dtype not in _DTYPES:
        raise ShardingError(f"FSDP reduce dtype {reduce_dtype!r}: use one of {', '.join(_DTYPES)}.")
    mp = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    param = _DTYPES.get(mp)  # "no" -> None: parameters stay in their own dtype (fp32)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=_DTYPES[reduce_dtype], output_dtype=param)


def fsdp_plugin(mixed_precision: str | None = None, reduce_dtype: str | None = None):
    """The FullyShardedDataParallelPlugin the launcher's config describes (its FSDP_* environment, read by the
    plugin exactly as `Accelerator()` would), or None when FSDP is not asked for. Pass it to `Accelerator(...,
    fsdp_plugin=...)` and then to `activate_fsdp`: Accelerate keeps no reference to a plugin it built itself."""
    if not fsdp_requested():
        return None
    too_old = versions.problem("FSDP")  # before Accelerate builds anything from the FSDP config
    if too_old:
        raise ShardingError(too_old)
    from accelerate import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ShardingError(
            f"The accelerate config asks for FSDP version {plugin.fsdp_version}; accel-trainer runs FSDP2 only "
            "(per-parameter sharding, DTensor state). Set `fsdp_version: 2` in its fsdp_config "
            "(`accel-trainer config --fsdp` writes it)."
        )
    policy = mixed_precision_policy(mixed_precision, reduce_dtype)
    if policy is not None:
        plugin.mixed_precision_policy = policy  # Accelerate keeps a policy it is given (set_mixed_precision)
    # Checkpoints are always sharded (DCP, each rank writes its own shards): FULL_STATE_DICT would gather the whole
    # model and optimizer onto rank 0 at every checkpoint, the memory FSDP saves. The full model a user wants is
    # the run's final model.safetensors (save_full_model), whatever the config says.
    plugin.state_dict_config = plugin.optim_state_dict_config = None  # rebuilt for sharded by set_state_dict_type
    plugin.set_state_dict_type("SHARDED_STATE_DICT")
    return plugin


def config_problems(config) -> list[str]:
    """What is wrong, sharding-wise, with an accelerate config (a ClusterConfig or its yaml dict) before anything
    is launched: DeepSpeed (refused), FSDP other than version 2, FSDP on CPU with fewer than 2 processes (nothing
    to shard over). For the wizard and `accel-trainer launch` (cluster_config.validate_config); empty when fine."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    dtype = str(get("distributed_type", "") or "").upper().rsplit(".", 1)[-1]  # DistributedType.FSDP -> FSDP
    if dtype == "DEEPSPEED" or get("deepspeed_config"):
        return [DEEPSPEED_REFUSAL.format(where="The config ")]
    if dtype != "FSDP":
        return []
    problems = []
    version = str((get("fsdp_config") or {}).get("fsdp_version", 1))
    if version != "2":
        problems.append(
            f"fsdp_version {version}: accel-trainer runs FSDP2 only (per-parameter sharding, DTensor state); set "
            "`fsdp_version: 2` in fsdp_config (`accel-trainer config --fsdp` writes it)."
        )
    if get("use_cpu") and int(get("num_processes", 1) or 1) < 2:
        problems.append(
            "FSDP on CPU with 1 process has nothing to shard over: set num_processes to 2 or more, or use a config "
            "without FSDP."
        )
    return problems


def activate_fsdp(accelerator, plugin) -> None:
    """Make `accelerator` run Accelerate's FSDP2 code path with `plugin` (the one passed to Accelerator()).
    On GPUs Accelerate has done it already; on CPU we set what AcceleratorState sets on GPUs (module docstring).
    Raises ShardingError when the world cannot shard."""
    if plugin is None:
        return
    state, kind = accelerator.state, accelerator.distributed_type
    if kind == DistributedType.FSDP:
        if not accelerator.is_fsdp2:
            raise ShardingError("Accelerate set up FSDP1; accel-trainer runs FSDP2 only. Set `fsdp_version: 2`.")
        return
    if kind == DistributedType.NO or accelerator.num_processes < 2:
        raise ShardingError(
            "FSDP was asked for, but this run has 1 process: there is nothing to shard over. Launch 2 or more "
            "processes (`accelerate launch --num_processes 2 ...` or the config's num_processes), or use a config "
            "without FSDP."
        )
    if kind != DistributedType.MULTI_CPU or accelerator.device.type != "cpu":
        raise ShardingError(
            f"FSDP was asked for, but Accelerate set up {kind.value} on {accelerator.device.type}; it would not "
            "shard. Use an accelerate config with `distributed_type: FSDP` and nothing else (no DeepSpeed)."
        )
    # What AcceleratorState.__init__ does for FSDP on accelerator devices (accelerate/state.py, 1.15), including
    # the copy into PartialState: every later AcceleratorState() (the optimizer wrapper makes one) re-reads
    # PartialState's distributed_type into the shared state, which would turn it back into MULTI_CPU.
    if privates.state_mixed_precision(state) != "no":
        plugin.set_mixed_precision(privates.state_mixed_precision(state))
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    privates.mark_partial_state_fsdp()


# ------------------------------------------------------------------------------------------------------ wrapping
def _class_names(model, wanted) -> list[str]:
    names = []
    present = {type(m).__name__ for m in model.modules()}
    for cls in wanted:
        name = cls if isinstance(cls, str) else cls.__name__
        if name not in present:
            raise ShardingError(
                f"FSDP wrapping: the model has no module of class {name}. Name classes the model uses "
                f"(the recipe's fsdp_wrap / fsdp_transformer_layer_cls_to_wrap), e.g. one of "
                f"{', '.join(sorted(present)[:8])}."
            )
        names.append(name)
    return names


def configure_wrapping(plugin, model, wrap=None) -> str:
    """Set the plugin's auto-wrap policy for this model and say what it is. Each FSDP unit's parameters are
    all-gathered together just before its forward and freed after, so units bound the peak memory.

    The config's `fsdp_auto_wrap_policy` decides; TRANSFORMER_BASED_WRAP (the wizard's), or no policy given,
    wraps, in this order of precedence: the config's
    `fsdp_transformer_layer_cls_to_wrap`, the recipe's `wrap` (a list of module classes or class names), the
    model's `_no_split_modules` (transformers' transformer blocks). A model with none of these would be one
    unit under Accelerate's transformer policy; it gets size-based wrapping (DEFAULT_MIN_NUM_PARAMS) instead.
    SIZE_BASED_WRAP and NO_WRAP (root unit only) in the config are kept as they are."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    policy = plugin.auto_wrap_policy
    policy = getattr(policy, "func", policy)  # set_auto_wrap_policy may have made it a functools.partial
    explicit = os.environ.get("FSDP_AUTO_WRAP_POLICY", "").upper()
    if policy is size_based_auto_wrap_policy:
        return f"size-based: submodules over {plugin.min_num_params} parameters"
    if policy is None and explicit == "NO_WRAP":
        return "no wrap: the whole model is one unit (the config's NO_WRAP)"
    if policy is not None and policy is not transformer_auto_wrap_policy:
        return f"the plugin's own policy {policy!r}"  # a user-built plugin; Accelerate decides what it does
    if plugin.transformer_cls_names_to_wrap:
        names, source = _class_names(model, plugin.transformer_cls_names_to_wrap), "the config"
    elif wrap:
        names, source = _class_names(model, wrap), "the recipe"
    elif getattr(model, "_no_split_modules", None):
        names, source = _class_names(model, model._no_split_modules), "_no_split_modules"
    else:
        plugin.auto_wrap_policy = size_based_auto_wrap_policy
        plugin.min_num_params = DEFAULT_MIN_NUM_PARAMS
        return f"size-based: submodules over {DEFAULT_MIN_NUM_PARAMS} parameters (no transformer blocks named)"
    # Accelerate 1.15's fsdp2_prepare_model makes the input and output embeddings units of their own after the
    # policy has run, and fully_shard on a parameter that a wrapped ancestor already sharded fails ("Invariant
    # encountered: value was None"). BERT names its BertEmbeddings in _no_split_modules, so BERT under FSDP failed
    # at start-up. A class holding an embedding is therefore not a unit; the embedding is one (Accelerate's).
    holders = _embedding_holders(model)
    kept = [n for n in names if n not in holders]
    if not kept:
        plugin.auto_wrap_policy = size_based_auto_wrap_policy
        plugin.min_num_params = DEFAULT_MIN_NUM_PARAMS
        return f"size-based: submodules over {DEFAULT_MIN_NUM_PARAMS} parameters ({', '.join(names)} hold embeddings)"
    plugin.auto_wrap_policy = transformer_auto_wrap_policy
    plugin.transformer_cls_names_to_wrap = kept
    left_out = f"; not {', '.join(sorted(set(names) - set(kept)))}: holds the embeddings" if kept != names else ""
    return f"transformer blocks {', '.join(kept)} (from {source}{left_out})"


def _embedding_holders(model) -> set[str]:
    """Class names of the modules that contain (not are) the model's input or output embedding."""
    embeddings = [getattr(model, f"get_{io}_embeddings", lambda: None)() for io in ("input", "output")]
    embeddings = [e for e in embeddings if isinstance(e, torch.nn.Module)]
    return {
        type(m).__name__
        for m in model.modules()
        if m is not model and any(e is not m and any(e is s for s in m.modules()) for e in embeddings)
    }


# ----------------------------------------------------------------------------------------------------- preparing
def prepare_sharded(accelerator, model, optimizer, *others, wrap=None):
    """`accelerator.prepare(model, optimizer, *others)`; under FSDP first the wrapping policy for this model,
    after it the check that the model really is sharded. Returns (the prepared objects in the same order, what
    this rank holds: assert_sharded's dict and the wrap policy, for run_config.json; {} without FSDP).
    FSDP2 needs the model and its optimizer in the same prepare() call: the optimizer's parameters are swapped
    for the sharded ones there."""
    if accelerator.distributed_type != DistributedType.FSDP:
        if fsdp_requested():
            raise ShardingError(
                f"The launcher asks for FSDP but the Accelerator runs {accelerator.distributed_type.value}: build it "
                "with fsdp_plugin=sharding.fsdp_plugin() and call sharding.activate_fsdp()."
            )
        return accelerator.prepare(model, optimizer, *others), {}
    plugin = accelerator.state.fsdp_plugin
    description = configure_wrapping(plugin, model, wrap)
    if plugin.cpu_ram_efficient_loading and _persistent_buffers(model):
        _load_from_rank0_ourselves(accelerator, plugin, model)
    norms = _batchnorms_in_fp32(accelerator, plugin, model, optimizer)
    prepared = accelerator.prepare(model, optimizer, *others)
    info = assert_sharded(accelerator, prepared[0])
    info["wrap"] = description + (f"; {norms} BatchNorm units in fp32" if norms else "")
    if _replicate_buffers(prepared[0], prepared[1]):
        info["wrap"] += "; buffers replicated from rank 0 at each step"
    return prepared, info


def _persistent_buffers(model) -> list[str]:
    """Names of the buffers a checkpoint holds (BatchNorm's running statistics): FSDP2 does not shard them."""
    buffers = {name for name, _ in model.named_buffers()}
    return [name for name in model.state_dict() if name in buffers]


def _replicate_buffers(model, optimizer) -> bool:
    """Give every rank rank 0's floating buffers (BatchNorm running statistics) at each optimizer step, before
    the update: one broadcast of them all, flattened. Returns whether the model has such buffers (else nothing
    is installed).

    Why: FSDP2 shards parameters only; each rank's buffers move with its own batches and drift apart. A sharded
    checkpoint (DCP) takes a plain tensor for replicated and saves ONE rank's copy (the rank that has written
    least so far), and a resume loads it into every rank: the resumed run's ranks then agree where the
    uninterrupted run's did not, and a same-world fp32 resume was not bit-identical. Rank 0's values, as DDP
    (broadcast_buffers=True) and the full model (model.safetensors holds rank 0's) have them: rank 0 never
    receives, so its trajectory is the one it had without any of this.
    Why at the step: it follows every backward of the update, and precedes whatever reads buffers across ranks
    before the next forward: the optimizer itself (the CIFAR recipe's lookahead averages buffers into its
    state), a checkpoint, an eval. Not after each forward: batch_norm's autograd node keeps the running
    statistics it updated, and changing them before the backward fails it ("modified by an inplace operation").
    Not before each forward, DDP's place: after the forward the ranks differ again, and the lookahead and a
    checkpoint would read that. Not only at save time: the lookahead's averages of the buffers would already
    differ by rank. Cost: one broadcast of a few KB per update.
    Not covered: after an update that does not step (--nan_policy skip, an fp16 overflow) the ranks' buffers
    differ until the next step; a checkpoint of exactly that update holds one rank's."""
    import torch.distributed as dist

    floating = {n for n, b in model.named_buffers() if b.is_floating_point()}
    names = [n for n in _persistent_buffers(model) if n in floating]
    if not names:
        return False

    @torch.no_grad()
    def broadcast_from_rank0(*_):
        buffers = dict(model.named_buffers())
        by_kind: dict = {}  # one flat tensor per dtype and device (torch.cat needs one of each)
        for n in names:
            by_kind.setdefault((buffers[n].dtype, buffers[n].device), []).append(buffers[n])
        for group in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in group])
            dist.broadcast(flat, src=0)
            privates.foreach_copy_(group, [v.view_as(b) for v, b in zip(flat.split([b.numel() for b in group]), group)])

    getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(broadcast_from_rank0)
    return True


def _load_from_rank0_ourselves(accelerator, plugin, model) -> None:
    """What cpu_ram_efficient_loading promises (every rank trains rank 0's weights), for a model with persistent
    buffers. Accelerate 1.15's fsdp2_load_full_state_dict takes every state-dict entry for a sharded DTensor and
    fails on a buffer ("'Tensor' object has no attribute 'device_mesh'": a CNN with BatchNorm under `accelerate
    launch --use_fsdp`, whose flag default turns the option on). So rank 0 broadcasts parameters and buffers
    before sharding, as DDP does at construction, and Accelerate's loader is switched off for this model."""
    import torch.distributed as dist

    on_meta = [name for name, t in model.state_dict().items() if t.is_meta]
    if on_meta:  # transformers loaded the weights on rank 0 only: there is nothing here to receive them into
        raise ShardingError(
            f"FSDP with fsdp_cpu_ram_efficient_loading: this model has buffers ({_persistent_buffers(model)[0]}, "
            f"...), which Accelerate 1.15 cannot load that way, and {on_meta[0]} is not loaded on rank "
            f"{accelerator.process_index}. Set `fsdp_cpu_ram_efficient_loading: false` in the accelerate config "
            "(or `--fsdp_cpu_ram_efficient_loading false`) so that every rank loads the model."
        )
    with torch.no_grad():
        for t in model.state_dict().values():
            moved = t.to(accelerator.device)  # NCCL broadcasts device tensors only
            dist.broadcast(moved, src=0)
            if moved is not t:
                t.copy_(moved)
    plugin.cpu_ram_efficient_loading = False


def _batchnorms_in_fp32(accelerator, plugin, model, optimizer) -> int:
    """Under a bf16/fp16 parameter policy, make each BatchNorm an FSDP unit of its own that computes in fp32 and
    hands the low-precision dtype on. Why: FSDP2 casts every parameter of a unit to the policy's dtype but never
    the buffers, and batch_norm refuses bf16 weights beside fp32 running statistics ("expected scalar type
    BFloat16 but found Float": a CNN under FSDP with bf16, at the first step). fp32 statistics are what one
    wants anyway. Returns the number of such units. Before accelerator.prepare, so that the optimizer is given
    the sharded parameters here (prepare maps the optimizer's parameters by identity)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = getattr(plugin.mixed_precision_policy, "param_dtype", None)
    norms = [m for m in model.modules() if isinstance(m, privates.batchnorm_base())]
    if not norms or low in (None, torch.float32):
        return 0
    owner = {id(p): (m, name) for m in norms for name, p in m.named_parameters(recurse=False)}
    mesh = getattr(accelerator, "torch_device_mesh", None)  # as Accelerate's fsdp2_prepare_model chooses it
    mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=low)
    for m in norms:
        fully_shard(m, mesh=mesh, mp_policy=policy, offload_policy=plugin.cpu_offload)
    opt = getattr(optimizer, "optimizer", optimizer)
    for group in opt.param_groups:  # fully_shard replaced the modules' parameters by sharded ones
        group["params"] = [getattr(*owner[id(p)]) if id(p) in owner else p for p in group["params"]]
    return len(norms)


def refuse_ema(ema_decay: float, sharded: bool) -> None:
    """The EMA copy is a full deep copy of the model on every rank (torch AveragedModel): under FSDP it would
    copy DTensor shards and FSDP hooks, or undo the memory saving. Refused rather than kept half-working."""
    if ema_decay > 0 and sharded:
        raise ShardingError(
            "--ema_decay is not supported with FSDP: the EMA would be a full copy of the model on every process. "
            "Drop --ema_decay, or train with DDP (an accelerate config without FSDP) to keep an EMA."
        )
