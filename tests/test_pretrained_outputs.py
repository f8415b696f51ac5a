"""The run's model as the ecosystem loads it (issue 31 item 1): for a transformers model, output_dir and best/ are
save_pretrained folders with the recipe's tokenizer, loaded by `AutoModelFor*.from_pretrained(output_dir)`,
`AutoTokenizer.from_pretrained(output_dir)` and `pipeline(...)`, on 1 process, DDP and FSDP; `--push_to_hub`
uploads it through huggingface_hub (a stub HfApi in-process, or a closed local port: nothing leaves the machine).

Everything is built here (tests/text_fixtures.py): tiny configs and tokenizers trained on the tests' own text.
"""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import RECIPES, env, flags, free_port, launcher, run_config
from safetensors.torch import load_file
from test_token_classification import make_config as make_ner_config
from test_token_classification import make_data as make_ner_data
from text_fixtures import (
    ctx,
    load_recipe_module,
    make_glue_folder,
    make_text_files,
    make_tiny_bert,
    make_tiny_gpt2,
    offline_env,
    read_jsonl,
)

from accel_trainer import Trainer

# recipe -> (the Auto class that loads its output, the pipeline task)
SPECS = {
    "causal_lm": ("AutoModelForCausalLM", "text-generation"),
    "glue": ("AutoModelForSequenceClassification", "text-classification"),
    "token_classification": ("AutoModelForTokenClassification", "token-classification"),
}
COMMON = dict(max_steps=4, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-3,
              warmup_steps=0, save_steps=0, logging_steps=2, eval_steps=2, disable_tqdm=True, seed=0)  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    train, valid = make_text_files(str(root / "text"), n_train=60, n_eval=12)
    ner = make_ner_data(str(root), n_train=24, n_eval=9)
    cache, ner_model = str(root / "cache"), make_ner_config(str(root / "ner-bert"))
    return {
        "causal_lm": dict(model_name_or_path=make_tiny_gpt2(str(root / "gpt2")), train_file=train,
                          validation_file=valid, block_size=16, sample_max_new_tokens=0, cache_dir=cache),
        "glue": dict(model_name_or_path=make_tiny_bert(str(root / "bert")), task_name="mrpc", cache_dir=cache,
                     dataset_name=make_glue_folder(str(root / "glue"), n_train=24, n_eval=9)),
        "token_classification": dict(config_name=ner_model, tokenizer_name=ner_model, dataset_name=ner["folder"],
                                     cache_dir=cache),
    }  # fmt: skip


def loaded(out: str, recipe: str):
    import transformers

    model = getattr(transformers, SPECS[recipe][0]).from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    return model, tokenizer


def assert_pipeline_runs(out: str, recipe: str):
    from transformers import pipeline

    pipe = pipeline(SPECS[recipe][1], model=out, device="cpu")
    if recipe == "causal_lm":
        text = pipe("the cat sat", max_new_tokens=3, do_sample=False)[0]["generated_text"]
        assert text.startswith("the cat sat")
    elif recipe == "glue":
        assert pipe("the cat sat on the mat")[0]["label"] in ("LABEL_0", "LABEL_1")
    else:
        tags = {e["entity"] for e in pipe("the red cat sat on a blue log")}
        assert tags <= {"B-ANI", "I-ANI", "B-COL", "I-COL"}  # O is left out by the pipeline


def assert_save_pretrained_folder(out: str, recipe: str):
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files, files
    assert ("generation_config.json" in files) == (recipe == "causal_lm")
    assert not any(f.endswith(".tmp") for f in files)


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize("recipe", list(SPECS))
def test_one_process_output_and_best_load_with_from_pretrained_and_pipeline(assets, recipe, tmp_path, capsys):
    out = str(tmp_path / "out")
    trainer = Trainer.from_recipe(os.path.join(RECIPES, f"{recipe}.py"), output_dir=out,
                                  metric_for_best_model="eval_loss", **COMMON, **assets[recipe])  # fmt: skip
    trainer.fit()
    (end,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("accel-trainer: done")]
    assert end.endswith(f".from_pretrained({out!r})"), end  # the end line's hint: the folder, as transformers loads
    assert_save_pretrained_folder(out, recipe)
    assert_save_pretrained_folder(os.path.join(out, "best"), recipe)
    batch = next(iter(trainer.eval_loader))
    own = trainer.unwrapped_model.eval()
    model, tokenizer = loaded(out, recipe)
    assert torch.equal(logits(model, batch), logits(own, batch))
    if recipe == "causal_lm":  # tied weights stay tied, stored once
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert tokenizer("the cat sat")["input_ids"] == trainer.tokenizer("the cat sat")["input_ids"]
    best, _ = loaded(os.path.join(out, "best"), recipe)
    assert logits(best, batch).shape == logits(own, batch).shape
    assert_pipeline_runs(out, recipe)


def eval_loss(model, recipe: str, values: dict) -> float:
    """The loaded model's loss over the recipe's whole eval split, computed as the run computes it."""
    module = load_recipe_module(recipe)
    names = {f.name for f in dataclasses.fields(module.Args)}
    data = module.build_data(ctx(module.Args(**{k: v for k, v in values.items() if k in names})))
    rows = [data["eval"][i] for i in range(len(data["eval"]))]
    total, n = 0.0, 0.0
    for i in range(0, len(rows), 4):
        step = module.eval_step(model, data["collate"](rows[i : i + 4]))
        total, n = total + float(step["loss"].double().sum()), n + float(step["n_items"].double().sum())
    return total / n


@pytest.mark.slow
@pytest.mark.parametrize("world", ["ddp", "fsdp"])
@pytest.mark.parametrize("recipe", list(SPECS))
def test_two_processes_write_one_folder_that_loads(assets, world, recipe, tmp_path):
    """The full state gathered once and written by the main process: the folder loads, and the loaded model's loss
    on the eval split is the run's own final eval_loss."""
    out = str(tmp_path / "out")
    proc = subprocess.run(
        launcher(world) + [os.path.join(RECIPES, f"{recipe}.py")] + flags(output_dir=out, **COMMON, **assets[recipe]),
        env=offline_env(tmp_path), capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = run_config(out)
    assert (config["num_processes"], config["topology"]["distributed_type"]) == (
        2, {"ddp": "MULTI_CPU", "fsdp": "FSDP"}[world]
    )  # fmt: skip
    assert_save_pretrained_folder(out, recipe)
    model, _ = loaded(out, recipe)
    if recipe == "causal_lm":  # the gathered state holds lm_head and wte apart: stored once all the same
        assert model.lm_head.weight is model.get_input_embeddings().weight
        assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))
    final = [r["eval_loss"] for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "eval_loss" in r][-1]
    assert eval_loss(model, recipe, assets[recipe]) == pytest.approx(final, rel=1e-4)
    assert_pipeline_runs(out, recipe)


# ------------------------------------------------------------------------------------------------ --push_to_hub
class RecordingHub:
    """Stands in for huggingface_hub.HfApi: what was asked, and the folder as upload_folder would send it (its own
    pattern filter: huggingface_hub.utils.filter_repo_objects)."""

    calls: list = []
    remote: str = ""

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kw):
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(("upload_folder", repo_id, kw))
        files = [os.path.relpath(os.path.join(d, f), folder_path) for d, _, fs in os.walk(folder_path) for f in fs]
        for rel in filter_repo_objects(files, ignore_patterns=ignore_patterns):
            os.makedirs(os.path.dirname(os.path.join(self.remote, rel)), exist_ok=True)
            shutil.copy(os.path.join(folder_path, rel), os.path.join(self.remote, rel))
        return f"https://hub.example/{repo_id}/commit/1"


def test_push_to_hub_uploads_the_model_folder_not_the_checkpoints(assets, tmp_path, monkeypatch):
    import huggingface_hub

    RecordingHub.calls, RecordingHub.remote = [], str(tmp_path / "remote")
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    out = str(tmp_path / "out")
    values = {**COMMON, **assets["causal_lm"], "save_steps": 2, "metric_for_best_model": "eval_loss"}
    Trainer.from_recipe(os.path.join(RECIPES, "causal_lm.py"), quiet=True, output_dir=out, push_to_hub=True,
                        hub_model_id="me/tiny-lm", **values).fit()  # fmt: skip
    assert [c[:2] for c in RecordingHub.calls] == [("create_repo", "me/tiny-lm"), ("upload_folder", "me/tiny-lm")]
    pushed = set(os.listdir(RecordingHub.remote))
    assert {"config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl"} <= pushed
    assert not pushed & {"checkpoints", "best"}, pushed
    model, _ = loaded(RecordingHub.remote, "causal_lm")
    assert model.lm_head.weight is model.get_input_embeddings().weight


def hub_run(tmp_path, *extra, **extra_env):
    out = str(tmp_path / "out")
    cmd = [sys.executable, os.path.join(RECIPES, "regression.py"), "--output_dir", out, "--max_steps", "3", *extra]
    return out, subprocess.run(
        cmd, env=env(**extra_env), capture_output=True, text=True, timeout=180, cwd=str(tmp_path)
    )  # fmt: skip


@pytest.mark.slow
def test_a_failed_push_is_one_line_and_the_model_stays(tmp_path):
    # The real HfApi against a local port nobody listens on: the connection is refused, nothing leaves the machine.
    out, proc = hub_run(tmp_path, "--push_to_hub", "--hub_model_id", "me/reg",
                        HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_TOKEN="hf_test", HF_HUB_OFFLINE="0")  # fmt: skip
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("error: Pushing") and "me/reg failed" in last and f"saved in {out}" in last, last
    assert "hf upload me/reg" in last
    # a plain nn.Module keeps its model.safetensors, and nothing else pretends to be transformers'
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    assert not os.path.exists(os.path.join(out, "config.json"))


@pytest.mark.slow
def test_push_to_hub_needs_a_repo_and_a_token_before_training(tmp_path):
    out, proc = hub_run(tmp_path, "--push_to_hub", HF_TOKEN="hf_test")
    assert proc.returncode != 0 and "--push_to_hub: needs the repo to upload to: add --hub_model_id" in proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(os.path.join(out, "model.safetensors"))
    home = str(tmp_path / "no-hf-home")  # no cached login there
    out, proc = hub_run(tmp_path, "--push_to_hub", "--hub_model_id", "me/reg", HF_TOKEN="", HF_HOME=home)
    assert proc.returncode != 0 and "--push_to_hub: no Hub token found" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
