"""Run arguments: one dataclass, named like `transformers.TrainingArguments` where the concept is the same.

Parsing is argparse, with one flag per dataclass field built the way `transformers.HfArgumentParser` builds them
(same flags and types; `--help` with defaults; a YAML/JSON file of arguments). A recipe adds its own fields in its
own dataclass; both are parsed together.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple

from .world import launched_world_size

MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
COMM_HOOKS = ("none", "fp16", "bf16", "power_sgd", "batched_power_sgd")
NAN_POLICIES = ("stop", "skip")
FSDP_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
LR_SCALING = ("none", "linear", "sqrt")
# Scheduler names every supported transformers version has (tests/test_args_parser.py checks them against
# transformers.SchedulerType), checked without importing transformers; other names are checked against it.
COMMON_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "polynomial", "cosine_with_restarts")


class ArgumentError(ValueError):
    """A bad argument value. The message names the flag and what to pass instead."""


def _canonical_report_to(value) -> str:
    """transformers' `report_to` values (None, [], ["a", "b"], "a,b", "all", "none") as one string: "none", "all"
    or names joined by commas. The same run then records the same value from the command line and from Python."""
    if value is None:
        return "none"
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ArgumentError(f"--report_to: {value!r} is not a tracker name, a list of names, 'all' or 'none'.")
    names = [v.strip() for v in value if v.strip()]
    if len(names) > 1 and ("none" in names or "all" in names):
        raise ArgumentError(f"--report_to: 'none' and 'all' stand alone, got {','.join(names)}.")
    return ",".join(names) or "none"


# What `pip install` needs for each of Accelerate's trackers (its LoggerType names).
TRACKER_PACKAGES = {"tensorboard": "tensorboard (or tensorboardX)", "comet_ml": "comet_ml"}


def tracker_problem(trackers) -> str | None:
    """The one line refusing --report_to (TrainingArguments.trackers) when a tracker it names cannot log here, or
    None. Accelerate drops a tracker whose package is missing with a warning and the run logs nothing to it, and
    raises a ValueError traceback for an unknown name. "all" takes whatever is installed, as Accelerate does."""
    if not trackers or trackers == "all":
        return None
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known = sorted(t.value for t in LoggerType if t.value != "all")
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    for name in trackers:
        if name not in known:
            return f"--report_to {name}: not a tracker Accelerate knows; use {', '.join(known)}, 'all' or 'none'."
        if name not in available:
            return (
                f"--report_to {name}: its package is not installed here, so nothing would be logged there. "
                f"Install it (pip install {TRACKER_PACKAGES.get(name, name)}) or drop {name} from --report_to "
                "(metrics.jsonl is always written)."
            )
    return None


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
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N eval samples."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes."})
    dataloader_drop_last: bool = field(default=False, metadata={"help": "Drop the last incomplete train batch."})

    # --- logging, eval, checkpoints ------------------------------------------------------------------------------
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer updates."})
    eval_steps: int = field(default=0, metadata={"help": "Evaluate every N updates; 0 = at the end of each epoch."})
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every N updates; 0 = no checkpoints."})
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

    # --- hardware and numerics -----------------------------------------------------------------------------------
    mixed_precision: str | None = field(
        default=None, metadata={"help": "no, fp16, bf16 or fp8. Unset: what the accelerate config says."}
    )
    use_cpu: bool = field(default=False, metadata={"help": "Train on the CPU even if a GPU is present."})
    torch_compile: bool = field(default=False, metadata={"help": "torch.compile the model."})
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

        self.report_to = _canonical_report_to(self.report_to)
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            bad("mixed_precision", f"{self.mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}.")
        if self.ddp_comm_hook not in COMM_HOOKS:
            bad("ddp_comm_hook", f"{self.ddp_comm_hook!r} is not one of {', '.join(COMM_HOOKS)}.")
        if self.fsdp_reduce_dtype is not None and self.fsdp_reduce_dtype not in FSDP_REDUCE_DTYPES:
            bad("fsdp_reduce_dtype", f"{self.fsdp_reduce_dtype!r} is not one of {', '.join(FSDP_REDUCE_DTYPES)}.")
        if self.nan_policy not in NAN_POLICIES:
            bad("nan_policy", f"{self.nan_policy!r} is not one of {', '.join(NAN_POLICIES)}.")
        if self.lr_scheduler_type not in COMMON_SCHEDULERS:
            from transformers import SchedulerType

            names = [s.value for s in SchedulerType]
            if self.lr_scheduler_type not in names:
                bad("lr_scheduler_type", f"{self.lr_scheduler_type!r} is not one of {', '.join(names)}.")
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
            "ddp_timeout",
            "powersgd_rank",
        ):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}.")
        for name in ("eval_steps", "save_steps", "dataloader_num_workers", "warmup_steps"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}.")
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

    @property
    def trackers(self) -> list[str] | str | None:
        """Accelerate's `log_with`: None (no tracker), "all", or a list of names."""
        names = _canonical_report_to(self.report_to).split(",")
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
        init(self, *args, **kwargs)
        object.__setattr__(self, "_user_fields", frozenset(names[: len(args)]) | frozenset(kwargs))

    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    cls.__init__ = __init__
    return cls


_record_user_fields(TrainingArguments)


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows every field's default, also for recipe fields that have no help text."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(" not in text:
            text = text.replace("%", "%%")  # argparse %-formats help: a literal % ("30% of training") must not crash
        if action.default is not argparse.SUPPRESS and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _read_args_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ArgumentError(f"Arguments file {path} does not exist.")
    with open(path) as f:
        if path.endswith(".json"):
            data = json.load(f)
        else:
            import yaml

            data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ArgumentError(f"Arguments file {path} must hold a mapping of argument names to values.")
    return data


def boolean(text: str) -> bool:
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false, yes/no, 1/0).")


def _choice(choices):
    by_text = {str(c): c for c in choices}

    def choice(text):
        return by_text.get(text, text)  # argparse then checks membership in `choices`

    return choice


def _option_names(name: str) -> list[str]:
    """--name_with_underscores and, as HfArgumentParser adds it, --name-with-underscores."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def _add_field(parser: argparse.ArgumentParser, f: Field, hint) -> None:
    """One dataclass field as flags, as transformers.HfArgumentParser adds it: --name and --name-with-hyphens;
    Optional[X] parses as X and a union with str (report_to) as str; bool takes an optional true/false and a
    field that defaults to True also gets --no_name; Literal and Enum give choices; list[X] takes one or more.
    Our own (~40 lines) because `import transformers` alone costs ~0.7 s of every run's start-up
    (bench/startup.py), more than everything else we import over torch."""
    kwargs = {k: v for k, v in f.metadata.items() if k != "aliases"}
    aliases = f.metadata.get("aliases", [])
    names = _option_names(f.name)
    names += [aliases] if isinstance(aliases, str) else list(aliases)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if str not in members and len(members) != 1:
            raise TypeError(f"Field {f.name}: a union parses only as Optional[X] or with str, got {hint}.")
        hint = str if str in members else members[0]
    if f.default is not MISSING:
        kwargs["default"] = f.default
    elif f.default_factory is not MISSING:
        kwargs["default"] = f.default_factory()
    else:
        kwargs["required"] = True
    origin = typing.get_origin(hint) or hint
    if origin is typing.Literal or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        kwargs["choices"] = typing.get_args(hint) if origin is typing.Literal else [e.value for e in hint]
        kwargs["type"] = _choice(kwargs["choices"])
    elif hint is bool:
        kwargs.update(type=boolean, nargs="?", const=True)  # --flag, --flag true, --flag false
        kwargs.setdefault("default", False)
        kwargs.pop("required", None)
    elif isinstance(origin, type) and issubclass(origin, list):
        kwargs.update(type=typing.get_args(hint)[0], nargs="+")
    else:
        kwargs["type"] = hint
    parser.add_argument(*names, **kwargs)
    if hint is bool and f.default is True:  # after --name: the first action sets the default
        parser.add_argument(
            *_option_names(f"no_{f.name}"),
            action="store_false",
            dest=f.name,
            default=argparse.SUPPRESS,
            help=f"Sets --{f.name} to False.",
        )


def _build_parser(classes: list[type]) -> argparse.ArgumentParser:
    # --learning_rat must be an error, not a prefix of --learning_rate: allow_abbrev=False.
    parser = argparse.ArgumentParser(allow_abbrev=False, formatter_class=_DefaultsHelpFormatter)
    for cls in classes:
        hints = typing.get_type_hints(cls)  # resolves `from __future__ import annotations` strings
        for f in fields(cls):
            if f.init:
                _add_field(parser, f, hints[f.name])
    return parser


def parse_args(
    recipe_args_cls: type | None = None,
    argv: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    return_given: bool = False,
):
    """Parse the command line into (TrainingArguments, recipe args or None), and with `return_given` also the
    set of field names the user gave (by flag or in the arguments file), which a recipe's `configure` needs to
    tell a value the user chose from a default it may replace (e.g. a preset's epochs).

    `argv` may start with a .yaml/.yml/.json file of arguments; flags after it override the file.
    `defaults` (a recipe's own choices, e.g. its learning rate) replace our defaults and are overridden by both.
    A bad flag or value exits with status 2 and a message that names it (argparse's convention).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    classes = [TrainingArguments] + ([recipe_args_cls] if recipe_args_cls is not None else [])
    parser = _build_parser(classes)
    for action in parser._actions:
        if not action.help:  # argparse prints no default for a field without help text: name its type
            action.help = getattr(action.type, "__name__", "value") if action.type else "flag"
    known = {a.dest for a in parser._actions}
    dest_of = {opt: a.dest for a in parser._actions for opt in a.option_strings}
    given = {dest_of[t.split("=", 1)[0]] for t in argv if t.split("=", 1)[0] in dest_of}
    try:
        preset = dict(defaults or {})
        if argv and argv[0].endswith((".yaml", ".yml", ".json")):
            from_file = _read_args_file(argv.pop(0))
            given |= set(from_file)
            preset.update(from_file)
        unknown = sorted(set(preset) - known)
        if unknown:
            raise ArgumentError(f"unknown argument(s) {', '.join(unknown)} in the arguments file or recipe defaults.")
        parser.set_defaults(**preset)
        # argparse itself exits 2 with "unrecognized arguments: --x" for an unknown flag.
        values = vars(parser.parse_args(argv))
        parsed = [cls(**{f.name: values[f.name] for f in fields(cls) if f.init}) for cls in classes]
    except (ArgumentError, ValueError) as e:
        parser.error(str(e))
    result = (parsed[0], parsed[1] if recipe_args_cls is not None else None)
    return (*result, given) if return_given else result


def _field_defaults(obj) -> dict[str, Any]:
    out = {}
    for f in fields(obj):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def user_values(targs: TrainingArguments | None, rargs=None) -> dict[str, Any]:
    """The values a notebook user set on argument objects they built themselves: the fields passed to
    `TrainingArguments(...)`, and the recipe Args fields that differ from their defaults (a recipe's dataclass
    cannot record its caller; a value equal to the default is then taken as unset)."""
    values = {}
    if targs is not None:
        values.update({k: getattr(targs, k) for k in getattr(targs, "_user_fields", ())})
    if rargs is not None and is_dataclass(rargs):
        default = _field_defaults(rargs)
        values.update(
            {
                f.name: getattr(rargs, f.name)
                for f in fields(rargs)
                if f.name not in default or getattr(rargs, f.name) != default[f.name]
            }
        )
    return values


class ResolvedArgs(NamedTuple):
    """What `resolve_args` returns and `Trainer(recipe, resolved)` takes as it is: the resolved training arguments,
    the recipe's arguments and the fields the user set. A tuple, so `targs, rargs, given = resolve_args(...)` works."""

    targs: TrainingArguments
    rargs: Any  # the recipe's Args instance, or None
    given: frozenset


def resolve_args(recipe, argv: list[str] | None = None, values: dict[str, Any] | None = None, world_size=None):
    """THE argument resolution of a run, for every entry point (python recipes/x.py, accelerate launch,
    accel-trainer train, Trainer.from_recipe, Trainer(recipe, TrainingArguments(...))), so they cannot drift:

        our defaults  <  the recipe's `defaults`  <  its `configure` (presets)  <  what the user set

    The user's values come either from a command line (`argv`, which may start with a YAML/JSON arguments file)
    or from Python (`values`: field names of TrainingArguments or the recipe's Args). `configure` sees which fields
    the user set (`ctx.given`) and leaves them alone. Returns ResolvedArgs(targs, recipe args or None, given).
    A bad flag exits 2 (argparse); a bad keyword raises ArgumentError naming it.
    """
    from .recipe import RecipeContext, load_recipe

    recipe = load_recipe(recipe)
    if values is None:
        targs, rargs, given = parse_args(recipe.Args, argv, defaults=recipe.defaults, return_given=True)
    else:
        names = {"targs": {f.name for f in fields(TrainingArguments)}}
        names["rargs"] = {f.name for f in fields(recipe.Args)} if recipe.Args is not None else set()
        unknown = sorted(set(values) - names["targs"] - names["rargs"])
        if unknown:
            raise ArgumentError(
                f"unknown argument(s) {', '.join(unknown)} for recipe {recipe.name}: pass TrainingArguments fields "
                f"or fields of the recipe's Args (python recipes/{recipe.name}.py --help lists them)."
            )
        chosen = {**(recipe.defaults or {}), **values}  # the recipe's defaults, then the user's values
        targs = TrainingArguments(**{k: v for k, v in chosen.items() if k in names["targs"]})
        rargs = recipe.Args(**{k: v for k, v in chosen.items() if k in names["rargs"]}) if recipe.Args else None
        given = set(values)
    given = frozenset(given)
    if recipe.configure:
        world = world_size if world_size is not None else launched_world_size()
        recipe.configure(RecipeContext(args=rargs, targs=targs, world_size=world, given=given))
    return ResolvedArgs(targs, rargs, given)
