"""Run arguments: one dataclass, named like `transformers.TrainingArguments` where the concept is the same, and its
checks. The command line becomes these fields in flags.py; resolve.py is the one resolution every entry point shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ArgumentError
from .field_types import field_type_problems
from .trackers import canonical_report_to
from .transformers_names import unknown_keywords

MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
COMM_HOOKS = ("none", "fp16", "bf16", "power_sgd", "batched_power_sgd")
NAN_POLICIES = ("stop", "skip")
FSDP_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
LR_SCALING = ("none", "linear", "sqrt")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")  # transformers' names
STRATEGIES = ("no", "steps", "epoch")  # transformers' IntervalType, for --eval_strategy and --save_strategy
# Scheduler names every supported transformers version has (tests/test_args_parser.py checks them against
# transformers.SchedulerType), checked without importing transformers; other names are checked against it.
COMMON_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "polynomial", "cosine_with_restarts")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


# (lowest allowed, first not allowed or None) of the numbers that have bounds of their own (field_types.py)
BOUNDS = {
    **dict.fromkeys(("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps", "ddp_timeout", "powersgd_rank", "max_train_samples",
                     "max_eval_samples"), (1, None)),
    **dict.fromkeys(("eval_steps", "save_steps", "dataloader_num_workers", "warmup_steps", "learning_rate",
                     "weight_decay", "adam_epsilon", "max_grad_norm"), (0, None)),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (0, 1)),
    "seed": (0, 2**32),  # numpy's and torch's seeds
    "max_steps": (-1, None),  # -1: from num_train_epochs
}  # fmt: skip


@dataclass
class TrainingArguments:
    # --- where things go -----------------------------------------------------------------------------------------
    output_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder for metrics.jsonl, run_config.json, checkpoints/, model.safetensors. "
            "Default: output/<recipe name>."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an output_dir that holds a previous run (its checkpoints "
            "and logs are deleted). Without it such a folder is refused."
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint folder; 'latest': the newest good one in output_dir/checkpoints "
            "(an error if there is none); 'auto': the same, or a new run when there is "
            "none. Elastic restarts always resume (docs/fault-tolerance.md)."
        },
    )

    push_to_hub: bool = field(
        default=False,
        metadata={
            "help": "At the end of the run, upload output_dir (the final model, run_config.json, metrics.jsonl; not "
            "checkpoints/ nor best/) to the Hub repo --hub_model_id, with the token huggingface_hub finds "
            "(HF_TOKEN, or `hf auth login`)."
        },
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "The Hub model repo --push_to_hub uploads to: <user or org>/<name>."}
    )

    # --- batch and optimisation ----------------------------------------------------------------------------------
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Samples per micro-batch per process."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Samples per eval batch per process."})
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={
            "help": "Micro-batches per optimizer update. Global batch = per_device_train_batch_size"
            " x gradient_accumulation_steps x number of processes."
        },
    )
    auto_micro_batch: bool = field(
        default=False,
        metadata={
            "help": "Out of memory in an update: halve the micro-batch and double the accumulation (the global "
            "batch and the numbers unchanged), agreed by every rank, and redo the update; saved in checkpoints."
        },
    )
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate of the default AdamW."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay (not on biases/norms)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this; 0 = off."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs to train (fractions allowed)."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer updates to train; > 0 overrides epochs."})
    lr_scheduler_type: str = field(
        default="linear",
        metadata={
            "help": "A transformers scheduler name: linear, cosine, constant, constant_with_warmup, polynomial, ..."
        },
    )
    warmup_ratio: float = field(default=0.0, metadata={"help": "Warm-up as a fraction of all updates."})
    warmup_steps: int = field(default=0, metadata={"help": "Warm-up in updates; > 0 overrides warmup_ratio."})
    seed: int = field(default=42, metadata={"help": "Seed for weights init, data order and augmentation."})

    # --- data ----------------------------------------------------------------------------------------------------
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N train samples."})
    max_eval_samples: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate on N samples drawn with --seed from the whole eval split (the same N on any world "
            "size, in every evaluation), not the first N: those of a split sorted by label hold one label."
        },
    )
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes."})
    dataloader_drop_last: bool = field(default=False, metadata={"help": "Drop the last incomplete train batch."})

    # --- logging, eval, checkpoints ------------------------------------------------------------------------------
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer updates."})
    eval_steps: int = field(default=0, metadata={"help": "Evaluate every N updates; 0 = at the end of each epoch."})
    eval_strategy: str | None = field(
        default=None,
        metadata={
            "help": "When to evaluate during training, as transformers' eval_strategy: steps (every --eval_steps "
            "updates; --logging_steps when that is 0), epoch (at each epoch's end) or no (the final evaluation "
            "alone). Unset: steps when --eval_steps > 0, else epoch. The run's end is always evaluated."
        },
    )
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every N updates; 0 = no checkpoints."})
    save_strategy: str | None = field(
        default=None,
        metadata={
            "help": "When to checkpoint, as transformers' save_strategy: steps (every --save_steps updates), epoch "
            "(at each epoch's end) or no (no checkpoint at all). Unset: steps when --save_steps > 0, else no. "
            "Unless no, the run's last update is checkpointed too."
        },
    )
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoints."})
    save_async: bool = field(
        default=False,
        metadata={
            "help": "Write checkpoints in the background: training stalls only while the state is copied to CPU "
            "memory (costs that much host memory; see docs/fault-tolerance.md)."
        },
    )
    metric_for_best_model: str | None = field(
        default=None,
        metadata={
            "help": "Keep the weights of the best evaluation by this metric (eval_loss, "
            "eval_mse, ...) in output_dir/best/, apart from checkpoints and "
            "save_total_limit."
        },
    )
    greater_is_better: bool | None = field(
        default=None,
        metadata={
            "help": "A larger metric_for_best_model is better. Default: False for names ending in 'loss', else True."
        },
    )
    load_best_model_at_end: bool = field(
        default=False,
        metadata={
            "help": "As in transformers: at the end, the weights of the best evaluation (--metric_for_best_model, "
            "default loss) are loaded, saved as the run's model and evaluated. The last checkpoint keeps the last "
            "update's state, to resume from. Not under FSDP."
        },
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={
            "help": "Stop after N evaluations in a row that do not improve --metric_for_best_model (default loss), "
            "as transformers' EarlyStoppingCallback; the run then ends as after its last update (checkpoint, "
            "model, final evaluation), and resuming it does not train on."
        },
    )
    # Typed as transformers types it (HfArgumentParser parses this order as a plain string); the Python API also
    # takes a list, and None or [] for none. __post_init__ makes it one canonical string.
    report_to: None | str | list[str] = field(
        default="none",
        metadata={
            "help": "Trackers for accelerate's log_with, comma-separated (tensorboard, "
            "wandb, ...), 'all', or 'none'. metrics.jsonl is always written."
        },
    )
    run_name: str | None = field(default=None, metadata={"help": "Project/run name given to the trackers."})
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar."})
    log_level_replica: str = field(
        default="error",
        metadata={
            "help": "transformers' and datasets' log level on the processes other than the main one, whose warnings "
            "(transformers' load report, FutureWarnings) and progress bars repeat the main one's; at error and "
            "above Python's warnings are off there too. passive: leave them as they are. transformers' default, "
            "warning, still prints its load report on every rank."
        },
    )

    # --- hardware and numerics -----------------------------------------------------------------------------------
    mixed_precision: str | None = field(
        default=None, metadata={"help": "no, fp16, bf16 or fp8. Unset: what the accelerate config says."}
    )
    use_cpu: bool = field(default=False, metadata={"help": "Train on the CPU even if a GPU is present."})
    torch_compile: bool = field(default=False, metadata={"help": "torch.compile the model."})
    torch_compile_mode: str | None = field(
        default=None,
        metadata={
            "help": "torch.compile's mode: default, reduce-overhead (CUDA graphs: the host's launches recorded once), "
            "max-autotune (autotuned kernels and CUDA graphs), max-autotune-no-cudagraphs. Implies --torch_compile."
        },
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Activation checkpointing (transformers models)."}
    )
    sync_batchnorm: bool = field(default=False, metadata={"help": "Convert BatchNorm to SyncBatchNorm (multi-GPU)."})
    ema_decay: float = field(
        default=0.0,
        metadata={
            "help": "Keep an EMA of the weights with this decay per update (e.g. 0.999) and "
            "evaluate and save it; 0 = off."
        },
    )
    nan_policy: str = field(
        default="stop",
        metadata={"help": "A non-finite loss: 'stop' the run naming the step, or 'skip' the update and count it."},
    )

    # --- distributed ---------------------------------------------------------------------------------------------
    ddp_find_unused_parameters: bool = field(default=False, metadata={"help": "DDP find_unused_parameters."})
    ddp_comm_hook: str = field(
        default="none",
        metadata={
            "help": "DDP only (refused under FSDP): gradient communication hook: none, fp16, bf16, power_sgd, batched_power_sgd."
        },
    )
    powersgd_rank: int = field(default=1, metadata={"help": "matrix_approximation_rank for power_sgd hooks."})
    fsdp_reduce_dtype: str | None = field(
        default=None,
        metadata={
            "help": "FSDP only: the dtype gradients are reduce-scattered in (fp32, bf16, fp16). With "
            "--mixed_precision bf16, fp32 keeps bf16 parameters and compute but sums gradients without bf16 "
            "rounding. Unset: the mixed-precision dtype (Accelerate's default)."
        },
    )
    ddp_timeout: int = field(
        default=1800,
        metadata={
            "help": "Seconds any collective (and the process-group set-up) may wait for a peer before the run fails."
        },
    )

    allow_global_batch_change: bool = field(
        default=False,
        metadata={
            "help": "Resume a checkpoint whose global batch (per-device x accumulation x processes) differs from "
            "this run's. The position in the epoch is then rounded down to a whole update (some samples are seen "
            "twice) and the schedule's length changes. Without it such a resume is refused."
        },
    )

    allow_args_change: bool = field(
        default=False,
        metadata={
            "help": "Resume with another value of an argument that changes the numbers (learning rate, schedule, "
            "optimizer, precision, seed, ...) than the run being resumed was trained with. Without it such a resume "
            "is refused; arguments left out are taken from the run's record (run_args.json in the checkpoint)."
        },
    )

    # --- learning-rate scaling -----------------------------------------------------------------------------------
    lr_scaling: str = field(
        default="none",
        metadata={
            "help": "Scale --learning_rate with the global batch (per-device x accumulation x processes) over "
            "--lr_base_batch_size: none, linear (lr x B/B0) or sqrt (lr x sqrt(B/B0)). The scaled value is used, "
            "logged, and recorded in run_config.json; warmup applies to it as to any learning rate."
        },
    )
    lr_base_batch_size: int | None = field(
        default=None, metadata={"help": "The global batch --learning_rate was tuned for (needed by --lr_scaling)."}
    )

    # --- observability -------------------------------------------------------------------------------------------
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "Peak TFLOP/s of one device, for the logged mfu (model FLOPs utilisation). Default: known for "
            "H100/H200/A100/L40S/L4/A10 under bf16/fp16; no mfu otherwise."
        },
    )
    profile_steps: str | None = field(
        default=None,
        metadata={
            "help": "Profile updates A-B (e.g. 5-8) with torch.profiler on every rank: traces for TensorBoard/Chrome "
            "in output_dir/profile/, top ops and collective time printed. See docs/observability.md."
        },
    )

    def __post_init__(self):
        def bad(flag, msg):
            raise ArgumentError(f"--{flag}: {msg}")

        for name, problem in field_type_problems(self, BOUNDS):  # a keyword, a file, a record: what argparse checks
            bad(name, problem)
        self.report_to = canonical_report_to(self.report_to)
        if self.torch_compile_mode is not None:
            if self.torch_compile_mode not in COMPILE_MODES:
                bad("torch_compile_mode", f"{self.torch_compile_mode!r} is not one of {', '.join(COMPILE_MODES)}.")
            self.torch_compile = True
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            bad("mixed_precision", f"{self.mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}.")
        if self.ddp_comm_hook not in COMM_HOOKS:
            bad("ddp_comm_hook", f"{self.ddp_comm_hook!r} is not one of {', '.join(COMM_HOOKS)}.")
        if self.fsdp_reduce_dtype is not None and self.fsdp_reduce_dtype not in FSDP_REDUCE_DTYPES:
            bad("fsdp_reduce_dtype", f"{self.fsdp_reduce_dtype!r} is not one of {', '.join(FSDP_REDUCE_DTYPES)}.")
        if self.save_strategy == "best":  # transformers' checkpoint at each new best: here best/ keeps that model
            bad(
                "save_strategy",
                "'best' is not one here: the best evaluation's model is kept in output_dir/best/ with "
                "--metric_for_best_model (apart from checkpoints and save_total_limit); checkpoints to resume "
                "from: --save_strategy steps or epoch.",
            )
        for name in ("eval_strategy", "save_strategy"):
            if getattr(self, name) is not None and getattr(self, name) not in STRATEGIES:
                bad(name, f"{getattr(self, name)!r} is not one of {', '.join(STRATEGIES)}.")
        if self.save_strategy == "steps" and self.save_steps == 0:
            bad("save_strategy", "steps checkpoints every --save_steps updates: give --save_steps > 0.")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            bad("early_stopping_patience", f"must be >= 1, got {self.early_stopping_patience}.")
        if self.early_stopping_patience and self.eval_strategy == "no":
            bad("early_stopping_patience", "counts evaluations during training: --eval_strategy steps or epoch.")
        if (self.load_best_model_at_end or self.early_stopping_patience) and not self.metric_for_best_model:
            self.metric_for_best_model = "loss"  # transformers' default for load_best_model_at_end
        if self.log_level_replica not in LOG_LEVELS:
            bad("log_level_replica", f"{self.log_level_replica!r} is not one of {', '.join(LOG_LEVELS)}.")
        if self.nan_policy not in NAN_POLICIES:
            bad("nan_policy", f"{self.nan_policy!r} is not one of {', '.join(NAN_POLICIES)}.")
        if self.lr_scheduler_type not in COMMON_SCHEDULERS:
            from transformers import SchedulerType

            names = [s.value for s in SchedulerType]
            if self.lr_scheduler_type not in names:
                bad("lr_scheduler_type", f"{self.lr_scheduler_type!r} is not one of {', '.join(names)}.")
        if not 0.0 <= self.ema_decay < 1.0:
            bad("ema_decay", f"must be in [0, 1), got {self.ema_decay}.")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            bad("warmup_ratio", f"must be in [0, 1], got {self.warmup_ratio}.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            bad("max_steps", "set --max_steps > 0 or --num_train_epochs > 0.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            bad("save_total_limit", f"must be >= 1, got {self.save_total_limit}.")
        if self.lr_scaling not in LR_SCALING:
            bad("lr_scaling", f"{self.lr_scaling!r} is not one of {', '.join(LR_SCALING)}.")
        if self.lr_scaling != "none" and (self.lr_base_batch_size is None or self.lr_base_batch_size < 1):
            bad("lr_base_batch_size", "--lr_scaling needs the global batch the learning rate was tuned for, >= 1.")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            bad("peak_tflops", f"must be > 0, got {self.peak_tflops}.")
        if self.profile_steps is not None:
            self.profile_range  # noqa: B018 - validates
        if self.push_to_hub and not self.hub_model_id:
            bad("push_to_hub", "needs the repo to upload to: add --hub_model_id <user or org>/<name>.")
        if self.push_to_hub:
            from huggingface_hub import get_token  # HF_TOKEN or `hf auth login`'s: known now, not after training

            if get_token() is None:
                bad("push_to_hub", "no Hub token found: set HF_TOKEN or run `hf auth login`, or drop --push_to_hub.")

    def evaluates_after(self, step: int, epoch_ended: bool) -> bool:
        """An evaluation is due after update `step` (--eval_strategy, --eval_steps); the final one always runs."""
        strategy = self.eval_strategy or ("steps" if self.eval_steps else "epoch")
        if strategy == "steps":
            return step % (self.eval_steps or self.logging_steps) == 0
        return strategy == "epoch" and epoch_ended

    @property
    def checkpoints(self) -> bool:
        """The run writes checkpoints (--save_strategy, --save_steps), and one at its last update."""
        return (self.save_strategy or ("steps" if self.save_steps else "no")) != "no"

    def saves_after(self, step: int, epoch_ended: bool) -> bool:
        """A checkpoint is due after update `step` (--save_strategy, --save_steps)."""
        strategy = self.save_strategy or ("steps" if self.save_steps else "no")
        if strategy == "steps":
            return step % self.save_steps == 0
        return strategy == "epoch" and epoch_ended

    @property
    def trackers(self) -> list[str] | str | None:
        """Accelerate's `log_with`: None (no tracker), "all", or a list of names."""
        names = canonical_report_to(self.report_to).split(",")
        if names == ["none"]:
            return None
        return "all" if names == ["all"] else names

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """--profile_steps A-B as (A, B), 1-based updates, both included."""
        if self.profile_steps is None:
            return None
        first, _, last = str(self.profile_steps).partition("-")
        try:
            a, b = int(first), int(last or first)
        except ValueError:
            a = b = 0
        if not 1 <= a <= b:
            raise ArgumentError(f"--profile_steps: {self.profile_steps!r} is not A-B with 1 <= A <= B (e.g. 5-8).")
        return a, b

    def scaled_learning_rate(self, world_size: int) -> float:
        """--learning_rate after --lr_scaling for this world size's global batch."""
        if self.lr_scaling == "none":
            return self.learning_rate
        ratio = (
            self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size / self.lr_base_batch_size
        )
        return self.learning_rate * (ratio if self.lr_scaling == "linear" else ratio**0.5)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _record_user_fields(cls):
    """Wrap a dataclass __init__ so each instance knows which fields its caller set: in a notebook,
    `TrainingArguments(output_dir=..., max_steps=200)` means "these two are mine, the recipe decides the rest",
    exactly like the same two flags on the command line (see resolve_args)."""
    init, names = cls.__init__, [f.name for f in fields(cls) if f.init]

    def __init__(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(names))
        if unknown:  # not Python's TypeError: one line naming what to pass, as for a bad value
            raise ArgumentError(unknown_keywords(cls, unknown)) from None
        init(self, *args, **kwargs)
        object.__setattr__(self, "_user_fields", frozenset(names[: len(args)]) | frozenset(kwargs))

    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    cls.__init__ = __init__
    return cls


_record_user_fields(TrainingArguments)
