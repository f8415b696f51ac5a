"""Data at scale, end to end (docs/data.md), with real processes (accelerate launch, gloo on CPU):

- a streamed corpus (many small text shards the test writes, `causal_lm --streaming`) trained on 1 process with
  the stream read in the main process and on 2 processes with 2 loader workers each, SIGKILLed after a checkpoint
  and resumed: the token blocks each rank trains on, update by update, are the uninterrupted run's, and the final
  weights are byte-identical; within an epoch no block is trained on twice across the ranks;
- map-style data read by 2 loader workers, for every shipped recipe that uses the Trainer's DataLoader (regression,
  glue, causal_lm): resumed from a checkpoint in the middle of the run, the same samples and the same weights;
- a stream without --max_steps is refused in one line.

Runs go through tests/recorded_recipe.py, which records the ids of every micro-batch each rank trains on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import procs
import pytest
from helpers import launch_cmd
from recorded_recipe import read_records
from text_fixtures import make_glue_folder, make_text_files, make_tiny_bert, make_tiny_gpt2, offline_env, sentences

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded_recipe.py")
DEADLINE = 240  # seconds a launch may take on a loaded 2-core machine
STEPS, SAVE = 12, 3
# 8 shards of 3 lines: 4 shards per rank on 2 processes, 2 per loader worker. Blocks of 16 tokens, 2 per
# micro-batch, 2 micro-batches per update: ~10 updates per epoch on 1 process, ~5 per rank on 2: 12 cross an epoch.
STREAM_ARGS = [
    "--train_file", "shards/*.txt", "--streaming", "--block_size", "16", "--per_device_train_batch_size", "2",
    "--gradient_accumulation_steps", "2", "--max_steps", str(STEPS), "--save_steps", str(SAVE),
    "--logging_steps", "1", "--sample_max_new_tokens", "0", "--disable_tqdm", "--seed", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    make_tiny_gpt2(str(root / "gpt2"))  # tied embeddings, as the real gpt2: resumed from its own checkpoint too
    os.makedirs(root / "shards")
    for s in range(8):  # every line unique (its shard and number), so that every block is
        lines = [f"doc {s} {i} {t}" for i, t in enumerate(sentences(3, seed=s))]
        (root / "shards" / f"part{s:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


class Launch(procs.Launch):
    """One `python`/`accelerate launch` of a recipe through recorded_recipe.py (procs.Launch: its own session, so
    that its whole process tree, ranks and loader workers, can be SIGKILLed and checked gone)."""

    def __init__(self, cwd, recipe, args, out, nproc=1, workers=0, delay=0.0):
        self.out, self.records = str(out), str(out) + "_records"
        os.makedirs(self.records, exist_ok=True)
        env = offline_env(cwd)
        env.update(RECORD_DIR=self.records, STEP_DELAY=str(delay), PYTHONUNBUFFERED="1")
        env.pop("WORLD_SIZE", None)
        cmd = launch_cmd(nproc) + [SCRIPT, recipe, *args, "--output_dir", self.out]
        cmd += ["--dataloader_num_workers", str(workers)]
        log = self.out + f"_{time.monotonic_ns()}.log"
        super().__init__(cmd, log, env=env, cwd=str(cwd), deadline=DEADLINE)


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield lambda *a, **kw: started.append(Launch(*a, **kw)) or started[-1]
    for launch in started:
        launch.stop()


def records(launch: Launch, nproc: int) -> list[dict]:
    return [read_records(os.path.join(launch.records, f"rank{r}.txt")) for r in range(nproc)]


def weights(out) -> bytes:
    return open(os.path.join(out, "model.safetensors"), "rb").read()


def world_size(out) -> int:
    return json.load(open(os.path.join(out, "run_config.json")))["num_processes"]


def resumed_step(output: str) -> int:
    line = next(x for x in output.splitlines() if x.startswith("Resumed from"))
    return int(line.split(" at step ")[1].split()[0])


# 2 processes: every 5 updates, with 14 of them: the ranks' epochs end together after 5 and 10 updates with this
# corpus (streaming.Stream), so the checkpoint resumed from (step 10) is at an epoch's end on both ranks.
@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,workers,extra",
    [(1, 0, []), (2, 2, ["--save_steps", "5", "--max_steps", "14"]), (1, 2, ["--save_async"])],
)
def test_streamed_run_killed_and_resumed_trains_on_the_same_blocks(corpus, tmp_path, launches, nproc, workers, extra):
    # --save_async with a stream: the position saved is the one at the checkpoint's update (checkpointing/folder.py's
    # write_extra runs while training waits; this tiny run's background write ends before the stream moves on, so
    # this case would also have passed with the position taken in the background)
    save, steps = (5, 14) if nproc == 2 else (SAVE, STEPS)
    args = ["--model_name_or_path", str(corpus / "gpt2"), *STREAM_ARGS, *extra]
    # the reference and the run to be killed side by side (both are mostly start-up time)
    ref = launches(corpus, "causal_lm", args, tmp_path / "ref", nproc, workers)
    victim = launches(corpus, "causal_lm", args, tmp_path / "run", nproc, workers, delay=0.3)
    victim.wait_until(lambda: os.path.isdir(tmp_path / "run" / "checkpoints" / f"step_{2 * save}"))
    victim.stop()
    assert ref.wait() == 0, ref.output()
    assert not os.path.exists(tmp_path / "run" / "model.safetensors")  # killed before the end
    resumed = launches(
        corpus, "causal_lm", [*args, "--resume_from_checkpoint", "latest"], tmp_path / "run", nproc, workers
    )
    assert resumed.wait() == 0, resumed.output()
    assert resumed_step(resumed.output()) in (2 * save, 3 * save)

    assert world_size(tmp_path / "ref") == world_size(tmp_path / "run") == nproc
    expected, got = records(ref, nproc), records(resumed, nproc)  # {step: (epoch, micro-batches)} per rank
    if nproc == 2:  # the checkpoint of step 10 is at the end of an epoch, on both ranks: the case a restored loader
        # got wrong (it started the epoch over) before streaming.Stream looked one batch ahead
        assert all([expected[r][s][0] for s in (2 * save, 2 * save + 1)] == [1, 2] for r in (0, 1)), expected
    for rank in range(nproc):
        assert sorted(expected[rank]) == list(range(1, steps + 1))
        assert got[rank] == expected[rank], f"rank {rank} trained on other blocks after the resume"
    assert weights(tmp_path / "run") == weights(tmp_path / "ref")
    if nproc == 2:  # a rank's position in its part of the stream does not move to another world size: refused
        other = launches(corpus, "causal_lm", [*args, "--resume_from_checkpoint", "latest"], tmp_path / "run", 1)
        assert other.wait() == 1
        last = other.output().strip().splitlines()[-1]
        assert last.startswith("error: Checkpoint") and "written by 2 processes" in last, other.output()
        assert weights(tmp_path / "run") == weights(tmp_path / "ref")  # nothing overwritten
    # each rank's stream crossed an epoch; within each epoch the ranks' blocks are all different
    for epoch in (0, 1):
        blocks = [b for rank in expected for e, mbs in rank.values() if e == epoch for mb in mbs for b in mb]
        assert blocks and len(blocks) == len(set(blocks)), f"a block trained on twice in epoch {epoch}"


def _recipe_args(name, tmp):
    """Arguments for a small run of each shipped recipe that batches with the Trainer's DataLoader."""
    if name == "regression":
        return ["--max_steps", "12", "--save_steps", "6", "--per_device_train_batch_size", "8", "--dropout", "0.2"]
    common = ["--max_steps", "8", "--save_steps", "4", "--per_device_train_batch_size", "4", "--eval_steps", "100"]
    if name == "glue":
        return ["--model_name_or_path", make_tiny_bert(str(tmp / "bert")), "--dataset_name",
                make_glue_folder(str(tmp / "glue")), "--task_name", "mrpc", *common]  # fmt: skip
    train, valid = make_text_files(str(tmp / "text"), n_train=60, n_eval=8)
    return ["--model_name_or_path", make_tiny_gpt2(str(tmp / "gpt2")), "--train_file", train, "--validation_file",
            valid, "--block_size", "16", "--sample_max_new_tokens", "0", *common]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("recipe,nproc", [("regression", 2), ("glue", 1), ("causal_lm", 1)])
def test_map_style_data_with_two_workers_resumes_exactly(tmp_path, launches, recipe, nproc):
    args = [*_recipe_args(recipe, tmp_path), "--logging_steps", "1", "--disable_tqdm"]
    ref = launches(tmp_path, recipe, args, tmp_path / "ref", nproc, workers=2)
    assert ref.wait() == 0, ref.output()
    assert world_size(tmp_path / "ref") == nproc
    # A run killed after its middle checkpoint is this checkpoint and nothing more: resume it in a new folder.
    checkpoints = sorted(os.listdir(tmp_path / "ref" / "checkpoints"), key=lambda d: int(d.split("_")[1]))
    middle = checkpoints[0]
    shutil.copytree(tmp_path / "ref" / "checkpoints" / middle, tmp_path / "run" / "checkpoints" / middle)
    resumed = launches(tmp_path, recipe, [*args, "--resume_from_checkpoint", "latest"], tmp_path / "run", nproc, 2)
    assert resumed.wait() == 0, resumed.output()
    step = resumed_step(resumed.output())
    assert step == int(middle.split("_")[1]) and step > 0
    expected, got = records(ref, nproc), records(resumed, nproc)
    for rank in range(nproc):
        assert got[rank] == {s: v for s, v in expected[rank].items() if s > step}, f"rank {rank}: other samples"
    assert weights(tmp_path / "run") == weights(tmp_path / "ref")


@pytest.mark.slow
def test_a_stream_without_max_steps_is_refused_in_one_line(corpus, tmp_path):
    args = [a for a in STREAM_ARGS if a not in ("--max_steps", str(STEPS))]
    proc = subprocess.run(
        [sys.executable, SCRIPT, "causal_lm", "--model_name_or_path", str(corpus / "gpt2"), *args,
         "--output_dir", str(tmp_path / "out")],
        cwd=str(corpus), env=offline_env(tmp_path), capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: The training data is a stream")
    assert "--max_steps" in proc.stderr and "Traceback" not in proc.stderr


def test_jsonl_shards_stream_split_across_ranks(corpus, tmp_path, monkeypatch):
    """In-process: json lines shards read as a stream on 2 ranks, packed into full blocks: the ranks' blocks are
    disjoint and together hold every document's tokens (less each rank's last partial block); a missing column is
    one clear error."""
    from text_fixtures import ctx, load_recipe_module

    from accel_trainer.kit.text import tokenizer_for

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    docs = []
    for s in range(4):
        docs += [f"doc {s} {i} {t}" for i, t in enumerate(sentences(4, seed=s))]
        rows = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[-4:])]
        (tmp_path / f"part{s}.jsonl").write_text("\n".join(rows) + "\n")
    clm = load_recipe_module("causal_lm")
    args = clm.Args(model_name_or_path=str(corpus / "gpt2"), train_file=str(tmp_path / "*.jsonl"), streaming=True)
    args.block_size = 8
    ranks = [[tuple(r["input_ids"]) for r in clm.build_data(ctx(args, world=2, rank=k))["train"]] for k in (0, 1)]
    assert ranks[0] and ranks[1] and not set(ranks[0]) & set(ranks[1])
    assert all(len(b) == 8 for b in ranks[0] + ranks[1])
    tok = tokenizer_for(args)
    total = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs)  # + EOS after each document
    assert total - 2 * 8 < 8 * (len(ranks[0]) + len(ranks[1])) <= total
    args.text_column = "body"
    with pytest.raises(FileNotFoundError, match="no column 'body'.*pass --text_column"):
        clm.build_data(ctx(args))
