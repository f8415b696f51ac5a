"""`evaluate` metric modules that load without the network.

`evaluate.load("accuracy")` fetches a script from the Hub, which fails offline (and on our CI). These are
`evaluate.Metric` subclasses with the same names, inputs and outputs as the Hub modules, computed with numpy
(the Hub versions call scikit-learn, which we don't otherwise need). `load_metric(name)` returns ours for the
names we have, and falls back to `evaluate.load` (a Hub id or a local metric folder) for anything else.
All modules keep their state in memory: several processes on one machine must not share cache files.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np


def _features(dtype: str) -> datasets.Features:
    return datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)})


def _info(description: str, dtype: str) -> evaluate.MetricInfo:
    return evaluate.MetricInfo(description=description, citation="", inputs_description="", features=_features(dtype))


class Accuracy(evaluate.Metric):
    def _info(self):
        return _info("Fraction of predictions equal to the references.", "int64")

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        hits = np.asarray(predictions) == np.asarray(references)
        w = np.ones(len(hits)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        return {"accuracy": float((hits * w).sum() / (w.sum() if normalize else 1.0))}


class F1(evaluate.Metric):
    def _info(self):
        return _info("F1 score (binary by default; macro/micro/weighted averages for multi-class).", "int64")

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        p, r = np.asarray(predictions), np.asarray(references)
        if average == "binary":
            return {"f1": _f1(p == pos_label, r == pos_label)}
        classes = np.unique(np.concatenate([p, r])) if labels is None else np.asarray(labels)
        if average == "micro":  # for single-label multi-class this equals accuracy
            return {"f1": float((p == r).mean())}
        scores = np.array([_f1(p == c, r == c) for c in classes])
        if average == "macro":
            return {"f1": float(scores.mean())}
        if average == "weighted":
            support = np.array([(r == c).sum() for c in classes], dtype=float)
            return {"f1": float((scores * support).sum() / support.sum())}
        if average is None:
            return {"f1": scores.tolist()}
        raise ValueError(f"f1: unknown average {average!r}")


def _f1(pred: np.ndarray, ref: np.ndarray) -> float:
    tp = float((pred & ref).sum())
    denom = float(pred.sum() + ref.sum())
    return 2 * tp / denom if denom else 0.0


class MSE(evaluate.Metric):
    def _info(self):
        return _info("Mean squared error.", "float32")

    def _compute(self, predictions, references, squared=True):
        err = float(np.mean((np.asarray(predictions, dtype=np.float64) - np.asarray(references, dtype=np.float64)) ** 2))
        return {"mse": err if squared else err ** 0.5}


BUILTIN = {"accuracy": Accuracy, "f1": F1, "mse": MSE}


def load_metric(name: str, **kwargs) -> evaluate.EvaluationModule:
    """An evaluate module by name: ours offline for the names in BUILTIN, else `evaluate.load(name)`."""
    if name in BUILTIN:
        return BUILTIN[name](keep_in_memory=True, **kwargs)
    return evaluate.load(name, keep_in_memory=True, **kwargs)
