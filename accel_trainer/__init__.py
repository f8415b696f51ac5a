"""accel-trainer: a thin training loop on Hugging Face Accelerate. See README.md and docs/architecture.md."""

from .args import TrainingArguments
from .errors import UserError
from .flags import parse_args
from .kit.metrics import load_metric
from .notebook import notebook_launcher
from .recipe import Recipe, RecipeContext, load_recipe
from .resolve import resolve_args
from .run import run
from .trainer import Trainer

__all__ = [
    "Recipe",
    "RecipeContext",
    "Trainer",
    "TrainingArguments",
    "UserError",
    "load_metric",
    "load_recipe",
    "notebook_launcher",
    "parse_args",
    "resolve_args",
    "run",
]
__version__ = "0.3.0"
