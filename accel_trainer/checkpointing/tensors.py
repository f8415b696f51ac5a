"""A checkpoint's tensor files, read without loading them whole: a safetensors file's header (names, shapes, dtypes,
metadata), NaN and infinity scanned in slices of bounded size, and DCP's safetensors shards (each rank's part of a
sharded tensor, at the offsets its header gives), whose chunks must cover each tensor exactly once, where FSDP2
puts each rank's part, in shards named for this checkpoint's step. verify.py reads them before a resume, load.py
compares what they hold with the run."""

from __future__ import annotations

import math
import os
import re

import torch

from .. import safe_read
from ..errors import why
from .folder import CheckpointError

# safetensors' dtype codes, as torch names them
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # fmt: skip


def read_header(path: str, file: str, step: int | None, scan: bool = True, finite=None):
    """A safetensors file's tensors {name: (shape, dtype name)} and metadata; `scan`: each tensor read and refused
    when a floating one holds NaN, or an infinity where it is in `finite` (True: every tensor) -- a parameter or an
    optimizer's state; a buffer may hold -inf (an attention mask); `step`: the step its metadata must name."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            metadata = f.metadata() or {}
            found = {}
            for k in f.keys():
                part = f.get_slice(k)
                found[k] = (tuple(part.get_shape()), _SAFETENSORS_DTYPES.get(part.get_dtype(), part.get_dtype()))
                if scan and _non_finite(f, k, finite is True or (finite is not None and k in finite)):
                    raise CheckpointError(
                        f"Checkpoint {path}: {file} holds NaN or infinity in {k}: a run that diverged before the "
                        "checkpoint was written (accel-trainer stops a run on a non-finite loss). Resume from an "
                        "earlier checkpoint."
                    )
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure means the file cannot be restored
        raise CheckpointError(f"Checkpoint {path}: {file} is not a readable safetensors file ({why(e)}).") from None
    if step is not None and metadata.get("step") != str(step):
        raise CheckpointError(
            f"Checkpoint {path}: {file} was written at step {metadata.get('step')}, not at this checkpoint's step "
            f"{step}: a file of another checkpoint. Resume from another checkpoint."
        )
    return found, metadata


def _non_finite(f, name: str, no_inf: bool) -> bool:
    """NaN (or, with `no_inf`, an infinity) in tensor `name` of the open safetensors file `f`, read in slices of
    bounded size (a tensor is not read whole into memory)."""
    part = f.get_slice(name)
    shape = part.get_shape()
    if not _SAFETENSORS_DTYPES.get(part.get_dtype(), "").startswith(("float", "bfloat")):
        return False  # integers, bools: no NaN to hold
    if not shape or shape[0] == 0:
        return _has_non_finite(f.get_tensor(name), no_inf)
    rows = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
    return any(_has_non_finite(part[start : start + rows], no_inf) for start in range(0, shape[0], rows))


def _has_non_finite(t, no_inf: bool) -> bool:
    # One pass (torch's aminmax propagates NaN): the extremes hold a NaN if any element does, and an infinity if
    # any element is one (a buffer's -inf is allowed where `no_inf` is off).
    if t.numel() == 0:
        return False
    low, high = (float(x) for x in torch.aminmax(t))
    return math.isnan(low) or math.isnan(high) or (no_inf and (math.isinf(low) or math.isinf(high)))


SHARD_FILE = re.compile(r"^shard-(\d{5})\.step_(\d+)\.safetensors$")  # state.name_shards: the rank and the step


def sharded_tensors(
    path: str, shards: list[str], scan: bool = True, step: int | None = None, ranks=None, finite=None
) -> dict:
    """{name: (global shape, dtype)} of DCP safetensors shards, whose chunks (each shard's offsets, which DCP
    writes in the header) must cover each tensor's global shape exactly once. With `step` and `ranks` (the
    verifier): each shard is named for this checkpoint's step (a shard of another checkpoint is named, not
    loaded), and a chunk sits where FSDP2 puts that rank's part (dim 0 split in `ranks` chunks of ceil(n / ranks)
    rows): chunks swapped between ranks tile a tensor too, with its rows in each other's place."""
    chunks: dict = {}
    for file in shards:
        found, metadata = read_header(path, file, None, scan, finite)
        named = SHARD_FILE.match(os.path.basename(file))
        if step is not None and (named is None or int(named.group(2)) != step):
            raise CheckpointError(
                f"Checkpoint {path}: {file} is not named as a shard of this checkpoint (shard-<rank>.step_{step}"
                ".safetensors): a shard of another checkpoint. Resume from another checkpoint."
            )
        try:
            info = safe_read.loads(metadata.get("DCP_SHARDING_INFO", "null"))
            offsets = {k: info[k]["saved_offsets"] for k in found}
        except (ValueError, TypeError, KeyError):
            raise CheckpointError(
                f"Checkpoint {path}: {file} has no DCP sharding information for its tensors."
            ) from None
        for k, (shape, dtype) in found.items():
            off = offsets[k]
            if not (isinstance(off, list) and len(off) == len(shape) and all(type(o) is int and o >= 0 for o in off)):
                raise CheckpointError(f"Checkpoint {path}: {file} gives {k} the offsets {str(off)[:80]}.")
            rank = int(named.group(1)) - 1 if named else None
            chunks.setdefault(k, []).append((tuple(off), shape, dtype, file, rank))
    out = {}
    for k, parts in chunks.items():
        shape = tuple(max(o[i] + s[i] for o, s, *_ in parts) for i in range(len(parts[0][1])))
        where = ", ".join(f"{list(o)} in {os.path.basename(f)}" for o, _, _, f, _ in parts[:4])
        if len({d for _, _, d, _, _ in parts}) > 1:
            raise CheckpointError(
                f"Checkpoint {path}: the shards of {k} hold it in different dtypes "
                f"({', '.join(sorted({d for _, _, d, _, _ in parts}))}: {where}). Resume from another checkpoint."
            )
        if len({o for o, *_ in parts}) < len(parts) or not _tile(shape, [(o, s) for o, s, *_ in parts]):
            raise CheckpointError(
                f"Checkpoint {path}: the shards of {k} do not cover it exactly once (chunks at {where}): a chunk moved "
                "to another place, or of another tensor. Resume from another checkpoint."
            )
        if ranks and len(parts) > 1:
            rows = -(-shape[0] // ranks)  # FSDP2's Shard(0): torch.chunk's ceil(n / ranks) rows per rank
            for off, size, _, file, rank in parts:
                expected = (rank * rows,) + (0,) * (len(shape) - 1)
                if math.prod(size) and rank is not None and off != expected:
                    raise CheckpointError(
                        f"Checkpoint {path}: {file} holds rank {rank}'s part of {k} at offsets {list(off)}, where "
                        f"rank {rank}'s rows are at {list(expected)}: chunks moved between ranks. Resume from another "
                        "checkpoint."
                    )
        out[k] = (shape, parts[0][2])
    return out


def _tile(shape: tuple, boxes: list) -> bool:
    """The boxes (offsets, sizes) cover `shape` exactly: as many elements as it has, and no two overlap."""
    boxes = [(o, s) for o, s in boxes if math.prod(s)]
    if sum(math.prod(s) for _, s in boxes) != math.prod(shape):
        return False
    return not any(
        all(a < b + t and b < a + u for a, u, b, t in zip(o1, s1, o2, s2))
        for i, (o1, s1) in enumerate(boxes)
        for o2, s2 in boxes[i + 1 :]
    )
