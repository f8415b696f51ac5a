"""Causal-LM training throughput (tokens/s): a hand-written PyTorch loop vs our Trainer vs transformers.Trainer,
on the same tiny model and data, in one run. Nothing comes from the Hub.

Built locally in a work folder: a byte-level BPE tokenizer trained on generated text (`tokenizers`), a GPT-2
config (4 layers, 128 wide, 4 heads, 128 positions by default; random init in every contestant) and the text
files. Each contestant runs in its own fresh process, with the same threads, batch, block size, AdamW, linear
schedule, gradient clipping at 1.0, fp32 on the CPU:

  plain          a hand-written loop: blocks of --block_size tokens in a tensor, DataLoader(shuffle=True), model
                 forward with labels, backward, clip, step, schedule, zero_grad
  accel_trainer  python recipes/causal_lm.py --config_name <folder> --tokenizer_name <folder> --train_file ...
                 (its datasets tokenisation and packing, its collate, its token-weighted loss)
  hf_trainer     transformers.Trainer on the same packed blocks (default_data_collator, its own loss)

tokens/s = per-device batch x block_size input tokens per update / seconds per update, the seconds measured over
--log_every-update intervals after the first interval (start-up, tokenisation, first-step costs excluded) and
the median taken: from metrics.jsonl's elapsed_s for accel_trainer, from timestamps taken every --log_every
updates (after a host sync on the loss) for the other two. tokens/CPU-s is the same over CPU seconds of the
contestant's process (time.process_time(), or /proc/PID/stat for the recipe): with one thread it equals tokens/s
on an idle machine, and it barely moves when other processes share the cores, which wall time does not.

    python bench/text.py                      # ~2 minutes on a 2-core CPU
    python bench/text.py --rounds 3 --threads 2 --json runs/text.json

Round r runs the contestants in turn starting with the (r mod 3)-th, so that none always runs first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import harness
from harness import ROOT

LR = 5e-4


def child_env(threads: int, work: str) -> dict:
    return harness.child_env(threads, HF_DATASETS_CACHE=os.path.join(work, "hf_datasets_cache"))


# ------------------------------------------------------------------------------------------------ set-up
def make_inputs(work: str, a) -> dict:
    """Tokenizer folder, config folder and train/validation text in `work` (built once per bench run)."""
    from transformers import GPT2Config

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from text_fixtures import byte_level_bpe  # the tests' tiny GPT-2 tokenizer, at this bench's vocabulary size

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgk"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]
    words_needed = 2 * a.steps * a.batch_size * a.block_size  # >= 1 token per word: more than one epoch's worth

    def lines(n_words: int) -> list[str]:
        out, n = [], 0
        while n < n_words:
            k = rng.randint(3, 16)
            out.append(" ".join(rng.choice(vocab) for _ in range(k)))
            n += k
        return out

    train, val = lines(words_needed), lines(4 * a.block_size)
    paths = {"train": os.path.join(work, "train.txt"), "validation": os.path.join(work, "validation.txt")}
    for split, text in (("train", train), ("validation", val)):
        with open(paths[split], "w") as f:
            f.write("\n".join(text) + "\n")

    tokenizer = byte_level_bpe(train, vocab_size=a.vocab_size)
    tok_dir, cfg_dir = os.path.join(work, "tokenizer"), os.path.join(work, "config")
    tokenizer.save_pretrained(tok_dir)
    GPT2Config(
        vocab_size=len(tokenizer),
        n_layer=a.layers,
        n_embd=a.width,
        n_head=a.heads,
        n_positions=a.block_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(cfg_dir)
    inputs = {"tokenizer": tok_dir, "config": cfg_dir, **paths}
    inputs["n_params"] = sum(p.numel() for p in build_model(inputs).parameters())
    return inputs


def packed_blocks(inputs: dict, block: int):
    """The train text as one token stream (lines joined with their newlines, as the recipe keeps them) cut into
    blocks of `block` tokens: the same shapes the recipe trains on."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    with open(inputs["train"]) as f:
        ids = tok(f.read(), add_special_tokens=False)["input_ids"]
    n = len(ids) // block * block
    return torch.tensor(ids[:n]).view(-1, block)


def build_model(inputs: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(inputs["config"]))


# ---------------------------------------------------------------------------------------------- contestants
def rate(stamps: list[tuple], tokens_per_step: int) -> dict:
    """Median tokens/s over the intervals between (step, wall seconds, CPU seconds) stamps; and tokens per CPU
    second over the same intervals (robust to other processes sharing the cores: one thread's CPU time does not
    grow while it waits for a core)."""
    pairs = list(zip(stamps, stamps[1:]))
    out = {"tokens_per_s": statistics.median((b[0] - a[0]) * tokens_per_step / (b[1] - a[1]) for a, b in pairs)}
    cpu = [
        (b[0] - a[0]) * tokens_per_step / (b[2] - a[2]) for a, b in pairs if None not in (a[2], b[2]) and b[2] > a[2]
    ]
    out["tokens_per_cpu_s"] = statistics.median(cpu) if cpu else None
    return out


def stamp(step: int) -> tuple[int, float, float]:
    return step, time.perf_counter(), time.process_time()


def worker_plain(a, inputs: dict) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(a.seed)
    blocks = packed_blocks(inputs, a.block_size)
    model = build_model(inputs)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / a.steps))
    loader = DataLoader(TensorDataset(blocks), batch_size=a.batch_size, shuffle=True, drop_last=True)
    stamps = []

    def log(step, loss):
        if step % a.log_every == 0:
            loss.item()  # the host sync a logging loop does; it ends the step's work on any device
            stamps.append(stamp(step))

    lm_loss = lambda model, batch: model(input_ids=batch[0], labels=batch[0], use_cache=False).loss  # noqa: E731
    harness.hand_written_loop(model, loader, lm_loss, opt, sched, a.steps, max_grad_norm=1.0, after_update=log)
    return rate(stamps, a.batch_size * a.block_size)


def worker_hf(a, inputs: dict, out: str) -> dict:
    import datasets
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    blocks = packed_blocks(inputs, a.block_size)
    ds = datasets.Dataset.from_dict({"input_ids": blocks.tolist(), "labels": blocks.tolist()})
    stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % a.log_every == 0:
                stamps.append(stamp(state.global_step))

    torch.manual_seed(a.seed)
    trainer = Trainer(
        model=build_model(inputs),
        args=TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=a.batch_size,
            max_steps=a.steps,
            learning_rate=LR,
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            logging_steps=a.log_every,  # its loss logging syncs the host, like ours
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=a.seed,
        ),
        train_dataset=ds,
        data_collator=default_data_collator,
        callbacks=[Stamp()],
    )
    trainer.train()
    return rate(stamps, a.batch_size * a.block_size)


def run_accel_trainer(a, inputs: dict, work: str, out: str) -> dict:
    """The recipe through its command line. Wall time per interval comes from metrics.jsonl's elapsed_s; CPU
    time is read from /proc when a new row appears (polled every 2 ms; /proc has 10 ms resolution, <1% of an
    interval here)."""
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "causal_lm.py")] + harness.flags(
        config_name=inputs["config"],
        tokenizer_name=inputs["tokenizer"],
        train_file=inputs["train"],
        validation_file=inputs["validation"],
        block_size=a.block_size,
        per_device_train_batch_size=a.batch_size,
        learning_rate=LR,
        max_steps=a.steps,
        logging_steps=a.log_every,
        max_grad_norm=1.0,
        save_steps=0,
        sample_max_new_tokens=0,
        seed=a.seed,
        use_cpu=True,
        output_dir=out,
        disable_tqdm=True,
    )
    rc, at_row, _ = harness.watch(cmd, out, a.timeout, env=child_env(a.threads, work), cwd=work)
    if rc != 0:
        harness.exit_with_log("recipes/causal_lm.py", rc, out + ".log")
    rows = harness.read_metrics(out)
    cpu_at_row = [cpu for _, cpu in at_row] + [None] * (len(rows) - len(at_row))
    stamps = [(r["step"], r["elapsed_s"], c) for r, c in zip(rows, cpu_at_row) if "loss" in r]
    return rate(stamps, a.batch_size * a.block_size)


def run_worker(a, kind: str, inputs_json: str, work: str, out: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", kind, "--_inputs", inputs_json, "--_out", out]
    cmd += [f"--{k}={v}" for k, v in vars(a).items() if not k.startswith("_") and k not in ("json", "work")]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=child_env(a.threads, work), timeout=a.timeout, cwd=work
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        sys.exit(f"error: the {kind} contestant failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(results[-1].split(" ", 1)[1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=1000, help="BPE vocabulary trained on the generated text")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=60, help="updates per contestant")
    p.add_argument("--log_every", type=int, default=5, help="timing interval in updates")
    p.add_argument("--threads", type=int, default=1, help="torch threads per contestant")
    p.add_argument("--rounds", type=int, default=1, help="the three contestants, interleaved, this many times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds any one contestant may take")
    p.add_argument("--work", default=None, help="work folder (default: a temporary one, removed at the end)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_inputs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps < 3 * a.log_every:
        p.error("--steps must be at least 3 x --log_every (two timed intervals after the first)")

    if a._worker:  # inside a contestant's own process
        import torch

        torch.set_num_threads(a.threads)
        inputs = json.loads(a._inputs)
        res = worker_plain(a, inputs) if a._worker == "plain" else worker_hf(a, inputs, a._out)
        print(f"RESULT {json.dumps(res)}", flush=True)
        return

    with tempfile.TemporaryDirectory(prefix="bench_text_") as tmp:
        work = a.work or tmp
        os.makedirs(work, exist_ok=True)
        t0 = time.perf_counter()
        inputs = make_inputs(work, a)
        inputs_json = json.dumps(inputs)
        results = {"plain": [], "accel_trainer": [], "hf_trainer": []}
        kinds = list(results)
        for r in range(a.rounds):
            # Each round starts with the next contestant: no one always runs first (or right after another).
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                out = os.path.join(work, f"out_{kind}_{r}")
                if kind == "accel_trainer":
                    results[kind].append(run_accel_trainer(a, inputs, work, out))
                else:
                    results[kind].append(run_worker(a, kind, inputs_json, work, out))
                res = results[kind][-1]
                print(f"  round {r} {kind:14s} {res['tokens_per_s']:9.0f} tokens/s", flush=True)
        wall = time.perf_counter() - t0

    import torch
    import transformers

    med = {
        k: {m: statistics.median(r[m] for r in v) if all(r[m] for r in v) else None for m in v[0]}
        for k, v in results.items()
    }
    n_params = inputs["n_params"]
    size = f"{n_params / 1e6:.2f} M params, "
    print(
        f"\nGPT-2 {a.layers} layers x {a.width} wide, {a.heads} heads ({size}vocab ~{a.vocab_size}), block "
        f"{a.block_size}, batch {a.batch_size}, {a.steps} updates, {a.threads} thread(s), fp32; torch "
        f"{torch.__version__}, transformers {transformers.__version__}; median of {a.rounds} round(s)"
    )
    base = med["plain"]
    print(f"  {'':14s} {'tokens/s':>9s} {'x plain':>8s}   {'tokens/CPU-s':>12s} {'x plain':>8s}")
    for k, v in med.items():
        cpu, cpu_base = v["tokens_per_cpu_s"], base["tokens_per_cpu_s"]
        cpu_cols = f"{cpu:12.0f} {cpu / cpu_base:8.3f}" if cpu and cpu_base else f"{'n/a':>12s} {'':8s}"
        print(f"  {k:14s} {v['tokens_per_s']:9.0f} {v['tokens_per_s'] / base['tokens_per_s']:8.3f}   {cpu_cols}")
    # The ratio to the hand-written loop within each round (the contestants ran minutes apart, not hours), then
    # the median over rounds: less moved by a slow round than the ratio of the medians.
    for k in ("accel_trainer", "hf_trainer"):
        per_round = [o["tokens_per_s"] / b["tokens_per_s"] for o, b in zip(results[k], results["plain"])]
        print(
            f"  {k} / plain per round: {', '.join(f'{x:.3f}' for x in per_round)}; median {statistics.median(per_round):.3f}"
        )
    print(f"  load average at the end: {harness.loadavg()}")
    print(f"bench wall time {wall:.0f} s")
    harness.write_json(a.json, {"args": vars(a), "median": med, "rounds": results})


if __name__ == "__main__":
    main()
