"""Our offline `evaluate` modules (accel_trainer/kit/metric_modules.py) honour every argument they accept."""

import pytest

from accel_trainer import load_metric


def f1(**kwargs):
    return load_metric("f1").compute(**kwargs)["f1"]


def test_f1_binary_sample_weight_weights_the_counts():
    # By hand, with weights: tp = 1 + 0.5, predicted positives = 1 + 2 + 0.5, true positives = 1 + 3 + 0.5,
    # F1 = 2 tp / (predicted + true) = 3 / 8 (sklearn's f1_score(..., sample_weight=w) gives the same).
    # Unweighted it is 4 / 6: a metric that ignores the weights fails.
    p, r, w = [1, 1, 0, 0, 1], [1, 0, 1, 0, 1], [1, 2, 3, 1, 0.5]
    assert f1(predictions=p, references=r, sample_weight=w) == pytest.approx(3 / 8)
    assert f1(predictions=p, references=r) == pytest.approx(4 / 6)


@pytest.mark.parametrize("average", ["binary", "micro", "macro", "weighted", None])
def test_f1_integer_sample_weight_equals_repeating_samples(average):
    p = [0, 1, 2, 1, 0, 2, 1, 1]
    r = [0, 1, 1, 2, 0, 2, 0, 1]
    w = [1, 3, 0, 2, 1, 1, 4, 2]
    repeated_p = [x for x, n in zip(p, w) for _ in range(n)]
    repeated_r = [x for x, n in zip(r, w) for _ in range(n)]
    want = f1(predictions=repeated_p, references=repeated_r, average=average)
    got = f1(predictions=p, references=r, sample_weight=w, average=average)
    assert got == pytest.approx(want)
    assert got != pytest.approx(f1(predictions=p, references=r, average=average))  # the weights matter here


def test_f1_micro_honours_labels():
    # sklearn: micro over the given labels only. Class 0: tp 1, predicted 1, true 2 -> 2/3.
    # (Accuracy over all classes would be 2/4.)
    assert f1(predictions=[0, 1, 2, 2], references=[0, 1, 0, 1], labels=[0], average="micro") == pytest.approx(2 / 3)
