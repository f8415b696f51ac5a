"""`run(recipe)`: what `python recipes/x.py` and `accelerate launch recipes/x.py` call.

Parses TrainingArguments plus the recipe's own Args, builds the Trainer and fits. A known kind of bad input
(missing data, an occupied output folder, a bad checkpoint) ends with one clear line on stderr and exit 1,
not a traceback; anything else raises as usual.
"""

from __future__ import annotations

import sys

from .args import parse_args
from .errors import UserError
from .recipe import load_recipe
from .trainer import Trainer

# Errors whose message already says what is wrong and what to do: no traceback needed.
USER_ERRORS = (UserError, FileNotFoundError, FileExistsError, NotADirectoryError)


def run(recipe, argv: list[str] | None = None) -> dict:
    recipe = load_recipe(recipe)
    targs, rargs, given = parse_args(recipe.Args, argv, defaults=recipe.defaults, return_given=True)
    if recipe.configure:
        recipe.configure(rargs, targs, given)
    try:
        return Trainer(recipe, targs, rargs).fit()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
