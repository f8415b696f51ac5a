"""LoRA fine-tuning (peft) of a sequence classifier on a GLUE task: a short recipe to copy and change.

    python recipes/lora.py --model_name_or_path <Hub id or save_pretrained folder> \\
        --dataset_name ../shared/data/glue --task_name mrpc --output_dir runs/lora-mrpc
    accelerate launch recipes/lora.py ...          # any number of processes, same flags

The base model is frozen; a LoRA adapter (rank --lora_r, scale --lora_alpha / --lora_r) on --lora_target_modules
and a new classification head train. What the run writes:
* output_dir: peft's adapter folder (adapter_config.json, adapter_model.safetensors), loaded with
  `peft.AutoPeftModelForSequenceClassification.from_pretrained(output_dir)` or
  `peft.PeftModel.from_pretrained(base_model, output_dir)`; `.merge_and_unload()` gives a plain transformers model.
* checkpoints: the adapter, the head and their optimizer state, and fingerprints of the frozen base
  (frozen.json), not the base itself: kilobytes to megabytes, whatever the base's size.
Metrics: the GLUE metric of the task (accuracy + F1 for MRPC and QQP), as recipes/glue.py.
"""

import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from accel_trainer import UserError
from accel_trainer.kit.text import load_pretrained, load_text_dataset, recipe_tokenizer

name = "lora"
# LoRA trains few parameters from zero: a higher learning rate than full fine-tuning (glue.py: 2e-5), a short
# warm-up (the LoRA paper's GLUE runs: 6%).
defaults = {
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "num_train_epochs": 3,
    "learning_rate": 5e-4,
    "warmup_ratio": 0.06,
}


@dataclass
class Args:
    model_name_or_path: str = field(
        default="bert-base-cased",
        metadata={"help": "Hub id or local folder (save_pretrained) of the base model and its tokenizer."},
    )
    dataset_name: str = field(
        default="nyu-mll/glue", metadata={"help": "Hub id or local folder in Hub layout (e.g. ../shared/data/glue)."}
    )
    task_name: str = field(default="mrpc", metadata={"help": "GLUE task (the dataset's config): mrpc, sst2, ..."})
    lora_r: int = field(default=8, metadata={"help": "Rank of the LoRA update matrices."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling: the update is multiplied by alpha / r."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated names of the modules that get an adapter (query,value), or all-linear. "
            "Default: peft's choice for the architecture (query,value for BERT)."
        },
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate pairs to this many tokens."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloads and the tokenised cache go."})


@functools.cache
def glue_task(dataset_name: str, task_name: str, cache_dir: str | None):
    """The task's splits (loaded once per process: build_model reads the labels, build_data the texts)."""
    return load_text_dataset(dataset_name, task_name, cache_dir=cache_dir)


def build_model(ctx):
    import peft
    from transformers import AutoModelForSequenceClassification

    args = ctx.args
    with ctx.accelerator.main_process_first():  # the main process downloads and prepares, the others read
        labels = glue_task(args.dataset_name, args.task_name, args.cache_dir)["train"].features["label"]
    if not hasattr(labels, "num_classes"):
        raise UserError(f"--task_name {args.task_name}: its labels are {labels}, not classes; lora.py classifies "
                        "(recipes/glue.py trains regression tasks).")  # fmt: skip
    base = load_pretrained(AutoModelForSequenceClassification, args.model_name_or_path,
                           num_labels=labels.num_classes, cache_dir=args.cache_dir)  # fmt: skip
    if base.config.pad_token_id is None:  # GPT-2 style models find each row's last token by the pad id
        base.config.pad_token_id = recipe_tokenizer(args.model_name_or_path, args.cache_dir).pad_token_id
    targets = args.lora_target_modules
    config = peft.LoraConfig(
        task_type="SEQ_CLS",  # also trains (and saves with the adapter) the new classification head
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=None if targets is None else targets if targets == "all-linear" else targets.split(","),
    )
    try:
        return peft.get_peft_model(base, config)  # the base's parameters frozen, the adapter's trainable
    except ValueError as e:  # no default target modules for this architecture, or names that match no module
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UserError(
            f"LoRA on {args.model_name_or_path}: {str(e).split('. ')[0].rstrip('.')}. Pass "
            f"--lora_target_modules names of its linear layers ({','.join(linear)}) or all-linear."
        ) from None


def build_data(ctx):
    from transformers import DataCollatorWithPadding

    args = ctx.args
    tokenizer = recipe_tokenizer(args.model_name_or_path, args.cache_dir)
    with ctx.accelerator.main_process_first():
        raw = glue_task(args.dataset_name, args.task_name, args.cache_dir)
    # GLUE's text columns are its string columns: sentence1 + sentence2 (MRPC), sentence (SST-2), ...
    texts = [c for c, f in raw["train"].features.items() if getattr(f, "dtype", None) == "string"]
    eval_split = "validation_matched" if args.task_name == "mnli" else "validation"

    def tokenize(batch):  # no padding here: each batch is padded to its own longest row by the collator
        return tokenizer(*(batch[c] for c in texts), truncation=True, max_length=args.max_seq_length)

    splits = {"train": raw["train"], "eval": raw[eval_split]}
    with ctx.accelerator.main_process_first():  # tokenised once, cached by datasets; the other ranks read it
        splits = {k: ds.map(tokenize, batched=True, remove_columns=[c for c in ds.column_names if c != "label"])
                  for k, ds in splits.items()}  # fmt: skip
    collate = functools.partial(pad_collate, collator=DataCollatorWithPadding(tokenizer))
    # "tokenizer": saved beside the adapter, so that the output folder is complete
    return {"train": splits["train"], "eval": splits["eval"], "collate": collate, "tokenizer": tokenizer}


def pad_collate(examples, collator):  # a module-level function: loader workers started by spawn can pickle it
    return dict(collator(examples))  # token ids and masks padded to the batch's longest row; label -> labels


def loss(model, batch):
    return model(**batch).loss, len(batch["labels"])  # cross-entropy, the mean over the batch's pairs


def eval_step(model, batch):
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    # per pair, so that the pairs Accelerate repeats to even out the ranks are dropped exactly
    per_pair = F.cross_entropy(logits, batch["labels"], reduction="none")
    return {"loss": per_pair, "n_items": torch.ones_like(per_pair), "predictions": logits.argmax(-1),
            "references": batch["labels"]}  # fmt: skip


def build_metrics(ctx):
    from accel_trainer import load_metric

    return {"glue": load_metric("glue", config_name=ctx.args.task_name)}  # eval_accuracy, eval_f1 (MRPC)


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
