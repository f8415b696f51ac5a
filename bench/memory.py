"""What does each process hold, unsharded and sharded? For a ~100M-parameter GPT-2 built from a config (random
init, no Hub), trained a few AdamW steps in fp32 on the CPU, this prints per rank: the bytes of parameters,
gradients and optimizer state (local shards under FSDP) and the peak resident memory, for

  single   1 process (python)
  ddp      2 processes, DDP (accelerate launch --multi_gpu, gloo)
  fsdp     2 processes, FSDP2 through accel_trainer.sharding (accelerate launch --use_fsdp), GPT2Block units

    python bench/memory.py                  # all three, ~3-5 minutes on a 2-core CPU, ~6 GiB of RAM at peak
    python bench/memory.py --modes fsdp --layers 2     # a quick look

Resident memory (RSS) per rank: after start-up ("base": Python, torch, accelerate, transformers), after the model
is built and prepared (sharded under FSDP), the peak during the training steps (sampled every 5 ms) and over the
process's life (ru_maxrss: includes building the full model on every rank before it is sharded; Accelerate's
cpu_ram_efficient_loading avoids that for pretrained weights). The processes run with
MALLOC_MMAP_THRESHOLD_=1MiB (see run_mode; --glibc_default to keep glibc's own) so freed tensors leave RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import harness
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2**20


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.width // 64,
        n_positions=args.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class RssSampler:
    """The largest resident set size seen while running (a thread reading /proc/self/statm every 5 ms)."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def worker(args):
    """One process of one mode: build, prepare (shard), train, report this rank's numbers as a JSON line."""
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before the "base" RSS is read
    from accelerate import Accelerator

    from accel_trainer import sharding, shards

    plugin = sharding.fsdp_plugin()
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, step_scheduler_with_optimizer=False)
    sharding.activate_fsdp(acc, plugin)
    rss_base = RssSampler.rss()
    assert acc.num_processes == (1 if args.mode == "single" else 2), acc.num_processes
    assert acc.distributed_type.value == {"single": "NO", "ddp": "MULTI_CPU", "fsdp": "FSDP"}[args.mode]
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    (model, optimizer), sharding_info = sharding.prepare_sharded(acc, model, optimizer)
    rss_prepared = RssSampler.rss()
    g = torch.Generator().manual_seed(acc.process_index)
    times = []
    with RssSampler() as during:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            held = shards.rank_state_bytes(model, optimizer)  # gradients exist now; optimizer state after step 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    held["optimizer_bytes"] = shards.rank_state_bytes(model, optimizer)["optimizer_bytes"]
    row = {
        "mode": args.mode,
        "rank": acc.process_index,
        "world": acc.num_processes,
        "params_total": n_params,
        **held,
        "rss_base": rss_base,
        "rss_prepared": rss_prepared,
        "peak_rss_training": during.peak,
        "peak_rss_lifetime": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "s_per_step": sorted(times)[len(times) // 2],
        "wrap": sharding_info.get("wrap"),
    }
    rows = [row]
    if acc.num_processes > 1:
        rows = [None] * acc.num_processes
        dist.all_gather_object(rows, row)
    if acc.is_main_process:
        with open(args.out, "w") as f:
            json.dump(rows, f)


def run_mode(mode: str, args, folder: str) -> list[dict]:
    out = os.path.join(folder, f"{mode}.json")
    me = [os.path.abspath(__file__), "--worker", mode, "--out", out]
    me += [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "vocab", "seq", "batch", "steps")]
    cmd = harness.launch_cmd(1 if mode == "single" else 2, mode=harness.FSDP2 if mode == "fsdp" else ("--multi_gpu",))
    env = harness.child_env(args.threads)
    if not args.glibc_default:
        # glibc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which freed tensors stay
        # in the heap and in RSS: the RSS of a process that built the full model and then sharded it would say
        # little about what it holds. A fixed 1 MiB threshold returns freed tensors to the OS.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    proc = subprocess.run(cmd + me, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"{mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="single,ddp,fsdp")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per process per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--glibc_default", action="store_true", help="keep glibc's dynamic mmap threshold (see code)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        return worker(args)

    print(f"load average before: {os.getloadavg()[0]:.1f} (cores: {os.cpu_count()})", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for mode in args.modes.split(","):
            rows += run_mode(mode, args, folder)
            print(f"{mode} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"\nGPT-2 {args.layers} layers x {args.width}, vocab {args.vocab}: {rows[0]['params_total'] / 1e6:.1f}M "
        f"parameters, fp32, AdamW, batch {args.batch} x {args.seq} tokens per process, {args.steps} steps"
    )
    columns = {  # header: (value, format)
        "mode": (lambda r: r["mode"], "{}"),
        "rank": (lambda r: r["rank"], "{}"),
        "params MiB": (lambda r: r["param_bytes"] / MiB, "{:.0f}"),
        "grads MiB": (lambda r: r["grad_bytes"] / MiB, "{:.0f}"),
        "optimizer MiB": (lambda r: r["optimizer_bytes"] / MiB, "{:.0f}"),
        "state MiB": (lambda r: (r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]) / MiB, "{:.0f}"),
        "RSS base MiB": (lambda r: r["rss_base"] / MiB, "{:.0f}"),
        "RSS prepared MiB": (lambda r: r["rss_prepared"] / MiB, "{:.0f}"),
        "peak RSS training MiB": (lambda r: r["peak_rss_training"] / MiB, "{:.0f}"),
        "peak RSS lifetime MiB": (lambda r: r["peak_rss_lifetime"] / MiB, "{:.0f}"),
        "s/step": (lambda r: r["s_per_step"], "{:.1f}"),
    }
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(fmt.format(value(r)) for value, fmt in columns.values()) + " |")
    wraps = {r["wrap"] for r in rows if r["wrap"]}
    if wraps:
        print(f"\nFSDP wrapping: {', '.join(wraps)}")


if __name__ == "__main__":
    main()
