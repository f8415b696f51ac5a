"""How an error speaks to the user at the entry point they used: flags on the command line (`--overwrite_output_dir`),
keyword arguments in Python (`overwrite_output_dir=True`).

Messages are written once, with flags (the command line is the reference form, and most runs use it). `run()` marks
its call as the command line; anywhere else is the Python API, where `python_api` (on Trainer(...), from_recipe(...),
fit()) renders every argument a message names as the keyword the user types (`argument`), and raises the bad
input as one exception of the project's type (errors.UserError) with one line and no chain of internal frames.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from dataclasses import fields

from .args import (
    COMM_HOOKS,
    COMMON_SCHEDULERS,
    FSDP_REDUCE_DTYPES,
    LR_SCALING,
    MIXED_PRECISION,
    NAN_POLICIES,
    STRATEGIES,
    TrainingArguments,
)
from .errors import UserError

# Errors whose message already says what is wrong and what to do: no traceback needed (run.py prints one line).
USER_ERRORS = (UserError, FileNotFoundError, FileExistsError, NotADirectoryError)

_COMMAND_LINE = contextvars.ContextVar("accel_trainer_command_line", default=False)

# The words a flag takes as its value in a message ("--nan_policy skip"): rendered as that keyword's string value.
CHOICES = {
    "mixed_precision": MIXED_PRECISION,
    "ddp_comm_hook": COMM_HOOKS,
    "fsdp_reduce_dtype": FSDP_REDUCE_DTYPES,
    "nan_policy": NAN_POLICIES,
    "lr_scaling": LR_SCALING,
    "lr_scheduler_type": COMMON_SCHEDULERS,
    "resume_from_checkpoint": ("latest", "auto"),
    "eval_strategy": STRATEGIES,
    "save_strategy": STRATEGIES,
}
_BOOLS = frozenset(f.name for f in fields(TrainingArguments) if f.type in ("bool", bool))
_NAMES = frozenset(f.name for f in fields(TrainingArguments))
_NUMBER = re.compile(r"-?\d[\d_]*(\.\d+)?([eE][-+]?\d+)?$")
# --name, optionally followed by one value token (which `argument` decides is a value or prose)
_FLAG = re.compile(r"--([a-z][a-z0-9_]*)(?: ([^\s,;()]+))?")


@contextlib.contextmanager
def command_line():
    """The calls inside are the command line's (run()): messages keep their flags."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def argument(name: str, value=None, names=_NAMES, bools=_BOOLS) -> str:
    """An argument (and its value, if any) as the user writes it at this entry point: `--nan_policy skip` on the
    command line, `nan_policy="skip"` in Python; a switch is `--overwrite_output_dir` / `overwrite_output_dir=True`."""
    if _COMMAND_LINE.get():
        return f"--{name}" + ("" if value is None else f" {value}")
    if name.startswith("no_") and name[3:] in bools:  # the --no_name form of a switch that defaults to True
        return f"{name[3:]}=False"
    if name in bools:
        return f"{name}=True"
    if value is None:
        return name
    return f"{name}={value!r}"


def _value(name: str, token: str | None):
    """The token after `--name` in a message if it is that flag's value (a number, one of its choices, a path),
    else None: "--output_dir to choose" is prose."""
    if token is None:
        return None
    token = token.rstrip(".:")
    if _NUMBER.match(token):
        return float(token) if any(c in token for c in ".eE") else int(token)
    if token in CHOICES.get(name, ()) or ("/" in token and len(token) > 1):  # a path, not "a / b"
        return token
    return None


def for_python(message: str, extra_names=frozenset()) -> str:
    """`message` with every flag of TrainingArguments (or `extra_names`, the recipe's own fields) it names written as
    the Python keyword (argument()); other `--words` (`--help` of a command) stay. One line."""
    names = _NAMES | frozenset(extra_names)

    def render(m: re.Match) -> str:
        name, token = m.group(1), m.group(2)
        plain = name[3:] if name.startswith("no_") else name
        if plain not in names:
            return m.group(0)
        value = _value(name, token)
        out = argument(name, value, names=names)
        if token is not None and value is None:  # the token was prose: keep it
            return f"{out} {token}"
        tail = token[len(token.rstrip(".:")) :] if token is not None else ""
        return out + tail

    return " ".join(_FLAG.sub(render, message).split())


def python_error(error: BaseException, extra_names=frozenset()) -> UserError:
    """A bad-input error met in the Python API as a UserError (its own class when it is one) speaking Python."""
    text = for_python(str(error), extra_names)
    if isinstance(error, UserError):
        error.args = (text,)
        return error
    return UserError(text)


def python_api(fn):
    """At a Python API entry point (Trainer(...), from_recipe(...), fit()): bad input raises one UserError of one
    line whose arguments are keywords, without the internal frames and the exception chain that led to it. Inside
    run() (the command line) it changes nothing: run() prints the flags' line itself."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _COMMAND_LINE.get():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            recipe = getattr(args[0], "recipe", None) if args else None
            own = {f.name for f in fields(recipe.Args)} if getattr(recipe, "Args", None) is not None else ()
            error = python_error(e, own)
            raise error.with_traceback(None) from None

    return wrapper
