"""Ranks whose data differ in length (real processes, gloo on CPU): a map-style loader whose len() differs by rank
stops the run at start-up in one line naming each rank's count; a stream split unevenly over the ranks (2 processes
x 2 loader workers) trains to the end, no rank waiting for another at an epoch end. A small --ddp_timeout makes a
hang fail fast instead of waiting torch's 30 minutes."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers import call, launcher

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

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


def test_a_stream_split_unevenly_over_two_ranks_with_two_workers_each_ends_its_epochs_together(tmp_path):
    # 8 shards: seven of 2 lines and one of 16, so whichever way datasets splits the files over the 2 ranks, one
    # rank's stream is several times the other's. `datasets` hands each rank its files after reordering them by the
    # epoch, so ranks in different epochs read the same files at once (streaming.Stream): every rank ends an epoch
    # when the first one's stream ends, agreed per window, and nobody waits for anyone (a rank left waiting in a
    # collective would fail after --ddp_timeout).
    from recorded_recipe import read_records
    from text_fixtures import make_tiny_gpt2, offline_env, sentences

    make_tiny_gpt2(str(tmp_path / "gpt2"))
    os.makedirs(tmp_path / "shards")
    for s in range(8):
        lines = [f"doc {s} {i} {t}" for i, t in enumerate(sentences(16 if s == 7 else 2, seed=s))]
        (tmp_path / "shards" / f"part{s:02d}.txt").write_text("\n".join(lines) + "\n")
    records, steps = tmp_path / "records", 12
    os.makedirs(records)
    cmd = launcher("ddp") + [os.path.join(HERE, "recorded_recipe.py"), "causal_lm"]
    cmd += ["--model_name_or_path", str(tmp_path / "gpt2"), "--train_file", "shards/*.txt", "--streaming"]
    cmd += ["--block_size", "16", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    cmd += ["--max_steps", str(steps), "--save_steps", "0", "--logging_steps", "1", "--sample_max_new_tokens", "0"]
    cmd += ["--dataloader_num_workers", "2", "--ddp_timeout", str(DDP_TIMEOUT), "--disable_tqdm"]
    cmd += ["--output_dir", str(tmp_path / "out")]
    env = dict(offline_env(tmp_path), RECORD_DIR=str(records))
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [read_records(records / f"rank{r}.txt") for r in (0, 1)]  # {step: (epoch, micro-batches)}
    assert all(sorted(rank) == list(range(1, steps + 1)) for rank in ranks)
    epochs = [[rank[s][0] for s in range(1, steps + 1)] for rank in ranks]
    assert epochs[0] == epochs[1] and epochs[0][-1] >= 2, epochs  # in step, and several epochs were crossed
    for epoch in set(epochs[0]):  # within an epoch no block is trained on twice, on any rank
        blocks = [b for rank in ranks for e, mbs in rank.values() if e == epoch for mb in mbs for b in mb]
        assert len(blocks) == len(set(blocks)), f"a block trained on twice in epoch {epoch}"
