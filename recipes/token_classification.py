"""Token classification (NER, POS, chunking) with any `AutoModelForTokenClassification` checkpoint.

Defaults mirror transformers' run_ner.py: `bert-base-cased` on `conll2003` (columns `tokens` and `ner_tags`).
Offline, point at local folders or files -- the same `from_pretrained` / `load_dataset` calls read them:

    python recipes/token_classification.py --model_name_or_path <folder written by save_pretrained> \\
        --dataset_name <dataset folder in Hub layout> --output_dir runs/ner

    # local json/jsonl/csv files: a list of words and a list of tags per row; names of integer tags given here
    python recipes/token_classification.py --model_name_or_path <folder> --train_file train.jsonl \\
        --validation_file dev.jsonl --label_names O,B-PER,I-PER,B-LOC,I-LOC --output_dir runs/ner

    accelerate launch recipes/token_classification.py ...      # any number of processes, same flags

Words are tokenised into sub-words; the first sub-word of each word gets the word's label and the others -100
(--label_all_tokens: the word's label, B- turned into I-), as do special tokens, so the loss and the metrics see
one position per word. Batches are padded per batch to their longest row. Metrics, computed offline by the
built-in `token_classification` metric: entity-level precision/recall/F1 with conlleval's span rules (IOB1 and
IOB2 tags) and token accuracy, exact on any number of processes.
"""

import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from accel_trainer.kit.text import MissingInputError, load_config, load_pretrained, load_text_dataset, tokenizer_for

name = "token_classification"
# run_ner.py's defaults (flags override them): batch 8, 3 epochs, lr 5e-5 (linear decay, no warm-up).
defaults = {
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "num_train_epochs": 3,
    "learning_rate": 5e-5,
}


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
    tokenizer_name: str | None = field(default=None, metadata={"help": "Hub id or folder of the (fast) tokenizer."})
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub id (e.g. conll2003) or local dataset folder in Hub layout; or --train_file."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: str | None = field(default=None, metadata={"help": "Local .json/.jsonl/.csv training file."})
    validation_file: str | None = field(default=None, metadata={"help": "Local .json/.jsonl/.csv validation file."})
    eval_split: str = field(default="validation", metadata={"help": "Split of --dataset_name to evaluate on."})
    tokens_column: str = field(default="tokens", metadata={"help": "Column holding each row's list of words."})
    tags_column: str = field(default="ner_tags", metadata={"help": "Column holding each row's list of word tags."})
    label_names: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated tag of each label id (O,B-PER,I-PER,...). Default: the names of the tags "
            "column's ClassLabel feature, or for string tags their sorted set in the train split."
        },
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={"help": "Label every sub-word of a word (B- becomes I- after the first), not only the first."},
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate rows to this many tokens."})
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad each batch to a multiple of this (8 helps fp16 tensor cores)."}
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where downloaded models/datasets and the tokenised cache go (default: the Hugging Face caches)."
        },
    )

    def __post_init__(self):
        if self.train_file is None and self.dataset_name is None:
            self.dataset_name = "conll2003"  # run_ner.py's example, when no data is named
        if self.train_file and self.dataset_name:
            raise ValueError("pass either --dataset_name or --train_file (with --validation_file), not both.")
        if self.validation_file and not self.train_file:
            raise ValueError("--validation_file needs --train_file too (or use --dataset_name).")


def _raw(args):
    """The raw splits {"train", "eval"?}, as datasets."""
    if args.train_file:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        raw = load_text_dataset(data_files=files, cache_dir=args.cache_dir)
        eval_split = "validation"
    else:
        raw = load_text_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir)
        eval_split = args.eval_split
        for split in ("train", eval_split):
            if split not in raw:
                raise MissingInputError(
                    f"dataset {args.dataset_name!r} has no {split!r} split; it has {list(raw)}. "
                    "Pass --eval_split one of those."
                )
    splits = {"train": raw["train"]}
    if eval_split in raw:
        splits["eval"] = raw[eval_split]
    for ds in splits.values():
        for column, flag in ((args.tokens_column, "--tokens_column"), (args.tags_column, "--tags_column")):
            if column not in ds.column_names:
                raise MissingInputError(
                    f"the data has no column {column!r}; its columns are {ds.column_names}. Pass {flag} one of them."
                )
    return splits


def _labels(args) -> tuple[str, ...]:
    """Tag names by label id: --label_names, else the tags column's ClassLabel names, else (string tags) their
    sorted set over the train split -- the same on every rank, as it is a function of the data only."""
    fields = ("label_names", "train_file", "validation_file", "dataset_name", "dataset_config_name", "eval_split",
              "tokens_column", "tags_column", "cache_dir")  # fmt: skip
    return _labels_of(tuple((f, getattr(args, f)) for f in fields))


@functools.cache  # build_model, build_data and build_metrics all need them; the data is read once per process
def _labels_of(key: tuple) -> tuple[str, ...]:
    args = type("LabelArgs", (), dict(key))
    if args.label_names:
        return tuple(n.strip() for n in args.label_names.split(",") if n.strip())
    train = _raw(args)["train"]
    feature = train.features[args.tags_column]
    inner = getattr(feature, "feature", None)
    if inner is None and isinstance(feature, list) and feature:
        inner = feature[0]
    if getattr(inner, "names", None):
        return tuple(inner.names)
    tags = {t for row in train[args.tags_column] for t in row}
    if tags and all(isinstance(t, str) for t in tags):
        return tuple(sorted(tags))
    raise MissingInputError(
        f"the tags column {args.tags_column!r} holds label ids without names: pass --label_names with the tag of "
        "each id in order, e.g. --label_names O,B-PER,I-PER."
    )


def build_model(ctx):
    from transformers import AutoModelForTokenClassification

    args = ctx.args
    labels = _labels(args)
    id2label = dict(enumerate(labels))
    label2id = {n: i for i, n in id2label.items()}
    kw = {"num_labels": len(labels), "id2label": id2label, "label2id": label2id, "cache_dir": args.cache_dir}
    if args.config_name:
        model = AutoModelForTokenClassification.from_config(load_config(args.config_name, **kw))
    else:
        # A base checkpoint (e.g. bert-base-cased) gets a freshly initialised token head of len(labels) classes.
        model = load_pretrained(AutoModelForTokenClassification, args.model_name_or_path, **kw)
    return model  # --gradient_checkpointing and --mixed_precision are applied by the Trainer


def align_labels(word_ids: list, word_labels: list[int], b_to_i: list[int], label_all_tokens: bool) -> list[int]:
    """Per-token labels of one row: the word's label on its first sub-word; -100 on special tokens and (unless
    label_all_tokens, which gives them the word's label with B- as I-) on its other sub-words."""
    out, previous = [], None
    for w in word_ids:
        if w is None:
            out.append(-100)
        elif w != previous:
            out.append(word_labels[w])
        else:
            out.append(b_to_i[word_labels[w]] if label_all_tokens else -100)
        previous = w
    return out


def build_data(ctx):
    from transformers import DataCollatorForTokenClassification

    args, accelerator = ctx.args, ctx.accelerator
    tokenizer = tokenizer_for(args)
    if not tokenizer.is_fast:
        raise MissingInputError(
            f"tokenizer {args.tokenizer_name or args.model_name_or_path!r} is not a fast tokenizer, which the "
            "sub-word to word alignment needs: pass --tokenizer_name a tokenizer with a tokenizer.json."
        )
    labels = _labels(args)
    label2id = {n: i for i, n in enumerate(labels)}
    # B-X -> I-X (when the model has I-X) for --label_all_tokens; other labels map to themselves
    b_to_i = [label2id.get("I-" + n[2:], i) if n.startswith("B-") else i for i, n in enumerate(labels)]
    splits = _raw(args)

    def tokenize(batch):
        enc = tokenizer(batch[args.tokens_column], truncation=True, max_length=args.max_seq_length,
                        is_split_into_words=True)  # fmt: skip
        tags = [[label2id[t] if isinstance(t, str) else int(t) for t in row] for row in batch[args.tags_column]]
        enc["labels"] = [
            align_labels(enc.word_ids(i), row, b_to_i, args.label_all_tokens) for i, row in enumerate(tags)
        ]
        return enc

    # Tokenise once: datasets caches map() results (keyed by a fingerprint of data and function), so the other
    # ranks, which wait for the main process, load the cache.
    with accelerator.main_process_first():
        splits = {
            k: ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc=f"tokenizing {k}")
            for k, ds in splits.items()
        }
    # Pads input_ids/attention_mask with the tokenizer's pad id and labels with -100, per batch.
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=args.pad_to_multiple_of)
    # A partial of a module-level function, not a closure: DataLoader workers started by spawn can pickle it.
    # "tokenizer": saved with the model, so that from_pretrained(output_dir) and pipeline() load both
    return {**splits, "collate": functools.partial(pad_collate, collator=collator), "tokenizer": tokenizer}


def pad_collate(examples, collator):
    return dict(collator(examples))


def loss(model, batch):
    out = model(**batch)  # cross-entropy, mean over the labelled positions (labels != -100)
    return out.loss, int((batch["labels"] != -100).sum())


def eval_step(model, batch):
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    per_token = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    # Per-row sums and counts, not the batch mean: exact when the ranks' last batches carry Accelerate's repeats.
    # predictions/references are [batch, tokens] with -100 where nothing is scored; rows of different ranks may
    # have different widths, which the Trainer pads with -100 before gathering.
    return {
        "loss": per_token.sum(1),
        "n_items": (labels != -100).sum(1),
        "predictions": logits.argmax(-1),
        "references": labels,
    }


def build_metrics(ctx):
    from accel_trainer.kit.metrics import load_metric

    # entity precision/recall/f1 and token accuracy, reported as eval_precision, eval_recall, eval_f1, eval_accuracy
    return {"entities": load_metric("token_classification", label_names=_labels(ctx.args))}


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
