"""recipes/glue.py: dynamic padding, length-grouped batches, the offline GLUE metric, end to end, and eval on
a split that the world size does not divide (real 2-process `accelerate launch`).

A tiny BERT (2 layers, hidden 32) from a config and a WordPiece tokenizer trained on the test's own text are
saved with save_pretrained into a temp folder and loaded by path; the data is a GLUE-MRPC-shaped folder in Hub
layout written here. No network, nothing from ../shared.
"""

import json

import pytest
import torch
from helpers import flags
from safetensors.torch import load_file
from text_fixtures import (
    OneProcess,
    ctx,
    load_recipe_module,
    make_glue_folder,
    make_tiny_bert,
    read_jsonl,
    run_recipe,
)

glue = load_recipe_module("glue")
N_EVAL = 13  # not a multiple of 2 processes x eval batch 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    return {
        "root": root,
        "model": make_tiny_bert(str(root / "tiny-bert")),
        "data": make_glue_folder(str(root / "glue"), n_train=64, n_eval=N_EVAL),
        "cache": str(root / "cache"),
    }


def args(env, **kw):
    return glue.Args(
        **{
            "model_name_or_path": env["model"],
            "dataset_name": env["data"],
            "task_name": "mrpc",
            "cache_dir": env["cache"],
            **kw,
        }
    )


# ------------------------------------------------------------------------------------------------ in-process
def test_batches_are_padded_to_their_own_longest_pair(env):
    data = glue.build_data(ctx(args(env)))
    assert len(data["train"]) == 64 and len(data["eval"]) == N_EVAL
    widths = []
    for start in range(0, 64, 8):
        rows = [data["train"][i] for i in range(start, start + 8)]
        batch = data["collate"](rows)
        longest = max(len(r["input_ids"]) for r in rows)
        assert batch["input_ids"].shape == batch["token_type_ids"].shape == (8, longest)
        assert batch["attention_mask"].sum(1).tolist() == [len(r["input_ids"]) for r in rows]
        assert batch["labels"].tolist() == [r["labels"] for r in rows]
        widths.append(longest)
    assert len(set(widths)) > 1 and max(widths) < 128  # per batch, not to max_seq_length
    loss, n = glue.loss(glue.build_model(ctx(args(env))), batch)
    assert n == 8 and loss.ndim == 0


def test_length_grouped_batches(env):
    from accel_trainer.kit.text import LengthGroupedBatches

    data = glue.build_data(ctx(args(env)))
    train, collate = data["train"], data["collate"]
    lengths = [len(x) for x in train["input_ids"]]

    def loader(world=1, rank=0, bs=8, seed=0):
        return LengthGroupedBatches(train, lengths, bs, collate, OneProcess(world, rank), seed=seed)

    one = loader()
    epoch0 = one.global_batches(0)
    assert sorted(i for b in epoch0 for i in b) == list(range(64))  # each example once per epoch
    assert loader().global_batches(0) == epoch0 and one.global_batches(1) != epoch0  # f(seed, epoch) only
    padded = sum(len(b) * max(lengths[i] for i in b) for b in epoch0)
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(0)).view(8, 8).tolist()
    assert padded < 0.9 * sum(8 * max(lengths[i] for i in b) for b in shuffled)  # much less padding
    # 2 processes x batch 4 take contiguous halves of the same global batches of 8
    batches1 = list(one)
    for rank in (0, 1):
        shard = list(loader(world=2, rank=rank, bs=4))
        assert len(shard) == len(batches1) == len(one) == 8
        for b2, b1 in zip(shard, batches1):
            assert torch.equal(b2["labels"], b1["labels"][rank * 4 : rank * 4 + 4])
    # a tail smaller than a global batch is shared out, or dropped only when smaller than the world size
    assert len(LengthGroupedBatches(train.select(range(61)), lengths[:61], 4, collate, OneProcess(2, 1))) == 8
    assert [
        len(b)
        for b in LengthGroupedBatches(
            train.select(range(57)), lengths[:57], 4, collate, OneProcess(2, 0)
        ).global_batches(0)
    ] == [8] * 7


@pytest.mark.parametrize(
    "task,preds,refs,expected",
    [
        ("mrpc", [1, 0, 1, 1], [1, 1, 1, 0], {"accuracy": 0.5, "f1": 2 * 2 / (3 + 3)}),
        ("qqp", [0, 0], [0, 0], {"accuracy": 1.0, "f1": 0.0}),
        ("sst2", [1, 0, 1], [1, 0, 0], {"accuracy": 2 / 3}),
        ("mnli", [0, 1, 2, 2], [0, 1, 2, 1], {"accuracy": 0.75}),
        # tp=2 tn=1 fp=1 fn=0: (2*1 - 1*0) / sqrt(3*2*2*1)
        ("cola", [1, 1, 1, 0], [1, 1, 0, 0], {"matthews_correlation": 2 / 12**0.5}),
        # spearman: ranks (0,1,2,3) vs (0,1,3,2) -> 1 - 6*2/(4*15) = 0.8
        ("stsb", [0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 4.0, 3.0], {"pearson": 0.8, "spearmanr": 0.8}),
    ],
)
def test_glue_metric_per_task_offline(task, preds, refs, expected):
    metrics = glue.build_metrics(ctx(glue.Args(task_name=task)))
    module = metrics["glue"]
    module.add_batch(predictions=preds, references=refs)
    assert module.compute() == pytest.approx(expected)


def test_missing_or_wrong_inputs_give_a_clear_error(env):
    from accel_trainer.kit.text import MissingInputError

    with pytest.raises(MissingInputError, match=r"dataset path .*no-data.* does not exist.*--dataset_name"):
        glue.build_data(ctx(args(env, dataset_name=str(env["root"] / "no-data"))))
    with pytest.raises(MissingInputError, match=r"(?s)has no config 'cola'.*--task_name"):
        glue.build_data(ctx(args(env, task_name="cola")))  # the folder has mrpc only
    with pytest.raises(MissingInputError, match=r"no 'test' split.*--eval_split"):
        glue.build_data(ctx(args(env, eval_split="test")))
    with pytest.raises(MissingInputError, match=r"model path .*no-model.* does not exist.*--model_name_or_path"):
        glue.build_model(ctx(args(env, model_name_or_path=str(env["root"] / "no-model"))))
    with pytest.raises(ValueError, match="not a GLUE task"):
        glue.Args(task_name="imdb")


@pytest.mark.slow
def test_missing_model_path_exits_non_zero_with_the_fix(env, tmp_path):
    proc = run_recipe(
        "glue",
        flags(
            model_name_or_path=tmp_path / "bert-typo",
            dataset_name=env["data"],
            output_dir=tmp_path / "out",
            max_steps=1,
        ),
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "bert-typo' does not exist" in proc.stderr and "save_pretrained" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------- end to end
def glue_flags(env, out, **kw) -> list[str]:
    """The tiny BERT on the GLUE folder, trained into `out` at a high learning rate with no warm-up; then `kw`."""
    return flags(model_name_or_path=env["model"], dataset_name=env["data"], output_dir=out, warmup_steps=0,
                 learning_rate="3e-3", save_steps=0, disable_tqdm=True, **kw)  # fmt: skip


@pytest.mark.slow
def test_end_to_end_length_grouped(env, tmp_path):
    out = tmp_path / "out"
    proc = run_recipe(
        "glue",
        glue_flags(
            env,
            out,
            group_by_length=True,
            max_steps=40,
            per_device_train_batch_size=8,
            logging_steps=5,
            eval_steps=20,
            seed=0,
        ),  # fmt: skip
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(out / "metrics.jsonl")
    losses = [e["loss"] for e in events if "loss" in e]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0] - 0.1, losses
    evals = [e for e in events if "eval_loss" in e]
    assert [e["step"] for e in evals] == [20, 40]
    for e in evals:
        assert e["eval_samples"] == N_EVAL and 0 <= e["eval_accuracy"] <= 1 and 0 <= e["eval_f1"] <= 1
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def _single_process_metrics(env, weights_path):
    model = glue.build_model(ctx(args(env)))
    model.load_state_dict(load_file(weights_path))
    model.eval()
    data = glue.build_data(ctx(args(env)))
    batch = data["collate"]([data["eval"][i] for i in range(len(data["eval"]))])
    out = glue.eval_step(model, batch)
    pred, ref = out["predictions"], out["references"]
    tp = int(((pred == 1) & (ref == 1)).sum())
    return {
        "eval_accuracy": int((pred == ref).sum()) / len(ref),
        "eval_f1": 2 * tp / int((pred == 1).sum() + (ref == 1).sum()),
        "eval_loss": float(out["loss"].mean()),
    }


@pytest.mark.slow
def test_two_process_eval_on_an_uneven_split_matches_one_process(env, tmp_path):
    out = tmp_path / "out"
    proc = run_recipe(
        "glue",
        glue_flags(env, out, max_steps=8, per_device_train_batch_size=4, per_device_eval_batch_size=4, logging_steps=4),
        tmp_path,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "run_config.json").read_text())["num_processes"] == 2
    final = [e for e in read_jsonl(out / "metrics.jsonl") if "eval_loss" in e][-1]
    # 13 pairs over 2 x 4: Accelerate pads the last round with repeats; each pair must count exactly once
    assert final["eval_samples"] == N_EVAL
    single = _single_process_metrics(env, str(out / "model.safetensors"))
    assert final["eval_accuracy"] == pytest.approx(single["eval_accuracy"], abs=1e-12)
    assert final["eval_accuracy"] * N_EVAL == pytest.approx(round(final["eval_accuracy"] * N_EVAL))  # k / 13
    assert final["eval_f1"] == pytest.approx(single["eval_f1"], abs=1e-12)
    assert final["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
