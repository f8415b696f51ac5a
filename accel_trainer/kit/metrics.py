"""`load_metric(name)`: metrics with evaluate's interface that work offline.

`evaluate.load("accuracy")` fetches a script from the Hub, which fails offline (and on our CI). For accuracy, f1,
mse, glue and token_classification we ship metrics with the same names, inputs and output keys as the Hub modules
and evaluate's `add_batch` / `add` / `compute` (`metric_modules.py`, numpy only: `evaluate` is not imported for
them); any other name goes to `evaluate.load` (a Hub id or a local metric folder).
Modules keep their state in memory: several processes on one machine must not share cache files.
"""

from __future__ import annotations


def load_metric(name: str, config_name: str | None = None, **kwargs):
    """A metric with evaluate's interface: ours, offline, for the names in metric_modules.BUILTIN, else the
    `evaluate.EvaluationModule` of evaluate.load."""
    from . import metric_modules

    if config_name is not None:
        kwargs["config_name"] = config_name
    if name in metric_modules.BUILTIN:
        return metric_modules.BUILTIN[name](keep_in_memory=True, **kwargs)
    import evaluate

    return evaluate.load(name, keep_in_memory=True, **kwargs)
