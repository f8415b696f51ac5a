"""The recipe seam: a recipe is a plain object (usually a module) with a few duck-typed functions.

See docs/architecture.md for the contract. No subclassing: `Recipe.from_module(module)` collects the
functions a recipe module defines; in a notebook, build a `Recipe(...)` directly from functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any


@dataclass
class Recipe:
    build_model: Callable[..., Any]  # (args, targs) -> nn.Module
    build_data: Callable[..., dict]  # (args, targs, accelerator) -> {"train": ..., "eval": ...}
    loss: Callable[..., Any]  # (model, batch) -> (mean loss, n_items)
    Args: type | None = None  # the recipe's own dataclass of command-line fields
    collate: Callable | None = None  # (examples) -> batch, for Dataset data
    build_optimizer: Callable | None = None  # (model, args, targs) -> Optimizer
    build_scheduler: Callable | None = None  # (optimizer, num_training_steps, args, targs) -> LR scheduler
    eval_step: Callable | None = None  # (model, batch) -> {"loss", "n_items", "predictions", "references"}
    build_metrics: Callable | None = None  # (args) -> {name: evaluate.EvaluationModule}
    on_evaluate: Callable | None = None  # (trainer, metrics, final) -> dict | None: extra metrics
    defaults: dict | None = None  # the recipe's own defaults for TrainingArguments fields
    configure: Callable | None = None  # (args, targs, given) -> None: adjust arguments after parsing (presets)
    name: str = "recipe"

    @classmethod
    def from_module(cls, module: Any) -> Recipe:
        missing = [n for n in ("build_model", "build_data", "loss") if not callable(getattr(module, n, None))]
        if missing:
            raise TypeError(
                f"Recipe {getattr(module, '__name__', module)!r} lacks {', '.join(missing)}: a recipe "
                "defines build_model(args, targs), build_data(args, targs, accelerator) and "
                "loss(model, batch) -> (loss, n_items). See docs/architecture.md."
            )
        kw = {f.name: getattr(module, f.name) for f in fields(cls) if hasattr(module, f.name)}
        if "name" not in kw:
            kw["name"] = getattr(module, "__name__", "recipe").rsplit(".", 1)[-1]
            if kw["name"] == "__main__":
                kw["name"] = os.path.splitext(os.path.basename(getattr(module, "__file__", "recipe")))[0]
        return cls(**kw)


def load_recipe(spec: Any) -> Recipe:
    """A Recipe from a Recipe, a module object, a file path (recipes/x.py) or an importable module name."""
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str):
        if spec.endswith(".py") or os.sep in spec:
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"Recipe file {spec} does not exist.")
            name = os.path.splitext(os.path.basename(spec))[0]
            mod_spec = importlib.util.spec_from_file_location(f"accel_trainer_recipe_{name}", spec)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module  # dataclasses need the module registered
            mod_spec.loader.exec_module(module)
            module.name = getattr(module, "name", name)
            spec = module
        else:
            spec = importlib.import_module(spec)
    if isinstance(spec, ModuleType) or hasattr(spec, "build_model"):
        return Recipe.from_module(spec)
    raise TypeError(f"Cannot make a recipe of {spec!r}.")
