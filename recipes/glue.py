"""GLUE sequence classification with any `AutoModelForSequenceClassification` checkpoint.

Defaults mirror Accelerate's `nlp_example.py`: `bert-base-cased` fine-tuned on `nyu-mll/glue` / `mrpc`.
Offline, point at local folders -- the same `from_pretrained` / `load_dataset` calls read them:

    python recipes/glue.py --model_name_or_path <folder written by save_pretrained> \\
        --dataset_name ../shared/data/glue --task_name mrpc --output_dir runs/mrpc

    accelerate launch recipes/glue.py ...          # any number of processes, same flags

Batches are padded per batch to their longest sequence (`DataCollatorWithPadding`), not to max_seq_length.
Metrics are the GLUE metric of the task through `evaluate`, computed offline: accuracy + F1 for MRPC and QQP,
Matthews correlation for CoLA, Pearson + Spearman for STS-B, accuracy otherwise.
"""

import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from accel_trainer.kit.text import (
    MissingInputError,
    length_grouped_loader,
    load_config,
    load_pretrained,
    load_text_dataset,
    tokenizer_for,
)

name = "glue"
# Accelerate's nlp_example.py hyper-parameters (flags override them): batch 16 (eval 32), 3 epochs,
# lr 2e-5 with 100 warm-up steps then linear decay; eval at the end of each epoch.
defaults = {
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "num_train_epochs": 3,
    "learning_rate": 2e-5,
    "warmup_steps": 100,
}

# (first text column, second text column or None) per GLUE task, as in transformers' run_glue.py
TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
NUM_LABELS = {"mnli": 3, "stsb": 1}  # stsb is a regression (one output); everything else not listed: 2 classes
EVAL_SPLIT = {"mnli": "validation_matched"}  # MNLI has no plain "validation" split


@dataclass
class Args:
    model_name_or_path: str = field(
        default="bert-base-cased",
        metadata={
            "help": "Hub id or local folder (save_pretrained) of the model; its tokenizer too unless "
            "--tokenizer_name. Ignored for weights when --config_name is given."
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={"help": "Train from scratch: a Hub id or folder of a config; weights are randomly initialised."},
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Hub id or folder of the tokenizer."})
    dataset_name: str = field(
        default="nyu-mll/glue", metadata={"help": "Hub id or local folder in Hub layout (e.g. ../shared/data/glue)."}
    )
    task_name: str = field(default="mrpc", metadata={"help": f"GLUE task: {', '.join(TASK_TO_KEYS)}."})
    eval_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on. Default: validation (validation_matched for mnli)."}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate pairs to this many tokens."})
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad each batch to a multiple of this (8 helps fp16 tensor cores)."}
    )
    group_by_length: bool = field(
        default=False,
        metadata={
            "help": "Train on batches of similar length (less padding, faster); the order "
            "is still a function of seed and epoch only."
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where downloaded models/datasets and the tokenised cache go (default: the Hugging Face caches)."
        },
    )

    def __post_init__(self):
        if self.task_name not in TASK_TO_KEYS:
            raise ValueError(
                f"--task_name {self.task_name!r} is not a GLUE task; use one of {', '.join(TASK_TO_KEYS)}."
            )


def build_model(ctx):
    from transformers import AutoModelForSequenceClassification

    args = ctx.args
    num_labels = NUM_LABELS.get(args.task_name, 2)
    if args.config_name:
        config = load_config(args.config_name, num_labels=num_labels, cache_dir=args.cache_dir)
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        # A base checkpoint (e.g. bert-base-cased) gets a freshly initialised classifier head of num_labels.
        model = load_pretrained(
            AutoModelForSequenceClassification, args.model_name_or_path, num_labels=num_labels, cache_dir=args.cache_dir
        )
    if model.config.pad_token_id is None:
        # Models like GPT-2 find the last real token of each row by looking for the pad id.
        model.config.pad_token_id = tokenizer_for(args).pad_token_id
    return model  # --gradient_checkpointing and --mixed_precision are applied by the Trainer


def build_data(ctx):
    from transformers import DataCollatorWithPadding

    args, accelerator = ctx.args, ctx.accelerator
    tokenizer = tokenizer_for(args)
    raw = load_text_dataset(args.dataset_name, args.task_name, cache_dir=args.cache_dir)
    eval_split = args.eval_split or EVAL_SPLIT.get(args.task_name, "validation")
    for split in ("train", eval_split):
        if split not in raw:
            raise MissingInputError(
                f"dataset {args.dataset_name!r} ({args.task_name}) has no {split!r} split; "
                f"it has {list(raw)}. Pass --eval_split one of those."
            )
    key1, key2 = TASK_TO_KEYS[args.task_name]

    def tokenize(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        # No padding here: each batch is padded to its own longest row in collate.
        return tokenizer(*texts, truncation=True, max_length=args.max_seq_length)

    splits = {"train": raw["train"], "eval": raw[eval_split]}
    # Tokenise once: datasets caches map() results next to the dataset (keyed by a fingerprint of data and
    # function), so the next run -- and the other ranks, which wait for the main process -- load the cache.
    with accelerator.main_process_first():
        splits = {
            k: ds.map(
                tokenize,
                batched=True,
                remove_columns=[c for c in ds.column_names if c != "label"],
                desc=f"tokenizing {k}",
            )
            for k, ds in splits.items()
        }
    splits = {k: ds.rename_column("label", "labels") for k, ds in splits.items()}
    # A partial of a module-level function, not a closure: DataLoader workers started by spawn can pickle it.
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=args.pad_to_multiple_of)
    collate = functools.partial(pad_collate, collator=collator)

    # group_by_length: our own batch loader of similar-length batches instead of the Trainer's shuffled DataLoader
    loader = length_grouped_loader(ctx, collate) if args.group_by_length else None
    # "tokenizer": saved with the model, so that from_pretrained(output_dir) and pipeline() load both
    return {"train": splits["train"], "eval": splits["eval"], "collate": collate, "loader": loader,
            "tokenizer": tokenizer}  # fmt: skip


def pad_collate(examples, collator):
    # Pads input_ids/attention_mask/token_type_ids to the longest example of this batch, stacks labels.
    return dict(collator(examples))


def loss(model, batch):
    out = model(**batch)  # with labels: cross-entropy over classes (MSE for STS-B), mean over the batch
    return out.loss, batch["labels"].shape[0]


def eval_step(model, batch):
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    if logits.shape[-1] == 1:  # one output column = regression (STS-B): the score itself, squared error
        predictions = logits.squeeze(-1)
        per_example = (predictions.float() - labels.float()) ** 2
    else:
        predictions = logits.argmax(-1)
        per_example = F.cross_entropy(logits.float(), labels, reduction="none")
    # Per-example losses, not the batch mean: when the world size doesn't divide the split, Accelerate pads
    # the last batches with repeated examples and gather_for_metrics drops them -- exact only per example.
    return {
        "loss": per_example,
        "n_items": torch.ones_like(per_example),
        "predictions": predictions,
        "references": labels,
    }


def build_metrics(ctx):
    from accel_trainer.kit.metrics import load_metric

    # one module returning the task's GLUE metrics (e.g. {"accuracy", "f1"}), reported as eval_accuracy, eval_f1
    return {"glue": load_metric("glue", config_name=ctx.args.task_name)}


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
