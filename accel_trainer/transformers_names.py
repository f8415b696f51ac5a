"""transformers.TrainingArguments names a transformers user brings that are no field of our TrainingArguments: the one
line each gets, naming what to pass here, instead of argparse's "unrecognized arguments" (flags.py) or Python's
TypeError (args.py, resolve.py). Written as a flag on the command line, as a keyword in Python.
"""

from __future__ import annotations

# name: (the field to pass here or None, its value or None, why)
TRANSFORMERS_NAMES = {
    "evaluation_strategy": ("eval_strategy", None, "its name since transformers 4.46"),
    "fp16": ("mixed_precision", "fp16", None),
    "bf16": ("mixed_precision", "bf16", None),
    "no_cuda": ("use_cpu", True, None),
    "per_gpu_train_batch_size": ("per_device_train_batch_size", None, None),
    "per_gpu_eval_batch_size": ("per_device_eval_batch_size", None, None),
    "logging_strategy": ("logging_steps", None, "a log row every N updates"),
    "data_seed": ("seed", None, "the data order is a function of the seed and the epoch"),
    "logging_dir": ("output_dir", None, "metrics.jsonl and the trackers' logs go there"),
    "save_safetensors": (None, None, "every model and checkpoint here is written as safetensors"),
    "optim": (None, None, "the default optimizer is AdamW; another one comes from the recipe's build_optimizer"),
    "deepspeed": (None, None, "DeepSpeed is not supported; FSDP2 shards from an accelerate config (docs/sharding.md)"),
}


def transformers_name(name: str, keyword: bool = False) -> str | None:
    """The line for a transformers argument `name` that is no field here (TRANSFORMERS_NAMES), as a flag
    (`--fp16 ... --mixed_precision fp16`) or, with `keyword`, as Python keywords (`fp16 ... mixed_precision='fp16'`);
    None for another name."""
    if name not in TRANSFORMERS_NAMES:
        return None
    field_name, value, why = TRANSFORMERS_NAMES[name]
    given = name if keyword else f"--{name}"
    if field_name is None:
        return f"{given} is transformers' argument, not needed or not supported here: {why}."
    if keyword:
        use = field_name + ("" if value is None else f"={value!r}")
    else:
        use = f"--{field_name}" + ("" if value in (None, True) else f" {value}")
    return f"{given} is transformers' argument; here it is {use}" + (f" ({why})." if why else ".")


def unknown_keywords(cls, unknown: list[str], where: str | None = None) -> str:
    """The line for keywords `cls` does not take: what to pass instead of a transformers argument, else the names."""
    for name in unknown:
        line = transformers_name(name, keyword=True)
        if line:
            return line
    where = where or f"{cls.__name__} takes no argument"
    return f"{where} {', '.join(unknown)}: dataclasses.fields({cls.__name__}) lists the ones it takes."
