"""What a run tells the world: console lines and files, from the main process only.

`metrics.jsonl`: one JSON object per log event (`step` = optimizer updates, `epoch`, `elapsed_s`, then metrics
named like transformers: `loss`, `learning_rate`, `grad_norm`, `eval_loss`, `eval_accuracy`, ...).
`run_config.json`: the resolved arguments, world size and topology, library versions; written at start.
"""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import sys
import time
import weakref
from dataclasses import asdict, is_dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from . import safe_read
from .errors import UserError


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("accel-trainer", "torch", "accelerate", "transformers", "datasets", "evaluate", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    out["cuda"] = torch.version.cuda or "none"
    return out


def flat_config(args, recipe_args) -> dict:
    """The scalar arguments, for the trackers (recipe fields as recipe.<name>)."""
    cfg = {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}
    if is_dataclass(recipe_args):
        cfg.update({f"recipe.{k}": v for k, v in asdict(recipe_args).items() if isinstance(v, (int, float, str, bool))})
    return cfg


def _json_safe(value):
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible rather than crash or drop them
    return value


class Reporter:
    def __init__(self, accelerator, output_dir: str, quiet: bool = False):
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.quiet = quiet
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self._metrics_fd = None  # opened at the first row
        self.start = time.perf_counter()

    def print(self, *msg):
        if self.is_main and not self.quiet:
            print(*msg, flush=True)

    def write_run_config(self, path: str, config: dict):
        self.run_config = config  # the start line's facts (start_line)
        if self.is_main:
            fd = open_output(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with os.fdopen(fd, "w") as f:
                json.dump(config, f, indent=2, default=str)

    def log(self, metrics: dict, step: int, epoch: float, progress=None) -> dict:
        """Append one event to metrics.jsonl, send it to the trackers, show it. Returns the event."""
        event = {"step": step, "epoch": round(epoch, 4), "elapsed_s": round(time.perf_counter() - self.start, 3)}
        event.update({k: _json_safe(v) for k, v in metrics.items()})
        if self.is_main:
            # One write() of the whole line on a descriptor kept open (O_APPEND): a reader never sees half a row,
            # and no open/close per row (a cost bench/overhead.py's log rows showed).
            if self._metrics_fd is None:
                self._metrics_fd = open_output(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                weakref.finalize(self, os.close, self._metrics_fd)
            os.write(self._metrics_fd, (json.dumps(event) + "\n").encode())
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in event.items())
            if self.quiet:
                pass
            elif progress is not None and not progress.disable:
                progress.write(shown)  # keeps the bar intact
            else:
                print(shown, flush=True)
        if self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in event.items() if isinstance(v, (int, float))}, step=step)
        return event


def open_output(path: str, flags: int) -> int:
    """A descriptor for a file the run writes in output_dir: never through a link (a run_config.json linked out of
    the folder was written over) and never a FIFO or device (a FIFO named metrics.jsonl blocked the run forever,
    printing nothing): one line naming it instead."""
    import stat

    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO without a reader
            raise UserError(
                f"{path} is {'a symbolic link' if e.errno == errno.ELOOP else 'not a regular file'}: the run writes "
                "its own file there. Move it away, or give another --output_dir."
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path} is not a regular file: the run writes its own file there. Move it away.")
    os.set_blocking(fd, True)
    return fd


def start_line(config: dict, output_dir: str, resumed_from: str | None) -> str:
    """The run in one line, printed before the first update: the world, the global batch, the updates, the
    precision, the sharding, where it writes and where it resumes from (run_config.json has the rest)."""
    topo, args = config["topology"], config["args"]
    world = config["num_processes"]
    machines, per_machine = topo["num_machines"], topo["local_world_size"]
    batch = f"{args['per_device_train_batch_size']} x {args['gradient_accumulation_steps']} accumulation x {world}"
    kind = topo["distributed_type"]
    sharding = "FSDP" if kind == "FSDP" else ("none (DDP replicas)" if world > 1 else "none")
    params = config.get("parameters")
    model = f"model {params['trainable']:,} trainable + {params['frozen']:,} frozen parameters; " if params else ""
    return (
        f"accel-trainer: {config['recipe']}; {model}world {world} = {machines} machine(s) x {per_machine} process(es) "
        f"({topo['device'].split(':')[0]}, {kind}); global batch {config['global_train_batch_size']} = {batch}; "
        f"{config['total_steps']} updates; precision {topo['mixed_precision']}; sharding {sharding}; output "
        f"{output_dir}; " + (f"resumed from {resumed_from}" if resumed_from else "a new run")
    )


# peft's task types (adapter_config.json's task_type) and the AutoPeftModel class that loads each
PEFT_AUTO_CLASSES = {
    "SEQ_CLS": "AutoPeftModelForSequenceClassification",
    "CAUSAL_LM": "AutoPeftModelForCausalLM",
    "SEQ_2_SEQ_LM": "AutoPeftModelForSeq2SeqLM",
    "TOKEN_CLS": "AutoPeftModelForTokenClassification",
    "QUESTION_ANS": "AutoPeftModelForQuestionAnswering",
    "FEATURE_EXTRACTION": "AutoPeftModelForFeatureExtraction",
}


def adapter_folder(path: str) -> str | None:
    """The folder of `path` when it is a peft adapter folder (a PeftModel's save_pretrained: adapter_config.json
    and adapter_model.safetensors, no model.safetensors), else None."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    return folder if os.path.isfile(os.path.join(folder, "adapter_config.json")) else None


def _how_to_load_adapter(folder: str) -> str:
    """peft's ways to load an adapter folder: its AutoPeftModel class, which reads the base model from
    adapter_config.json's base_model_name_or_path, or PeftModel.from_pretrained on the base model."""
    try:
        config = safe_read.read_json(os.path.join(folder, "adapter_config.json"), max_bytes=1 << 20)
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    cls = PEFT_AUTO_CLASSES.get(config.get("task_type"), "AutoPeftModel")
    on_base = f"peft.PeftModel.from_pretrained(base_model, {folder!r})"
    base = config.get("base_model_name_or_path")
    if not base:  # AutoPeftModel has no base model to load
        return f"{on_base} on the base model the recipe's build_model starts from"
    return f"peft.{cls}.from_pretrained({folder!r}) or {on_base} (base model: {base!r})"


def how_to_load(path: str) -> str:
    """How to load what the run saved at `path`, phrased from what is there: a peft adapter folder, a
    save_pretrained folder (its config.json names the class) or a safetensors file of a plain module. Reads JSON
    only (no code runs)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)  # the weights file of a save_pretrained folder
    if adapter_folder(path):
        return _how_to_load_adapter(folder)
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        try:
            architectures = safe_read.read_json(config, max_bytes=1 << 20).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            architectures = []
        cls = f"transformers.{architectures[0]}" if architectures else "transformers.AutoModel"
        return f"{cls}.from_pretrained({folder!r})"
    return (
        f"safetensors.torch.load_model(model, {path!r}) into the model the recipe's build_model builds "
        "(docs/architecture.md)"
    )


def end_line(steps: int, seconds: float, model_path: str) -> str:
    hint = how_to_load(model_path)
    adapter = adapter_folder(model_path)
    if adapter:  # what a PeftModel's save_pretrained writes (model_path names a model.safetensors it does not)
        model_path = f"the peft adapter folder {adapter} (adapter_model.safetensors, adapter_config.json)"
    elif ".from_pretrained(" in hint:  # a save_pretrained folder: the folder is what loads
        model_path = os.path.dirname(model_path) if os.path.isfile(model_path) else model_path
    return f"accel-trainer: done at step {steps} ({seconds:.1f} s); the model is {model_path}; load it with {hint}"


def topology(accelerator) -> dict:
    """The world this run formed, for run_config.json: sizes from the launcher (world.launched_world), the
    device and backend from Accelerate, and the network choices that decide how machines find each other."""
    from .world import NETWORK_ENV, launched_world

    state = accelerator.state
    world = launched_world()
    return {
        "num_processes": accelerator.num_processes,
        "num_machines": world.num_machines if world else 1,
        "local_world_size": world.processes_per_machine if world else 1,
        "machine_rank": world.machine_rank if world else None,
        "distributed_type": str(
            state.distributed_type.value if hasattr(state.distributed_type, "value") else state.distributed_type
        ),
        "backend": getattr(state, "backend", None),
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "hostname": platform.node(),
        "network": {k: os.environ[k] for k in NETWORK_ENV if k in os.environ},
        "argv": sys.argv,
    }
