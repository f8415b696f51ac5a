"""THE argument resolution of a run (resolve_args), shared by every entry point so they cannot drift."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

from .args import TrainingArguments
from .checkpointing import record
from .errors import ArgumentError
from .field_types import field_type_problems
from .flags import parse_args
from .recipe import Recipe, RecipeContext, load_recipe
from .transformers_names import transformers_name
from .world import launched_world_size


def _field_defaults(obj) -> dict[str, Any]:
    out = {}
    for f in fields(obj):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def user_values(targs: TrainingArguments | None, rargs=None) -> dict[str, Any]:
    """The values a notebook user set on argument objects they built themselves: the fields passed to
    `TrainingArguments(...)`, and the recipe Args fields that differ from their defaults (a recipe's dataclass
    cannot record its caller; a value equal to the default is then taken as unset)."""
    values = {}
    if targs is not None:
        values.update({k: getattr(targs, k) for k in getattr(targs, "_user_fields", ())})
    if rargs is not None and is_dataclass(rargs):
        default = _field_defaults(rargs)
        values.update(
            {
                f.name: getattr(rargs, f.name)
                for f in fields(rargs)
                if f.name not in default or getattr(rargs, f.name) != default[f.name]
            }
        )
    return values


@dataclass(frozen=True)
class ResolvedArgs:
    """What `resolve_args` returns and `Trainer(recipe, resolved)` takes as it is: the resolved training arguments,
    the recipe's arguments and the fields the user set; with them the recipe they were resolved for (loaded once)
    and the one RecipeContext of the run, which `configure` saw and the Trainer completes (RecipeContext.complete).
    Unpacks as before: `targs, rargs, given = resolve_args(...)`."""

    targs: TrainingArguments
    rargs: Any  # the recipe's Args instance, or None
    given: frozenset
    recipe: Recipe
    ctx: RecipeContext
    resumed: tuple | None = (
        None  # (checkpoint, its record) whose arguments this run continues (checkpointing/record.py)
    )
    notes: tuple = ()  # lines to say at start-up: arguments given with other values than the resumed run's

    def __iter__(self):
        return iter((self.targs, self.rargs, self.given))


def resolve_args(recipe, argv: list[str] | None = None, values: dict[str, Any] | None = None, world_size=None):
    """THE argument resolution of a run, for every entry point (python recipes/x.py, accelerate launch,
    accel-trainer train, Trainer.from_recipe, Trainer(recipe, TrainingArguments(...))), so they cannot drift:

        our defaults  <  the recipe's `defaults`  <  its `configure` (presets)  <  a resumed run's record
                      <  what the user set

    The user's values come either from a command line (`argv`, which may start with a YAML/JSON arguments file)
    or from Python (`values`: field names of TrainingArguments or the recipe's Args). `configure` sees which fields
    the user set (`ctx.given`) and leaves them alone. Returns ResolvedArgs (unpacks as targs, recipe args or None, given).
    A bad flag exits 2 (argparse); a bad keyword raises ArgumentError naming it.
    """
    recipe = load_recipe(recipe)  # the one load of a run: the Trainer takes it from the result
    if values is None:
        targs, rargs, given = parse_args(recipe.Args, argv, defaults=recipe.defaults, return_given=True)
    else:
        names = {"targs": {f.name for f in fields(TrainingArguments)}}
        names["rargs"] = {f.name for f in fields(recipe.Args)} if recipe.Args is not None else set()
        unknown = sorted(set(values) - names["targs"] - names["rargs"])
        transformers_names = [transformers_name(name, keyword=True) for name in unknown if transformers_name(name)]
        if transformers_names:  # what to pass instead
            raise ArgumentError(transformers_names[0])
        if unknown:
            raise ArgumentError(
                f"unknown argument(s) {', '.join(unknown)} for recipe {recipe.name}: pass TrainingArguments fields "
                f"or fields of the recipe's Args (python recipes/{recipe.name}.py --help lists them)."
            )
        chosen = {**(recipe.defaults or {}), **values}  # the recipe's defaults, then the user's values
        targs = TrainingArguments(**{k: v for k, v in chosen.items() if k in names["targs"]})
        rargs = recipe.Args(**{k: v for k, v in chosen.items() if k in names["rargs"]}) if recipe.Args else None
        given = set(values)
    for name, problem in field_type_problems(rargs) if rargs is not None else ():  # as TrainingArguments' own
        raise ArgumentError(f"--{name}: {problem}")  # a 400-digit --data_seed was a traceback in numpy
    given = frozenset(given)
    # The run's one RecipeContext. configure runs before the Accelerator exists (its presets may change the
    # arguments the Accelerator is built from), so it sees the launcher's world; the Trainer completes this same
    # object once the Accelerator exists (RecipeContext.complete), and every builder gets it.
    world = world_size if world_size is not None else launched_world_size()
    ctx = RecipeContext(args=rargs, targs=targs, world_size=world, given=given)
    if recipe.configure:
        recipe.configure(ctx)
    targs.output_dir = output_dir_of(targs, recipe)  # after configure: a preset may name the folder
    # A resumed run continues the run it resumes: what the user left out comes from that run's record.
    resumed = record.find(targs.resume_from_checkpoint, targs.output_dir)
    notes = record.apply(targs, rargs, given, resumed, world) if resumed is not None else []
    return ResolvedArgs(targs, rargs, given, recipe, ctx, resumed, tuple(notes))


def output_dir_of(args: TrainingArguments, recipe: Recipe) -> str:
    """--output_dir, or output/<recipe name> when it is not given."""
    return args.output_dir if args.output_dir is not None else os.path.join("output", recipe.name)
