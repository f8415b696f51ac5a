"""Text helpers shared by `recipes/glue.py` and `recipes/causal_lm.py`.

Only what both recipes need and would otherwise copy verbatim: loading a tokenizer / config / model from a
Hub name *or* a local folder through the one `from_pretrained` code path, loading a dataset from a Hub name,
a local folder or local files, and turning the confusing errors those raise when something is missing (a
typo'd path, no network) into one message that names the problem and the fix.

Everything here is a thin wrapper over transformers / datasets; a recipe copied out of this repo can inline it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

__all__ = [
    "MissingInputError",
    "load_tokenizer",
    "load_config",
    "load_pretrained",
    "load_text_dataset",
]


class MissingInputError(FileNotFoundError):
    """A model, tokenizer or dataset that the command line names cannot be found."""


def _is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get(
        "TRANSFORMERS_OFFLINE", "0"
    ).lower() in ("1", "true", "yes")


def _looks_like_local_path(name: str) -> bool:
    # A Hub id is "name" or "org/name". Anything absolute, relative with ./ ../ ~, or with more than one
    # slash can only be a path on disk -- so if it doesn't exist we can say so without asking the Hub
    # (which, offline, retries for the best part of a minute before failing).
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\"))
        or name.count("/") > 1
        or name in (".", "..")
    )


def _check_exists(name: str, what: str, flag: str) -> None:
    if not name:
        raise MissingInputError(f"no {what} given: pass {flag} <Hub id or local folder>.")
    if _looks_like_local_path(name) and not os.path.exists(os.path.expanduser(name)):
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
        hint = (
            " HF_HUB_OFFLINE is set, so only local folders and the local Hub cache are used."
            if _is_offline()
            else ""
        )
        raise MissingInputError(
            f"could not load the {what} from {where} {name!r}: {err}\n"
            f"Fix: pass {flag} a folder written by `save_pretrained`, or a Hub id that exists and is "
            f"reachable (or already in the Hub cache).{hint}"
        ) from err


def load_tokenizer(name_or_path: str, flag: str = "--tokenizer_name", **kwargs):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, "tokenizer", flag, **kwargs)


def load_config(name_or_path: str, flag: str = "--config_name", **kwargs):
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig.from_pretrained, name_or_path, "model config", flag, **kwargs)


def load_pretrained(auto_cls, name_or_path: str, flag: str = "--model_name_or_path", **kwargs):
    """`auto_cls.from_pretrained(name_or_path)` (e.g. `AutoModelForCausalLM`) with the clear-error wrapper."""
    return _from_pretrained(auto_cls.from_pretrained, name_or_path, "model", flag, **kwargs)


_BUILDER_BY_EXT = {".txt": "text", ".text": "text", ".csv": "csv", ".json": "json", ".jsonl": "json",
                   ".parquet": "parquet"}


def load_text_dataset(
    dataset_name: Optional[str] = None,
    dataset_config_name: Optional[str] = None,
    data_files: Optional[dict] = None,
    builder: Optional[str] = None,
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
    if _looks_like_local_path(dataset_name) and not os.path.exists(os.path.expanduser(dataset_name)):
        raise MissingInputError(
            f"dataset path {dataset_name!r} does not exist. Pass --dataset_name an existing local folder "
            f"(Hub layout, e.g. ../shared/data/glue) or a Hub id (needs network)."
        )
    try:
        return datasets.load_dataset(os.path.expanduser(dataset_name), dataset_config_name, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError) as err:
        # DatasetNotFoundError subclasses FileNotFoundError; no network shows up as ConnectionError/OSError.
        raise MissingInputError(
            f"could not load dataset {dataset_name!r} (config {dataset_config_name!r}): {err}\n"
            f"Fix: pass --dataset_name a local dataset folder (Hub layout) or a Hub id that is reachable "
            f"(or cached), and a config name that exists in it."
        ) from err
