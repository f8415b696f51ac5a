"""The recipe seam: a recipe is a plain object (usually a module) with a few duck-typed functions.

Every builder gets one argument, a read-only `RecipeContext`: the recipe's arguments, the training arguments,
the world size and (once it exists) the accelerator and the run length. No recipe reads WORLD_SIZE or builds a
`PartialState()` of its own, and no recipe keeps state in module globals: what `collate` needs (a tokenizer),
`build_data` closes over and returns with the data. The contract is in docs/architecture.md; `recipes/regression.py`
shows every hook.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from .errors import UserError
from .events import EVENTS

# A recipe attaches to a named event (events.EVENTS, declared there once) by defining `on_<event>`.
EVENT_HOOKS = tuple(f"on_{event}" for event in EVENTS)


@dataclass(frozen=True)
class RecipeContext:
    """What a recipe's builders know about the run. Frozen: a builder reads it, it cannot re-point it.

    One per run: resolve_args builds it for `configure`, and the Trainer completes that same object as set-up
    learns more (`complete`), so `configure` and every builder see one context.
    `args` and `targs` are the resolved arguments; only `configure` may change their fields (presets).
    `accelerator` is None in `configure` (it is built from the resolved arguments), and `world_size` is then the
    launcher's; `num_training_steps` (optimizer updates of the whole run) is None until the data is built, i.e.
    known in build_optimizer/build_scheduler.
    """

    args: Any  # the recipe's own Args dataclass instance, or None
    targs: Any  # TrainingArguments
    world_size: int  # processes in the run (the launcher's world; 1 in a notebook)
    process_index: int = 0
    accelerator: Any = None
    num_training_steps: int | None = None
    given: frozenset = frozenset()  # the fields the user set (flags, arguments file, keyword arguments)
    resume_from: str | None = None  # the checkpoint this run resumes from (None: a new run)

    @property
    def resuming(self) -> bool:
        """Whether this run continues from a checkpoint (ctx.resume_from): build what the checkpoint was trained
        with, not something new (build_once keeps the artifacts of the run it resumes)."""
        return self.resume_from is not None

    def build_once(self, name: str, build: Callable[[str], Any], load: Callable[[str], Any]):
        """An artifact every rank must share (a tokenizer trained on the data, a vocabulary, label ids), built
        once: the main process runs `build(path)` to write it, then every rank returns `load(path)`, the same
        object on every rank. `path` is output_dir/name; a resumed run (ctx.resuming) loads the one its run built
        instead of building it again, a new run builds it anew.

        Why: built on each rank, it sees that rank's data order or randomness and comes out different (a tokenizer
        with other ids per rank: silently different models), and rebuilt on a resume it can differ from the one
        the checkpoint was trained with. For build_data and build_model (the accelerator exists); output_dir must
        be one folder for every machine, as checkpoints need. The wait for the main process is bounded by
        --ddp_timeout."""
        if self.accelerator is None:
            raise RecipeError("ctx.build_once needs the accelerator: call it in build_data or build_model.")
        path = os.path.join(self.targs.output_dir, name)
        if self.accelerator.is_main_process and not (self.resuming and os.path.exists(path)):
            # Built aside, then renamed: a run killed while building leaves no half artifact for its resume.
            aside = os.path.join(self.targs.output_dir, ".building", name)
            for stale in (aside, path):
                if os.path.isdir(stale):
                    shutil.rmtree(stale)
                elif os.path.exists(stale):
                    os.remove(stale)
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            build(aside)
            if not os.path.exists(aside):
                raise RecipeError(f"ctx.build_once({name!r}): build(path) wrote nothing at the path it was given.")
            os.replace(aside, path)
        self.accelerator.wait_for_everyone()
        return load(path)

    @property
    def device(self):
        return self.accelerator.device if self.accelerator is not None else None

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def learning_rate(self) -> float:
        """The learning rate to build the optimizer with: --learning_rate (targs.learning_rate, the user's value,
        never rewritten) after --lr_scaling for this world's global batch. The same as targs.learning_rate without
        --lr_scaling."""
        return self.targs.scaled_learning_rate(self.world_size)

    @property
    def global_batch_size(self) -> int:
        t = self.targs
        return t.per_device_train_batch_size * t.gradient_accumulation_steps * self.world_size

    def replace(self, **changes) -> RecipeContext:
        return dataclasses.replace(self, **changes)

    def complete(
        self, accelerator=None, targs=None, resume_from: str | None = None, num_training_steps: int | None = None
    ) -> RecipeContext:
        """The Trainer's, not a builder's: fill in what set-up has learnt (the Accelerator and this process's place
        in its world, with the checkpoint the run resumes from (None: a new run) and the Trainer's copy of the
        training arguments; then the run length) in this object, and return it. In place (frozen to recipes, hence
        object.__setattr__, which dataclasses document for this): a second Trainer from the same resolved arguments
        completes it again for its own Accelerator."""
        if targs is not None:
            object.__setattr__(self, "targs", targs)
        if accelerator is not None:
            object.__setattr__(self, "accelerator", accelerator)
            object.__setattr__(self, "resume_from", resume_from)
            object.__setattr__(self, "world_size", accelerator.num_processes)
            object.__setattr__(self, "process_index", accelerator.process_index)
        if num_training_steps is not None:
            object.__setattr__(self, "num_training_steps", num_training_steps)
        return self


@dataclass
class Recipe:
    build_model: Callable[..., Any]  # (ctx) -> nn.Module
    build_data: Callable[..., dict]  # (ctx) -> {"train", "eval"?, "collate"?, "loader"?}
    loss: Callable[..., Any]  # (model, batch) -> (mean loss, n_items)
    Args: type | None = None  # the recipe's own dataclass of command-line fields
    build_optimizer: Callable | None = None  # (model, ctx) -> Optimizer
    build_scheduler: Callable | None = None  # (optimizer, ctx) -> LR scheduler; ctx.num_training_steps is set
    eval_step: Callable | None = None  # (model, batch) -> {"loss", "n_items", "predictions", "references"}
    build_metrics: Callable | None = None  # (ctx) -> {name: metric with add_batch and compute (evaluate's)}
    defaults: dict | None = None  # the recipe's own defaults for TrainingArguments fields
    configure: Callable | None = None  # (ctx) -> None: adjust ctx.args/ctx.targs after parsing (presets)
    # FSDP: the module classes (or class names) that become their own FSDP unit, for a model without transformers'
    # _no_split_modules; without either, modules over 1M parameters are (sharding.configure_wrapping).
    fsdp_wrap: list | None = None
    # Events: {"update_end": handler, ...}, collected from the recipe's on_<event> functions (events.EVENTS).
    events: dict = field(default_factory=dict)
    name: str = "recipe"

    def __post_init__(self):  # Recipe(...) in a notebook is checked like a recipe module
        check_signatures(f"Recipe {self.name!r}", {f.name: getattr(self, f.name) for f in fields(self)})
        unknown = set(self.events) - set(EVENTS)
        if unknown:
            raise RecipeError(f"Recipe {self.name!r}: unknown events {sorted(unknown)}; the events are {EVENTS}.")

    @classmethod
    def from_module(cls, module: Any) -> Recipe:
        who = f"Recipe {getattr(module, '__file__', None) or getattr(module, '__name__', module)}"
        missing = [n for n in ("build_model", "build_data", "loss") if not callable(getattr(module, n, None))]
        if missing:
            raise RecipeError(
                f"{who} lacks {', '.join(missing)}: a recipe defines build_model(ctx), build_data(ctx) and "
                "loss(model, batch) -> (loss, n_items). See docs/architecture.md."
            )
        if callable(getattr(module, "on_evaluate", None)):  # the 0.1 name of on_evaluate_end: say so, don't ignore
            raise RecipeError(f"{who}: rename on_evaluate to on_evaluate_end (CHANGELOG.md, 0.2.0).")
        kw = {f.name: getattr(module, f.name) for f in fields(cls) if f.name != "events" and hasattr(module, f.name)}
        kw["events"] = {e: getattr(module, f"on_{e}") for e in EVENTS if callable(getattr(module, f"on_{e}", None))}
        if "name" not in kw:
            kw["name"] = getattr(module, "__name__", "recipe").rsplit(".", 1)[-1]
            if kw["name"] == "__main__":
                kw["name"] = os.path.splitext(os.path.basename(getattr(module, "__file__", "recipe")))[0]
        return cls(**kw)


class RecipeError(UserError, TypeError):
    """A recipe that does not follow the contract. A TypeError too, as it was before 0.2.0 (callers catching that)."""


# How many positional arguments the Trainer passes each hook: the contract, once (docs/architecture.md).
# 0.1.0 builders took (args, targs[, accelerator]); 0.2.0 passes one read-only ctx (CHANGELOG.md).
CONTRACT = {
    "build_model": ("ctx",),
    "build_data": ("ctx",),
    "loss": ("model", "batch"),
    "build_optimizer": ("model", "ctx"),
    "build_scheduler": ("optimizer", "ctx"),
    "eval_step": ("model", "batch"),
    "build_metrics": ("ctx",),
    "configure": ("ctx",),
}


def _fits(fn: Callable, n: int) -> bool:
    """Whether fn can be called with n positional arguments (False only when its signature says it cannot)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: no signature to check, the call will tell
        return True
    try:
        sig.bind(*range(n))
    except TypeError:
        return False
    return True


def check_signatures(who: str, hooks: dict) -> None:
    """Refuse, at load time and in one line, a hook whose signature cannot take what the Trainer passes.

    Why here: a builder written to the 0.1.0 contract (build_model(args, targs)) otherwise fails deep inside the
    Trainer with a bare "<lambda>() missing 1 required positional argument".
    """
    for name, params in CONTRACT.items():
        fn = hooks.get(name)
        if fn is not None and callable(fn) and not _fits(fn, len(params)):
            raise RecipeError(
                f"{who}: {name}{_shown(fn)} does not fit the recipe contract {name}({', '.join(params)}); since "
                "0.2.0 every builder takes one read-only ctx (ctx.args, ctx.targs, ctx.accelerator): see CHANGELOG.md."
            )


def _shown(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def load_recipe(spec: Any) -> Recipe:
    """A Recipe from a Recipe, a module object, a file path (recipes/x.py) or an importable module name."""
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str):
        if spec.endswith(".py") or os.sep in spec:
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"Recipe file {spec} does not exist: pass the path of a recipe .py file.")
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
    raise RecipeError(f"Cannot make a recipe of {spec!r}: pass a recipe .py file, a module or a Recipe.")
