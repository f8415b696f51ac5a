"""Ranks whose data differ in length (real processes, gloo on CPU): a map-style loader whose len() differs by rank
stops the run at start-up in one line naming each rank's count; a stream split unevenly over the ranks (2 processes
x 2 loader workers) trains to the end, no rank waiting for another at an epoch end. A small --ddp_timeout makes a
hang fail fast instead of waiting torch's 30 minutes."""

from __future__ import annotations

import os
import time

from helpers import call, launcher

HERE = os.path.dirname(os.path.abspath(__file__))
DDP_TIMEOUT = 20  # seconds: a rank left waiting in a collective fails after this


def test_a_loader_with_another_length_on_one_rank_stops_at_start_up_naming_the_counts(tmp_path):
    # 256 samples, 16 per rank and batch on 2 ranks: 8 batches per epoch on rank 0, 9 on rank 1 (uneven_recipe.py)
    out = tmp_path / "out"
    cmd = launcher("ddp") + [os.path.join(HERE, "uneven_recipe.py"), "--output_dir", str(out)]
    cmd += ["--num_train_epochs", "2", "--ddp_timeout", str(DDP_TIMEOUT), "--disable_tqdm"]
    started = time.monotonic()
    proc = call(cmd, timeout=240)
    took = time.monotonic() - started
    errors = sorted({line for line in proc.stderr.splitlines() if line.startswith("error:")})
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-4000:]
    assert "rank 0: 8, rank 1: 9" in errors[0] and "'loader'" in errors[0], errors[0]
    ranks = proc.stderr.split("torch/distributed/elastic")[0]  # then the launcher's own report of a failed child
    assert "Traceback" not in ranks and "died or hangs" not in proc.stderr, proc.stderr[-4000:]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()  # no update ran
    assert took < 200, f"{took:.0f} s"
