"""Where a name points: a Hugging Face Hub id or a path on this disk. Shared by the text and CIFAR loaders.

Why our own test instead of asking the Hub: offline (HF_HUB_OFFLINE, or no network) the Hub client retries for the
best part of a minute before failing, and then says "repo not found" for what was a mistyped local path.
"""

from __future__ import annotations

import os


def is_local_path(name: str) -> bool:
    """True when `name` can only be a folder or file on disk: it exists, or it cannot be a Hub id.

    A Hub id is "name" or "org/name". Anything absolute, starting with ./ ../ ~, with more than one slash or a
    backslash is a path, so if it does not exist we can say so without asking the Hub.
    """
    return (
        os.path.exists(os.path.expanduser(name))
        or os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\"))
        or name in (".", "..")
        or name.count("/") > 1
        or "\\" in name
    )


def is_offline() -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set: only local folders and the local Hub cache are used."""
    return any(
        os.environ.get(v, "0").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
