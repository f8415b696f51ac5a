"""CIFAR-10 at speed-record pace, through the Trainer: the airbench94 method (Jordan 2024, arXiv:2404.00498).

    python recipes/cifar.py --dataset ../shared/data/cifar10              # default preset: airbench94, for a GPU
    python recipes/cifar.py --preset muon --dataset ../shared/data/cifar10    # airbench94_muon, for a GPU
    python recipes/cifar.py --preset small --dataset ../shared/data/cifar10   # a 2-core CPU (docs/cifar.md)
    accelerate launch recipes/cifar.py ...                                 # any number of processes, same flags

What makes it fast (each line is an airbench94 ingredient; see docs/cifar.md for measurements):
* Data: the whole split lives on the device as uint8; flip + translate run once per epoch on the device, batches
  are slices (cifar_data.py). Flips alternate: each image is seen mirrored and unmirrored in any two consecutive
  epochs.
* Net: a VGG-like ConvNet (widths 64/256/256 by default), 2x2 first conv initialised as a frozen patch-whitening
  layer (from 5000 train images), identity (dirac) init of the other convs, BatchNorm with no affine weight and a
  fast running-stat momentum, logits scaled down by 9.
* Optimisation: Nesterov SGD in airbench's decoupled units (the learning rate and weight decay are per 1024
  examples, so they do not move when the batch size or momentum changes), BatchNorm biases at 64x the lr,
  label smoothing 0.2, a triangular lr schedule, lookahead (an EMA of the weights copied back into the net every
  5 steps, with a decay that warms up), and the whitening bias frozen after 30% of training. torch's fused SGD.
  `--preset muon`: Muon for the conv filters instead, no lookahead (cifar_muon.py).
* Eval: test-time augmentation (mirror + 1-pixel shifts, 6 views) in the final eval.

Units: lr and weight decay are airbench's ("per 1024 examples"): `--learning_rate 11.5 --weight_decay 0.0153`.
Batch sizes are global (`--batch_size`, split over the processes), as the method is defined by its global batch.
"""

import os
import sys
from dataclasses import dataclass, field

# On a CPU shared with other processes, OpenMP threads that spin while waiting for each other waste the cores
# the other processes need: passive waiting is faster under load and no slower on an idle machine (docs/cifar.md).
# Must be set before torch loads OpenMP; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cifar_data.py next to this file
from cifar_data import DEFAULT_DATASET, CifarSplit, DeviceLoader, load_cifar10, normalize  # noqa: E402
from cifar_muon import Muon, state_like_params  # noqa: E402

from accel_trainer import UserError  # noqa: E402
from accel_trainer.precision import fast_mixed_precision, training_device  # noqa: E402

name = "cifar"

# ---------------------------------------------------------------------------------------------------------------
# Presets: one line per knob that differs. Anything given on the command line wins.
# "default" is airbench94, for a GPU; "small" is for a 2-core CPU; "muon" is airbench94_muon, for a GPU (their
# results: docs/cifar.md). Mixed precision is no preset's knob: unless given, it is what the device runs fast
# (configure below). A knob of the recipe's Args or of TrainingArguments alike.

PRESETS = {
    "default": dict(
        widths="64,256,256",  # channels of the three conv blocks
        batch_size=1024,  # images per optimizer step, all processes together
        eval_batch_size=2000,  # images per eval forward, all processes together
        num_train_epochs=9.9,  # passes over the 50k train images (airbench94: 9.9)
        logging_steps=50,  # a log row is a host read: 9 in 476 updates, where 10 kept a GPU waiting
    ),
    "muon": dict(  # airbench94_muon: Muon for the conv filters, SGD for the rest, no lookahead
        widths="64,256,256",
        batch_size=2000,
        eval_batch_size=2000,
        num_train_epochs=8,  # 25 updates an epoch: 200 in all
        optimizer="muon",
        learning_rate=0.24,  # Muon's step along the orthogonalized update (no unit: its size is the lr)
        weight_decay=2e-6,  # SGD's, per example of the global batch (airbench94_muon: 2e-6 x batch per step)
        lookahead=False,
        whiten_bias_frac=0.375,  # 3 of 8 epochs
        lr_peak_at=0.0,  # the schedule: a linear decay from 1 to 0
        lr_end=0.0,
        logging_steps=50,
    ),
    "small": dict(  # for a 2-core CPU (AMD EPYC Zen 4 with AVX512-BF16 here); measurements in docs/cifar.md
        widths="32,64,128",  # the 31x31 first block dominates CPU time: narrow; 16 wide was faster but stopped
        # short of 90% with TTA
        batch_size=512,  # more steps per epoch than 1024 suit a net this small
        eval_batch_size=1000,
        num_train_epochs=8,  # enough for 90% with TTA in the time the goal allows (docs/cifar.md)
    ),
}

# TrainingArguments defaults of this recipe (the Trainer's own defaults suit transformers, not airbench).
defaults = {
    "learning_rate": 11.5,  # per 1024 examples (airbench's decoupled lr; see build_optimizer)
    "weight_decay": 0.0153,  # per 1024 examples, decoupled from the lr
    "num_train_epochs": 9.9,
    "max_grad_norm": 0.0,  # no clipping: BatchNorm + label smoothing keep gradients tame
    "logging_steps": 10,
    "save_steps": 0,  # no mid-run checkpoints: a run is seconds on a GPU (pass --save_steps to resume)
    "seed": 0,
    # airbench drops the last, short batch of each epoch (50000 = 48 x 1024 + 848): 476 updates in 9.9 epochs, not
    # 486; one batch shape (no second cuDNN autotune, no recompile under --torch_compile), and no update with the
    # full batch's learning rate on 848 images. Every image is still seen: the order is reshuffled each epoch.
    "dataloader_drop_last": True,
}


@dataclass
class Args:
    preset: str = field(
        default="default",
        metadata={"help": f"One of {', '.join(PRESETS)}: sets the knobs left unset below (see PRESETS in this file)."},
    )
    dataset: str = field(
        default=DEFAULT_DATASET,
        metadata={
            "help": "Hub id (needs the network), a local folder in the Hub layout (e.g. ../shared/data/cifar10), or "
            "the original cifar-10-batches-py pickle folder."
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where decoded uint8 arrays are cached. Default: $ACCEL_TRAINER_CACHE or ~/.cache/accel-trainer."
        },
    )
    widths: str | None = field(default=None, metadata={"help": "Channels of the 3 conv blocks, e.g. 64,256,256."})
    batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Global train batch (all processes); sets --per_device_train_batch_size to batch_size / processes."
        },
    )
    eval_batch_size: int | None = field(default=None, metadata={"help": "Global eval batch."})
    optimizer: str = field(
        default="sgd",
        metadata={
            "help": "sgd (airbench94: Nesterov SGD and lookahead) or muon (airbench94_muon: Muon for the conv "
            "filters at --learning_rate, Nesterov SGD for the rest at --muon_bias_lr / --muon_head_lr)."
        },
    )
    momentum: float = field(default=0.85, metadata={"help": "Nesterov momentum (of SGD)."})
    muon_momentum: float = field(default=0.6, metadata={"help": "Muon's Nesterov momentum (--optimizer muon)."})
    muon_bias_lr: float = field(
        default=0.053,
        metadata={
            "help": "--optimizer muon: SGD's lr of the biases (whitening, BatchNorm) in airbench94_muon's units (a "
            "loss summed over the batch: per example). --weight_decay is per example there too."
        },
    )
    muon_head_lr: float = field(default=0.67, metadata={"help": "--optimizer muon: SGD's lr of the head, likewise."})
    compile_muon: bool = field(
        default=True,
        metadata={"help": "--optimizer muon on a CUDA device: torch.compile Muon's Newton-Schulz iteration."},
    )
    bias_lr_scale: float = field(
        default=64.0, metadata={"help": "BatchNorm biases train at this times the lr (not their weight decay)."}
    )
    label_smoothing: float = field(default=0.2, metadata={"help": "Label smoothing of the train loss."})
    lr_start: float = field(default=0.2, metadata={"help": "Triangular schedule: lr factor at step 0."})
    lr_peak_at: float = field(default=0.23, metadata={"help": "... fraction of training where the factor is 1."})
    lr_end: float = field(default=0.07, metadata={"help": "... factor at the last step."})
    lookahead: bool = field(
        default=True,
        metadata={
            "help": "Lookahead (airbench94's): EMA of the weights from the start, copied back into the net every 5 "
            "steps and at the end."
        },
    )
    whiten_bias_frac: float = field(
        default=0.3,
        metadata={"help": "Freeze the whitening bias after this fraction of training (airbench: 3 of 9.9 epochs)."},
    )
    bn_momentum: float = field(default=0.6, metadata={"help": "BatchNorm running stats: new = m*old + (1-m)*batch."})
    flip: str = field(default="alternate", metadata={"help": "alternate, random or none."})
    translate: int = field(default=2, metadata={"help": "Random shift in pixels (reflect padding)."})
    tta_level: int = field(default=2, metadata={"help": "Final eval: 0 none, 1 mirror, 2 mirror + 1px shifts."})
    channels_last: bool = field(default=True, metadata={"help": "NHWC memory layout for the convs."})
    cudnn_benchmark: bool = field(
        default=True,
        metadata={
            "help": "On a CUDA GPU, let cuDNN time its conv algorithms for each shape and keep the fastest (airbench "
            "does; the shapes here are fixed). Off: cuDNN's heuristic choice, the same algorithms every run."
        },
    )

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: use one of {', '.join(PRESETS)}.")
        if self.optimizer not in ("sgd", "muon"):
            raise ValueError(f"--optimizer {self.optimizer!r}: use sgd or muon.")
        if self.flip not in ("alternate", "random", "none"):
            raise ValueError(f"--flip {self.flip!r}: use alternate, random or none.")
        if self.tta_level not in (0, 1, 2):
            raise ValueError(f"--tta_level {self.tta_level}: use 0, 1 or 2.")


def configure(ctx):
    """Fill what the preset decides and the user left unset (`ctx.given`); derive per-device batches from the global
    ones over `ctx.world_size` processes."""
    args, targs = ctx.args, ctx.targs
    for key, value in PRESETS[args.preset].items():
        if key in ("widths", "batch_size", "eval_batch_size"):  # None: unset (the preset's), also from Python
            if getattr(args, key) is None:
                setattr(args, key, value)
        elif key not in ctx.given:
            setattr(args if hasattr(args, key) else targs, key, value)
    if targs.mixed_precision is None and not os.environ.get("ACCELERATE_MIXED_PRECISION"):
        # What this device runs fast, asked of torch (bf16 on an Ampere+ GPU or a CPU with AVX512-BF16/AMX, fp32 on
        # an AVX2 CPU, where bf16 convs are far slower): see accel_trainer/precision.py.
        targs.mixed_precision = fast_mixed_precision(training_device(targs.use_cpu))
    for key, flag in (("batch_size", "per_device_train_batch_size"), ("eval_batch_size", "per_device_eval_batch_size")):
        if getattr(args, key) % ctx.world_size:
            raise UserError(
                f"--{key} {getattr(args, key)} does not split evenly over {ctx.world_size} processes: pass a "
                f"multiple of {ctx.world_size}."
            )
        setattr(targs, flag, getattr(args, key) // ctx.world_size)


def _widths(args):
    return tuple(int(w) for w in (args.widths or PRESETS[args.preset]["widths"]).split(","))


# ---------------------------------------------------------------------------------------------------------------
# The network


class BatchNorm(nn.BatchNorm2d):
    # No learnable scale (the next conv can absorb it); a bias that trains at 64x the lr (see build_optimizer).
    def __init__(self, num_features, momentum=0.6):
        super().__init__(num_features, eps=1e-12, momentum=1 - momentum)  # torch's momentum is airbench's 1 - m
        self.weight.requires_grad_(False)


class Conv(nn.Conv2d):
    def __init__(self, c_in, c_out):
        super().__init__(c_in, c_out, kernel_size=3, padding="same", bias=False)
        # Identity init of the first c_in filters: the block starts as an (implicit) residual, which trains faster.
        with torch.no_grad():
            nn.init.dirac_(self.weight[:c_in])


class ConvGroup(nn.Module):
    def __init__(self, c_in, c_out, bn_momentum):
        super().__init__()
        self.conv1, self.pool, self.norm1 = Conv(c_in, c_out), nn.MaxPool2d(2), BatchNorm(c_out, bn_momentum)
        self.conv2, self.norm2 = Conv(c_out, c_out), BatchNorm(c_out, bn_momentum)

    def forward(self, x):
        x = F.gelu(self.norm1(self.pool(self.conv1(x))))  # pooling before BN: 4x less BN work
        return F.gelu(self.norm2(self.conv2(x)))


class CifarNet(nn.Module):
    """whiten (2x2 conv, frozen) -> GELU -> 3 x [conv, pool, BN, GELU, conv, BN, GELU] -> max -> linear -> / 9.

    variant "airbench94_muon" (--preset muon): the same layers, initialised and scaled as airbench94_muon does: the
    head's weights at std 1 and the logits divided by the head's width, the whitening bias at torch's default."""

    def __init__(self, widths=(64, 256, 256), whiten_kernel=2, bn_momentum=0.6, label_smoothing=0.2,
                 variant="airbench94"):  # fmt: skip
        super().__init__()
        muon = variant == "airbench94_muon"
        whiten_width = 2 * 3 * whiten_kernel**2  # every patch direction, with both signs (GELU is not odd)
        self.whiten = nn.Conv2d(3, whiten_width, whiten_kernel, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        if not muon:
            nn.init.zeros_(self.whiten.bias)
        chans = (whiten_width,) + tuple(widths)
        self.blocks = nn.Sequential(*[ConvGroup(a, b, bn_momentum) for a, b in zip(chans[:-1], chans[1:])])
        self.head = nn.Linear(widths[-1], 10, bias=False)
        # small logits at init: the net starts out "uncertain", which label smoothing likes
        self.scale = 1 / widths[-1] if muon else 1 / 9
        if muon:
            with torch.no_grad():
                self.head.weight.mul_(1 / self.head.weight.std())
        self.label_smoothing = label_smoothing  # read by loss(); kept on the model so loss(model, batch) suffices

    def forward(self, x):
        # The whitening conv in its weights' precision (fp32) under autocast too: its smallest-variance directions
        # have the largest filters and the smallest outputs, a cancellation bf16 cannot carry (docs/cifar.md,
        # "Accuracy"). A 2x2 conv to 24 channels: its cost is small next to the blocks'. (Under FSDP with a bf16
        # parameter policy its weights are bf16, and so is its input.)
        with torch.autocast(x.device.type, enabled=False):
            x = self.whiten(x.to(self.whiten.weight.dtype))
        x = self.blocks(F.gelu(x))
        x = F.adaptive_max_pool2d(x, 1).flatten(1)  # the last block is 3x3 on 32x32 inputs: a global max pool
        return self.head(x) * self.scale

    @torch.no_grad()
    def init_whitening(self, images, eps=5e-4):
        """Set the first conv to ZCA-like patch whitening: eigenvectors of the patch covariance of `images`
        (normalized, NCHW), scaled by 1/sqrt(eigenvalue), each with both signs."""
        c, (h, w) = images.shape[1], self.whiten.weight.shape[2:]
        patches = images.float().unfold(2, h, 1).unfold(3, w, 1).transpose(1, 3).reshape(-1, c * h * w)
        cov = patches.T @ patches / len(patches)
        eigenvalues, eigenvectors = torch.linalg.eigh(cov)
        filters = (eigenvectors.T / torch.sqrt(eigenvalues + eps)[:, None]).reshape(-1, c, h, w).flip(0)
        # flip(0): largest-eigenvalue directions first. Patches are flattened in (c, h, w) order, like the weights.
        self.whiten.weight.copy_(torch.cat((filters, -filters)))


def _cifarnet(model):
    """The CifarNet under DDP / torch.compile wrappers."""
    while not isinstance(model, CifarNet):
        model = model._orig_mod if hasattr(model, "_orig_mod") else model.module
    return model


def _whitening_images(train_images, device):
    """The first 5000 train images (uint8 NHWC, numpy), normalized, on `device`."""
    return normalize(torch.from_numpy(train_images[:5000]).to(device))


def build_model(ctx):
    args = ctx.args
    if args.cudnn_benchmark and ctx.accelerator.device.type == "cuda":
        # Process-wide, set by the recipe: a flag of the cuDNN backend, not of the model (it means nothing elsewhere).
        torch.backends.cudnn.benchmark = True
    variant = "airbench94_muon" if args.optimizer == "muon" else "airbench94"
    model = CifarNet(_widths(args), bn_momentum=args.bn_momentum, label_smoothing=args.label_smoothing, variant=variant)
    with ctx.accelerator.main_process_first():  # rank 0 decodes and caches the data; the others then read it
        train_images = load_cifar10(args.dataset, args.cache_dir)["train"][0]
    # Whitening statistics from the first 5000 train images: the same on every rank, no communication needed;
    # computed on the training device, as airbench does (and times: bench/cifar.py), then copied into the model.
    model.init_whitening(_whitening_images(train_images, ctx.accelerator.device))
    # FSDP2 shards only contiguous parameters ("FSDP does not support non-contiguous parameters yet", a traceback
    # at start-up): under FSDP the weights keep the default layout; the inputs are channels_last either way.
    sharded = getattr(ctx.accelerator, "distributed_type", None) == DistributedType.FSDP
    if args.channels_last and not sharded:
        model = model.to(memory_format=torch.channels_last)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Data


def build_data(ctx):
    """The splits as uint8 arrays (cut by --max_train_samples/--max_eval_samples in the Trainer), batched on the
    device by DeviceLoader: each rank a contiguous part of every global batch."""
    args, acc = ctx.args, ctx.accelerator
    with acc.main_process_first():
        data = load_cifar10(args.dataset, args.cache_dir)

    def loader(split, *, batch_size, train, drop_last):
        return DeviceLoader(
            split.images,
            split.labels,
            batch_size,
            train=train,
            drop_last=drop_last,
            flip=args.flip,
            translate=args.translate,
            device=acc.device,
            seed=ctx.targs.seed,
            rank=ctx.process_index,
            world_size=ctx.world_size,
        )

    return {"train": CifarSplit(*data["train"]), "eval": CifarSplit(*data["test"]), "loader": loader}


# ---------------------------------------------------------------------------------------------------------------
# Loss and eval


def loss(model, batch):
    logits = model(batch["images"])
    labels = batch["labels"]
    # sum / max(n, 1), not the mean: a rank whose share of the last global batch is empty (1025 images on
    # 2 x 512) gives 0 with weight 0 instead of NaN (the mean of nothing), which would stop the run.
    total = F.cross_entropy(logits.float(), labels, label_smoothing=_cifarnet(model).label_smoothing, reduction="sum")
    return total / max(len(labels), 1), len(labels)


def eval_step(model, batch):
    logits = model(batch["images"]).float()
    labels = batch["labels"]
    return {
        "loss": F.cross_entropy(logits, labels, reduction="none"),  # per image: exact for any split into ranks
        "n_items": torch.ones(len(labels), device=logits.device),
        "predictions": logits.argmax(1),
        "references": labels,
    }


def build_metrics(ctx):
    from accel_trainer import load_metric

    return {"accuracy": load_metric("accuracy")}


def tta_logits(model, images, level=2):
    """Test-time augmentation: level 1 averages the image and its mirror; level 2 also averages (with weight 1/2)
    two 1-pixel diagonal shifts of both, i.e. 6 views (airbench94)."""

    # Every view in the layout of the batches (channels_last, cifar_data.normalize): under --torch_compile an input
    # of another layout is another graph, compiled during the final eval (seen on an H100: a flip and two shifted
    # views gave 3 of its 8 recompiles).
    layout = torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format

    def mirror(x):
        return 0.5 * model(x).float() + 0.5 * model(x.flip(-1).contiguous(memory_format=layout)).float()

    if level == 0:
        return model(images).float()
    logits = mirror(images)
    if level == 1:
        return logits
    padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
    # up-left and down-right by one pixel
    shifted = [
        padded[:, :, 0:-2, 0:-2].contiguous(memory_format=layout),
        padded[:, :, 2:, 2:].contiguous(memory_format=layout),
    ]
    return 0.5 * logits + 0.25 * (mirror(shifted[0]) + mirror(shifted[1]))


def on_evaluate_end(trainer, metrics, final):
    """After the final eval: accuracy with test-time augmentation, through `evaluate` like the plain accuracy."""
    args = trainer.recipe_args
    if not final or args.tta_level == 0 or trainer.eval_loader is None:
        return None
    model = trainer.eval_model
    was_training = model.training
    model.eval()
    metric = build_metrics(trainer.ctx)["accuracy"]
    with torch.no_grad():
        for batch in trainer.eval_loader:
            out = {
                "predictions": tta_logits(model, batch["images"], args.tta_level).argmax(1),
                "references": batch["labels"],
            }
            out = trainer.gather_eval(out)  # every test image once, also when shards differ by one sample
            metric.add_batch(predictions=out["predictions"].cpu(), references=out["references"].cpu())
    model.train(was_training)
    return {"eval_tta_accuracy": metric.compute()["accuracy"]}


# ---------------------------------------------------------------------------------------------------------------
# Optimisation


class LookaheadSGD(torch.optim.SGD):
    """Nesterov SGD plus airbench94's lookahead: the EMA of the model's floating state (weights and BatchNorm
    running stats) starts from the net as built; every `every` steps from the start it moves towards the net and
    the net is set to it. The decay warms up as 0.95^5 (step / total)^3, so early on the net moves fast and at the
    end it is averaged strongly; the last step sets the net to the EMA a final time (airbench94's `decay=1.0`).

    Why not the Trainer's --ema_decay: that keeps a separate averaged copy for eval with a fixed decay; lookahead
    pulls the training weights themselves back (it changes the trajectory), on a schedule tied to the run length.
    It lives in the optimizer so that it runs right after each update, under any Trainer, and is checkpointed
    with the optimizer state.

    Where that state lives: where torch's distributed checkpoint (DCP, which saves the optimizer under FSDP) keeps
    and reshards optimizer state, so that a resume goes on with the same lookahead on any launch. A parameter's EMA
    is its optimizer state (`state[p]["lookahead_ema"]`: a DTensor shard under FSDP, like its momentum); the step
    count and the EMA of the buffers (plain tensors, the same on every rank: sharding.py keeps buffers replicated
    under FSDP) are a value of the first param group. get_optimizer_state_dict keeps only "state" and
    "param_groups": a top-level key of state_dict() was dropped, and a resumed FSDP run restarted its count at 0
    and never pulled back again. Frozen parameters (whitening weights, BatchNorm scales) average to themselves:
    they need no EMA.

    The tensors it averages, and their averages, are listed once (at the first step, when prepare() has placed the
    model; again after a load): walking the parameters and the model's buffers every step was most of the host's
    work for a pull that comes every fifth step. An update skipped on the device (a fused step given GradScaler's
    flag) would still be pulled and counted here: this optimizer, fused or not, is skipped from the host (it is
    built unfused, so GradScaler and the Trainer's --nan_policy skip do not hand it a skip flag).
    """

    def __init__(self, params, model, lr, momentum, every=5, decay_base=0.95, decay_pow=3.0, enabled=True, fused=None):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=True)
        # torch's fused step where `fused` (_fused: not under FSDP), set in the param groups only during a step: the
        # state a checkpoint holds is the same on any launch, so that a run resumes on another world size (its check
        # wants every flag of a param group as it is here).
        self.fused = fused
        self.model, self.every, self.enabled = model, every, enabled
        self.decay_base, self.decay_pow = decay_base, decay_pow
        self.total_steps = None  # set by build_scheduler, which knows the run length
        self.param_groups[0]["lookahead"] = _new_lookahead_state()
        if enabled:  # the buffers' averages from the net as built, before a forward moves its running statistics
            self.param_groups[0]["lookahead"]["buffers"] = {n: b.detach().clone() for n, b in self._buffers().items()}
        self._lists = None  # (averages, the net's tensors they average): built once (_pairs)
        self._decays = None  # the decay at each step of the run (_decay)

    @property
    def step_count(self) -> int:
        return self.param_groups[0]["lookahead"]["step"]

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _buffers(self) -> dict:
        """The net's floating buffers that a checkpoint holds (BatchNorm running statistics), by name."""
        persistent = self.model.state_dict().keys()
        return {n: b for n, b in self.model.named_buffers() if n in persistent and b.is_floating_point()}

    def _pairs(self):
        """(EMA tensors, the net's tensors they average), as plain tensors, built once; the parameters' averages
        allocated from the net where they are missing. Not at construction: DCP loads into the state a fresh
        optimizer has after one zero-lr step (get_optimizer_state_dict runs it only while the state is empty), so
        the EMA must exist after a step, and must not exist before one (SGD's momentum would then not be created to
        load into). Under FSDP2 the parameters are DTensors beside plain buffers, and one _foreach op over both
        fails: each rank averages its own shards (to_local shares their storage), the buffers whole."""
        if self._lists is not None:
            return self._lists

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        params, buffers = self._params(), self._buffers()
        averaged = self.param_groups[0]["lookahead"]["buffers"]
        for p in params:
            if "lookahead_ema" not in self.state[p]:
                self.state[p]["lookahead_ema"] = p.detach().clone()
        for name, b in buffers.items():  # on their buffer's device: prepare() moved the model after construction
            averaged[name] = averaged[name].to(b.device) if name in averaged else b.detach().clone()
        ema = [local(self.state[p]["lookahead_ema"]) for p in params] + [averaged[n] for n in buffers]
        self._lists = ema, [local(p) for p in params] + list(buffers.values())
        return self._lists

    @torch.no_grad()
    def step(self, closure=None):
        if self.enabled:
            self._pairs()  # at the first step before the update: the average starts from the net as built
        for group in self.param_groups:
            group["fused"] = self.fused
        try:
            loss = super().step(closure)
        finally:
            for group in self.param_groups:
                group["fused"] = None
        state = self.param_groups[0]["lookahead"]
        state["step"] += 1
        n, total = state["step"], self.total_steps
        if not self.enabled or total is None or (n % self.every and n != total):
            return loss
        ema, net = self._pairs()
        if n % self.every == 0:
            torch._foreach_lerp_(ema, net, 1 - self._decay(n, total))
        torch._foreach_copy_(net, ema)  # the last step, when it is no 5th: back to the average, nothing taken in
        return loss

    def _decay(self, n: int, total: int) -> float:
        """airbench94's `alpha_schedule[n]`, computed as it computes it (a float32 tensor over the run, here once, as
        Python numbers), so that the recipe's lookahead is airbench's to the bit (tests/test_cifar.py)."""
        if self._decays is None or len(self._decays) != total + 1:
            self._decays = (self.decay_base**self.every * (torch.arange(total + 1) / total) ** self.decay_pow).tolist()
        return self._decays[n]

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        legacy = state_dict.pop("lookahead", None)  # the earlier format: a top-level key
        super().load_state_dict(state_dict)
        state = self.param_groups[0].setdefault("lookahead", _new_lookahead_state())
        state.pop("started", None)  # of the schedule that started at 30% of the run
        self._lists = None  # the loaded tensors are new ones
        if legacy is not None:
            self._load_legacy(legacy)
        state_like_params(self)  # a fused step needs each state in its parameter's layout
        # torch moves each parameter's state to its parameter's device, not values of a param group (Accelerate
        # reads optimizer.bin onto the CPU on one GPU): the buffers' averages go to their buffers' device here.
        buffers = self._buffers()
        state["buffers"] = {n: t.to(buffers[n].device) if n in buffers else t for n, t in state["buffers"].items()}

    def _load_legacy(self, old):
        """{"step_count", "ema": None, or the averages of all the net's floating state-dict entries, in order}."""
        state = self.param_groups[0]["lookahead"]
        state["step"] = old["step_count"]
        if old["ema"] is None:  # not started yet: _pairs starts the averages from the net
            return
        floats = [n for n, v in self.model.state_dict().items() if v.is_floating_point()]
        averages, names = dict(zip(floats, old["ema"])), {p: n for n, p in self.model.named_parameters()}
        for p in self._params():
            self.state[p]["lookahead_ema"] = averages[names[p]].to(p.device)
        state["buffers"] = {n: averages[n] for n in self._buffers()}


def _new_lookahead_state() -> dict:
    return {"step": 0, "buffers": {}}


def build_optimizer(model, ctx):
    """--optimizer sgd: airbench94's SGD and lookahead (_sgd_optimizer); muon: airbench94_muon's (_muon_optimizer)."""
    return (_muon_optimizer if ctx.args.optimizer == "muon" else _sgd_optimizer)(model, ctx)


def _sgd_optimizer(model, ctx):
    """airbench's decoupled units -> torch SGD. Our loss is the MEAN over the global batch of B examples, so the
    torch lr is lr_per_1024 * B / (1024 * (1 + 1/(1-momentum))): the second factor undoes Nesterov's step
    amplification for time-constant gradients. Weight decay per step is wd_per_1024 * B / (same), and torch
    multiplies its weight_decay by the lr, so we pass the ratio."""
    args, targs = ctx.args, ctx.targs
    B = ctx.global_batch_size
    scale = 1024 * (1 + 1 / (1 - args.momentum))
    lr = ctx.learning_rate * B / scale  # --learning_rate, after --lr_scaling if asked
    wd = targs.weight_decay * B / scale
    net = _cifarnet(model)
    norm_biases = [m.bias for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    ids = {id(p) for p in norm_biases} | {id(net.whiten.bias)}
    others = [p for p in net.parameters() if p.requires_grad and id(p) not in ids]
    lr_b = lr * args.bias_lr_scale
    groups = [
        dict(params=others, lr=lr, weight_decay=wd / lr),
        dict(params=norm_biases, lr=lr_b, weight_decay=wd / lr_b),
        dict(params=[net.whiten.bias], lr=lr, weight_decay=wd / lr),
    ]  # frozen after whiten_bias_frac
    return LookaheadSGD(groups, net, lr=lr, momentum=args.momentum, enabled=args.lookahead, fused=_fused(ctx))


def _muon_optimizer(model, ctx):
    """airbench94_muon: Muon at --learning_rate for the conv filters (4-d, trained); Nesterov SGD for the whitening
    and BatchNorm biases at --muon_bias_lr and the head at --muon_head_lr, in airbench94_muon's units (a loss summed
    over the batch). Our loss is the mean over the global batch of B examples: the torch lr is that lr x B, and the
    per-step weight decay --weight_decay x B (torch multiplies its weight_decay by the lr: the ratio is passed).
    Muon's step does not depend on the loss's scale. Its param groups: [filters, BatchNorm biases, whitening bias,
    head] (build_scheduler's order)."""
    args, targs, acc = ctx.args, ctx.targs, getattr(ctx, "accelerator", None)
    if acc is not None and getattr(acc, "distributed_type", None) == DistributedType.FSDP:
        raise UserError(
            "--optimizer muon (--preset muon) orthogonalizes each conv filter's whole update, and under FSDP a "
            "process holds a shard of it: train it on one process or with DDP (an accelerate config without FSDP)."
        )
    B = ctx.global_batch_size
    wd = targs.weight_decay * B  # per step
    net = _cifarnet(model)
    filters = [p for p in net.parameters() if p.ndim == 4 and p.requires_grad]
    norm_biases = [m.bias for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    bias_lr, head_lr = args.muon_bias_lr * B, args.muon_head_lr * B
    groups = [
        dict(params=filters, muon=True),
        dict(params=norm_biases, lr=bias_lr, momentum=args.momentum, weight_decay=wd / bias_lr),
        dict(params=[net.whiten.bias], lr=bias_lr, momentum=args.momentum, weight_decay=wd / bias_lr),
        dict(params=[net.head.weight], lr=head_lr, momentum=args.momentum, weight_decay=wd / head_lr),
    ]
    return Muon(groups, lr=ctx.learning_rate, momentum=args.muon_momentum, fused=_fused(ctx),
                compiled=args.compile_muon)  # fmt: skip


def _fused(ctx) -> bool | None:
    """torch's fused SGD (one kernel for all of an update's parameters, where the default runs a few per parameter
    group or per parameter) on the CPU and CUDA; under FSDP, whose parameters are DTensors, torch's default (None).
    A context without an accelerator (a test's, a bench's) is a CPU's."""
    acc = getattr(ctx, "accelerator", None)
    if acc is not None and getattr(acc, "distributed_type", None) == DistributedType.FSDP:
        return None
    return (acc.device.type if acc is not None else "cpu") in ("cpu", "cuda") or None


def build_scheduler(optimizer, ctx):
    """airbench's triangle: lr factor lr_start -> 1 (at lr_peak_at of training) -> lr_end, linear pieces; with
    lr_peak_at 0 a straight line from 1 to lr_end (airbench94_muon's 1 - step / total). The whitening bias follows
    it and stops at whiten_bias_frac of the run; under --optimizer muon it decays to 0 there instead (airbench94_muon's
    1 - step / whiten_steps)."""
    args, num_training_steps = ctx.args, ctx.num_training_steps
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.total_steps = num_training_steps
    peak = max(1, int(args.lr_peak_at * num_training_steps)) if args.lr_peak_at > 0 else 0

    def triangle(step):
        if step < peak:
            return args.lr_start + (1 - args.lr_start) * step / peak
        return 1 + (args.lr_end - 1) * (step - peak) / max(1, num_training_steps - peak)

    freeze_at = args.whiten_bias_frac * num_training_steps
    if args.optimizer == "muon":
        whiten = lambda step: max(0.0, 1 - step / freeze_at) if freeze_at > 0 else 0.0  # noqa: E731
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [triangle, triangle, whiten, triangle])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [triangle, triangle, lambda step: triangle(step) * (step < freeze_at)]
    )


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
