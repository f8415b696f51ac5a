"""Causal language modelling with any `AutoModelForCausalLM` (default `gpt2`) on a Hub text dataset or local
text files.

    # fine-tune a checkpoint (Hub id or local folder) on local text
    python recipes/causal_lm.py --model_name_or_path gpt2 --train_file input.txt --output_dir runs/clm

    # from scratch: a config (Hub id or folder) + a tokenizer, random init; --config_overrides shrinks it
    python recipes/causal_lm.py --config_name gpt2 --config_overrides n_layer=4,n_embd=128,n_head=4 \\
        --tokenizer_name <folder> --train_file ../shared/data/tinyshakespeare/input.txt --block_size 128

Text is tokenised once and cached by `datasets` (a second run, or the other ranks, read the cache), then
packed into blocks of exactly --block_size tokens (the standard recipe), or with --packing false each line is
one example, padded per batch with the padding excluded from the loss.

The loss is the mean over target tokens, and `loss()` returns the number of target tokens with it: the
Trainer weights micro-batches by that count across accumulation steps and processes, so an update's gradient
is the mean over every target token of the global batch, however unevenly they fall into micro-batches.
Eval reports eval_loss (token-weighted), eval_perplexity = exp(eval_loss), and a short generated sample.
"""

import functools
import glob
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from accel_trainer.errors import UserError
from accel_trainer.kit.text import (
    MissingInputError,
    length_grouped_loader,
    load_config,
    load_pretrained,
    load_text_dataset,
    tokenizer_for,
)

name = "causal_lm"


@dataclass
class Args:
    model_name_or_path: str | None = field(
        default="gpt2",
        metadata={
            "help": "Hub id or local folder (save_pretrained) of the model; its tokenizer too unless "
            "--tokenizer_name. With --config_name, used only for the tokenizer."
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Train from scratch: Hub id or folder of a config; random init."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "With --config_name: comma-separated key=value, e.g. n_layer=4,n_embd=128."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Hub id or folder of the tokenizer."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id or local dataset folder (instead of --train_file)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: str | None = field(default=None, metadata={"help": "Local .txt/.csv/.json(l) training file."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file."})
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "Without a validation split or file: hold out the last this-many percent of the train rows."},
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training example."})
    packing: bool = field(
        default=True,
        metadata={
            "help": "Pack the token stream into block_size blocks. false: one line = one "
            "example (truncated to block_size, padded per batch)."
        },
    )
    group_by_length: bool = field(
        default=False, metadata={"help": "With --packing false: batches of similar length (less padding)."}
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where downloaded models/datasets and the tokenised cache go (default: the Hugging Face caches)."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the training data as a stream (datasets' streaming=True): nothing is downloaded whole or "
            "cached, for corpora larger than memory or disk. --train_file may be a glob ('shards/*.jsonl'); the "
            "files are split across processes, tokenised and packed on the fly by --dataloader_num_workers "
            "workers. Needs --max_steps. Evaluation: --validation_file (read whole), else none. docs/data.md"
        },
    )
    sample_prompt: str = field(default="", metadata={"help": "Prompt for the sample generated at each eval."})
    sample_max_new_tokens: int = field(default=40, metadata={"help": "Length of that sample; 0 = no sample."})

    def __post_init__(self):
        if not (self.dataset_name or self.train_file):
            raise ValueError("no data: pass --train_file <text file> or --dataset_name <Hub id or local folder>.")
        if self.group_by_length and self.packing:
            raise ValueError("--group_by_length needs --packing false (packed blocks all have --block_size tokens).")
        if self.streaming and self.group_by_length:
            raise ValueError("--group_by_length needs the whole dataset; it cannot be used with --streaming.")
        if self.block_size < 2:
            raise ValueError(f"--block_size must be >= 2 (one input and one target token), got {self.block_size}.")


def build_model(ctx):
    from transformers import AutoModelForCausalLM

    args = ctx.args
    if args.config_name:
        config = load_config(args.config_name, cache_dir=args.cache_dir)
        if args.config_overrides:
            config.update_from_string(args.config_overrides)
        config.vocab_size = len(tokenizer_for(args))  # a from-scratch model must fit its tokenizer
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, cache_dir=args.cache_dir)
    max_pos = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if max_pos is not None and args.block_size > max_pos:
        raise UserError(
            f"--block_size {args.block_size} is longer than the model's {max_pos} positions: pass "
            f"--block_size {max_pos} or less."
        )
    return model  # --gradient_checkpointing and --mixed_precision are applied by the Trainer


def _load_raw(args):
    if args.dataset_name:
        raw = load_text_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir)
    else:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        # keep_linebreaks: packed text keeps its line structure (matters for verse/code); per-line examples don't
        kwargs = {"keep_linebreaks": args.packing} if args.train_file.endswith((".txt", ".text")) else {}
        raw = load_text_dataset(data_files=files, cache_dir=args.cache_dir, **kwargs)
    if "train" not in raw:
        raise MissingInputError(f"the dataset has no 'train' split (it has {list(raw)}).")
    if "validation" not in raw:
        # Hold out the tail, unshuffled: deterministic, and for a single long text (Shakespeare) it's a
        # contiguous, unseen passage rather than lines interleaved with the training ones.
        # (select() of a range, not train_test_split: its fingerprint is deterministic, so the tokenised
        # cache is found again by the next run.)
        n = len(raw["train"])
        n_eval = max(1, int(n * args.validation_split_percentage / 100))
        raw["validation"] = raw["train"].select(range(n - n_eval, n))
        raw["train"] = raw["train"].select(range(n - n_eval))
    if args.text_column not in raw["train"].column_names:
        raise MissingInputError(
            f"no column {args.text_column!r} in the dataset (columns: {raw['train'].column_names}); pass --text_column."
        )
    return raw


def build_data(ctx):
    args, accelerator = ctx.args, ctx.accelerator
    tokenizer = tokenizer_for(args)
    block = args.block_size
    eos = tokenizer.eos_token_id

    def tokenize_lines(batch):
        # One example per non-empty line, ending in EOS so the model learns where a line stops.
        ids = tokenizer(batch[args.text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [(x + ([eos] if eos is not None else []))[:block] for x in ids]}

    # Rows of a .txt file are lines (with their line breaks kept); rows of a dataset are documents, which get
    # an EOS after each so the model sees where one ends and the next begins in the packed stream.
    rows_are_lines = not args.dataset_name and args.train_file.endswith((".txt", ".text"))
    doc_end = [] if rows_are_lines or eos is None else [eos]

    def tokenize(batch):
        ids = tokenizer(batch[args.text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + doc_end for x in ids]}

    def pack(batch):
        # Concatenate the batch's token streams and cut into full blocks; the remainder (< block tokens per
        # 1000 rows) is dropped, as in transformers' run_clm.py.
        stream = [t for ids in batch["input_ids"] for t in ids]
        n = len(stream) // block * block
        return {"input_ids": [stream[i : i + block] for i in range(0, n, block)]}

    if args.streaming:
        splits = {"eval": _load_validation(args)} if args.validation_file else {}
    else:
        raw = _load_raw(args)
        splits = {"train": raw["train"], "eval": raw["validation"]}

    # Tokenise once: map() results are cached next to the dataset, keyed by a fingerprint of the data and
    # of these functions (tokenizer and block size included); the main process writes, the others then read.
    with accelerator.main_process_first():
        out = {}
        for k, ds in splits.items():
            cols = ds.column_names
            if args.packing:
                ds = ds.map(tokenize, batched=True, remove_columns=cols, desc=f"tokenizing {k}")
                ds = ds.map(pack, batched=True, batch_size=1000, desc=f"packing {k} into blocks of {block}")
            else:
                ds = ds.filter(lambda b: [bool(t.strip()) for t in b[args.text_column]], batched=True)
                ds = ds.map(tokenize_lines, batched=True, remove_columns=cols, desc=f"tokenizing {k}")
            if len(ds) == 0:
                what = f"full block of {block} tokens" if args.packing else "non-empty line"
                raise MissingInputError(f"the {k} split has no {what}; give more text or a smaller --block_size.")
            out[k] = ds
    collate = functools.partial(pad_collate, pad_id=tokenizer.pad_token_id)
    # group_by_length: our own batch loader of similar-length batches instead of the Trainer's shuffled DataLoader
    loader = length_grouped_loader(ctx, collate) if args.group_by_length else None
    # "tokenizer": saved with the model, so that from_pretrained(output_dir) and pipeline() load both
    if args.streaming:
        return {"train": _stream(ctx, tokenize, pack, tokenize_lines), "eval": out.get("eval"), "collate": collate,
                "tokenizer": tokenizer}  # fmt: skip
    return {"train": out["train"], "eval": out["eval"], "collate": collate,
            "loader": loader, "tokenizer": tokenizer}  # fmt: skip


def _data_files(pattern: str) -> list[str]:
    """--train_file as files: a glob ('shards/*.txt') expands to its matches, sorted (one order on every rank)."""
    return sorted(glob.glob(os.path.expanduser(pattern))) or [pattern]  # no match: load_text_dataset names it


def _text_kwargs(args, path: str) -> dict:
    # keep_linebreaks: packed text keeps its line structure (matters for verse/code); per-line examples don't
    return {"keep_linebreaks": args.packing} if path.endswith((".txt", ".text")) else {}


def _load_validation(args):
    """--validation_file, read whole (a stream has no held-out tail): eval counts every line once."""
    raw = load_text_dataset(
        data_files={"validation": args.validation_file},
        cache_dir=args.cache_dir,
        **_text_kwargs(args, args.validation_file),
    )
    return raw["validation"]


def _stream(ctx, tokenize, pack, tokenize_lines):
    """The training split as this rank's stream: a datasets IterableDataset over the files (or Hub dataset), each
    rank reading its own files (split_dataset_by_node: whole files when their number divides by the number of
    processes, else every world_size-th example), tokenised and packed as it is read (in the loader's workers,
    which share out this rank's files)."""
    from datasets.distributed import split_dataset_by_node

    args = ctx.args
    if args.dataset_name:
        raw = load_text_dataset(
            args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir, streaming=True, split="train"
        )
    else:
        files = _data_files(args.train_file)
        raw = load_text_dataset(
            data_files={"train": files},
            cache_dir=args.cache_dir,
            streaming=True,
            split="train",
            **_text_kwargs(args, files[0]),
        )
    col = args.text_column
    columns = raw.column_names
    if columns is None:  # datasets 3.x knows a streamed json's columns only once it reads a row: peek at the first
        columns = list(next(iter(raw), {}))
    if col not in columns:
        raise MissingInputError(f"no column {col!r} in the dataset (columns: {columns}); pass --text_column.")
    ds = split_dataset_by_node(raw, rank=ctx.process_index, world_size=ctx.world_size).select_columns([col])
    if args.packing:
        return ds.map(tokenize, batched=True, remove_columns=[col]).map(pack, batched=True, batch_size=1000)
    ds = ds.filter(lambda b: [bool(t.strip()) for t in b[col]], batched=True)
    return ds.map(tokenize_lines, batched=True, remove_columns=[col])


def pad_collate(examples, pad_id: int):
    """Right-pad to the longest example of the batch; padding is masked from attention and from the loss."""
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        input_ids[i, : len(e["input_ids"])] = torch.as_tensor(e["input_ids"])
        attention_mask[i, : len(e["input_ids"])] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _token_losses(model, batch):
    """Per-example (summed next-token cross-entropy, number of target tokens)."""
    # use_cache=False: training and scoring don't need the KV cache (generate() still uses one)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    targets = batch["labels"][:, 1:]  # position t predicts token t+1; -100 = padding, not a target
    # Rows of (tokens, vocabulary), not (batch, vocabulary, positions): torch's softmax over a dimension that is
    # not the last one is slower for the whole loss (docs/benchmarks.md, "Causal-LM tokens/s"). float(): the
    # softmax in fp32 even under mixed precision. Ignored positions give 0.
    per_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view(targets.shape)
    return per_token.sum(dim=1), (targets != -100).sum(dim=1)


def loss(model, batch):
    sums, counts = _token_losses(model, batch)
    n_tokens = counts.sum()
    # The mean over this micro-batch's target tokens, with their count: the Trainer weights by the count, so
    # an update averages over every target token of the global batch. clamp: no targets -> 0, not NaN.
    return sums.sum() / n_tokens.clamp(min=1), n_tokens


def eval_step(model, batch):
    with torch.no_grad():
        sums, counts = _token_losses(model, batch)
    # Per-example sums and counts (not one batch mean): eval_loss = sum / count over the gathered split is
    # then exact on any world size, even when examples have different numbers of tokens.
    return {"loss": sums, "n_items": counts}


def generate_sample(
    model, tokenizer, prompt: str = "", max_new_tokens: int = 40, seed: int = 0, synced_gpus: bool = False
) -> str:
    """A short sampled continuation of `prompt` (from BOS/EOS if empty), without touching the training RNG.
    `synced_gpus`: every process keeps stepping until all are done (transformers' switch for sharded models,
    whose every forward is a collective): no rank can stop at EOS while another still generates."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"] if prompt else None
    if ids is None or ids.numel() == 0:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = torch.tensor([[start]])
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    # fork_rng: the sample is reproducible for a seed, and training's random stream is left where it was
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(
            ids.to(device),
            attention_mask=torch.ones_like(ids).to(device),
            do_sample=True,
            top_k=50,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            synced_gpus=synced_gpus,
        )
    model.train(was_training)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def on_evaluate_end(trainer, metrics, final):
    extra = {}
    if "eval_loss" in metrics:
        # eval_loss is the token-weighted mean over the whole eval split, so exp() of it is the perplexity
        extra["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 700.0))
    args = trainer.recipe_args
    if args.sample_max_new_tokens > 0:
        # Every rank generates (the same sample: same weights and seed), so that a sharded model, whose forward
        # is a collective, is never run by one rank alone; only the main process prints it. Under FSDP the ranks
        # also agree at every step on whether to go on (synced_gpus), so that none can stop first and hang the others.
        sample = generate_sample(
            trainer.unwrapped_model,
            tokenizer_for(args),
            args.sample_prompt,
            args.sample_max_new_tokens,
            seed=trainer.args.seed,
            synced_gpus=trainer.sharded and trainer.accelerator.num_processes > 1,
        )
        trainer.reporter.print(f"[sample @ step {trainer.global_step}] {sample!r}")
        extra["eval_sample"] = sample
    return extra


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
