"""Build the `accelerate.Accelerator` for a run (every knob goes through Accelerate's own kwargs handlers), and
`configure_process`: the one function that changes the whole process for a run, and records what it changed."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)

from . import cpu_allocator, faults, precision, privates, sharding, versions
from .args import TrainingArguments
from .errors import UserError
from .trackers import tracker_problem
from .world import check_world, launched_world_size

# What NCCL's watchdog does when a collective fails or times out (--ddp_timeout). torch's default, 3 (SkipCleanUp),
# ends the process from the watchdog thread: the main thread never sees an exception, so the Trainer cannot name
# the rank that stopped answering (peers.describe_peer_failure, which gloo reaches). 2 (CleanUpOnly) aborts the
# communicators, which ends the NCCL kernels still waiting, and leaves the process alive: the failure reaches the
# main thread as an exception at its next use of the group, and the Trainer names the rank on its gloo side group,
# then exits 1. Read when the NCCL process group is created. Not yet run on a GPU (docs/fault-tolerance.md).
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def configure_process(args: TrainingArguments) -> tuple[Accelerator, dict]:
    """Everything a run changes beyond its own objects, in one place and in this order; returns the Accelerator and
    what was set, for run_config.json ("process"; docs/architecture.md lists them):

    - under `accel-trainer launch`, a SIGUSR1 handler that keeps a preemption notice arriving during set-up
      (faults.keep_early_preemption);
    - Accelerate's process-wide singletons reset (AcceleratorState, GradientState), NCCL's error handling
      (NCCL_ERROR_HANDLING) and torch's Flight Recorder (FLIGHT_RECORDER) where the user set neither, the process
      group, and under FSDP on a CPU the FSDP type in PartialState's shared
      state (sharding.activate_fsdp): build_accelerator;
    - inductor's CPU weight prepacking off for a compiled CPU run (inductor_on_cpu);
    - the world checked against the launcher's (world.check_world);
    - glibc malloc's thresholds for a CPU run (cpu_allocator.keep_freed_memory);
    - on the processes other than the main one, transformers', datasets' and the Hub's logs, progress bars and
      Python's warnings quieted (quiet_replica)."""
    preemption_notice = faults.keep_early_preemption()
    ours = (NCCL_ERROR_HANDLING[0], FLIGHT_RECORDER[0])  # what build_accelerator sets where the user chose none
    before = {name: os.environ.get(name) for name in ours}
    accelerator = build_accelerator(args)
    sharded_on_cpu = accelerator.distributed_type == DistributedType.FSDP and accelerator.device.type == "cpu"
    process = {
        "sigusr1_kept_during_setup": preemption_notice,
        "accelerate_state_reset": ["AcceleratorState", "GradientState"],
        "environ": {name: os.environ[name] for name in ours if os.environ.get(name) != before[name]},
        "fsdp_in_partial_state": sharded_on_cpu,  # sharding.activate_fsdp
        "inductor": inductor_on_cpu(accelerator),  # before prepare() compiles: a heap corruption on CPUs
    }
    # The world this process joined must be the one the launcher/config describe (world.py): it catches every
    # process training alone in a world of 1, per-machine/total mix-ups and bad machine ranks.
    check_world(accelerator)
    process["cpu_allocator"] = cpu_allocator.keep_freed_memory(accelerator.device.type)  # no page faults per step (CPU)
    process["replica_logs"] = quiet_replica(accelerator, args.log_level_replica)  # before the recipe loads anything
    return accelerator, process


def quiet_replica(accelerator, level: str) -> dict | None:
    """On a process other than the main one, as transformers.Trainer does with --log_level_replica: transformers'
    and datasets' log level set to `level`, their and the Hub's progress bars off, and at error and above Python's
    warnings ignored. What every rank would print once each (a model's load report, a FutureWarning, a map's
    progress bar) is then printed once, by the main process; an error is still printed where it happens. Through
    their public functions where the library is imported, and their environment variables for an import to come
    (neither is imported for it: importing transformers slows every start-up). Returns what was set (None: nothing)."""
    if accelerator.is_main_process or level == "passive":
        return None
    environ = {"TRANSFORMERS_VERBOSITY": level, "DATASETS_VERBOSITY": level}
    environ |= {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    os.environ.update(environ)
    number = getattr(logging, level.upper())
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity(number)
        transformers.logging.disable_progress_bar()  # the Hub's too
    if "datasets" in sys.modules:
        import datasets

        datasets.logging.set_verbosity(number)
        datasets.disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if number >= logging.ERROR:
        warnings.simplefilter("ignore")
    return {"log_level": level, "environ": environ, "python_warnings_ignored": number >= logging.ERROR}


def inductor_on_cpu(accelerator) -> dict | None:
    """--torch_compile on a CPU: inductor's oneDNN weight prepacking is switched off, unless the user set it
    (TORCHINDUCTOR_CPP_WEIGHT_PREPACK). With it on, the C++ that torch 2.13.0's inductor generates for the CIFAR
    recipe's net (channels_last convs, training-mode BatchNorm, batch 512, fp32) corrupts the heap: 5 of 5 runs on
    this project's AVX512 CPU died in malloc, through the Trainer too. That is pytorch/pytorch#181618: an
    out-of-bounds write from the oneDNN-aware code path, seen only with oneDNN. Without prepacking the same runs
    gave eager's losses at eager's speed. Returns what was set, for run_config.json; process-wide, like the
    setting itself. Decided by what prepare() will do: --torch_compile, or an accelerate config's dynamo_backend."""
    compiles = accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    if not compiles or accelerator.device.type != "cpu" or "TORCHINDUCTOR_CPP_WEIGHT_PREPACK" in os.environ:
        return None
    privates.inductor_config().cpp.weight_prepack = False
    return {"cpp.weight_prepack": False}


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that record CUDA graphs


def compile_notes(accelerator, last_rows: list[int] | None) -> list[str]:
    """One line for each part of the run CUDA graphs cannot take, under a compile mode that records them: a device
    that is not CUDA (inductor compiles as in the default mode there), and an epoch's last batch of another shape
    (`last_rows`: each rank's samples in it, loaders.last_batch_rows), which is compiled and recorded anew. A recipe's
    own loader says nothing of its last batch: its shapes are the recipe's."""
    plugin = accelerator.state.dynamo_plugin
    mode = plugin.mode if plugin.backend != DynamoBackend.NO else None
    if mode not in CUDA_GRAPH_MODES:
        return []
    notes = []
    if accelerator.device.type != "cuda":
        notes.append(
            f"note: --torch_compile_mode {mode} records CUDA graphs, which need a CUDA device: on "
            f"{accelerator.device.type} inductor compiles as in its default mode, without them."
        )
    if last_rows is not None:
        notes.append(
            f"note: --torch_compile_mode {mode}: each epoch's last batch holds {min(last_rows)} samples on some rank, "
            "another shape, which is compiled and recorded anew; --dataloader_drop_last keeps one shape."
        )
    return notes


def nccl_error_handling(environ=None):
    """Set NCCL_ERROR_HANDLING unless the user chose a value (under either of torch's names for it)."""
    environ = os.environ if environ is None else environ
    name, value = NCCL_ERROR_HANDLING
    if not environ.get(name) and not environ.get("NCCL_ASYNC_ERROR_HANDLING"):
        environ[name] = value


# torch's Flight Recorder keeps the last N collectives each rank entered (name, sequence number, state), on gloo and
# NCCL alike; peers.StackDumps writes them beside each rank's stack when a collective fails. Read when the process
# group is created. 0 switches it off; its cost per collective is in docs/fault-tolerance.md.
FLIGHT_RECORDER = ("TORCH_FR_BUFFER_SIZE", "2000")


def flight_recorder(environ=None):
    """Set FLIGHT_RECORDER unless the user chose a size (under either of torch's names for it)."""
    environ = os.environ if environ is None else environ
    name, value = FLIGHT_RECORDER
    if not environ.get(name) and not environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        environ[name] = value


def process_group_kwargs(timeout_s: float):
    """Accelerate kwargs handler bounding process-group setup and every collective to `timeout_s` seconds.

    With gloo a collective that waits on a dead peer raises after this timeout; with NCCL the watchdog aborts
    the communicator after it and, with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (accel.nccl_error_handling), the next
    use of the group raises (torch's default, 3, ends the process from the watchdog instead).
    """
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"The process-group timeout must be a positive number of seconds, got {timeout_s!r}.")
    return InitProcessGroupKwargs(timeout=timedelta(seconds=float(timeout_s)))


def build_accelerator(args: TrainingArguments) -> Accelerator:
    problem = tracker_problem(args.trackers)  # before anything is written: a run that would log nowhere
    if not problem and args.save_async:  # before hours of training, not at the first checkpoint
        problem = versions.problem("--save_async")
    if problem:
        raise UserError(problem)
    # On a machine without CUDA, Accelerate only forms a multi-process (gloo) world when told cpu=True;
    # otherwise every launched process silently becomes its own world of size 1 (measured with accelerate 1.15).
    cpu = args.use_cpu or (launched_world_size() > 1 and not torch.cuda.is_available())
    if args.mixed_precision == "fp8" and not precision.has_fp8(precision.training_device(cpu)):
        raise UserError(
            "--mixed_precision fp8 needs a GPU with compute capability >= 8.9 (Ada, Hopper or newer) "
            "and an fp8 backend (transformer-engine, torchao or MS-AMP); use bf16 here."
        )

    handlers = _kwargs_handlers(args)
    # Sharding: DeepSpeed is refused, FSDP (the launcher's FSDP config or --use_fsdp) runs Accelerate's FSDP2 path,
    # on CPU too (sharding.activate_fsdp); a request for FSDP that would not shard is an error, never DDP.
    plugin = sharding.plugin_for(args)

    # Accelerate keeps its state in process-wide singletons: a second Trainer in the same notebook or test
    # process would silently inherit the first one's precision and compile settings. Start each from clean
    # (the process group, in PartialState, stays).
    privates.reset_accelerate_state()
    nccl_error_handling()  # before the process group exists (Accelerator creates it)
    flight_recorder()
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=args.mixed_precision,  # None: ACCELERATE_MIXED_PRECISION from the launcher/config
        # The Trainer does its own accumulation (item-weighted normalisation needs the window boundaries), so
        # Accelerate must not divide the loss by the accumulation steps in backward().
        gradient_accumulation_steps=1,
        # We step the scheduler once per optimizer update ourselves; Accelerate would step it num_processes times.
        step_scheduler_with_optimizer=False,
        # torch.compile, applied by prepare(), in the mode asked for (unset: an accelerate config's, else torch's
        # default). A later Trainer of the same recipe in the process compiles nothing again: dynamo guards on the
        # modules' structure, not their identity (tests/test_compile_cpu.py).
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=args.torch_compile_mode)
        if args.torch_compile
        else None,
        log_with=args.trackers,
        project_dir=args.output_dir,
        kwargs_handlers=handlers,
        # A sampler seeded from (seed, epoch) alone: the same order on any world size, and resumable. (The train
        # loader brings one with this order, loaders.train_sampler; this covers a shuffling DataLoader that a
        # recipe or notebook prepares with this accelerator.)
        # non_blocking: the train and eval loaders pin their batches on a GPU machine (loaders.py); a blocking copy
        # of a pinned batch would wait for the queued kernels before the next step could be queued.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=torch.cuda.is_available()
        ),
        fsdp_plugin=plugin,
    )
    sharding.activate_fsdp(accelerator, plugin)  # on CPU, Accelerate would run DDP instead: see sharding.py
    _fp8_weights_saveable(accelerator)
    _refuse_ignored_settings(accelerator, args)
    return accelerator


def _fp8_weights_saveable(accelerator: Accelerator) -> None:
    """torchao's fp8 (Accelerate's pick where torchao is installed) wraps every converted weight in a tensor subclass
    for FSDP2's fp8 all-gather, which Accelerate turns on by default even with no FSDP2 to gather for; safetensors
    cannot save such a weight (seen on an H100: "Attempted to access the data pointer on an invalid python storage"
    at the final save, after training). Off without FSDP2, unless the user set Accelerate's variable for it. Under
    FSDP2 it stays on (Accelerate's default, not run on a GPU here). The conversion reads this config in prepare()."""
    handler = getattr(accelerator, "ao_recipe_handler", None)
    if (
        handler is None
        or getattr(accelerator, "is_fsdp2", False)
        or "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER" in os.environ
    ):
        return
    if handler.config is not None and handler.config.enable_fsdp_float8_all_gather:
        handler.config = dataclasses.replace(handler.config, enable_fsdp_float8_all_gather=False)
        handler.enable_fsdp_float8_all_gather = False


def _kwargs_handlers(args: TrainingArguments) -> list:
    # --ddp_comm_hook is Accelerate's to register (none: DDP's own all-reduce, no Python hook). update.py weighs
    # by item count around it, so any hook sees gradients of mean size.
    power = {"matrix_approximation_rank": args.powersgd_rank} if "power_sgd" in args.ddp_comm_hook else {}
    ddp = DistributedDataParallelKwargs(
        find_unused_parameters=args.ddp_find_unused_parameters,
        # the enum, not its string: Accelerate looks the hook up by enum and would register nothing for a string
        comm_hook=DDPCommunicationHookType("no" if args.ddp_comm_hook == "none" else args.ddp_comm_hook),
        comm_state_option=power,
    )
    return [
        ddp,
        process_group_kwargs(args.ddp_timeout),  # process-group set-up and every collective
        GradScalerKwargs(),  # dynamic loss scaling with torch's defaults; only used under fp16
    ]


def _refuse_ignored_settings(accelerator: Accelerator, args: TrainingArguments):
    """Settings Accelerate or torch would accept and then ignore or crash on, named here instead."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError(
            "fp16 mixed precision on a CPU: Accelerate applies no fp16 autocast or loss scaling there, so the run "
            "would silently train in fp32. Use --mixed_precision bf16 (CPU autocast) or no; fp16 needs a CUDA GPU."
        )
    if args.sync_batchnorm and accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        # torch's DDP refuses SyncBatchNorm off CUDA ("SyncBatchNorm layers only work with GPU modules"), as a
        # traceback after the model and data were built; say it first, in one line.
        raise UserError(
            "--sync_batchnorm needs CUDA GPUs: torch's SyncBatchNorm does not run on CPU processes. Drop the flag "
            "here (each process then normalises over its own part of the batch)."
        )
    if args.ddp_comm_hook != "none" and accelerator.distributed_type == DistributedType.FSDP:
        # Accelerate registers the hook only on a DDP model: under FSDP it would be dropped without a word.
        raise UserError(
            f"--ddp_comm_hook {args.ddp_comm_hook} compresses DDP's gradient all-reduce; this run shards with FSDP, "
            "which reduce-scatters gradients instead. Drop the flag; --fsdp_reduce_dtype bf16 halves that traffic."
        )
    if args.load_best_model_at_end and accelerator.distributed_type == DistributedType.FSDP:
        # the best weights would have to be loaded into the sharded model; best/ holds them whole
        raise UserError(
            "--load_best_model_at_end is not supported under FSDP: the best evaluation's model is saved in "
            "output_dir/best/ (--metric_for_best_model); load it from there, or drop the flag."
        )
    if args.ddp_comm_hook == "bf16" and accelerator.num_processes > 1 and accelerator.state.backend != "nccl":
        raise UserError(
            f"--ddp_comm_hook bf16 needs NCCL (CUDA GPUs); this run's backend is {accelerator.state.backend}. "
            "Use --ddp_comm_hook fp16 or none."
        )
