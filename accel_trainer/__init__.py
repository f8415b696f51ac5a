"""accel-trainer: a thin training loop on Hugging Face Accelerate. See README.md and docs/architecture.md."""

from .args import TrainingArguments, parse_args
from .metrics import load_metric
from .recipe import Recipe, load_recipe
from .run import run
from .trainer import Trainer

__all__ = ["Trainer", "TrainingArguments", "Recipe", "load_recipe", "load_metric", "parse_args", "run"]
__version__ = "0.1.0"
