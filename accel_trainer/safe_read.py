"""The one way the package reads a file that someone else could have written or replaced: a checkpoint's JSON, the
output folder's records (best/best.json, the lock's record), an arguments file, a saved model's config.

A file is opened without following a link and without blocking (a FIFO would block `open` forever), taken only if
it is a regular file (a device never ends), read up to a bound (a sparse file of terabytes would be read to its
end), and its JSON parsed strictly: a key repeated in an object (Python's json keeps the last one silently) and
nesting deep enough to exhaust the parser's recursion are refused, and so is an integer beyond 64 bits (no field
holds one; a 400-digit one made `math.isfinite` and every float conversion raise OverflowError in the checks that
read it, a traceback instead of a refusal). Every failure is a ValueError or an OSError with
a short reason, for the caller's one line. Only the standard library: argument parsing imports this at start-up.
`tests/test_architecture.py` holds the package to it: no `json.load`/`json.loads` and no reading `open()` of
such files elsewhere."""

from __future__ import annotations

import errno
import json
import os
import stat

MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON files are kilobytes (an optimizer's param groups: megabytes at most)


def read_bytes(file: str, max_bytes: int) -> bytes:
    """The bytes of the regular file `file` (a link is not followed), at most `max_bytes` of them; a larger file is
    a ValueError, not a read without end."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the OS's words for it, "Too many levels of symbolic links", mislead
            raise ValueError("a symbolic link, not followed") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"{info.st_size} bytes, more than the {max_bytes} it may hold")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # grew while read
        raise ValueError(f"more than the {max_bytes} bytes it may hold")
    return raw


def read_text(file: str, max_bytes: int = MAX_JSON_BYTES) -> str:
    """read_bytes as UTF-8 text (ValueError if it is not)."""
    try:
        return read_bytes(file, max_bytes).decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason})") from None


def read_json(file: str, max_bytes: int = MAX_JSON_BYTES):
    """A JSON file as Python objects, strictly (loads)."""
    return loads(read_bytes(file, max_bytes))


def loads(raw: bytes | str):
    """JSON text as Python objects, strictly: a repeated key or nesting past the parser's recursion is a
    ValueError with a short reason, as anything else JSON refuses."""
    try:
        return json.loads(raw, object_pairs_hook=_no_repeated_keys, parse_int=_int64)
    except RecursionError:
        raise ValueError("JSON nested too deep to parse") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason})") from None


def _int64(text: str) -> int:
    """An integer that fits 64 bits, signed or not (a seed is a uint64); past that (or json's own digit limit) a
    ValueError naming its size, not the number."""
    value = int(text) if len(text) <= 21 else None
    if value is None or not -(2**63) <= value < 2**64:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits, beyond the 64 bits any field holds")
    return value


def _no_repeated_keys(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k[:80]!r} appears twice in one object")
        out[k] = v
    return out
