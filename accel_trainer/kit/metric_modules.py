"""Metrics that load without the network and without `evaluate` (imported by `metrics.load_metric` on first use).

`evaluate.load("accuracy")` fetches a script from the Hub, which fails offline (and on our CI). These have the same
names, inputs and outputs as the Hub modules and evaluate's metric interface (`add_batch`, `add`, `compute`, which
resets), computed with numpy (the Hub versions call scikit-learn, which we don't otherwise need). They are not
`evaluate.Metric` subclasses: importing `evaluate` pulls in transformers.pipelines and datasets, seconds of start-up
in every process that evaluates (docs/benchmarks.md), for metrics that are a few lines of numpy. `load_metric(name)`
returns ours for the names we have, and falls back to `evaluate.load` (a Hub id or a local metric folder) for
anything else. All keep their state in memory: no cache files shared between processes.
"""

from __future__ import annotations

import numpy as np
import torch


class Metric:
    """evaluate's metric interface without evaluate: `add_batch(predictions=, references=)` and `add(prediction=,
    reference=)` keep the values, `compute(**options)` computes over all of them (and any it is given) and resets.
    Each value is read as `dtype`, the feature type of the Hub module of the same name: one number per sample."""

    name = "metric"
    dtype = "int64"  # "int64": class ids (a float prediction that is not a whole number is refused), or "float32"

    def __init__(self, config_name: str | None = None, keep_in_memory: bool = True):
        self.config_name = config_name or "default"
        self._predictions: list[np.ndarray] = []
        self._references: list[np.ndarray] = []

    def _column(self, what: str, values) -> np.ndarray:
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu()
            values = values.float() if values.dtype == torch.bfloat16 else values  # numpy has no bfloat16
        a = np.asarray(values)
        if a.ndim != 1:
            raise ValueError(
                f"Predictions and/or references don't match the expected format: {self.name} takes one value per "
                f"sample; got {what} of shape {list(a.shape)}."
            )
        if self.dtype == "int64":
            if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
                raise ValueError(
                    f"{self.name} takes class ids (whole numbers); got {what} such as {a[a != np.round(a)][0]:g}: "
                    "take the argmax of the logits."
                )
            return a.astype(np.int64)
        return a.astype(np.float32)  # as the Hub module's float32 feature rounds them

    def add_batch(self, *, predictions=None, references=None):
        p, r = self._column("predictions", predictions), self._column("references", references)
        if len(p) != len(r):
            raise ValueError(f"Mismatch in the number of predictions ({len(p)}) and references ({len(r)})")
        self._predictions.append(p)
        self._references.append(r)

    def add(self, *, prediction=None, reference=None):
        self.add_batch(predictions=[prediction], references=[reference])

    def compute(self, *, predictions=None, references=None, **options) -> dict:
        if predictions is not None or references is not None:
            self.add_batch(predictions=predictions, references=references)
        if not self._predictions:
            raise ValueError(f"{self.name}: compute() has no values: add_batch(predictions=, references=) first.")
        p, r = np.concatenate(self._predictions), np.concatenate(self._references)
        self._predictions, self._references = [], []
        return self._compute(p, r, **options)

    def _compute(self, predictions: np.ndarray, references: np.ndarray, **options) -> dict:
        raise NotImplementedError


class Accuracy(Metric):
    """Fraction of predictions equal to the references."""

    name = "accuracy"

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        hits = np.asarray(predictions) == np.asarray(references)
        w = np.ones(len(hits)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        return {"accuracy": float((hits * w).sum() / (w.sum() if normalize else 1.0))}


class F1(Metric):
    """F1 score (binary by default; macro/micro/weighted averages for multi-class)."""

    name = "f1"

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        # sklearn's f1_score: per class, counts of true positives, predicted and true samples, each sample
        # counted with its sample_weight (1 without). F1 = 2 tp / (predicted + true); 0 where that is 0/0.
        p, r = np.asarray(predictions), np.asarray(references)
        w = np.ones(len(p)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if w.shape != p.shape:
            raise ValueError(f"f1: sample_weight has {w.size} values for {p.size} predictions.")
        if average == "binary":
            classes = np.asarray([pos_label])
        elif labels is not None:
            classes = np.asarray(labels)
        else:
            classes = np.unique(np.concatenate([p, r]))
        tp = np.array([w[(p == c) & (r == c)].sum() for c in classes])
        pred = np.array([w[p == c].sum() for c in classes])
        true = np.array([w[r == c].sum() for c in classes])
        if average == "micro":  # pooled counts over the classes (all classes: the weighted accuracy)
            return {"f1": _ratio(2 * tp.sum(), pred.sum() + true.sum())}
        scores = np.array([_ratio(2 * t, d) for t, d in zip(tp, pred + true)])
        if average == "binary":
            return {"f1": float(scores[0])}
        if average == "macro":
            return {"f1": float(scores.mean())}
        if average == "weighted":  # by each class's (weighted) number of true samples
            return {"f1": _ratio((scores * true).sum(), true.sum())}
        if average is None:
            return {"f1": scores.tolist()}
        raise ValueError(f"f1: unknown average {average!r}")


def _ratio(num: float, denom: float) -> float:
    return float(num / denom) if denom else 0.0


def _f1(pred: np.ndarray, ref: np.ndarray) -> float:
    tp = float((pred & ref).sum())
    denom = float(pred.sum() + ref.sum())
    return 2 * tp / denom if denom else 0.0


class MSE(Metric):
    """Mean squared error."""

    name, dtype = "mse", "float32"

    def _compute(self, predictions, references, squared=True):
        err = float(
            np.mean((np.asarray(predictions, dtype=np.float64) - np.asarray(references, dtype=np.float64)) ** 2)
        )
        return {"mse": err if squared else err**0.5}


BUILTIN = {"accuracy": Accuracy, "f1": F1, "mse": MSE}


# ----------------------------------------------------------------------------------------------------------------
# GLUE (issue 4, text recipes: recipes/glue.py). Same config names, inputs and output keys as the Hub's
# `evaluate.load("glue", task)`: accuracy + F1 for mrpc/qqp, matthews_correlation for cola, pearson + spearmanr
# for stsb (float predictions), accuracy for the rest.
GLUE_TASKS = (
    "sst2",
    "mnli",
    "mnli_mismatched",
    "mnli_matched",
    "cola",
    "stsb",
    "mrpc",
    "qqp",
    "qnli",
    "rte",
    "wnli",
    "hans",
)


class Glue(Metric):
    """The GLUE metric of the task `config_name`."""

    name = "glue"

    def __init__(self, config_name: str | None = None, keep_in_memory: bool = True):
        super().__init__(config_name, keep_in_memory)
        if self.config_name not in GLUE_TASKS:
            raise KeyError(f"glue: config_name must be one of {', '.join(GLUE_TASKS)}, got {self.config_name!r}.")
        self.dtype = "float32" if self.config_name == "stsb" else "int64"  # stsb: a similarity score per pair

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        if self.config_name == "cola":
            return {"matthews_correlation": _matthews(p, r)}
        if self.config_name == "stsb":
            return {"pearson": _pearson(p, r), "spearmanr": _pearson(_rank(p), _rank(r))}
        out = {"accuracy": float((p == r).mean())}
        if self.config_name in ("mrpc", "qqp"):
            out["f1"] = _f1(p == 1, r == 1)
        return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denom) if denom else float("nan")


def _rank(x: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank (what Spearman's correlation needs)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def _matthews(p: np.ndarray, r: np.ndarray) -> float:
    """Matthews correlation, multi-class form (equals the binary one for two classes); 0 when undefined."""
    classes = np.unique(np.concatenate([p, r]))
    c = np.array([[np.sum((r == a) & (p == b)) for b in classes] for a in classes], dtype=np.float64)
    t, pk, s = c.sum(axis=1), c.sum(axis=0), c.sum()
    correct = np.trace(c)
    cov_ytyp = correct * s - (t * pk).sum()
    cov_ypyp = s * s - (pk * pk).sum()
    cov_ytyt = s * s - (t * t).sum()
    denom = np.sqrt(cov_ytyt * cov_ypyp)
    return float(cov_ytyp / denom) if denom else 0.0


BUILTIN["glue"] = Glue


# ----------------------------------------------------------------------------------------------------------------
# Token classification (recipes/token_classification.py): entity-level precision/recall/F1 with the semantics of
# conlleval and seqeval's default mode, plus token accuracy, from per-token label ids [batch, tokens] where -100
# marks positions that are not scored (special tokens, padding, a word's later sub-tokens).
class TokenClassification:
    """Entity-level micro precision/recall/F1 (conlleval / seqeval default mode) and token accuracy.

    Not a `Metric` above: it keeps counts, not the tokens, and takes rows of any length. It follows the metric
    protocol the Trainer needs: `add_batch(predictions=, references=)` with int tensors or nested lists of shape
    [batch, tokens] (rows may have different lengths, -100 in `references` drops that position from both), then
    `compute()` -> {"precision", "recall", "f1", "accuracy"} (floats; 0.0 where a ratio is 0/0), which resets.

    Spans follow conlleval, so IOB1 and IOB2 tags are both read right: a chunk starts at B-, at I- after O or
    after a chunk of another type, and ends where the next tag is O, B- or another type (or the row ends).
    `label_names` maps ids to tags ("O", "B-PER", "I-PER", ...); E-/S- (IOBES) tags are read as conlleval does.
    """

    def __init__(self, label_names=None, keep_in_memory: bool = True, ignore_index: int = -100):
        if not label_names:
            raise ValueError("token_classification: pass label_names, the tag of each label id (e.g. ['O', 'B-PER']).")
        self.label_names = [str(n) for n in label_names]
        self.ignore_index = ignore_index
        self._reset()

    def _reset(self):
        self.tp = self.n_pred = self.n_true = 0
        self.correct = self.tokens = 0

    def _tags(self, ids) -> list[str]:
        out = []
        for i in ids:
            if not 0 <= i < len(self.label_names):
                raise ValueError(
                    f"token_classification: label id {i} is outside the {len(self.label_names)} label_names; "
                    "pass the label_names of every id the model can predict (-100 marks positions to skip)."
                )
            out.append(self.label_names[i])
        return out

    def add_batch(self, *, predictions, references):
        preds, refs = _rows(predictions), _rows(references)
        if len(preds) != len(refs):
            raise ValueError(f"token_classification: {len(preds)} prediction rows for {len(refs)} reference rows.")
        for p, r in zip(preds, refs):
            if len(p) != len(r):
                raise ValueError(f"token_classification: a row of {len(p)} predictions has {len(r)} references.")
            kept = [(a, b) for a, b in zip(p, r) if b != self.ignore_index]
            ptags, rtags = self._tags([a for a, _ in kept]), self._tags([b for _, b in kept])
            pred_spans, true_spans = set(entities(ptags)), set(entities(rtags))
            self.tp += len(pred_spans & true_spans)
            self.n_pred += len(pred_spans)
            self.n_true += len(true_spans)
            self.correct += sum(a == b for a, b in kept)
            self.tokens += len(kept)

    def compute(self, *, predictions=None, references=None) -> dict:
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        out = {
            "precision": _ratio(self.tp, self.n_pred),
            "recall": _ratio(self.tp, self.n_true),
            "f1": _ratio(2 * self.tp, self.n_pred + self.n_true),
            "accuracy": _ratio(self.correct, self.tokens),
        }
        self._reset()
        return out


def _rows(x) -> list[list[int]]:
    if hasattr(x, "tolist"):  # a tensor or array [batch, tokens]
        x = x.tolist()
    return [[int(v) for v in row] for row in x]


def _split(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', '_') (seqeval's reading of a tag)."""
    if tag == "O":
        return "O", "_"
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def entities(tags: list[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) of each chunk in a row of tags, with conlleval's start/end rules (seqeval's
    get_entities): an I- after O, or after another type, starts a chunk (IOB1); a B- always does (IOB2)."""
    spans, start, prev, prev_type = [], None, "O", "_"
    for i, tag in enumerate(tags + ["O"]):  # a sentinel O closes a chunk that runs to the end of the row
        t, typ = _split(tag)
        ends = prev in ("E", "S") or (prev in ("B", "I") and t in ("B", "S", "O")) or (prev != "O" and prev_type != typ)
        if ends and start is not None:
            spans.append((prev_type, start, i - 1))
            start = None
        starts = t in ("B", "S") or (prev in ("E", "S", "O") and t in ("E", "I")) or (t != "O" and prev_type != typ)
        if starts:
            start = i
        prev, prev_type = t, typ
    return spans


BUILTIN["token_classification"] = TokenClassification
