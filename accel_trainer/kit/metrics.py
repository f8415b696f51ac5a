"""`load_metric(name)`: `evaluate` modules that work offline.

`evaluate.load("accuracy")` fetches a script from the Hub, which fails offline (and on our CI). For accuracy, f1,
mse and glue we ship `evaluate.Metric` subclasses with the same names, inputs and output keys as the Hub modules
(`metric_modules.py`); any other name goes to `evaluate.load` (a Hub id or a local metric folder).
Modules keep their state in memory: several processes on one machine must not share cache files.
"""

from __future__ import annotations


def load_metric(name: str, config_name: str | None = None, **kwargs):
    """An `evaluate.EvaluationModule`: ours, offline, for the names in metric_modules.BUILTIN, else evaluate.load."""
    from . import metric_modules  # imports evaluate (slow); only when a metric is needed

    if config_name is not None:
        kwargs["config_name"] = config_name
    if name in metric_modules.BUILTIN:
        return metric_modules.BUILTIN[name](keep_in_memory=True, **kwargs)
    import evaluate

    return evaluate.load(name, keep_in_memory=True, **kwargs)
