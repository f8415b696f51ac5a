"""recipes/causal_lm.py: tokenise-once-and-cache, packing, per-line batches, the token-count loss contract,
end to end from scratch, and token-count parity across world sizes with a real 2-process `accelerate launch`.

Everything is built here: a tokenizer trained on the test's own text, a 2-layer GPT-2 from a config, saved with
save_pretrained into a temp folder and loaded by path. No network, nothing from ../shared.
"""

import glob
import json
import math
import os

import pytest
import torch
from helpers import flags
from safetensors.torch import load_file
from text_fixtures import ctx, load_recipe_module, make_text_files, make_tiny_gpt2, read_jsonl, run_recipe

clm = load_recipe_module("causal_lm")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("clm")
    train, valid = make_text_files(str(root / "text"))
    return {
        "root": root,
        "train": train,
        "valid": valid,
        "model": make_tiny_gpt2(str(root / "tiny-gpt2")),
        "config_only": make_tiny_gpt2(str(root / "tiny-gpt2-config"), weights=False),
        "cache": str(root / "cache"),
    }


def args(env, **kw):
    base = dict(
        model_name_or_path=env["model"],
        train_file=env["train"],
        validation_file=env["valid"],
        block_size=16,
        cache_dir=env["cache"],
    )
    return clm.Args(**{**base, **kw})


# ------------------------------------------------------------------------------------------------ data, in-process
def test_packing_cuts_the_token_stream_into_full_blocks(env):
    a = args(env, block_size=16)
    data = clm.build_data(ctx(a))
    tok = clm.tokenizer_for(a)
    with open(env["train"]) as f:  # text files keep their line breaks when packed
        stream = [
            t for line in f.read().splitlines(keepends=True) for t in tok(line, add_special_tokens=False)["input_ids"]
        ]
    blocks = data["train"]["input_ids"]
    assert {len(b) for b in blocks} == {16}
    packed = [t for b in blocks for t in b]
    assert packed == stream[: len(packed)] and len(stream) - len(packed) < 16  # only the remainder is dropped
    batch = data["collate"]([data["train"][i] for i in range(4)])
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["attention_mask"].all()
    _, n = clm.loss(clm.build_model(ctx(a)), batch)
    assert n == 4 * 15  # every token but the first of each block is a target


def test_tokenised_once_then_read_from_the_cache(env):
    a = args(env, block_size=8)
    first = clm.build_data(ctx(a))["train"]
    files = first.cache_files
    assert files and all(os.path.basename(f["filename"]).startswith("cache-") for f in files)
    mtimes = [os.path.getmtime(f["filename"]) for f in files]
    again = clm.build_data(ctx(a))["train"]  # the cross-process case: see the parity test
    assert again.cache_files == files and [os.path.getmtime(f["filename"]) for f in files] == mtimes


def test_without_validation_file_the_tail_is_held_out(env):
    a = args(env, validation_file=None, packing=False, validation_split_percentage=10, block_size=64)
    data = clm.build_data(ctx(a))
    with open(env["train"]) as f:
        n_lines = len([line for line in f if line.strip()])
    assert len(data["eval"]) == n_lines // 10 and len(data["train"]) == n_lines - n_lines // 10
    tok = clm.tokenizer_for(a)
    with open(env["train"]) as f:
        last = f.read().splitlines()[-1]
    assert data["eval"][-1]["input_ids"] == tok(last, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_per_line_batches_mask_padding_and_weight_by_target_tokens(env):
    a = args(env, packing=False, block_size=64)
    data = clm.build_data(ctx(a))
    model = clm.build_model(ctx(a))
    lengths = [len(x) for x in data["train"]["input_ids"]]
    assert min(lengths) < 6 and max(lengths) > 20  # micro-batches will hold very different token counts
    short = sorted(range(len(lengths)), key=lengths.__getitem__)[:4]
    long = sorted(range(len(lengths)), key=lengths.__getitem__)[-4:]
    b_short, b_long, b_all = (data["collate"]([data["train"][i] for i in ix]) for ix in (short, long, short + long))
    # padding is never a target, nor attended to
    assert torch.equal(b_all["labels"] == -100, b_all["attention_mask"] == 0)
    l_s, n_s = clm.loss(model, b_short)
    l_l, n_l = clm.loss(model, b_long)
    l_a, n_a = clm.loss(model, b_all)
    assert n_s == sum(lengths[i] - 1 for i in short) and n_a == n_s + n_l
    # The contract the Trainer relies on: weighting micro-batch means by their counts gives the mean over all
    # target tokens; a plain mean of means would not.
    weighted = (l_s * n_s + l_l * n_l) / (n_s + n_l)
    torch.testing.assert_close(weighted, l_a)
    assert abs(float((l_s + l_l).detach() / 2 - l_a.detach())) > 1e-3
    # and it is the model's own next-token loss (transformers' shift and -100 masking), on padded rows too
    own = model(input_ids=b_all["input_ids"], attention_mask=b_all["attention_mask"], labels=b_all["labels"]).loss
    torch.testing.assert_close(l_a, own)


def test_missing_inputs_give_a_clear_error(env):
    from accel_trainer.kit.text import MissingInputError

    with pytest.raises(MissingInputError, match=r"train file .*nope\.txt.* does not exist.*--train_file"):
        clm.build_data(ctx(args(env, train_file=str(env["root"] / "nope.txt"))))
    with pytest.raises(MissingInputError, match=r"model path .*no-model.* does not exist.*--model_name_or_path"):
        clm.build_model(ctx(args(env, model_name_or_path=str(env["root"] / "no-model"))))
    with pytest.raises(MissingInputError, match=r"tokenizer path .*no-tok.* does not exist"):
        clm.build_model(ctx(args(env, config_name=env["config_only"], tokenizer_name=str(env["root"] / "no-tok"))))
    with pytest.raises(ValueError, match="--train_file"):
        clm.Args(model_name_or_path=env["model"])


# ----------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_from_scratch_end_to_end(env, tmp_path):
    out = tmp_path / "out"
    proc = run_recipe(
        "causal_lm",
        flags(
            config_name=env["config_only"],
            tokenizer_name=env["config_only"],
            train_file=env["train"],
            block_size=32,
            output_dir=out,
            max_steps=30,
            learning_rate="3e-3",
            per_device_train_batch_size=8,
            logging_steps=5,
            eval_steps=15,
            save_steps=0,
            disable_tqdm=True,
            sample_prompt="the cat",
            sample_max_new_tokens=8,
            seed=1,
            mixed_precision="bf16",
            gradient_checkpointing=True,  # through the Trainer, for transformers models
        ),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "run_config.json").read_text())
    assert config["topology"]["mixed_precision"] == "bf16" and config["args"]["gradient_checkpointing"]
    events = read_jsonl(out / "metrics.jsonl")
    losses = [e["loss"] for e in events if "loss" in e]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.8, losses  # random init: ~ln(300)=5.7 to well below
    evals = [e for e in events if "eval_loss" in e]
    assert [e["step"] for e in evals] == [15, 30] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    for e in evals:
        assert e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"]))
        assert e["eval_sample"].startswith("the cat") and len(e["eval_sample"]) > len("the cat")
    assert "[sample @ step 30] 'the cat" in proc.stdout
    # plain weights that load back into the model built from the same config
    model = clm.build_model(ctx(args(env, config_name=env["config_only"], tokenizer_name=env["config_only"])))
    missing, unexpected = model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    # the output projection is tied to the input embedding: safetensors stores the shared tensor once
    assert not unexpected and len(missing) <= 1 and set(missing) <= {"lm_head.weight", "transformer.wte.weight"}
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.slow
def test_tied_embeddings_resume_from_own_checkpoint_bit_identical(env, tmp_path):
    # GPT-2 ties lm_head.weight to the input embedding; Accelerate's save stores the shared tensor once. A run
    # stopped after its step-4 checkpoint (the later ones and the final model removed, as a kill leaves it) must
    # resume with `latest` and end with the bytes of the uninterrupted run (CPU fp32).
    import shutil

    common = [
        "--config_name",
        env["config_only"],
        "--tokenizer_name",
        env["config_only"],
        "--train_file",
        env["train"],
        "--block_size",
        "16",
        "--max_steps",
        "8",
        "--save_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "2",
        "--disable_tqdm",
        "--sample_max_new_tokens",
        "0",
        "--seed",
        "2",
        "--mixed_precision",
        "no",
        "--cache_dir",
        env["cache"],
    ]
    ref = tmp_path / "ref"
    proc = run_recipe("causal_lm", common + ["--output_dir", str(ref)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = tmp_path / "stopped"
    shutil.copytree(ref, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step_8")
    os.remove(stopped / "model.safetensors")
    proc = run_recipe(
        "causal_lm", common + ["--output_dir", str(stopped), "--resume_from_checkpoint", "latest"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resumed from" in proc.stdout + proc.stderr and "step_4" in proc.stdout + proc.stderr
    assert (stopped / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------ token-count parity
# --adam_epsilon 1e-6: Adam divides each coordinate by its own gradient scale. A coordinate whose gradient is a
# nearly cancelling sum (|g| ~ 1e-9 from terms ~1e-3) carries float rounding noise as large as itself, and the
# summation order -- i.e. the world size -- changes that noise; with eps 1e-8 Adam turns it into weight
# differences up to 0.1 x lr (measured: 1e-4 in an MLP projection for one of four initialisations). eps 1e-6 keeps
# it below 1e-6 (measured) while real gradients, orders of magnitude above eps, are scaled as before.
PARITY = [
    "--packing",
    "false",
    "--block_size",
    "64",
    "--max_steps",
    "4",
    "--learning_rate",
    "1e-3",
    "--adam_epsilon",
    "1e-6",
    "--logging_steps",
    "1",
    "--save_steps",
    "0",
    "--disable_tqdm",
    "--sample_max_new_tokens",
    "0",
    "--seed",
    "3",
    "--per_device_eval_batch_size",
    "3",
    "--eval_steps",
    "2",
]


@pytest.fixture(scope="module")
def parity_runs(env):
    runs, cache_files = {}, {}
    common = [
        "--model_name_or_path",
        env["model"],
        "--train_file",
        env["train"],
        "--validation_file",
        env["valid"],
        "--cache_dir",
        env["cache"] + "-parity",
    ] + PARITY
    # 1 process x batch 16 (no accumulation) vs 2 processes x batch 4 x accumulation 2: one global batch of 16
    # lines per update, split into micro-batches whose target-token counts differ.
    for name, nproc, bs, acc in (("1x16x1", 1, 16, 1), ("2x4x2", 2, 4, 2)):
        out = env["root"] / f"parity-{name}"
        proc = run_recipe(
            "causal_lm",
            common
            + [
                "--output_dir",
                str(out),
                "--per_device_train_batch_size",
                str(bs),
                "--gradient_accumulation_steps",
                str(acc),
            ],
            env["root"],
            nproc=nproc,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = out
        cache_files[name] = sorted(glob.glob(env["cache"] + "-parity/**/cache-*.arrow", recursive=True))
    return runs, cache_files


@pytest.mark.slow
def test_world_size_is_two(parity_runs):
    runs, _ = parity_runs
    for name, out in runs.items():
        config = json.loads((out / "run_config.json").read_text())
        assert config["num_processes"] == int(name[0])
        assert config["global_train_batch_size"] == 16


@pytest.mark.slow
def test_two_processes_with_accumulation_give_the_one_process_weights(parity_runs):
    runs, _ = parity_runs
    ref, got = load_file(str(runs["1x16x1"] / "model.safetensors")), load_file(str(runs["2x4x2"] / "model.safetensors"))
    assert ref.keys() == got.keys()
    initial = load_file(os.path.join(os.path.dirname(runs["1x16x1"]), "tiny-gpt2", "model.safetensors"))
    assert any(not torch.equal(ref[k], initial[k]) for k in ref.keys() & initial.keys())  # it did train
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], msg=lambda m: f"{k}: {m}")  # float32 tolerances
    loss = {n: [e["loss"] for e in read_jsonl(o / "metrics.jsonl") if "loss" in e] for n, o in runs.items()}
    assert loss["2x4x2"] == pytest.approx(loss["1x16x1"], rel=1e-5)


@pytest.mark.slow
def test_eval_on_an_uneven_split_counts_every_line_once(parity_runs, env):
    # 20 validation lines over 2 processes x batch 3: Accelerate repeats lines to even out the ranks
    runs, _ = parity_runs
    with open(env["valid"]) as f:
        n_valid = len([line for line in f if line.strip()])
    evals = {n: [e for e in read_jsonl(o / "metrics.jsonl") if "eval_loss" in e] for n, o in runs.items()}
    assert n_valid % 6 and [e["eval_samples"] for e in evals["2x4x2"]] == [n_valid, n_valid]
    for a, b in zip(evals["2x4x2"], evals["1x16x1"]):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
        assert a["eval_perplexity"] == pytest.approx(math.exp(a["eval_loss"]))


@pytest.mark.slow
def test_two_processes_resume_bit_identical_with_token_counts_that_differ_by_rank_and_update(env, tmp_path):
    # Per-line batches: every micro-batch has its own target-token count, so each update's gradient is rescaled
    # after DDP's all-reduce by K x world / N (update.py), K the previous update's tokens per rank. K is saved in
    # the checkpoint: a run stopped after its step-3 checkpoint resumes to the uninterrupted run's bytes.
    import shutil

    common = flags(
        model_name_or_path=env["model"],
        train_file=env["train"],
        cache_dir=env["cache"] + "-resume2",
        packing="false",
        block_size=64,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=6,
        save_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        sample_max_new_tokens=0,
        seed=4,
        mixed_precision="no",
    ) + ["--disable_tqdm"]
    ref = tmp_path / "ref"
    proc = run_recipe("causal_lm", common + ["--output_dir", str(ref)], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ref / "run_config.json").read_text())["num_processes"] == 2
    stopped = tmp_path / "stopped"
    shutil.copytree(ref, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step_6")
    os.remove(stopped / "model.safetensors")
    state = json.loads((stopped / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["items_per_rank"] > 1  # tokens per rank of update 3, not a sample count of 1
    proc = run_recipe(
        "causal_lm", common + ["--output_dir", str(stopped), "--resume_from_checkpoint", "latest"], tmp_path, nproc=2
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_3" in proc.stdout + proc.stderr
    assert (stopped / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_the_other_process_reads_the_main_process_cache(parity_runs):
    # Tokenise once: the 2-process run found the 1-process run's cache (same fingerprints) and wrote nothing new.
    _, cache_files = parity_runs
    assert cache_files["1x16x1"] and cache_files["2x4x2"] == cache_files["1x16x1"]


@pytest.mark.slow
def test_a_hub_id_that_cannot_be_reached_is_a_clear_error(tmp_path):
    # The real Hub code path, offline (HF_HUB_OFFLINE=1, as on CI): one message naming the id and the fix.
    import subprocess
    import sys

    from text_fixtures import offline_env

    code = (
        "from transformers import AutoModelForCausalLM\n"
        "from accel_trainer.kit.text import load_pretrained\n"
        "load_pretrained(AutoModelForCausalLM, 'no-such-org/no-such-model')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=offline_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "MissingInputError: could not load the model from Hub id 'no-such-org/no-such-model'" in proc.stderr
    assert "--model_name_or_path a folder written by `save_pretrained`" in proc.stderr
