"""The command line as TrainingArguments (and a recipe's own Args): argparse, one flag per dataclass field built the
way `transformers.HfArgumentParser` builds them (same flags and types; `--help` with defaults; a YAML/JSON file of
arguments). A recipe adds its own fields in its own dataclass; both are parsed together.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Any

from . import safe_read
from .args import ArgumentError, TrainingArguments
from .transformers_names import transformers_name


class _Parser(argparse.ArgumentParser):
    """argparse, its errors one line (bad input is one line naming the fix): argparse printed its usage first, every
    flag of the run, some 50 lines above the one that matters. `--help` still prints them all."""

    def error(self, message):
        hint = " (--help lists every flag)" if message.startswith("unrecognized arguments") else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows every field's default, also for recipe fields that have no help text."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(" not in text:
            text = text.replace("%", "%%")  # argparse %-formats help: a literal % ("30% of training") must not crash
        if action.default is not argparse.SUPPRESS and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _read_args_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ArgumentError(f"Arguments file {path} does not exist.")
    import yaml

    try:
        data = safe_read.read_json(path) if path.endswith(".json") else yaml.safe_load(safe_read.read_text(path))
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArgumentError(
            f"Arguments file {path} cannot be read ({reason}): give a JSON or YAML file of arguments."
        ) from None
    if not isinstance(data, dict):
        raise ArgumentError(f"Arguments file {path} must hold a mapping of argument names to values.")
    names = [k for k in data if not isinstance(k, str)]  # YAML keys may be numbers, null, lists
    if names:
        raise ArgumentError(
            f"Arguments file {path}: the key {str(names[0])[:80]!r} is no argument name: give names as text "
            "(max_steps: 100)."
        )
    return data


def boolean(text: str) -> bool:
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false, yes/no, 1/0).")


def _choice(choices):
    by_text = {str(c): c for c in choices}

    def choice(text):
        return by_text.get(text, text)  # argparse then checks membership in `choices`

    return choice


def _option_names(name: str) -> list[str]:
    """--name_with_underscores and, as HfArgumentParser adds it, --name-with-underscores."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def _add_field(parser: argparse.ArgumentParser, f: Field, hint) -> None:
    """One dataclass field as flags, as transformers.HfArgumentParser adds it: --name and --name-with-hyphens;
    Optional[X] parses as X and a union with str (report_to) as str; bool takes an optional true/false and a
    field that defaults to True also gets --no_name; Literal and Enum give choices; list[X] takes one or more.
    Our own because `import transformers` alone costs more of every run's start-up than everything else we import
    over torch (docs/benchmarks.md, "Choices the numbers decided")."""
    kwargs = {k: v for k, v in f.metadata.items() if k != "aliases"}
    aliases = f.metadata.get("aliases", [])
    names = _option_names(f.name)
    names += [aliases] if isinstance(aliases, str) else list(aliases)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if str not in members and len(members) != 1:
            raise TypeError(f"Field {f.name}: a union parses only as Optional[X] or with str, got {hint}.")
        hint = str if str in members else members[0]
    if f.default is not MISSING:
        kwargs["default"] = f.default
    elif f.default_factory is not MISSING:
        kwargs["default"] = f.default_factory()
    else:
        kwargs["required"] = True
    origin = typing.get_origin(hint) or hint
    if origin is typing.Literal or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        kwargs["choices"] = typing.get_args(hint) if origin is typing.Literal else [e.value for e in hint]
        kwargs["type"] = _choice(kwargs["choices"])
    elif hint is bool:
        kwargs.update(type=boolean, nargs="?", const=True)  # --flag, --flag true, --flag false
        kwargs.setdefault("default", False)
        kwargs.pop("required", None)
    elif isinstance(origin, type) and issubclass(origin, list):
        kwargs.update(type=typing.get_args(hint)[0], nargs="+")
    else:
        kwargs["type"] = hint
    parser.add_argument(*names, **kwargs)
    if hint is bool and f.default is True:  # after --name: the first action sets the default
        parser.add_argument(
            *_option_names(f"no_{f.name}"),
            action="store_false",
            dest=f.name,
            default=argparse.SUPPRESS,
            help=f"Sets --{f.name} to False.",
        )


def _build_parser(classes: list[type]) -> argparse.ArgumentParser:
    # --learning_rat must be an error, not a prefix of --learning_rate: allow_abbrev=False.
    parser = _Parser(allow_abbrev=False, formatter_class=_DefaultsHelpFormatter)
    for cls in classes:
        hints = typing.get_type_hints(cls)  # resolves `from __future__ import annotations` strings
        for f in fields(cls):
            if f.init:
                _add_field(parser, f, hints[f.name])
    return parser


def parse_args(
    recipe_args_cls: type | None = None,
    argv: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    return_given: bool = False,
):
    """Parse the command line into (TrainingArguments, recipe args or None), and with `return_given` also the
    set of field names the user gave (by flag or in the arguments file), which a recipe's `configure` needs to
    tell a value the user chose from a default it may replace (e.g. a preset's epochs).

    `argv` may start with a .yaml/.yml/.json file of arguments; flags after it override the file.
    `defaults` (a recipe's own choices, e.g. its learning rate) replace our defaults and are overridden by both.
    A bad flag or value exits with status 2 and a message that names it (argparse's convention).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    classes = [TrainingArguments] + ([recipe_args_cls] if recipe_args_cls is not None else [])
    parser = _build_parser(classes)
    for action in parser._actions:
        if not action.help:  # argparse prints no default for a field without help text: name its type
            action.help = getattr(action.type, "__name__", "value") if action.type else "flag"
    known = {a.dest for a in parser._actions}
    dest_of = {opt: a.dest for a in parser._actions for opt in a.option_strings}
    given = {dest_of[t.split("=", 1)[0]] for t in argv if t.split("=", 1)[0] in dest_of}
    try:
        preset = dict(defaults or {})
        if argv and argv[0].endswith((".yaml", ".yml", ".json")):
            from_file = _read_args_file(argv.pop(0))
            given |= set(from_file)
            preset.update(from_file)
        unknown = sorted(set(preset) - known)
        if unknown:
            raise ArgumentError(f"unknown argument(s) {', '.join(unknown)} in the arguments file or recipe defaults.")
        parser.set_defaults(**preset)
        for token in argv:  # a transformers flag that is no field here: what to pass instead
            name = token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else None
            if name and name not in known and transformers_name(name):
                raise ArgumentError(transformers_name(name))
        # argparse itself exits 2 with "unrecognized arguments: --x" for an unknown flag.
        values = vars(parser.parse_args(argv))
        parsed = [cls(**{f.name: values[f.name] for f in fields(cls) if f.init}) for cls in classes]
    except (ArgumentError, ValueError) as e:
        parser.error(str(e))
    result = (parsed[0], parsed[1] if recipe_args_cls is not None else None)
    return (*result, given) if return_given else result
