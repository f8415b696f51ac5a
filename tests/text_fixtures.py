"""Tiny, offline stand-ins for the text recipes' inputs: a tokenizer trained on the test's own text with
`tokenizers`, a model built from a small config with random init, both `save_pretrained` into a folder and
loaded back by path -- the same `from_pretrained` code path a Hub checkpoint goes through -- and small
datasets in the layouts the recipes read (a GLUE-style Hub-layout folder, plain text files).

Dropout is off in the configs so that runs with different world sizes can be compared weight for weight.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from helpers import env, launch_cmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = (
    "the a cat dog bird fish sat ran flew swam on under over near mat log tree pond red blue green small big "
    "quick slow happy sad old young yes no"
).split()


def sentences(n: int, seed: int = 0, min_len: int = 2, max_len: int = 14) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


# ----------------------------------------------------------------------------------------------- tokenizers
def _train_tokenizer(texts, kind: str):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if kind == "bert":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        # BERT's pair template, so token_type_ids and [CLS]/[SEP] come out as with a real BERT tokenizer
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        tok.decoder = decoders.WordPiece()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            model_max_length=128,
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        )
    return byte_level_bpe(texts, vocab_size=300, model_max_length=128)


def byte_level_bpe(texts, vocab_size: int, **kwargs):
    """A GPT-2 style byte-level BPE tokenizer trained on `texts`, with only an end-of-text token (no pad token, like
    the real gpt2); `kwargs` go to PreTrainedTokenizerFast. bench/text.py builds its tokenizer with it too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    eot = "<|endoftext|>"
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eot], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot, **kwargs)


def make_tiny_bert(folder: str, texts=None, num_labels: int = 2) -> str:
    """A 2-layer, 32-wide BERT for sequence classification + WordPiece tokenizer, saved in `folder`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = _train_tokenizer(texts or sentences(300), "bert")
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=num_labels,
    )
    with torch.random.fork_rng():  # the same tiny model every run (reproducible tests), global RNG untouched
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_tiny_gpt2(folder: str, texts=None, weights: bool = True) -> str:
    """A 2-layer, 32-wide GPT-2 + byte-level BPE tokenizer saved in `folder` (config only if not `weights`)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = _train_tokenizer(texts or sentences(300), "gpt2")
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if weights:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = GPT2LMHeadModel(config)
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_tiny_llama(folder: str, texts=None, width: int = 256, layers: int = 2) -> str:
    """A Llama config (random init by the recipe) + byte-level BPE tokenizer saved in `folder`, for fp8: every
    projection is an nn.Linear whose features are multiples of 16 (width, 2 x width), which is what Accelerate's
    fp8 backends convert. GPT-2's projections are Conv1D, which they leave alone."""
    from transformers import LlamaConfig

    tokenizer = _train_tokenizer(texts or sentences(300), "gpt2")
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 64,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------- datasets
def make_glue_folder(folder: str, n_train: int = 64, n_eval: int = 13, seed: int = 0) -> str:
    """A GLUE-MRPC-shaped dataset folder in Hub layout (like ../shared/data/glue): config `mrpc`, parquet
    splits, columns sentence1/sentence2/label/idx, sentences of 2..14 words. Label 1 pairs draw their words
    from the first half of the vocabulary, label 0 pairs from the second: learnable in a few dozen steps by a
    tiny model, which is all the end-to-end test needs."""
    import datasets

    os.makedirs(os.path.join(folder, "mrpc"), exist_ok=True)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(
            "---\nconfigs:\n- config_name: mrpc\n  data_files:\n"
            "  - split: train\n    path: mrpc/train-*\n  - split: validation\n    path: mrpc/validation-*\n---\n"
        )
    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
            "idx": datasets.Value("int32"),
        }
    )
    half = len(WORDS) // 2
    for split, n, s in (("train", n_train, seed), ("validation", n_eval, seed + 1)):
        rng = random.Random(s)
        labels = [rng.randint(0, 1) for _ in range(n)]

        def sent(label):
            words = WORDS[:half] if label else WORDS[half:]
            return " ".join(rng.choice(words) for _ in range(rng.randint(2, 14)))

        s1, s2 = [sent(y) for y in labels], [sent(y) for y in labels]
        ds = datasets.Dataset.from_dict(
            {"sentence1": s1, "sentence2": s2, "label": labels, "idx": list(range(n))}, features=features
        )
        ds.to_parquet(os.path.join(folder, "mrpc", f"{split}-00000-of-00001.parquet"))
    return folder


def make_text_files(folder: str, n_train: int = 200, n_eval: int = 20, seed: int = 0) -> tuple[str, str]:
    """train.txt / validation.txt, one sentence a line, lines of very different lengths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for split, n, s in (("train", n_train, seed), ("validation", n_eval, seed + 1)):
        path = os.path.join(folder, f"{split}.txt")
        with open(path, "w") as f:
            f.write("\n".join(sentences(n, seed=s, min_len=1, max_len=20)) + "\n")
        paths.append(path)
    return tuple(paths)


# -------------------------------------------------------------------------------------------------- running
def offline_env(tmp_path) -> dict:
    """Environment for recipe subprocesses: no Hub access (fail fast instead of retrying for a minute),
    dataset cache inside the test's temp dir, one thread per process on this small machine."""
    return env(HF_DATASETS_CACHE=str(tmp_path / "hf_datasets_cache"))


def run_recipe(recipe: str, args: list[str], tmp_path, nproc: int = 1, timeout: int = 240):
    """`python recipes/<recipe>.py ARGS`, or with nproc > 1 a real `accelerate launch` of nproc CPU processes."""
    script = os.path.join(REPO, "recipes", f"{recipe}.py")
    return subprocess.run(
        launch_cmd(nproc) + [script, *args],
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(tmp_path),
    )


def load_recipe_module(recipe: str):
    """recipes/<recipe>.py as a module, to call its functions directly."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"text_recipe_{recipe}", os.path.join(REPO, "recipes", f"{recipe}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


class OneProcess:
    """Stands in for the Accelerator in build_data called in-process: one process, on the CPU."""

    num_processes, process_index, is_main_process = 1, 0, True

    def __init__(self, num_processes: int = 1, process_index: int = 0):
        import torch

        self.num_processes, self.process_index, self.device = num_processes, process_index, torch.device("cpu")

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()


def targs(**kw):
    """A TrainingArguments for in-process calls to recipe functions."""
    from accel_trainer import TrainingArguments

    return TrainingArguments(**{"output_dir": "unused", **kw})


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ctx(recipe_args, world: int = 1, rank: int = 0, **targs_kw):
    """The RecipeContext a recipe's builders get, for in-process calls: one (or a stand-in) process on the CPU."""
    from accel_trainer import RecipeContext

    return RecipeContext(
        args=recipe_args,
        targs=targs(**targs_kw),
        world_size=world,
        process_index=rank,
        accelerator=OneProcess(world, rank),
    )
