"""What a dataclass field's value must be, by its declared type: the check argparse makes for flags, made for what
does not come through argparse -- a keyword in Python, a value in an arguments file, a checkpoint's record of the
run's arguments (checkpointing/record.py). TrainingArguments and a recipe's arguments dataclass alike."""

from __future__ import annotations

import enum
import math
import types
import typing
from dataclasses import fields
from typing import Any

INT64 = 2**63


def field_type_problems(obj, bounds: dict | None = None) -> list[tuple[str, str]]:
    """(field, what is wrong) for each field of the dataclass `obj` whose value is not of its declared type or out of
    `bounds` ({field: (lowest allowed, first not allowed or None)}): an int
    field holds an int (not 16.0, not True), a float field a finite number, a str field a str, a Literal one of its
    values. argparse converts flags; a keyword in Python, an arguments file or a checkpoint's record of the run's
    arguments come as they are, and 16.0 as a batch size or "0.01" as a learning rate failed deep in torch."""
    hints = typing.get_type_hints(type(obj))
    problems = []
    for f in fields(obj):
        if not (f.init and f.name in hints):
            continue
        value, (low, below) = getattr(obj, f.name), (bounds or {}).get(f.name, (None, None))
        if not _is_of(value, hints[f.name]):
            problems.append((f.name, f"{_shown(value)} is not {_type_name(hints[f.name])}."))
        elif isinstance(value, (int, float)) and (
            (low is not None and value < low) or (below is not None and value >= below)
        ):
            allowed = f"in [{low}, {below})" if below is not None else f">= {low}"
            problems.append((f.name, f"must be {allowed}, got {value}."))
    return problems


def _is_of(value, hint) -> bool:
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_of(value, m) for m in members)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in members
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_is_of(v, members[0]) for v in value) if members else True
    if hint is bool:
        return type(value) is bool
    if hint is int:  # torch's and numpy's integers are 64 bits; past that every count overflowed somewhere deep
        return type(value) is int and -INT64 <= value < INT64
    if hint is float:  # an int is a float's value (--learning_rate 1 in YAML); NaN and infinity are no setting
        return (type(value) is int and -INT64 <= value < INT64) or (type(value) is float and math.isfinite(value))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in [e.value for e in hint]
    if isinstance(hint, type) and hint is not Any:
        return isinstance(value, hint)
    return True


def _shown(value) -> str:
    """The value for a one-line message: a 400-digit integer or a megabyte string is named by its size."""
    text = (
        repr(value)
        if not (type(value) is int and abs(value) >= INT64)
        else f"an integer of {len(str(abs(value)))} digits"
    )
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _type_name(hint) -> str:
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(m) for m in members)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, members))
    names = {
        int: "an integer of at most 64 bits",
        float: "a finite number",
        bool: "true or false",
        str: "a string",
        type(None): "None",
    }
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")


def value_problem(cls, name: str, value, bounds: dict | None = None) -> str | None:
    """What is wrong with `value` for field `name` of dataclass `cls` (field_type_problems' rule), or None."""
    hint = typing.get_type_hints(cls).get(name)
    if hint is None:
        return None
    if not _is_of(value, hint):
        return f"{_shown(value)} is not {_type_name(hint)}"
    low, below = (bounds or {}).get(name, (None, None))
    if isinstance(value, (int, float)) and (
        (low is not None and value < low) or (below is not None and value >= below)
    ):
        return f"{value!r} is out of its range ({'[' + str(low) + ', ' + str(below) + ')' if below is not None else '>= ' + str(low)})"
    return None
