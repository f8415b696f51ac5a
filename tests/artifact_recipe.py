"""The regression recipe with an artifact built in build_data that comes out different on every rank and every
attempt (a vocabulary drawn from the rank and the clock, as a tokenizer trained on each rank's view of the data
does). With --once it is built by ctx.build_once; each rank writes what it got, and what ctx says about resuming, to
output_dir/seen/rank<R>_<attempt>.json."""

import json
import os
import random
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import regression  # noqa: E402
from regression import build_metrics, build_model, configure, defaults, eval_step, loss  # noqa: E402,F401

name = "regression"


@dataclass
class Args(regression.Args):
    once: bool = False  # build the vocabulary with ctx.build_once


def build_data(ctx):
    def build(path):
        vocab = random.Random(f"{ctx.process_index}-{time.time_ns()}").sample(range(10_000), 16)
        with open(path, "w") as f:
            json.dump(vocab, f)

    def load(path):
        with open(path) as f:
            return json.load(f)

    if ctx.args.once:
        vocab = ctx.build_once("vocab.json", build, load)
    else:
        path = os.path.join(ctx.targs.output_dir, f"vocab_rank{ctx.process_index}.json")
        build(path)
        vocab = load(path)
    seen = os.path.join(ctx.targs.output_dir, "seen")
    os.makedirs(seen, exist_ok=True)
    attempt = "resumed" if ctx.resuming else "new"
    with open(os.path.join(seen, f"rank{ctx.process_index}_{attempt}.json"), "w") as f:
        json.dump({"vocab": vocab, "resuming": ctx.resuming, "resume_from": ctx.resume_from}, f)
    return regression.build_data(ctx)


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
