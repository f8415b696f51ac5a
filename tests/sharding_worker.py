"""A plain training loop over the sharding seam (accel_trainer.sharding), launched by tests/test_sharding.py with
1 process, 2-process DDP or 2-process FSDP. It does what the Trainer does per update -- item-weighted
accumulation with no gradient sync before the window's last micro-batch, the rescale by world_size / N, clipping,
one optimizer and scheduler step -- over the same global batches on any world size, so the runs can be compared
weight for weight. It asserts the world it was launched into and writes what the test compares:

    out/model.safetensors   the full plain model (sharding.save_full_model)
    out/log.json            losses, grad norms, distributed type, what each rank held (main process)
    out/ckpt/               --save_at N: accelerator.save_state after update N (DCP under FSDP), with
    out/ckpt_full/          model.safetensors + optimizer.pt: the full model and optimizer state at that point
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext

import torch
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from accel_trainer import checkpoint as ckpt  # noqa: E402
from accel_trainer import sharding  # noqa: E402

SAMPLES, GLOBAL_BATCH, SEQ = 48, 16, 12  # 3 updates per epoch: runs of more than 3 cross an epoch boundary


def build_model(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=96,
        bos_token_id=0,
        eos_token_id=0,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)  # tied lm_head/wte; _no_split_modules = ["GPT2Block"]


def build_data(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        x = torch.randn(SAMPLES, 16, generator=g)
        y = torch.tanh(x @ torch.randn(16, 4, generator=g))
        mask = (torch.rand(SAMPLES, 4, generator=g) > 0.4).float()  # a different number of items per sample
        return {"x": x, "y": y, "mask": mask}
    ids = torch.randint(0, 96, (SAMPLES, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(SAMPLES, SEQ, generator=g) < 0.3] = -100  # masked targets: varying tokens per sample
    return {"input_ids": ids, "labels": labels}


def loss_fn(kind: str, model, batch):
    if kind == "mlp":
        err = (model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]
        n = batch["mask"].sum()
        return err.sum() / n.clamp(min=1), n
    n = (batch["labels"][:, 1:] != -100).sum()
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss, n


def micro_batches(data: dict, step: int, accum: int, rank: int, world: int) -> list[dict]:
    """This rank's micro-batches of global batch `step` (0-based): the same global batch on any world size."""
    epoch, pos = divmod(step * GLOBAL_BATCH, SAMPLES)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch))
    idx = order[pos : pos + GLOBAL_BATCH]
    micro = GLOBAL_BATCH // accum
    per_rank = micro // world
    out = []
    for i in range(accum):
        part = idx[i * micro + rank * per_rank : i * micro + (rank + 1) * per_rank]
        out.append({k: v[part] for k, v in data.items()})
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="mlp", choices=["mlp", "lm"])
    p.add_argument("--expect", required=True, choices=["single", "ddp", "fsdp"])
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--max_grad_norm", type=float, default=0.5)
    p.add_argument("--save_at", type=int, default=0)
    p.add_argument("--resume", default=None, help="checkpoint folder: accelerator.load_state, same world size")
    p.add_argument("--load_resharded", default=None, help="checkpoint folder: ckpt.load_resharded, then exit")
    p.add_argument("--reduce_dtype", default=None)
    a = p.parse_args()

    plugin = sharding.fsdp_plugin(reduce_dtype=a.reduce_dtype)
    # The scheduler steps once per update (Accelerate would step it once per process), as in the Trainer.
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, step_scheduler_with_optimizer=False)
    sharding.activate_fsdp(acc, plugin)
    # The world we asked for, not a silent world of 1 or DDP in place of FSDP.
    assert acc.num_processes == a.world == int(os.environ.get("WORLD_SIZE", "1")), (acc.num_processes, a.world)
    want = {"single": "NO", "ddp": "MULTI_CPU", "fsdp": "FSDP"}[a.expect]
    assert acc.distributed_type.value == want, (acc.distributed_type, want)

    model = build_model(a.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (a.steps + 1))
    model, optimizer, scheduler = sharding.prepare_sharded(acc, model, optimizer, scheduler)
    os.makedirs(a.out, exist_ok=True)

    if a.load_resharded:  # e.g. a 2-process FSDP checkpoint into a plain model on 1 process
        ckpt.load_resharded(a.load_resharded, model, optimizer, scheduler)
        save_full(acc, model, optimizer, a.out)
        return

    start = 0
    if a.resume:
        acc.load_state(a.resume)
        start = a.save_at
    data = build_data(a.model)
    rank, world = acc.process_index, acc.num_processes
    params = [p for p in model.parameters() if p.requires_grad]
    log = {"distributed_type": acc.distributed_type.value, "losses": [], "grad_norms": [], "lrs": []}
    for step in range(start, a.steps):
        window = micro_batches(data, step, a.accum, rank, world)
        loss_sum = n_sum = 0
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            with nullcontext() if last or world == 1 else acc.no_sync(model):
                loss, n = loss_fn(a.model, model, batch)
                acc.backward(loss * n)  # summed loss: micro-batches and ranks weighted by their items
            if not last and a.expect == "fsdp":
                # no reduce-scatter happened: FSDP2 keeps the unsharded gradients to itself until the last one
                assert all(p.grad is None for p in params), "FSDP synced gradients inside the accumulation window"
            loss_sum, n_sum = loss_sum + loss.detach() * n, n_sum + n
        totals = torch.stack([torch.as_tensor(loss_sum).float(), torch.as_tensor(n_sum).float()])
        if world > 1:
            totals = acc.reduce(totals, reduction="sum")
        # DDP and FSDP2 average over ranks: the mean over the global batch's N items is that x world / N.
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], world / totals[1].clamp(min=1))
        norm = acc.clip_grad_norm_(params, a.max_grad_norm)  # global norm over the DTensor shards under FSDP
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log["losses"].append((totals[0] / totals[1]).item())
        log["grad_norms"].append(float(norm))
        log["lrs"].append(scheduler.get_last_lr()[0])
        if step + 1 == a.save_at and not a.resume:
            acc.save_state(os.path.join(a.out, "ckpt"))
            save_full(acc, model, optimizer, os.path.join(a.out, "ckpt_full"))

    if a.expect == "fsdp":
        log["sharding"] = acc.sharding_info
        log["per_rank"] = sharding.rank_holdings(acc, model, optimizer)
        if a.reduce_dtype:
            log["mp_policy"] = mp_policy_seen(model)
    save_full(acc, model, optimizer, a.out)
    if acc.is_main_process:
        with open(os.path.join(a.out, "log.json"), "w") as f:
            json.dump(log, f, indent=1)


def save_full(acc, model, optimizer, folder: str):
    """The full model (safetensors) and the full optimizer state (torch.save), for exact comparisons."""
    os.makedirs(folder, exist_ok=True)
    sharding.save_full_model(acc, model, os.path.join(folder, "model.safetensors"))
    opt = getattr(optimizer, "optimizer", optimizer)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if acc.is_main_process:
        torch.save(osd["state"], os.path.join(folder, "optimizer.pt"))


def mp_policy_seen(model) -> dict:
    """The mixed-precision policy on the FSDP units, and the dtype the first block computes in."""
    from torch.distributed.fsdp import FSDPModule

    seen = {"master_dtype": str(next(model.parameters()).dtype)}  # the sharded parameters the optimizer steps
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

    def hook(module, inputs, output):
        seen["compute_dtype"] = str(output.dtype)

    first.register_forward_hook(hook)
    model(torch.randn(2, 16))  # every rank: the forward all-gathers the shards
    policy = model._get_fsdp_state()._mp_policy if isinstance(model, FSDPModule) else None
    seen["param_dtype"], seen["reduce_dtype"] = str(policy.param_dtype), str(policy.reduce_dtype)
    return seen


if __name__ == "__main__":
    main()
