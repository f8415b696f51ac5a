"""`accel-trainer report`: draws the curves of real runs (1 and 2 processes of recipes/regression.py), and the lines
in the picture hold exactly the values in metrics.jsonl. Bad input: one line, exit 1, no traceback."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import ROOT, env, metrics, run, run_config

from accel_trainer.tools import report

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

RUN_ARGS = ["--max_steps", "20", "--logging_steps", "2", "--eval_steps", "5", "--disable_tqdm", "--save_steps", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_runs")
    dirs = []
    for nproc, batch in ((1, 32), (2, 16)):  # the same global batch on 1 and 2 processes
        out = str(root / f"reg_{nproc}proc")
        run("regression.py", ["--output_dir", out, "--per_device_train_batch_size", batch, *RUN_ARGS], nproc=nproc)
        assert run_config(out)["topology"]["num_processes"] == nproc  # a real world of nproc, not nproc worlds of 1
        dirs.append(out)
    return dirs


def cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "accel_trainer.cli", "report", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        cwd=ROOT,
    )


def logged(rows, key, x):
    """Independently of report.series: the (x, value) pairs of `key` as written in metrics.jsonl."""
    pts = [(r["step"] if x == "step" else r["elapsed_s"], float(r[key])) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def test_report_draws_the_logged_values(runs, tmp_path):
    out = tmp_path / "report.png"
    proc = cli(*runs, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # a picture with content, not an empty canvas

    drawn = report.plot_runs(runs, str(tmp_path / "again.png"), labels=["one", "two"])
    keys_seen = {key for _, key, _, _ in drawn}
    assert {"loss", "eval_loss", "eval_mse", "learning_rate", "grad_norm"} <= keys_seen
    assert "eval_samples" not in keys_seen  # a count, not a curve
    for label, run_dir in zip(["one", "two"], runs):
        rows = metrics(run_dir)
        for key in {k for r in rows for k in r} - report.NOT_PLOTTED - {"epoch"}:
            panel = "loss" if key == "eval_loss" else key
            for x in ("step", "time"):
                xs, ys = drawn[(panel, key, x, label)]
                want_x, want_y = logged(rows, key, x)
                assert xs == want_x, (label, key, x)
                assert ys == want_y, (label, key, x)
                assert len(xs) >= 4  # 10 log rows / 4 evals per run


def test_report_one_view_and_restarted_clock(tmp_path):
    """--x step draws one column; a resumed run's clock restarts at 0 and is summed; 'nan' strings are NaN."""
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    rows = [
        {"step": 1, "epoch": 0.1, "elapsed_s": 1.0, "loss": 2.0},
        {"step": 2, "epoch": 0.2, "elapsed_s": 2.0, "loss": "nan"},
        {"step": 3, "epoch": 0.3, "elapsed_s": 0.5, "loss": 1.0, "note": "text is not drawn"},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    drawn = report.plot_runs([str(run_dir)], str(tmp_path / "r.png"), x="step")
    assert {k[2] for k in drawn} == {"step"} and {k[1] for k in drawn} == {"loss"}
    xs, ys = drawn[("loss", "loss", "step", "resumed")]
    assert xs == [1, 2, 3] and ys[0] == 2.0 and math.isnan(ys[1]) and ys[2] == 1.0
    assert report.series(rows, "loss", "time")[0] == [1.0, 2.0, 2.5]


@pytest.mark.parametrize("case", ["missing_dir", "no_metrics", "empty", "out_folder_missing", "out_unwritable"])
def test_report_bad_input_is_one_line(case, tmp_path, runs, capsys):
    """In-process through the console script's main() (what `accel-trainer report` exits with): one process start
    costs ~4 s of imports here, and the successful subprocess run above already covers the console entry point."""
    good, out = runs[0], str(tmp_path / "r.png")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    args = {
        "missing_dir": [str(tmp_path / "nope"), "--out", out],
        "no_metrics": [str(tmp_path), "--out", out],
        "empty": [str(empty), "--out", out],
        "out_folder_missing": [good, "--out", str(tmp_path / "no" / "r.png")],
        "out_unwritable": [good, "--out", "/proc/report.png"],  # not writable even for root
    }[case]
    if case == "empty":
        (empty / "metrics.jsonl").write_text("")
    from accel_trainer.cli import main

    assert main(["report", *args]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not os.path.exists(out)


def test_report_draws_fields_runs_will_log(tmp_path):
    """Throughput, memory, MFU and any new numeric field get their own panels, in a stable order, when logged."""
    rows = [
        {
            "step": s,
            "epoch": s / 10,
            "elapsed_s": s * 0.1,
            "loss": 1.0 / s,
            "learning_rate": 0.1,
            "samples_per_second": 100.0 + s,
            "items_per_second": 900.0,
            "step_time_s": 0.01,
            "data_wait_fraction": 0.1,
            "peak_memory_mb": 512.0,
            "mfu": 0.4,
            "my_metric": s,
        }
        for s in (1, 2, 3)
    ] + [{"step": 3, "epoch": 0.3, "elapsed_s": 0.4, "eval_loss": 0.5, "eval_accuracy": 0.9, "eval_samples": 64}]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    layout = report.panels([("run", rows)])
    assert [title for title, _ in layout] == [
        "loss",
        "eval_accuracy",
        "learning_rate",
        "samples_per_second",
        "items_per_second",
        "step_time_s",
        "data_wait_fraction",
        "peak_memory_mb",
        "mfu",
        "my_metric",
    ]
    assert layout[0] == ("loss", ["loss", "eval_loss"])
    drawn = report.plot_runs([str(run_dir)], str(tmp_path / "r.png"), x="time", cols=3)
    assert {k[2] for k in drawn} == {"time"} and len({k[0] for k in drawn}) == len(layout)
    assert drawn[("samples_per_second", "samples_per_second", "time", "run")] == (
        [r["elapsed_s"] for r in rows[:3]],
        [101.0, 102.0, 103.0],
    )


# ------------------------------------------------------------------------------- a metrics file from elsewhere
def test_report_draws_foreign_field_names_as_text_and_a_bounded_number_of_panels(tmp_path, capsys, monkeypatch):
    """`accel-trainer report` on a metrics.jsonl someone else wrote: a '$\\frac{$' field name raised in matplotlib's
    math parser, a lone surrogate in the file writer, 3000 fields drew 3000 panels (gigabytes), a 400-digit
    number raised OverflowError: each was a traceback."""
    monkeypatch.setattr(report, "MAX_PANELS", 6)  # the bound, not its value (48 panels take seconds to draw)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    many = {f"k{i}": 1.0 for i in range(30)}
    rows = [json.dumps({"step": s, "eval_$\\frac{$": 1.0 / s, "a\ud800": 2.0, **many}) for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    drawn = report.plot_runs([str(run_dir)], str(tmp_path / "r.png"), x="step")
    assert len({k[0] for k in drawn}) == 6 and (tmp_path / "r.png").stat().st_size > 0
    assert {"eval_$\\frac{$", "a\ud800"} <= {k[1] for k in drawn}  # drawn, as text
    assert "drawing the first 6" in capsys.readouterr().err
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1' + "0" * 400 + '}\n{"step": 2, "loss": 1}\n')
    with pytest.raises(report.ReportError, match=r"metrics.jsonl:1 .*beyond the 64 bits"):
        report.plot_runs([str(run_dir)], str(tmp_path / "r.png"), x="step")
