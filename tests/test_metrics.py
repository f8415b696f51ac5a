"""Our offline metrics (accel_trainer/kit/metric_modules.py) honour every argument they accept, read their inputs as
the Hub modules' features do, and load without `evaluate`."""

import subprocess
import sys

import pytest
import torch
from helpers import RECIPES, env

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


def test_inputs_are_read_as_the_hub_modules_features():
    # evaluate's features: accuracy/f1/glue read class ids (int64), mse float32. Batches of tensors (bf16 too, which
    # numpy lacks), lists and single values (add) all count, and compute() resets.
    m = load_metric("mse")
    m.add_batch(predictions=torch.tensor([1.0, 2.0], dtype=torch.bfloat16), references=torch.tensor([1.1, 2.0]))
    m.add(prediction=3.0, reference=3.0)
    assert m.compute() == {"mse": pytest.approx((1.1 - 1.0) ** 2 / 3, rel=1e-6)}
    with pytest.raises(ValueError, match="compute\\(\\) has no values"):
        m.compute()
    acc = load_metric("accuracy")
    acc.add_batch(predictions=torch.tensor([1, 0, 2]), references=[1, 1, 2])
    assert acc.compute(predictions=[1.0], references=[1]) == {"accuracy": 0.75}  # a whole-number float is an id
    assert load_metric("glue", "stsb").compute(predictions=[0.5, 1.5, 2.5], references=[1.0, 2.0, 3.5])["pearson"] > 0.9


@pytest.mark.parametrize(
    "predictions, references, says",
    [
        # evaluate itself truncated 0.7 to class 0 and called the prediction right (accuracy 1.0)
        ([0.7, 1.0], [0, 1], "accuracy takes class ids (whole numbers); got predictions such as 0.7: take the argmax"),
        # per-token values: a [batch, tokens] array compared with broadcasting would be a number, and wrong
        (torch.zeros(3, 2), torch.zeros(3, 2), "accuracy takes one value per sample; got predictions of shape [3, 2]"),
        ([1, 0, 1], [1, 0], "Mismatch in the number of predictions (3) and references (2)"),
    ],
)
def test_values_a_metric_cannot_take_are_refused_in_one_line(predictions, references, says):
    with pytest.raises(ValueError) as e:
        load_metric("accuracy").add_batch(predictions=predictions, references=references)
    assert says in str(e.value) and "\n" not in str(e.value)


LOCAL_METRIC = """
import datasets
import evaluate


class Exact(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
        return evaluate.MetricInfo(description="", citation="", inputs_description="", features=features)

    def _compute(self, predictions, references):
        return {"exact": sum(p == r for p, r in zip(predictions, references)) / len(predictions)}
"""


def test_any_other_name_goes_to_evaluate_load(tmp_path):
    # A local metric folder (as a Hub id would, online): evaluate's own module, kept in memory.
    folder = tmp_path / "exact"
    folder.mkdir()
    (folder / "exact.py").write_text(LOCAL_METRIC)
    metric = load_metric(str(folder))
    metric.add_batch(predictions=[1, 2], references=[1, 3])
    assert metric.compute() == {"exact": 0.5}
    assert type(metric).__module__ != "accel_trainer.kit.metric_modules"


CODE = """
import sys
sys.path.insert(0, {recipes!r})
import regression
from accel_trainer import run
sys.argv = ["regression.py", "--output_dir", {out!r}, "--max_steps", "2", "--eval_steps", "2", "--save_steps", "0",
            "--disable_tqdm"]
run(regression)
print("evaluate imported:", "evaluate" in sys.modules)
"""


@pytest.mark.slow
def test_a_run_with_the_builtin_metrics_does_not_import_evaluate(tmp_path):
    # Importing evaluate pulls in transformers.pipelines and datasets: seconds of every run's start-up (the recipe
    # check computes the metrics before the first update), more than the regression recipe's short runs train.
    code = CODE.format(recipes=RECIPES, out=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval_mse" in (tmp_path / "out" / "metrics.jsonl").read_text()
    assert "evaluate imported: False" in proc.stdout
