"""recipes/token_classification.py and the offline `token_classification` metric: entity spans by conlleval's rules
(IOB1 and IOB2), -100 skipped, sub-word label alignment, and the recipe end to end with `python` (a model that
learns) and on 2 processes (metrics equal to one process's on the same weights, on a split the world size does not
divide, with batches padded to different widths on each rank).

A tiny BERT (2 layers, hidden 32) from a config and a WordPiece tokenizer trained on the test's own words; tagged
sentences where each word's tag follows from the word (animals are ANI, colours COL, the rest O; a run of the same
type is one entity: B- then I-), so a small model learns it in a few dozen updates. No network.
"""

import json
import os
import random

import pytest
import torch
from helpers import flags
from safetensors.torch import load_file
from text_fixtures import _train_tokenizer, ctx, load_recipe_module, read_jsonl, run_recipe

from accel_trainer.kit.metric_modules import TokenClassification, entities
from accel_trainer.kit.metrics import load_metric

tc = load_recipe_module("token_classification")

LABELS = ["O", "B-ANI", "I-ANI", "B-COL", "I-COL"]
TYPE = {w: "ANI" for w in ("cat", "dog", "bird", "fish", "catdog")} | {w: "COL" for w in ("red", "blue", "green")}
OTHER = "the a sat ran on under over near mat log tree pond small big quick slow".split()
N_EVAL = 13  # not a multiple of 2 processes x eval batch 4


def tag(words: list[str]) -> list[str]:
    out, prev = [], None
    for w in words:
        t = TYPE.get(w)
        out.append("O" if t is None else ("I-" if t == prev else "B-") + t)
        prev = t
    return out


def sentences(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    vocab = list(TYPE) + OTHER * 2
    return [[rng.choice(vocab) for _ in range(rng.randint(2, 12))] for _ in range(n)]


def make_data(root, n_train=96, n_eval=N_EVAL) -> dict:
    """The same rows as a Hub-layout folder (ClassLabel tags) and as jsonl files (string tags)."""
    import datasets

    folder = os.path.join(root, "ner")
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(
            "---\nconfigs:\n- config_name: default\n  data_files:\n"
            "  - split: train\n    path: data/train-*\n  - split: validation\n    path: data/validation-*\n---\n"
        )
    features = datasets.Features(
        {"tokens": datasets.Sequence(datasets.Value("string")), "ner_tags": datasets.Sequence(datasets.ClassLabel(names=LABELS))}
    )  # fmt: skip
    files = {}
    for split, n, seed in (("train", n_train, 0), ("validation", n_eval, 1)):
        rows = sentences(n, seed)
        tags = [tag(r) for r in rows]
        ds = datasets.Dataset.from_dict({"tokens": rows, "ner_tags": tags}, features=features)
        ds.to_parquet(os.path.join(folder, "data", f"{split}-00000-of-00001.parquet"))
        files[split] = os.path.join(root, f"{split}.jsonl")
        with open(files[split], "w") as f:
            f.writelines(json.dumps({"words": r, "tags": t}) + "\n" for r, t in zip(rows, tags))
    return {"folder": folder, **files}


def make_config(folder: str) -> str:
    """A 2-layer BERT config for token classification (random init by the recipe) + WordPiece tokenizer."""
    from transformers import BertConfig

    # trained without the word "catdog", which it then splits into several sub-words
    texts = [" ".join(w for w in s if w != "catdog") for s in sentences(300, 7)]
    tokenizer = _train_tokenizer(texts, "bert")
    BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(folder)  # fmt: skip
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokcls")
    return {"model": make_config(str(root / "tiny-bert")), "cache": str(root / "cache"), **make_data(str(root))}


def args(env, **kw):
    base = {"config_name": env["model"], "tokenizer_name": env["model"], "dataset_name": env["folder"]}
    return tc.Args(**{**base, "cache_dir": env["cache"], **kw})


# ------------------------------------------------------------------------------------------------- the metric
@pytest.mark.parametrize(
    "tags,spans",
    [
        (["B-PER", "I-PER", "O", "B-LOC"], [("PER", 0, 1), ("LOC", 3, 3)]),  # IOB2; a trailing entity ends the row
        (["O", "I-PER", "I-PER", "O"], [("PER", 1, 2)]),  # IOB1: I- after O starts an entity
        (["I-PER", "I-LOC", "I-LOC"], [("PER", 0, 0), ("LOC", 1, 2)]),  # a type change starts another
        (["I-PER", "B-PER", "I-PER"], [("PER", 0, 0), ("PER", 1, 2)]),  # IOB1: B- splits two adjacent entities
        (["B-PER", "B-PER"], [("PER", 0, 0), ("PER", 1, 1)]),
        (["O", "O"], []),
        (["B-MISC", "I-PER"], [("MISC", 0, 0), ("PER", 1, 1)]),  # I- of another type: a new entity
    ],
)
def test_entity_spans(tags, spans):
    assert entities(tags) == spans


def test_entity_precision_recall_f1_by_hand():
    m = TokenClassification(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"])
    # row 1: gold PER(0,1), LOC(3,3); predicted PER(0,0) (wrong end), LOC(3,3) (right)
    # row 2: gold LOC(1,2); predicted PER(0,0) (spurious), LOC(1,2) (right: I-LOC after B-PER starts one)
    m.add_batch(predictions=[[1, 0, 0, 3]], references=[[1, 2, 0, 3]])
    m.add_batch(predictions=[[1, 4, 4]], references=[[0, 3, 4]])
    # tp 2, predicted 4, gold 3; tokens right: 3 of 4, then 1 of 3
    assert m.compute() == pytest.approx({"precision": 2 / 4, "recall": 2 / 3, "f1": 4 / 7, "accuracy": 4 / 7})
    assert m.compute() == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 0.0}  # compute() resets


def test_metric_ignores_minus_100_positions():
    names = ["O", "B-PER", "I-PER"]
    # -100 (sub-words, specials, padding) drops the position from both sides, whatever was predicted there:
    # the I-PER after the hole continues the entity, as if the position were not there
    with_holes = load_metric("token_classification", label_names=names)
    with_holes.add_batch(
        predictions=torch.tensor([[0, 1, 0, 2, 2], [2, 0, 0, 0, 0]]),
        references=torch.tensor([[-100, 1, -100, 2, -100], [0, -100, -100, -100, -100]]),
    )
    plain = load_metric("token_classification", label_names=names)
    plain.add_batch(predictions=[[1, 2], [2]], references=[[1, 2], [0]])
    expected = {"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "accuracy": 2 / 3}
    assert with_holes.compute() == pytest.approx(expected) == plain.compute()


def test_metric_refuses_ids_without_names():
    m = load_metric("token_classification", label_names=["O", "B-X"])
    with pytest.raises(ValueError, match="label id 5 is outside the 2 label_names"):
        m.add_batch(predictions=[[5]], references=[[0]])


# ------------------------------------------------------------------------------------------ labels and data
def test_first_sub_word_gets_the_label():
    word_ids = [None, 0, 1, 1, 1, 2, None]
    b_to_i = [0, 2, 2]  # O, B-X, I-X
    assert tc.align_labels(word_ids, [0, 1, 2], b_to_i, False) == [-100, 0, 1, -100, -100, 2, -100]
    assert tc.align_labels(word_ids, [0, 1, 2], b_to_i, True) == [-100, 0, 1, 2, 2, 2, -100]


@pytest.mark.parametrize("source", ["folder", "jsonl"])
def test_build_data_aligns_tags_to_sub_words(env, source):
    kw = {} if source == "folder" else {"dataset_name": None, "train_file": env["train"],
                                        "validation_file": env["validation"], "tokens_column": "words",
                                        "tags_column": "tags"}  # fmt: skip
    a = args(env, **kw)
    assert tc._labels(a) == (tuple(LABELS) if source == "folder" else tuple(sorted(LABELS)))
    data = tc.build_data(ctx(a))
    assert len(data["train"]) == 96 and len(data["eval"]) == N_EVAL
    tok = tc.tokenizer_for(a)
    assert len(tok.tokenize("catdog")) > 1  # the data has a word of several sub-words
    names = tc._labels(a)
    rows = sentences(96, 0)
    split_words = 0
    for i in range(96):
        labels = data["train"][i]["labels"]
        enc = tok(rows[i], is_split_into_words=True)
        assert data["train"][i]["input_ids"] == enc["input_ids"]
        kept = [names[x] for x in labels if x != -100]
        assert kept == tag(rows[i])  # one label per word, on its first sub-word
        word_ids = enc.word_ids()
        split_words += sum(
            1 for j in range(1, len(word_ids)) if word_ids[j] is not None and word_ids[j] == word_ids[j - 1]
        )
    assert split_words > 0
    batch = data["collate"]([data["eval"][i] for i in range(4)])
    longest = max(len(data["eval"][i]["input_ids"]) for i in range(4))
    assert batch["labels"].shape == batch["input_ids"].shape == (4, longest)  # per batch; labels padded with -100
    model = tc.build_model(ctx(a))
    assert model.config.id2label == dict(enumerate(names)) and model.num_labels == len(LABELS)
    out = tc.eval_step(model, batch)
    assert out["predictions"].shape == out["references"].shape == (4, longest)
    loss, n = tc.loss(model, batch)
    assert n == int(out["n_items"].sum()) and torch.isclose(loss, out["loss"].sum() / n, rtol=1e-5)


def test_bad_columns_and_unnamed_ids_give_one_clear_error(env, tmp_path):
    from accel_trainer.kit.text import MissingInputError

    with pytest.raises(MissingInputError, match=r"no column 'ner_tags'.*--tags_column"):
        tc.build_data(ctx(args(env, dataset_name=None, train_file=env["train"], tokens_column="words")))
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"tokens": ["a", "cat"], "ner_tags": [0, 1]}) + "\n")
    with pytest.raises(MissingInputError, match="without names: pass --label_names"):
        tc.build_model(ctx(args(env, dataset_name=None, train_file=str(ids))))
    assert tc._labels(args(env, dataset_name=None, train_file=str(ids), label_names="O,B-ANI")) == ("O", "B-ANI")


@pytest.mark.slow
def test_bad_flags_exit_with_one_line(env, tmp_path):
    proc = run_recipe(
        "token_classification",
        flags(
            config_name=env["model"],
            tokenizer_name=env["model"],
            dataset_name=env["folder"],
            train_file=env["train"],
            output_dir=tmp_path / "out",
            max_steps=1,
        ),
        tmp_path,
        timeout=120,
    )
    assert proc.returncode != 0 and "either --dataset_name or --train_file" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------- end to end
def run_flags(env, out, **kw) -> list[str]:
    return flags(config_name=env["model"], tokenizer_name=env["model"], output_dir=out, learning_rate="5e-3",
                 warmup_steps=0, save_steps=0, disable_tqdm=True, cache_dir=env["cache"], seed=0, **kw)  # fmt: skip


@pytest.mark.slow
def test_one_process_learns_the_entities(env, tmp_path):
    out = tmp_path / "out"
    proc = run_recipe(
        "token_classification",
        run_flags(
            env,
            out,
            train_file=env["train"],
            validation_file=env["validation"],
            tokens_column="words",
            tags_column="tags",
            max_steps=60,
            per_device_train_batch_size=8,
            logging_steps=10,
            eval_steps=30,
        ),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [e for e in read_jsonl(out / "metrics.jsonl") if "eval_loss" in e]
    assert [e["step"] for e in evals] == [30, 60]
    final = evals[-1]
    assert final["eval_samples"] == N_EVAL
    assert final["eval_f1"] > 0.7 and final["eval_accuracy"] > 0.9, final
    assert 0 <= final["eval_precision"] <= 1 and 0 <= final["eval_recall"] <= 1


def _one_process_metrics(env, weights_path) -> dict:
    """The same weights evaluated in this process, the whole split in one batch."""
    a = args(env)
    model = tc.build_model(ctx(a))
    model.load_state_dict(load_file(weights_path))
    model.eval()
    data = tc.build_data(ctx(a))
    out = tc.eval_step(model, data["collate"]([data["eval"][i] for i in range(N_EVAL)]))
    metric = tc.build_metrics(ctx(a))["entities"]
    metric.add_batch(predictions=out["predictions"], references=out["references"])
    results = {f"eval_{k}": v for k, v in metric.compute().items()}
    return results | {"eval_loss": float(out["loss"].sum() / out["n_items"].sum())}


@pytest.mark.slow
def test_two_processes_match_one_process_on_an_uneven_split(env, tmp_path):
    out = tmp_path / "out"
    proc = run_recipe(
        "token_classification",
        run_flags(
            env,
            out,
            dataset_name=env["folder"],
            max_steps=8,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            logging_steps=4,
        ),
        tmp_path,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "run_config.json").read_text())["num_processes"] == 2
    final = [e for e in read_jsonl(out / "metrics.jsonl") if "eval_loss" in e][-1]
    assert final["eval_samples"] == N_EVAL  # Accelerate's repeats in the last round counted once
    single = _one_process_metrics(env, str(out / "model.safetensors"))
    for k in ("eval_precision", "eval_recall", "eval_f1", "eval_accuracy"):
        assert final[k] == single[k], (k, final, single)  # counts of the same tokens: exactly equal
    assert 0 < final["eval_accuracy"] < 1  # a partly trained model: the comparison is not trivially 0 = 0
    assert final["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
