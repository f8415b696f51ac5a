"""The run's state as JSON plus tensors: what a checkpoint holds besides weights, with no pickle anywhere.

A checkpoint used to be Accelerate's `save_state` folder: the optimizer, scheduler, scaler and RNG states pickled
by torch.save, and under FSDP DCP's `.metadata` pickled by plain pickle. Every loader of those runs an unpickler on
bytes that came with the checkpoint, and each safe-looking allow-list was one more parser to get exactly right
(docs/fault-tolerance.md: a crafted FSDP checkpoint ran code through the second one). Here the same states are
written as JSON (Python's json: builds only dicts, lists, strings and numbers) and their tensors as safetensors
(a header and raw bytes); reading them back cannot run code whatever the bytes are, and reading twice gives the
same objects.

    tree = encode(state, tensors)          # tensors: {name: tensor} filled with the state's tensors (by path)
    state = decode(tree, tensors, where)   # the same state: every tensor reference resolved, each used once

What a state dict holds besides tensors -- tuples (betas, RNG states), dicts with int keys (an optimizer's state by
parameter index), NumPy arrays and scalars (NumPy's RNG state) -- is tagged in the JSON (`{"@tuple": [...]}`) so that
it comes back as it was: a resumed run is bit-identical. Anything else is refused when the checkpoint is written,
naming where it sits (EncodeError), not silently changed. With `tensors=None` tensors are written inline (base64),
for the per-rank files of a few kilobytes (RNG states).
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import torch

from ..errors import UserError

# dtypes a tensor or array in the JSON may name; the name is looked up in these tables, never imported or evaluated.
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool)
}  # fmt: skip
_NUMPY_DTYPES = {
    np.dtype(n).name: np.dtype(n) for n in ("float64", "float32", "int64", "int32", "uint32", "uint8", "bool")
}
_TAGS = ("@tuple", "@dict", "@tensor", "@ndarray", "@numpy")


class EncodeError(UserError):
    """A state holds a value a checkpoint cannot keep safely (no JSON form): the message names where."""


class DecodeError(ValueError):
    """A JSON tree that encode() does not write; the message says where in it."""


# ----------------------------------------------------------------------------------------------------- writing
def encode(obj, tensors: dict | None, path: str = ""):
    """`obj` as a JSON-able tree. Tensors go into `tensors` under their path in `obj` (`state.0.exp_avg`) and are
    referenced by it; with `tensors=None` they are written inline."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            return {"@tensor": _inline(obj.detach().cpu(), path)}
        if path in tensors:
            raise EncodeError(f"two tensors of the state are both named {path!r}; rename one of the keys.")
        tensors[path] = obj
        return {"@tensor": path}
    if isinstance(obj, np.ndarray):
        return {"@ndarray": _inline_array(obj, path)}
    if isinstance(obj, np.generic) and obj.dtype.name in _NUMPY_DTYPES:
        return {"@numpy": [obj.dtype.name, obj.item()]}
    if isinstance(obj, (list, tuple)):
        items = [encode(v, tensors, _join(path, i)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"@tuple": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("@") for k in obj):
            return {k: encode(v, tensors, _join(path, k)) for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise EncodeError(f"{path or 'the state'} has a key of type {type(k).__name__}, which a checkpoint "
                                  "cannot keep (str, int, float, bool, None, tuple).")  # fmt: skip
            pairs.append([encode(k, None, path), encode(v, tensors, _join(path, k))])
        return {"@dict": pairs}
    raise EncodeError(
        f"{path or 'the state'} holds a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint cannot "
        "keep: a state dict holds tensors, numbers, strings, None and lists, tuples or dicts of these."
    )


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _inline(t: torch.Tensor, path: str) -> dict:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise EncodeError(f"{path or 'the state'} is a tensor of dtype {t.dtype}, which a checkpoint cannot keep.")
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": dtype, "shape": list(t.shape), "data": base64.b64encode(data).decode()}


def _inline_array(a: np.ndarray, path: str) -> dict:
    if a.dtype.name not in _NUMPY_DTYPES:
        raise EncodeError(f"{path or 'the state'} is an array of dtype {a.dtype}, which a checkpoint cannot keep.")
    data = np.ascontiguousarray(a).tobytes()
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(data).decode()}


def dumps(tree) -> str:
    return json.dumps(tree, indent=1, allow_nan=True)


# ----------------------------------------------------------------------------------------------------- reading
def decode(tree, tensors: dict | None = None, used: set | None = None):
    """The state encode() made `tree` from; references into `tensors` resolved (their names added to `used`).
    Raises DecodeError, and only DecodeError, for anything encode() does not write: an unknown tag, a tensor
    reference that is not the reference encode() writes at that place (a tensor is named by its path), a bad
    inline tensor, a key or number no state dict holds."""
    try:
        return _decode(tree, tensors, used, "")
    except DecodeError:
        raise
    except (TypeError, ValueError, OverflowError, MemoryError) as e:  # a value Python or NumPy will not build
        raise DecodeError(f"a value that cannot be built ({type(e).__name__}: {str(e)[:120]})") from None


def _decode(tree, tensors, used, path: str):
    if tree is None or isinstance(tree, (bool, int, str, float)):
        return tree
    if isinstance(tree, list):
        return [_decode(v, tensors, used, _join(path, i)) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        raise DecodeError(f"a {type(tree).__name__}")
    tags = [k for k in tree if k.startswith("@")]
    if not tags:
        return {k: _decode(v, tensors, used, _join(path, k)) for k, v in tree.items()}
    if len(tree) != 1 or tags[0] not in _TAGS:
        raise DecodeError(f"an object with keys {sorted(tree)[:4]}")
    tag, value = tags[0], tree[tags[0]]
    if tag == "@tuple" and isinstance(value, list):
        return tuple(_decode(v, tensors, used, _join(path, i)) for i, v in enumerate(value))
    if tag == "@dict" and isinstance(value, list):
        out = {}
        for pair in value:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise DecodeError("a @dict entry that is not a [key, value] pair")
            key = _decode(pair[0], None, None, path)
            if not _plain_key(key) or key in out:
                raise DecodeError(f"a @dict key {str(key)[:80]} that is repeated or of another type")
            out[key] = _decode(pair[1], tensors, used, _join(path, key))
        return out
    if tag == "@tensor" and isinstance(value, str):
        if value != path:  # encode() names a tensor by its place: a reference elsewhere moves a tensor
            raise DecodeError(f"a reference to tensor {value[:100]!r} at {path[:100]!r}")
        if tensors is None or value not in tensors:
            raise DecodeError(f"a reference to tensor {value[:100]!r}, which is not in the checkpoint")
        if used is not None:
            used.add(value)
        return tensors[value]
    if tag == "@tensor" and isinstance(value, dict):
        raw, dtype, shape = _raw(value, _TORCH_DTYPES)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
    if tag == "@ndarray" and isinstance(value, dict):
        raw, dtype, shape = _raw(value, _NUMPY_DTYPES)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if tag == "@numpy" and isinstance(value, list) and len(value) == 2 and value[0] in _NUMPY_DTYPES:
        if not isinstance(value[1], (int, float, bool)):
            raise DecodeError("a @numpy value that is not a number")
        dtype = _NUMPY_DTYPES[value[0]]
        number = dtype.type(value[1])
        if number.item() != value[1] and not (isinstance(value[1], float) and math.isnan(value[1])):
            raise DecodeError(f"a @numpy {value[0]} holding {str(value[1])[:40]}, which it cannot")
        return number
    raise DecodeError(f"a malformed {tag}")


def _plain_key(key) -> bool:
    """A key encode() writes for a dict: a str, int, float, bool, None, or a tuple of these."""
    if isinstance(key, tuple):
        return all(_plain_key(k) and not isinstance(k, tuple) for k in key)
    return isinstance(key, (str, int, float, bool, type(None)))


def _raw(value: dict, dtypes: dict) -> tuple[bytes, object, list]:
    """An inline tensor's or array's bytes, dtype and shape, checked against each other."""
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if set(value) != {"dtype", "shape", "data"} or dtype not in dtypes or not isinstance(data, str):
        raise DecodeError("an inline tensor without a known dtype, a shape and its data")
    if not isinstance(shape, list) or not all(type(n) is int and 0 <= n < 1 << 40 for n in shape) or len(shape) > 8:
        raise DecodeError(f"an inline tensor of shape {str(shape)[:80]}")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise DecodeError("an inline tensor whose data is not base64") from None
    itemsize = (
        torch.tensor([], dtype=dtypes[dtype]).element_size() if dtypes is _TORCH_DTYPES else dtypes[dtype].itemsize
    )
    if len(raw) != math.prod(shape) * itemsize:
        raise DecodeError(f"an inline tensor of shape {shape} and dtype {dtype} with {len(raw)} bytes of data")
    return raw, dtypes[dtype], shape
