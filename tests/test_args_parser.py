"""Our argument parser and default schedules stand in for transformers' (whose import costs ~0.7 s of start-up):
they must give what transformers gives, flag for flag and step for step, and a run must reach its first update
without importing transformers."""

from __future__ import annotations

import enum
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
from helpers import ROOT, env
from transformers import HfArgumentParser, SchedulerType, get_scheduler

from accel_trainer.args import COMMON_SCHEDULERS, TrainingArguments
from accel_trainer.flags import _build_parser, parse_args
from accel_trainer.optim import default_scheduler


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class KitchenSink:
    """Every kind of field a recipe's Args may have."""

    name: str = "x"
    maybe_name: str | None = None
    count: int = 3
    maybe_count: int | None = None
    rate: float = 0.5
    flag: bool = False
    on_by_default: bool = field(default=True, metadata={"help": "Defaults to True: has --no_on_by_default."})
    lookahead: bool = True  # one word: --no_lookahead and --no-lookahead, as HfArgumentParser
    mode: Literal["a", "b"] = "a"
    colour: Colour = Colour.RED
    sizes: list[int] = field(default_factory=lambda: [1, 2])


ARGVS = [
    [],
    ["--learning_rate", "1e-3", "--max_steps", "7", "--torch_compile", "--disable_tqdm", "false"],
    ["--learning-rate", "0.1", "--per-device-train-batch-size", "4", "--report_to", "wandb,tensorboard"],
    ["--name", "y", "--maybe_name", "z", "--count", "9", "--maybe_count", "4", "--rate", "2.5", "--flag", "true"],
    ["--no_on_by_default", "--no-lookahead", "--mode", "b", "--colour", "blue", "--sizes", "3", "4", "5"],
    ["--on_by_default", "false", "--no-on-by-default", "--greater_is_better", "true", "--save_total_limit", "2"],
    ["--flag=yes", "--mixed_precision", "bf16", "--resume_from_checkpoint", "latest", "--lr_scheduler_type", "cosine"],
]


@pytest.mark.parametrize("argv", ARGVS, ids=[" ".join(a) or "(none)" for a in ARGVS])
def test_the_parser_gives_what_transformers_parser_gives(argv):
    ours = parse_args(KitchenSink, argv)
    theirs = HfArgumentParser([TrainingArguments, KitchenSink]).parse_args_into_dataclasses(
        args=argv, look_for_args_file=False
    )
    assert ours[0].to_dict() == theirs[0].to_dict()
    assert ours[1] == theirs[1]


def test_the_parser_has_transformers_flags():
    def flags(parser):
        return {opt for a in parser._actions for opt in a.option_strings}

    assert flags(_build_parser([TrainingArguments, KitchenSink])) == flags(
        HfArgumentParser([TrainingArguments, KitchenSink])
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--flag", "maybe"], "not a boolean"),
        (["--mode", "c"], "invalid choice"),
        (["--count", "three"], "invalid int value"),
        (["--learning_rat", "1"], "unrecognized arguments"),
        (["--nan_policy", "never"], "--nan_policy"),
    ],
)
def test_the_parser_refuses_bad_values_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(KitchenSink, argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_common_scheduler_names_are_transformers_names():
    assert set(COMMON_SCHEDULERS) <= {s.value for s in SchedulerType}


@pytest.mark.parametrize("kind", ["linear", "constant"])
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (10, 10), (0, 1), (4, 7)])
def test_default_schedules_are_transformers_schedules_step_for_step(kind, warmup, total):
    def run(build, resume_from=None, steps=total + 2):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        sched = build(opt)
        if resume_from is not None:
            sched.load_state_dict(resume_from)
        lrs = []
        for _ in range(steps):
            lrs.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return lrs, sched.state_dict()

    args = TrainingArguments(lr_scheduler_type=kind, warmup_steps=warmup)
    ours = lambda opt: default_scheduler(opt, total, args)  # noqa: E731
    theirs = lambda opt: get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)  # noqa: E731
    assert run(ours)[0] == run(theirs)[0]  # exactly: the same formula in the same float arithmetic
    # A checkpoint of either schedule resumes in the other.
    half = total // 2 + 1
    for a, b in ((ours, theirs), (theirs, ours)):
        _, state = run(a, steps=half)
        assert run(b, resume_from=state, steps=total + 2 - half)[0] == run(a)[0][half:]


# A recipe without metrics: one with metrics builds them before the first update (the recipe check runs them on
# the first batch, so a metric that cannot take the predictions stops the run before it trains), and `evaluate`
# imports transformers.
FIRST_UPDATE = """
import dataclasses, sys
from accel_trainer import Trainer, load_recipe, resolve_args
argv = ["--max_steps", "2", "--save_steps", "0", "--disable_tqdm", "--output_dir", sys.argv[1]]
recipe = dataclasses.replace(load_recipe("recipes/regression.py"), build_metrics=None)
trainer = Trainer(recipe, resolve_args(recipe, argv))
seen = []
trainer.on("update_end", lambda t: seen.append("transformers" in sys.modules))
trainer.fit()
print("transformers imported by the first update:", seen[0])
"""


@pytest.mark.slow
def test_a_run_without_metrics_reaches_its_first_update_without_importing_transformers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", FIRST_UPDATE, str(tmp_path / "out")],
        capture_output=True, text=True, env=env(), timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "transformers imported by the first update: False" in out.stdout
