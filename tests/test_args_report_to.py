"""`report_to` takes transformers' values: a list of names, 'a,b', 'all', 'none', and None or [] for none.

The Trainer reads `.trackers` (Accelerate's `log_with`): None for no tracker, "all", or a list of names.
`report_to` itself becomes one canonical string, so a command line and the Python API record the same value.
"""

import pytest

from accel_trainer.args import TrainingArguments
from accel_trainer.errors import ArgumentError
from accel_trainer.flags import parse_args


@pytest.mark.parametrize(
    "report_to, trackers, canonical",
    [
        ([], None, "none"),  # how transformers users write "no trackers"
        (None, None, "none"),
        ("none", None, "none"),
        (["none"], None, "none"),
        ("", None, "none"),
        ("all", "all", "all"),
        (["all"], "all", "all"),
        ("tensorboard", ["tensorboard"], "tensorboard"),
        (["tensorboard"], ["tensorboard"], "tensorboard"),
        (["tensorboard", "wandb"], ["tensorboard", "wandb"], "tensorboard,wandb"),
        ("tensorboard, wandb", ["tensorboard", "wandb"], "tensorboard,wandb"),
    ],
)
def test_python_api_takes_transformers_values(report_to, trackers, canonical):
    args = TrainingArguments(output_dir="unused", report_to=report_to)
    assert args.trackers == trackers
    assert args.report_to == canonical


@pytest.mark.parametrize("bad", [["none", "wandb"], "all,tensorboard", [1], 3])
def test_python_api_refuses_mixed_or_non_names(bad):
    with pytest.raises(ArgumentError, match="--report_to"):
        TrainingArguments(output_dir="unused", report_to=bad)


@pytest.mark.parametrize(
    "value, trackers", [("none", None), ("all", "all"), ("tensorboard,wandb", ["tensorboard", "wandb"])]
)
def test_command_line(value, trackers):
    args, _ = parse_args(argv=["--output_dir", "unused", "--report_to", value])
    assert args.trackers == trackers


def test_arguments_file_with_a_list(tmp_path):
    (tmp_path / "args.yaml").write_text("output_dir: unused\nreport_to: []\n")
    args, _ = parse_args(argv=[str(tmp_path / "args.yaml")])
    assert args.trackers is None and args.report_to == "none"
