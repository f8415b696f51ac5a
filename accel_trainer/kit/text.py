"""Text helpers shared by `recipes/glue.py` and `recipes/causal_lm.py`.

Only what both recipes need and would otherwise copy verbatim: loading a tokenizer / config / model from a
Hub name *or* a local folder through the one `from_pretrained` code path, loading a dataset from a Hub name,
a local folder or local files, and turning the confusing errors those raise when something is missing (a
typo'd path, no network) into one message that names the problem and the fix.

Everything here is a thin wrapper over transformers / datasets; a recipe copied out of this repo can inline it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from .hub import is_local_path, is_offline

__all__ = [
    "MissingInputError",
    "load_tokenizer",
    "recipe_tokenizer",
    "tokenizer_for",
    "load_config",
    "load_pretrained",
    "load_text_dataset",
    "LengthGroupedBatches",
    "length_grouped_loader",
]


class MissingInputError(FileNotFoundError):
    """A model, tokenizer or dataset that the command line names cannot be found."""


def _check_exists(name: str, what: str, flag: str) -> None:
    if not name:
        raise MissingInputError(f"no {what} given: pass {flag} <Hub id or local folder>.")
    if is_local_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise MissingInputError(
            f"{what} path {name!r} does not exist. Pass {flag} an existing folder written by "
            f"`save_pretrained` (with config.json / tokenizer files), or a Hub id such as 'gpt2' "
            f"(downloads need network access)."
        )


def _from_pretrained(load: Callable[..., Any], name: str, what: str, flag: str, **kwargs) -> Any:
    """`load(name, **kwargs)` with a clear error when `name` is neither a local folder nor reachable on the Hub."""
    _check_exists(name, what, flag)
    try:
        return load(os.path.expanduser(name), **kwargs)
    except OSError as err:  # transformers raises OSError for both "no such repo" and "no network"
        where = "local folder" if os.path.isdir(os.path.expanduser(name)) else "Hub id"
        hint = " HF_HUB_OFFLINE is set, so only local folders and the local Hub cache are used." if is_offline() else ""
        raise MissingInputError(
            f"could not load the {what} from {where} {name!r}: {err}\n"
            f"Fix: pass {flag} a folder written by `save_pretrained`, or a Hub id that exists and is "
            f"reachable (or already in the Hub cache).{hint}"
        ) from err


def load_tokenizer(name_or_path: str, flag: str = "--tokenizer_name", **kwargs):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, "tokenizer", flag, **kwargs)


@functools.cache
def recipe_tokenizer(name_or_path: str | None, cache_dir: str | None = None):
    """The tokenizer a text recipe names (--tokenizer_name, else --model_name_or_path), loaded once per process
    (build_model, build_data and collate all need it), with a pad token: GPT-2 style tokenizers have none, and
    padded positions are masked out of attention and loss anyway."""
    if not name_or_path:
        raise MissingInputError("no tokenizer: pass --tokenizer_name (Hub id or folder) or --model_name_or_path.")
    tok = load_tokenizer(name_or_path, flag="--tokenizer_name/--model_name_or_path", cache_dir=cache_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_for(args):
    """`recipe_tokenizer` for a text recipe's Args (fields tokenizer_name, model_name_or_path, cache_dir)."""
    return recipe_tokenizer(args.tokenizer_name or args.model_name_or_path, args.cache_dir)


def load_config(name_or_path: str, flag: str = "--config_name", **kwargs):
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig.from_pretrained, name_or_path, "model config", flag, **kwargs)


def load_pretrained(auto_cls, name_or_path: str, flag: str = "--model_name_or_path", **kwargs):
    """`auto_cls.from_pretrained(name_or_path)` (e.g. `AutoModelForCausalLM`) with the clear-error wrapper."""
    return _from_pretrained(auto_cls.from_pretrained, name_or_path, "model", flag, **kwargs)


_BUILDER_BY_EXT = {
    ".txt": "text",
    ".text": "text",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


def load_text_dataset(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    data_files: dict | None = None,
    builder: str | None = None,
    **kwargs,
):
    """`datasets.load_dataset` from a Hub name, a local folder in Hub layout, or local files.

    data_files: {"train": path(s), "validation": path(s)}; `builder` is then inferred from the extension
    (.txt -> "text", .csv -> "csv", .json/.jsonl -> "json", .parquet -> "parquet") unless given.
    """
    import datasets

    if data_files:
        for split, paths in data_files.items():
            for p in [paths] if isinstance(paths, str) else paths:
                if not os.path.exists(os.path.expanduser(p)):
                    raise MissingInputError(
                        f"{split} file {p!r} does not exist. Pass --{split}_file an existing text/csv/json "
                        f"file, or --dataset_name <Hub id or local dataset folder> instead."
                    )
        if builder is None:
            first = next(iter(data_files.values()))
            first = first if isinstance(first, str) else first[0]
            ext = os.path.splitext(first)[1].lower()
            builder = _BUILDER_BY_EXT.get(ext)
            if builder is None:
                raise ValueError(
                    f"can't tell the format of {first!r} from its extension {ext!r}: "
                    f"use one of {sorted(_BUILDER_BY_EXT)}"
                )
        return datasets.load_dataset(builder, data_files=dict(data_files), **kwargs)

    if not dataset_name:
        raise MissingInputError("no dataset given: pass --dataset_name <Hub id or local folder> or --train_file.")
    if is_local_path(dataset_name) and not os.path.exists(os.path.expanduser(dataset_name)):
        raise MissingInputError(
            f"dataset path {dataset_name!r} does not exist. Pass --dataset_name an existing local folder "
            f"(Hub layout, e.g. ../shared/data/glue) or a Hub id (needs network)."
        )
    try:
        return datasets.load_dataset(os.path.expanduser(dataset_name), dataset_config_name, **kwargs)
    except ValueError as err:
        if "BuilderConfig" not in str(err):
            raise
        raise MissingInputError(
            f"dataset {dataset_name!r} has no config {dataset_config_name!r}: {err}\n"
            f"Fix: pass a config name that exists in it (--task_name for GLUE, --dataset_config_name otherwise)."
        ) from err
    except (FileNotFoundError, ConnectionError, OSError) as err:
        # DatasetNotFoundError subclasses FileNotFoundError; no network shows up as ConnectionError/OSError.
        raise MissingInputError(
            f"could not load dataset {dataset_name!r} (config {dataset_config_name!r}): {err}\n"
            f"Fix: pass --dataset_name a local dataset folder (Hub layout) or a Hub id that is reachable "
            f"(or cached), and a config name that exists in it."
        ) from err


class LengthGroupedBatches:
    """A batch loader (see docs/architecture.md) whose batches hold examples of similar length, so dynamic
    padding pads little -- `group_by_length` of transformers' Trainer, for the recipe seam.

    Per epoch: a permutation seeded by (seed, epoch); cut into mega-batches of `megabatch_mult` global batches;
    each sorted by length; cut into global micro-batches of batch_size x world size; their order shuffled (so
    lengths don't grow monotonically through the epoch). Rank r takes its contiguous share of each global batch.
    The global batches therefore depend only on (seed, epoch, batch_size x world size): 1 process x batch 8
    sees the same global batches as 2 processes x batch 4. The last incomplete global batch is split as evenly
    as the ranks allow (the Trainer weights by item count, so unequal shares are still exact); only a tail
    smaller than the world size is dropped, so that no rank gets an empty batch.
    """

    def __init__(
        self,
        dataset,
        lengths,
        batch_size: int,
        collate,
        accelerator,
        seed: int = 0,
        megabatch_mult: int = 50,
        drop_last: bool = False,
    ):
        if len(lengths) != len(dataset):
            raise ValueError(f"{len(lengths)} lengths for {len(dataset)} examples")
        self.dataset, self.lengths, self.collate = dataset, list(lengths), collate
        self.batch_size, self.seed, self.megabatch_mult = batch_size, seed, megabatch_mult
        self.drop_last = drop_last  # --dataloader_drop_last: no incomplete global batch at the end of an epoch
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.device = accelerator.device
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def global_batches(self, epoch: int) -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        size = self.batch_size * self.world
        mega = size * self.megabatch_mult
        batches = []
        for i in range(0, len(perm), mega):
            chunk = sorted(perm[i : i + mega], key=lambda j: self.lengths[j], reverse=True)
            batches += [chunk[k : k + size] for k in range(0, len(chunk), size)]
        full = [b for b in batches if len(b) == size]
        tail = [j for b in batches if len(b) < size for j in b]
        order = torch.randperm(len(full), generator=g).tolist()
        out = [full[i] for i in order]
        if len(tail) >= self.world and not self.drop_last:
            out.append(sorted(tail, key=lambda j: self.lengths[j], reverse=True))
        return out

    def _shard(self, batch: list[int]) -> list[int]:
        # contiguous near-equal shares: rank r gets [r*n//W, (r+1)*n//W)
        n = len(batch)
        return batch[self.rank * n // self.world : (self.rank + 1) * n // self.world]

    def __len__(self) -> int:
        # mega-batches are whole multiples of the global batch, so only the very last global batch is partial
        size = self.batch_size * self.world
        return len(self.lengths) // size + (len(self.lengths) % size >= self.world and not self.drop_last)

    def skip_first_batches(self, n: int):
        return self._iter(n)

    def __iter__(self):
        return self._iter(0)

    def _iter(self, skip: int):
        from accelerate.utils import send_to_device

        for batch in self.global_batches(self.epoch)[skip:]:
            yield send_to_device(self.collate([self.dataset[j] for j in self._shard(batch)]), self.device)


def length_grouped_loader(ctx, collate, column: str = "input_ids"):
    """A build_data `loader` factory: LengthGroupedBatches for the train split, the Trainer's DataLoader (None)
    for eval. The Trainer has already cut the split to --max_train_samples."""

    def loader(dataset, *, batch_size, train, drop_last):
        if not train:
            return None
        lengths = [len(x) for x in dataset[column]]
        return LengthGroupedBatches(
            dataset, lengths, batch_size, collate, ctx.accelerator, seed=ctx.targs.seed, drop_last=drop_last
        )

    return loader
