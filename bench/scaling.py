"""Does a second process make training faster, and where does the rest of the time go? One run prints it all.

The same compute-bound model and global batch, through the Trainer's command line (recipes/regression.py with a
wide MLP, 512-2048-512 by default: 2.1 M parameters, 8.4 MB of fp32 gradients per update; global batch 1024),
one thread per process:

  1 proc        python recipes/regression.py, per-device batch = global batch
  2 procs DDP   accelerate launch, 2 CPU processes (gloo), per-device batch = global / 2; the world size is asserted
  2 procs alone two independent single-process runs at the same time, per-device batch = global / 2, no
                communication: what two processes get from this machine (cores, memory bandwidth) -- the ceiling
  variants      2 procs DDP with extra Trainer flags (--ddp_variants; default --ddp_comm_hook fp16: half the bytes)
  hand-written  1 proc and 2 procs DDP of the loop a user writes by hand for the same run (`hand_written`: the
                recipe's data through a DataLoader + DistributedSampler, DDP defaults, AdamW, linear schedule,
                clipping at 1.0 as the Trainer's default, a logged loss.item() every --log_every updates)

The 1-process, 2-process, alone and hand-written runs are repeated at a second global batch (--also_global_batch,
2048 by default: twice the compute per communicated byte).

Throughput = samples per second from metrics.jsonl: (updates x global batch) / (elapsed_s difference) between
consecutive log rows (every --log_every updates; start-up and the first updates come before the first row), the
median over those intervals. Ratios: DDP / 1 proc (the goal is >= 1.8 on 2 cores), alone / 1 proc (the
ceiling), DDP / alone, and the Trainer's step over the hand-written loop's on 1 and 2 processes (goal <= 1.02).
The runs of a round go in an order that rotates by one each round; the Trainer's and the hand-written loop's
2-process runs go back to back (which first alternates), and the median of their per-round ratios is printed too
("paired"): this VM's throughput drifts between rounds by more than the 2% to resolve (docs/benchmarks.md).

Where the DDP time goes, measured in a hand-written DDP loop on the same model, batch and optimizer (gloo, 2
processes, 1 thread each), per update:
  compute   the same step inside `model.no_sync()` (no gradient communication at all); compute and DDP steps
            alternate, each started together on both ranks, and the medians of single steps are reported
  ddp       the normal DDP step; ddp - compute = the communication time that is NOT hidden behind backward
  hook      a DDP comm hook that times every bucket's all_reduce future from launch to completion (summed per
            update; it overlaps backward, so it can exceed the exposed time)
  idle      all_reduce of the same number of bytes with nothing else running (gloo's bare cost here)
for each --bucket_caps value (DDP's bucket_cap_mb; 25 is the default the Trainer uses).

    python bench/scaling.py                       # ~2 minutes on an idle 2-core machine
    python bench/scaling.py --rounds 3 --json runs/scaling.json
    python bench/scaling.py --global_batch 512    # less compute per byte communicated: a lower ratio
    python bench/scaling.py --also_global_batch 0 # only the --global_batch runs (by default also at 2048)

Timings need an idle machine: the load average is printed before and after; another busy process on a 2-core
machine takes the second core and the ratio with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness
from harness import ROOT, launch_cmd

RECIPE = os.path.join(ROOT, "recipes", "regression.py")


def recipe_args(a, out: str, per_device: int) -> list[str]:
    return harness.flags(
        output_dir=out,
        num_features=a.features,
        hidden_size=a.hidden,
        num_targets=a.targets,
        num_train_samples=a.global_batch * 8,
        num_eval_samples=0,
        per_device_train_batch_size=per_device,
        max_steps=a.steps,
        logging_steps=a.log_every,
        save_steps=0,
        disable_tqdm=True,
    )


def hand_written(out: str, per_device: int, a) -> None:
    """`python bench/scaling.py --_hand OUT`: the loop a user writes by hand for the same run, on 1 process or
    under any launcher (RANK/WORLD_SIZE/MASTER_ADDR from it): the regression recipe's data, model, AdamW and linear
    schedule, a DataLoader with a DistributedSampler, DDP with its defaults, clipping at 1.0 (the Trainer's
    default), and a metrics.jsonl row (step, elapsed_s, loss.item()) on rank 0 every --log_every updates: the same
    rows `throughput` reads from the Trainer's runs."""
    import json
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import get_scheduler

    sys.path.insert(0, os.path.dirname(RECIPE))
    import regression

    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    args = regression.Args(num_features=a.features, hidden_size=a.hidden, num_targets=a.targets)
    data = regression.TensorDict(regression._synthetic(args, per_device * world * 8, args.data_seed + 1))
    sampler = DistributedSampler(data, world, rank, seed=0) if world > 1 else None
    loader = DataLoader(data, per_device, shuffle=sampler is None, sampler=sampler, collate_fn=regression.collate)
    model = regression.build_model(SimpleNamespace(args=args))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = get_scheduler("linear", optimizer, 0, a.steps)
    os.makedirs(out, exist_ok=True)
    rows = open(os.path.join(out, "metrics.jsonl"), "w") if rank == 0 else None
    t0 = time.perf_counter()

    def log(step, loss):
        if step % a.log_every == 0:
            value = loss.item()  # a logging loop's host sync
            if rows:
                rows.write(json.dumps({"step": step, "elapsed_s": time.perf_counter() - t0, "loss": value}) + "\n")
                rows.flush()

    harness.hand_written_loop(model, loader, lambda m, b: regression.loss(m, b)[0], optimizer, scheduler,
                              a.steps, max_grad_norm=1.0, after_update=log)  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


def throughput(out: str, global_batch: int, world: int | None = None) -> tuple[float, int]:
    """Samples/s of a run, the median over its log intervals (robust to a short burst of load from elsewhere),
    and its world size from run_config.json."""
    rows = [r for r in harness.read_metrics(out) if "loss" in r]
    world = world or harness.read_run_config(out)["topology"]["num_processes"]
    rates = [
        (b["step"] - a["step"]) * global_batch / (b["elapsed_s"] - a["elapsed_s"])
        for a, b in zip(rows, rows[1:])
        if b["elapsed_s"] > a["elapsed_s"]
    ]
    return statistics.median(rates), world


def start(cmd: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=harness.child_env(), cwd=ROOT)


def wait(procs: list[subprocess.Popen], logs: list[str], timeout: float):
    deadline = time.monotonic() + timeout
    for p, log in zip(procs, logs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"error: a run took longer than {timeout:.0f} s (see {log}); pass fewer --steps.")
        if rc != 0:
            harness.exit_with_log("a run", rc, log)


def trainer_runs(a, tmp: str, round_: int, tag: str = "") -> dict[str, float]:
    """One round: every run once. The runs go in a fixed list whose order rotates by one per round, so that no run
    always follows the same other run (a run after the 2-process ones can find the cores in another state), and
    the Trainer's 2-process run and the hand-written one stay next to each other: their per-round ratio is paired."""
    g, half = a.global_batch, a.global_batch // 2
    res = {}

    def trainer(name, procs, per, flags=()):
        out = os.path.join(tmp, f"r{round_}{tag}_" + "_".join(name.split()))
        log = out + ".log"
        wait([start(launch_cmd(procs) + [RECIPE] + recipe_args(a, out, per) + list(flags), log)], [log], a.timeout)
        res[name], world = throughput(out, g)
        if world != procs:
            sys.exit(f"error: accelerate launch formed a world of {world}, not {procs}; see {log}")

    def alone():  # 2 independent processes at the same time: each does half the global batch, nothing communicated
        outs = [os.path.join(tmp, f"r{round_}{tag}_alone{i}") for i in range(2)]
        logs = [o + ".log" for o in outs]
        procs = [start(launch_cmd(1) + [RECIPE] + recipe_args(a, o, half), lg) for o, lg in zip(outs, logs)]
        wait(procs, logs, a.timeout)
        res["2 procs alone"] = sum(throughput(o, half)[0] for o in outs)

    def hand(name, n, per):  # the same run by the loop written by hand (`hand_written`): the Trainer's baseline
        out = os.path.join(tmp, f"r{round_}{tag}_hand{n}")
        log = out + ".log"
        cmd = [os.path.abspath(__file__), "--_hand", out, "--_per_device", str(per)] + harness.flags(
            features=a.features, hidden=a.hidden, targets=a.targets, steps=a.steps, log_every=a.log_every
        )
        wait([start(launch_cmd(n) + cmd, log)], [log], a.timeout)
        res[name] = throughput(out, g, world=n)[0]

    def ddp_pair():  # the paired comparison of issue 17 part 1: back to back, which goes first alternates by round
        pair = [lambda: trainer("2 procs DDP", 2, half), lambda: hand("hand-written 2 procs DDP", 2, half)]
        for run in pair[round_ % 2 :] + pair[: round_ % 2]:
            run()

    runs = [
        lambda: trainer("1 proc", 1, g),
        ddp_pair,
        alone,
        lambda: hand("hand-written 1 proc", 1, g),
    ] + [  # DDP variants that move less data or communicate less often (--ddp_variants)
        (lambda f=flags: trainer(f"2 procs DDP {f}", 2, half, f.split())) for flags in a.ddp_variants
    ]
    k = round_ % len(runs)
    for run in runs[k:] + runs[:k]:
        run()
    return res


def paired(rounds: list[dict], num: str, den: str) -> str:
    """The median over rounds of each round's own ratio num / den, and the rounds' values."""
    each = [r[num] / r[den] for r in rounds]
    return f"{statistics.median(each):.3f} (per round: {', '.join(f'{x:.3f}' for x in each)})"


# ------------------------------------------------------------------------------------- communication probe
def _probe_worker(rank: int, a, port: int, queue):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    per_rank = a.global_batch // 2
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(per_rank, a.features, generator=g), torch.randn(per_rank, a.targets, generator=g)
    results = {}
    for cap in a.bucket_caps:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(a.features, a.hidden), nn.Tanh(), nn.Linear(a.hidden, a.targets))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        hook_s, buckets = [0.0], []

        def timed_allreduce(state, bucket):
            # DDP's default all-reduce (sum, then divide by world size), timed from launch to completion
            t0 = time.perf_counter()
            buf = bucket.buffer()
            buckets.append(buf.numel())

            def done(fut):
                hook_s[0] += time.perf_counter() - t0
                return fut.value()[0].div_(2)

            return dist.all_reduce(buf, async_op=True).get_future().then(done)

        ddp.register_comm_hook(None, timed_allreduce)

        def step(sync: bool):
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):  # warm-up (DDP rebuilds its buckets after the first step)
            step(True)
            step(False)
        # Compute-only and DDP steps alternate, each started together on both ranks (barrier, untimed), so that
        # load from other processes falls on both alike; medians of single steps: a preempted step moves nothing.
        per_step, hook_per_step = {"compute": [], "ddp": []}, []
        for _ in range(a.probe_steps):
            for mode in ("compute", "ddp"):
                dist.barrier()
                hook_s[0] = 0.0
                buckets.clear()
                t0 = time.perf_counter()
                step(mode == "ddp")
                per_step[mode].append(time.perf_counter() - t0)
                if mode == "ddp":
                    hook_per_step.append(hook_s[0])
        timings = {mode: statistics.median(v) for mode, v in per_step.items()}
        timings["hook"] = statistics.median(hook_per_step)
        timings["buckets"] = len(buckets)
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        for _ in range(3):
            dist.all_reduce(flat)
        dist.barrier()
        idle = []
        for _ in range(a.probe_steps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            idle.append(time.perf_counter() - t0)
        timings["idle"] = statistics.median(idle)
        timings["grad_mb"] = flat.numel() * 4 / 2**20
        results[cap] = timings
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def comm_probe(a) -> dict:
    import torch.multiprocessing as mp

    for k, v in harness.child_env().items():
        if k.endswith("_THREADS"):
            os.environ[k] = v
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_probe_worker, args=(r, a, a._port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = queue.get(timeout=a.timeout)
    except Exception:
        for p in procs:
            p.kill()
        sys.exit(f"error: the communication probe did not finish within {a.timeout:.0f} s.")
    for p in procs:
        p.join(timeout=30)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global_batch", type=int, default=1024, help="samples per update, split over the processes")
    p.add_argument(
        "--also_global_batch",
        type=int,
        default=2048,
        help="the same 1- and 2-process Trainer and hand-written runs again at this global batch (no variants); 0: not",
    )
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--targets", type=int, default=512)
    p.add_argument("--steps", type=int, default=30, help="updates per Trainer run")
    p.add_argument("--log_every", type=int, default=5, help="log interval: throughput is the median over intervals")
    p.add_argument("--rounds", type=int, default=1, help="repeat the three Trainer runs; medians are reported")
    p.add_argument("--probe_steps", type=int, default=20, help="timed steps per mode in the communication probe")
    p.add_argument("--bucket_caps", type=float, nargs="+", default=[25.0, 1.0, 100.0], help="DDP bucket_cap_mb")
    p.add_argument(
        "--ddp_variants",
        nargs="*",
        default=["--ddp_comm_hook fp16"],
        help="extra 2-process runs, each with these Trainer flags (default: fp16 gradient compression, half the bytes; bf16 needs NCCL)",
    )
    p.add_argument("--no_probe", action="store_true", help="skip the communication probe")
    p.add_argument("--probe_only", action="store_true", help="only the communication probe (no Trainer runs)")
    p.add_argument("--timeout", type=float, default=900, help="seconds any one run may take")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--_hand", help=argparse.SUPPRESS)  # a hand-written run writing its rows here (a child)
    p.add_argument("--_per_device", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._hand:
        return hand_written(a._hand, a._per_device, a)
    if a.global_batch % 2 or a.steps <= a.log_every:
        p.error("--global_batch must be even and --steps larger than --log_every")
    a._port = harness.free_port()

    load_before = harness.loadavg()
    t_start = time.perf_counter()
    rounds, rounds_b, tput, tput_b, ratio, ceiling = [], [], {}, {}, None, None
    if not a.probe_only:
        with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
            rounds = [trainer_runs(a, tmp, r) for r in range(a.rounds)]
            if a.also_global_batch:
                b = argparse.Namespace(**{**vars(a), "global_batch": a.also_global_batch, "ddp_variants": []})
                rounds_b = [trainer_runs(b, tmp, r, "_b") for r in range(a.rounds)]
        tput = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        tput_b = {k: statistics.median(r[k] for r in rounds_b) for k in rounds_b[0]} if a.also_global_batch else {}
    probe = {} if a.no_probe else comm_probe(a)
    load_after = harness.loadavg()

    import torch

    params = a.features * a.hidden + a.hidden + a.hidden * a.targets + a.targets
    print(
        f"model {a.features}-{a.hidden}-{a.targets} ({params / 1e6:.2f} M params), global batch {a.global_batch}, "
        f"{a.steps} updates (median of {a.log_every}-update intervals), 1 thread per process, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average before {load_before} / after {load_after}"
    )
    if tput:
        print(f"\nTrainer throughput (samples/s; median of {a.rounds} round(s)):")
        for k, v in tput.items():
            print(f"  {k:36s} {v:9.1f}   per round: {', '.join(f'{r[k]:.1f}' for r in rounds)}")
        ratio = tput["2 procs DDP"] / tput["1 proc"]
        ceiling = tput["2 procs alone"] / tput["1 proc"]
        print(f"\n  2 procs DDP / 1 proc   = {ratio:.3f}   (goal >= 1.8)")
        print(f"  2 procs alone / 1 proc = {ceiling:.3f}   (the ceiling without communication)")
        print(f"  DDP / alone            = {tput['2 procs DDP'] / tput['2 procs alone']:.3f}   (kept of the ceiling)")
        for flags in a.ddp_variants:
            print(f"  DDP {flags} / 1 proc = {tput[f'2 procs DDP {flags}'] / tput['1 proc']:.3f}")
        hand2, hand1 = tput["hand-written 2 procs DDP"], tput["hand-written 1 proc"]
        print(f"  hand-written 2 procs / 1 proc = {hand2 / hand1:.3f}   (the Trainer's goal: the same)")
        print(f"  Trainer step / hand-written step, 2 procs = {hand2 / tput['2 procs DDP']:.3f}   (goal <= 1.02)")
        print(f"    paired (back to back) = {paired(rounds, 'hand-written 2 procs DDP', '2 procs DDP')}")
        print(f"  Trainer step / hand-written step, 1 proc  = {hand1 / tput['1 proc']:.3f}")
    if tput_b:
        g = a.also_global_batch
        print(f"\nAt global batch {g} (samples/s; median of {a.rounds} round(s)):")
        for k, v in tput_b.items():
            print(f"  {k:36s} {v:9.1f}   per round: {', '.join(f'{r[k]:.1f}' for r in rounds_b)}")
        print(f"  2 procs DDP / 1 proc   = {tput_b['2 procs DDP'] / tput_b['1 proc']:.3f}   (goal >= 1.8)")
        print(f"  2 procs alone / 1 proc = {tput_b['2 procs alone'] / tput_b['1 proc']:.3f}   (the ceiling)")
        hand2, hand1 = tput_b["hand-written 2 procs DDP"], tput_b["hand-written 1 proc"]
        print(f"  hand-written 2 procs / 1 proc = {hand2 / hand1:.3f}")
        print(f"  Trainer step / hand-written step, 2 procs = {hand2 / tput_b['2 procs DDP']:.3f}   (goal <= 1.02)")
        print(f"    paired (back to back) = {paired(rounds_b, 'hand-written 2 procs DDP', '2 procs DDP')}")
        print(f"  Trainer step / hand-written step, 1 proc  = {hand1 / tput_b['1 proc']:.3f}")
    if probe:
        print("\nCommunication probe (hand-written DDP loop, gloo, 2 x 1 thread), median ms per update:")
        print("  bucket_cap_mb  buckets  compute(no_sync)    ddp  exposed comm  hook all_reduce  idle all_reduce")
        for cap, t in probe.items():
            print(
                f"  {cap:13g}  {t['buckets']:7d}  {t['compute'] * 1e3:16.1f}  {t['ddp'] * 1e3:5.1f}  "
                f"{(t['ddp'] - t['compute']) * 1e3:12.1f}  {t['hook'] * 1e3:15.1f}  {t['idle'] * 1e3:15.1f}"
            )
        cap, t = next(iter(probe.items()))
        print(
            f"  gradient {t['grad_mb']:.1f} MB per update; gloo all_reduce alone: {t['grad_mb'] / t['idle'] / 1024:.2f} GB/s; "
            f"at bucket_cap_mb {cap:g} the exposed comm is {(t['ddp'] - t['compute']) / t['ddp']:.1%} of a DDP step"
        )
        # Two processes each compute half the batch; what they cannot hide is (at least) the bare all_reduce.
        print(
            f"  => 2 procs / 1 proc can reach at most 2 x compute / (compute + exposed comm) = "
            f"{2 * t['compute'] / t['ddp']:.3f} (measured), {2 * t['compute'] / (t['compute'] + t['idle']):.3f} "
            "(if only the bare all_reduce were exposed)"
        )
    print(f"\nbench wall time {time.perf_counter() - t_start:.0f} s")
    harness.write_json(
        a.json,
        {
            "args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
            "throughput": tput,
            "rounds": rounds,
            "throughput_also_global_batch": tput_b,
            "rounds_also_global_batch": rounds_b,
            "ratio_ddp_over_1proc": ratio,
            "ratio_alone_over_1proc": ceiling,
            "probe": {str(k): v for k, v in probe.items()},
            "loadavg": [load_before, load_after],
        },
    )


if __name__ == "__main__":
    main()
