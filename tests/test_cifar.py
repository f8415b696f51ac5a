"""recipes/cifar.py and recipes/cifar_data.py on a tiny CIFAR-format dataset that the tests write themselves.

In-process: the loading code (Hub layout vs pickle folder), the device loader's sharding / ordering / augmentation,
the whitening init, lookahead and the lr units. Subprocesses (as users run it): 1 process and `accelerate launch`
with 2 processes end to end, and the missing-dataset error.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import cifar  # noqa: E402
import cifar_data  # noqa: E402
from cifar_data import CifarDataError, DeviceLoader, augment_gather, load_cifar10  # noqa: E402
from helpers import env as child_env  # noqa: E402
from helpers import launch_cmd  # noqa: E402

N_TRAIN, N_TEST = 240, 60


from cifar_fixtures import tiny_arrays, write_hub_layout, write_pickle_folder  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_cifar")
    train, test = tiny_arrays(N_TRAIN, 0), tiny_arrays(N_TEST, 1)
    write_hub_layout(str(root / "hub"), train, test)
    pickles = write_pickle_folder(str(root / "pickle"), train, test)
    return {"hub": str(root / "hub"), "pickle": pickles, "train": train, "test": test, "root": root}


# ----------------------------------------------------------------------------------------------------------------
# Loading


def test_hub_layout_and_pickle_folder_load_the_same_arrays(tiny, tmp_path):
    hub = load_cifar10(tiny["hub"], cache_dir=str(tmp_path / "cache"))
    pkl = load_cifar10(tiny["pickle"], cache_dir=str(tmp_path / "cache"))
    for split, (x, y) in (("train", tiny["train"]), ("test", tiny["test"])):
        assert hub[split][0].dtype == np.uint8 and hub[split][0].shape == (len(y), 32, 32, 3)
        np.testing.assert_array_equal(hub[split][0], x)  # PNG is lossless: the arrays we wrote
        np.testing.assert_array_equal(hub[split][1], y)
        np.testing.assert_array_equal(pkl[split][0], hub[split][0])
        np.testing.assert_array_equal(pkl[split][1], hub[split][1])
    # The parent of cifar-10-batches-py works too.
    parent = load_cifar10(os.path.dirname(tiny["pickle"]), use_cache=False)
    np.testing.assert_array_equal(parent["train"][0], hub["train"][0])


class _RunsCode:
    """A pickled object whose unpickling runs a shell command: what a crafted data file would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_crafted_pickle_folder_is_refused_without_running_code(tiny, tmp_path):
    # The original CIFAR layout is pickles: a copy from elsewhere must never run code when loaded. A data_batch_1
    # whose array is an object that runs a command, in protocols 2 (the original files') and 5: refused in one
    # line naming the file, the command never runs, from Python and from the recipe's command line.
    import pickle
    import shutil

    marker = tmp_path / "ran"
    for protocol in (2, 5):
        folder = tmp_path / f"crafted{protocol}" / "cifar-10-batches-py"
        shutil.copytree(tiny["pickle"], folder)
        with open(folder / "data_batch_1", "wb") as f:
            pickle.dump({b"data": _RunsCode(marker), b"labels": [0]}, f, protocol=protocol)
        with pytest.raises(CifarDataError, match="data_batch_1.*not run"):
            load_cifar10(str(folder), use_cache=False)
        assert not marker.exists()
    proc = run_recipe(["--dataset", str(folder), "--cache_dir", str(tmp_path / "cache")]
                      + ["--output_dir", str(tmp_path / "out"), "--max_steps", "1"])  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data_batch_1" in errors[0], proc.stderr[-3000:]
    assert not marker.exists()


def test_decoded_arrays_are_cached(tiny, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    first = load_cifar10(tiny["hub"], cache_dir=cache)
    assert any(f.endswith("train_images.npy") for _, _, fs in os.walk(cache) for f in fs)

    def no_decoding(*a, **k):
        raise AssertionError("decoded again although the arrays are cached")

    monkeypatch.setattr(cifar_data, "_load_hub_layout", no_decoding)
    second = load_cifar10(tiny["hub"], cache_dir=cache)
    np.testing.assert_array_equal(first["train"][0], second["train"][0])


def test_missing_dataset_raises_a_clear_error(tmp_path):
    with pytest.raises(cifar_data.CifarDataError) as e:
        load_cifar10(str(tmp_path / "nowhere"), cache_dir=str(tmp_path / "cache"))
    msg = str(e.value)
    assert "uoft-cs/cifar10" in msg and "cifar-10-batches-py" in msg and "nowhere" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(cifar_data.CifarDataError, match="cifar-10-batches-py"):
        load_cifar10(str(empty), cache_dir=str(tmp_path / "cache"))


# ----------------------------------------------------------------------------------------------------------------
# The device loader


def id_images(n, seed=0):
    """Random images (so every transformed view identifies its source) with labels = sample ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g), torch.arange(n)


def epoch_ids(n, batch, world, epoch, seed=0, **kw):
    """Per rank: the list of batches (sample ids) of one epoch."""
    x, y = id_images(n)
    out = []
    for rank in range(world):
        ld = DeviceLoader(x, y, batch, train=True, seed=seed, rank=rank, world_size=world, **kw)
        ld.set_epoch(epoch)
        out.append([b["labels"].tolist() for b in ld])
    return out


@pytest.mark.parametrize("n,batch,world", [(100, 8, 1), (100, 8, 2), (103, 8, 2), (101, 5, 3)])
def test_every_sample_exactly_once_per_epoch_across_ranks(n, batch, world):
    for epoch in (0, 1):
        ranks = epoch_ids(n, batch, world, epoch)
        assert len({len(r) for r in ranks}) == 1  # same number of batches on every rank
        seen = [i for r in ranks for b in r for i in b]
        assert sorted(seen) == list(range(n))  # each sample once, none missing
        assert all(len(b) <= batch for r in ranks for b in r)


def test_order_depends_on_seed_and_epoch_only():
    e0, e1 = epoch_ids(100, 10, 2, 0), epoch_ids(100, 10, 2, 1)
    assert e0 != e1  # reshuffled each epoch
    assert epoch_ids(100, 10, 2, 0) == e0  # same seed, same epoch: same order
    assert epoch_ids(100, 10, 2, 0, seed=1) != e0  # another seed: another order
    # The global batches do not depend on the world size: 2 ranks x 10 == 1 rank x 20, batch by batch.
    one = epoch_ids(100, 20, 1, 0)[0]
    assert [sorted(a + b) for a, b in zip(*e0)] == [sorted(b) for b in one]


def test_skip_first_batches_and_len():
    x, y = id_images(100)
    ld = DeviceLoader(x, y, 16, train=True, seed=3)
    ld.set_epoch(2)
    full = [b["labels"].tolist() for b in ld]
    assert len(ld) == len(full) == 7
    assert [b["labels"].tolist() for b in ld.skip_first_batches(3)] == full[3:]
    assert len(DeviceLoader(x, y, 16, train=True, drop_last=True)) == 6


def test_an_epoch_is_augmented_at_once_and_a_resumed_epoch_gives_its_batches(monkeypatch):
    """As airbench94 does, the whole train split is flipped and translated once per epoch (one gather on the
    device), and the batches are slices of it: one gather per epoch, not per batch. The epoch's augmentation is a
    function of (seed, epoch) alone, so a run resumed mid-epoch (skip_first_batches) gets exactly the batches,
    pixels and labels, of the uninterrupted one, on 1 and 2 ranks, whose global batches are the 1-rank ones."""
    x, y = tiny_arrays(100, 0)
    gathers, real = [], cifar_data.augment_gather
    monkeypatch.setattr(cifar_data, "augment_gather", lambda *a, **k: gathers.append(1) or real(*a, **k))

    def batches(rank=0, world=1, skip=0):
        ld = DeviceLoader(x, y, 16 // world, train=True, seed=3, rank=rank, world_size=world)
        ld.set_epoch(2)
        return [(b["images"], b["labels"]) for b in ld.skip_first_batches(skip)]

    whole = batches()
    assert len(gathers) == 1 and len(whole) == 7
    for world in (1, 2):
        ranks = [batches(rank, world) for rank in range(world)]
        for step, (images, labels) in enumerate(whole):  # the ranks' parts make the 1-rank global batch
            assert torch.equal(torch.cat([r[step][0] for r in ranks]), images)
            assert torch.equal(torch.cat([r[step][1] for r in ranks]), labels)
        for rank in range(world):
            resumed = batches(rank, world, skip=3)
            assert len(resumed) == 4
            for (a, la), (b, lb) in zip(resumed, ranks[rank][3:]):
                assert torch.equal(a, b) and torch.equal(la, lb)


def reference_view(img, flip, dy, dx, pad=2):
    """numpy: mirror (if flip), reflect-pad by `pad`, crop 32x32 at offset (pad + dy, pad + dx)."""
    img = img[:, ::-1] if flip else img
    padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
    return padded[pad + dy : pad + dy + 32, pad + dx : pad + dx + 32]


def test_augment_gather_matches_pad_crop_flip():
    x, _ = id_images(6)
    cases = [(False, 0, 0), (True, 0, 0), (False, 2, -1), (True, -2, 2), (True, 1, -2), (False, -1, 1)]
    flip = torch.tensor([c[0] for c in cases])
    dy, dx = torch.tensor([c[1] for c in cases]), torch.tensor([c[2] for c in cases])
    out = augment_gather(x, torch.arange(6), flip, dy, dx, pad=2).numpy()
    for i, (f, a, b) in enumerate(cases):
        np.testing.assert_array_equal(out[i], reference_view(x[i].numpy(), f, a, b))


def test_loader_batches_keep_labels_and_produce_expected_pixels():
    x, y = id_images(64)
    ld = DeviceLoader(x, y, 16, train=True, seed=0, flip="random", translate=2)
    ld.set_epoch(0)
    batch = next(iter(ld))
    images = batch["images"]
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    mean, std = torch.tensor(cifar_data.MEAN) * 255, torch.tensor(cifar_data.STD) * 255
    pixels = (images.permute(0, 2, 3, 1) * std + mean).round().to(torch.uint8).numpy()
    views = {(f, a, b) for f in (False, True) for a in range(-2, 3) for b in range(-2, 3)}
    used = set()
    for img, label in zip(pixels, batch["labels"].tolist()):
        # The image is a flip/translate of the source image its label names (labels are sample ids here).
        match = [v for v in views if np.array_equal(img, reference_view(x[label].numpy(), *v))]
        assert match, f"batch image with label {label} is no flip/translate of sample {label}"
        used.update(match)
    assert len({v[0] for v in used}) == 2  # both mirrored and plain views occur


def test_alternating_flip_mirrors_each_image_every_other_epoch():
    x, y = id_images(32)
    ld = DeviceLoader(x, y, 32, train=True, seed=0, flip="alternate", translate=0)
    views = []
    for epoch in (0, 1, 2):
        ld.set_epoch(epoch)
        b = next(iter(ld))
        pixels = (
            (b["images"].permute(0, 2, 3, 1) * torch.tensor(cifar_data.STD) * 255 + torch.tensor(cifar_data.MEAN) * 255)
            .round()
            .to(torch.uint8)
        )
        views.append({int(i): bool(torch.equal(p, x[i].flip(1))) for p, i in zip(pixels, b["labels"])})
    assert any(views[0].values()) and not all(views[0].values())
    assert all(views[1][i] != views[0][i] and views[2][i] == views[0][i] for i in range(32))


def test_eval_loader_is_unaugmented_and_sharded():
    x, y = id_images(60)
    parts = []
    for rank in range(2):
        ld = DeviceLoader(x, y, 10, train=False, rank=rank, world_size=2)
        for b in ld:
            for img, i in zip(b["images"], b["labels"].tolist()):
                torch.testing.assert_close(img, cifar_data.normalize(x[i : i + 1])[0])
            parts += b["labels"].tolist()
    assert sorted(parts) == list(range(60))


# ----------------------------------------------------------------------------------------------------------------
# Model and optimisation pieces


def test_whitening_layer_whitens_patches():
    x, _ = tiny_arrays(200, 3)
    images = cifar_data.normalize(torch.from_numpy(x))
    net = cifar.CifarNet(widths=(8, 16, 16))
    net.init_whitening(images, eps=0)
    with torch.no_grad():
        out = F.conv2d(images, net.whiten.weight[:12])  # the first (positive) half
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    cov = flat.T @ flat / len(flat)
    torch.testing.assert_close(cov, torch.eye(12), atol=2e-3, rtol=0)
    assert not net.whiten.weight.requires_grad
    assert net(images[:4].contiguous(memory_format=torch.channels_last)).shape == (4, 10)


def smooth_images(n: int, seed: int) -> np.ndarray:
    """uint8 NHWC images whose neighbouring pixels and colours are as correlated as photographs' (a low-resolution
    random field, upsampled, tinted, plus a little noise): the 2x2 patch covariance then has CIFAR's spread of
    eigenvalues, which the tiny noisy images lack."""
    g = torch.Generator().manual_seed(seed)
    field = F.interpolate(torch.rand(n, 1, 6, 6, generator=g), size=32, mode="bicubic", align_corners=False)
    tint = torch.rand(n, 3, 1, 1, generator=g) * 0.3 + 0.7
    images = field * tint * 255 + torch.randn(n, 3, 32, 32, generator=g) * 2
    return images.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_the_whitening_conv_computes_in_fp32_under_autocast():
    """Each whitened channel of a bf16-autocast forward within 1% (relative, over the batch) of the fp32 one. In
    bf16 the smallest-variance directions, whose filters are the largest (1 / sqrt(eigenvalue)) and whose outputs
    the smallest, lost up to 6% here and 10.6% on CIFAR-10 itself (docs/cifar.md); airbench keeps that layer's
    precision (its fp16 loses at most 1.3% on CIFAR-10)."""
    images = cifar_data.normalize(torch.from_numpy(smooth_images(64, 0))).contiguous(memory_format=torch.channels_last)
    net = cifar.CifarNet(widths=(8, 16, 16))
    net.init_whitening(images)
    with torch.no_grad():
        net.whiten.bias.normal_(0, 0.01)  # trained: the bias moves
    seen = []
    net.whiten.register_forward_hook(lambda module, inputs, out: seen.append(out.detach().float()))
    with torch.no_grad():
        net(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = net(images)
    exact, mixed = seen
    error = torch.linalg.vector_norm(mixed - exact, dim=(0, 2, 3)) / torch.linalg.vector_norm(exact, dim=(0, 2, 3))
    assert error.max() < 0.01, error
    assert logits.dtype == torch.bfloat16  # the rest of the net still computes in bf16


def test_lr_units_and_schedule():
    from accel_trainer import RecipeContext, TrainingArguments

    net = cifar.CifarNet(widths=(8, 16, 16))
    targs = TrainingArguments(per_device_train_batch_size=512, learning_rate=11.5, weight_decay=0.0153)
    ctx = RecipeContext(args=cifar.Args(), targs=targs, world_size=2)  # global batch 1024
    opt = cifar.build_optimizer(net, ctx)
    # airbench94: lr 11.5 per 1024 examples with a summed loss == torch lr 1.5 on our mean loss at batch 1024.
    assert opt.param_groups[0]["lr"] == pytest.approx(11.5 / (1 + 1 / 0.15), rel=1e-6)
    assert opt.param_groups[1]["lr"] == pytest.approx(64 * opt.param_groups[0]["lr"])
    # per-step decay lr * wd is airbench's (0.0153 * 1024 / (1024 * (1 + 1/0.15))) for every group
    for g in opt.param_groups:
        assert g["lr"] * g["weight_decay"] == pytest.approx(0.0153 / (1 + 1 / 0.15), rel=1e-6)
    sched = cifar.build_scheduler(opt, ctx.replace(num_training_steps=100))
    factors = []
    for _ in range(100):
        factors.append([g["lr"] / g["initial_lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert factors[0][0] == pytest.approx(0.2) and factors[23][0] == pytest.approx(1.0)
    assert factors[99][0] == pytest.approx(1 + (0.07 - 1) * 76 / 77)
    assert factors[29][2] > 0 and factors[30][2] == 0  # whitening bias frozen after 30%


def test_muon_steps_as_airbench94_muon_does():
    """The recipe's Muon against airbench94_muon's update written out per tensor: Nesterov momentum, the filter
    rescaled to norm sqrt(its first dimension), a step of lr along the Newton-Schulz orthogonalized update (in bf16);
    and the other groups as torch's fused SGD takes them. Bit for bit over 4 steps of fixed gradients."""
    import copy

    from cifar_muon import Muon, newton_schulz

    torch.manual_seed(0)
    net = cifar.CifarNet(widths=(4, 8, 8), variant="airbench94_muon")
    ref = copy.deepcopy(net)
    filters = lambda m: [p for p in m.parameters() if p.ndim == 4 and p.requires_grad]  # noqa: E731
    rest = lambda m: [p for p in m.parameters() if p.ndim < 4 and p.requires_grad]  # noqa: E731
    opt = Muon([{"params": filters(net), "muon": True}, {"params": rest(net), "lr": 0.1, "momentum": 0.85,
                "weight_decay": 0.01}], lr=0.24, momentum=0.6, fused=True)  # fmt: skip
    sgd = torch.optim.SGD(rest(ref), lr=0.1, momentum=0.85, nesterov=True, weight_decay=0.01, fused=True)
    buffers = [torch.zeros_like(p) for p in filters(ref)]
    for step in range(4):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 100 + i))
                 for i, p in enumerate(net.parameters())]  # fmt: skip
        for model in (net, ref):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone() if p.requires_grad else None
        opt.step()
        sgd.step()
        with torch.no_grad():
            for p, buffer in zip(filters(ref), buffers):
                buffer.mul_(0.6).add_(p.grad)
                update = p.grad.add(buffer, alpha=0.6)
                p.mul_(len(p) ** 0.5 / p.norm())
                p.add_(newton_schulz(update.reshape(len(update), -1)).reshape(update.shape), alpha=-0.24)
    for (name, a), b in zip(net.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    # Newton-Schulz: singular values near 1 (airbench's ~ Uniform(0.5, 1.5)), whatever the gradient's scale
    g = torch.randn(16, 72, generator=torch.Generator().manual_seed(0))
    for scale in (1e-4, 1.0, 1e4):
        sv = torch.linalg.svdvals(newton_schulz(g * scale).float())
        assert 0.4 < sv.min() and sv.max() < 1.6, sv


def test_muon_preset_units_and_schedule():
    """--preset muon: airbench94_muon's numbers on our mean loss over the global batch B: SGD's lr x B and a per-step
    weight decay of 2e-6 x B; Muon at 0.24; the lr decays linearly from 1 to 0 (1 - step / total), the whitening
    bias's from 1 to 0 at 3/8 of the run, then stays 0."""
    from accel_trainer import resolve_args

    targs, args, _ = resolve_args(cifar, ["--preset", "muon", "--mixed_precision", "no"], world_size=1)
    assert (args.optimizer, args.lookahead, args.widths, args.batch_size) == ("muon", False, "64,256,256", 2000)
    assert (targs.learning_rate, targs.weight_decay, targs.num_train_epochs) == (0.24, 2e-6, 8)
    net = cifar.CifarNet(widths=(8, 16, 16), variant="airbench94_muon")
    assert net.scale == 1 / 16 and net.head.weight.std().item() == pytest.approx(1.0)
    ctx = cifar_ctx(args, targs, 2000)
    opt = cifar.build_optimizer(net, ctx)
    assert [g["muon"] for g in opt.param_groups] == [True, False, False, False]
    assert opt.param_groups[0]["lr"] == 0.24 and opt.param_groups[0]["momentum"] == 0.6
    for g, lr in zip(opt.param_groups[1:], (0.053, 0.053, 0.67)):
        assert g["lr"] == pytest.approx(lr * 2000) and g["momentum"] == 0.85 and opt.fused
        assert g["lr"] * g["weight_decay"] == pytest.approx(2e-6 * 2000)  # per step, as airbench94_muon's wd
    sched = cifar.build_scheduler(opt, ctx.replace(num_training_steps=200))
    factors = []
    for _ in range(200):
        factors.append([g["lr"] / g["initial_lr"] for g in opt.param_groups])
        opt.step()  # no gradients: nothing moves
        sched.step()
    for step in (0, 1, 100, 199):
        assert factors[step][0] == factors[step][1] == factors[step][3] == pytest.approx(1 - step / 200)
    assert factors[50][2] == pytest.approx(1 - 50 / 75) and factors[75][2] == factors[150][2] == 0
    # Under FSDP a rank holds a shard of each filter's update, which Muon orthogonalizes whole: refused in one line
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from accel_trainer import UserError

    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, device=torch.device("cpu"))
    with pytest.raises(UserError, match="under FSDP a process holds a shard"):
        cifar.build_optimizer(net, ctx.replace(accelerator=fsdp))


def cifar_ctx(args, targs, batch):
    from accel_trainer import RecipeContext

    targs.per_device_train_batch_size = batch
    return RecipeContext(args=args, targs=targs, world_size=1)


def test_presets_fill_unset_knobs_and_split_global_batches(monkeypatch):
    from accel_trainer import UserError, resolve_args

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    targs, args, _ = resolve_args(cifar, ["--preset", "small"], world_size=2)
    small = cifar.PRESETS["small"]
    assert args.widths == small["widths"] and targs.num_train_epochs == small["num_train_epochs"]
    assert targs.per_device_train_batch_size == small["batch_size"] // 2  # global batch split over 2
    assert targs.per_device_eval_batch_size == small["eval_batch_size"] // 2
    assert targs.max_grad_norm == 0 and targs.learning_rate == 11.5  # the recipe's defaults
    argv = "--preset small --widths 8,8,8 --num_train_epochs 3 --batch_size 64 --mixed_precision no".split()
    targs, args, _ = resolve_args(cifar, argv, world_size=2)
    assert (args.widths, targs.num_train_epochs, targs.per_device_train_batch_size) == ("8,8,8", 3, 32)
    assert targs.mixed_precision == "no"
    # A flag equal to the recipe's default is still the user's choice: the preset must not replace it.
    argv = ["--preset", "small", "--num_train_epochs", str(cifar.defaults["num_train_epochs"])]
    targs, args, given = resolve_args(cifar, argv, world_size=2)
    assert "num_train_epochs" in given and "learning_rate" not in given
    assert targs.num_train_epochs == cifar.defaults["num_train_epochs"] != small["num_train_epochs"]
    # The same from Python: the keyword is the user's, as the flag was.
    targs, _, _ = resolve_args(cifar, values={"preset": "small", "num_train_epochs": 9.9}, world_size=2)
    assert targs.num_train_epochs == 9.9
    with pytest.raises(UserError, match="split evenly over 2 processes"):
        resolve_args(cifar, ["--batch_size", "1001"], world_size=2)
    # A log row is a host read: every 50 updates in the GPU presets, every 10 on the CPU; a flag wins.
    for argv, every in ((["--preset", "default"], 50), (["--preset", "muon"], 50), (["--preset", "small"], 10),
                        (["--preset", "muon", "--logging_steps", "3"], 3)):  # fmt: skip
        assert resolve_args(cifar, argv, world_size=1).targs.logging_steps == every, argv


def test_an_empty_share_of_the_last_batch_gives_a_zero_weight_loss_not_nan():
    # 5 images in global batches of 2 x 2: the last global batch has one image, so rank 1's share is empty
    # (as 1025 images on 2 x 512). Its loss used to be the mean of nothing (NaN), which stopped the run.
    x, y = tiny_arrays(5, 0)
    last = list(DeviceLoader(x, y, 2, train=True, rank=1, world_size=2))[-1]
    assert len(last["labels"]) == 0
    net = cifar.CifarNet(widths=(4, 8, 8))
    value, n = cifar.loss(net, last)
    assert n == 0 and torch.isfinite(value)
    (value * n).backward()  # what the Trainer back-propagates: weight 0
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)
    out = cifar.eval_step(net.eval(), last)
    assert out["loss"].numel() == 0 and out["n_items"].numel() == 0


def _train_mode_steps(net, opt, steps, after_step=None):
    """`steps` train-mode steps of `net` on fixed inputs (the BatchNorm statistics move too), `after_step(n)` after
    each optimizer step."""
    for n in range(1, steps + 1):
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(n))  # this step's batch
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(n)


def test_lookahead_follows_airbench94s_schedule():
    """The recipe's LookaheadSGD against airbench94's own loop around torch's SGD: LookaheadState(net) before
    training (the average starts from the net as built), every 5 steps from the start `ema.lerp_(net, 1 - decay)`
    and `net.copy_(ema)` over the floating state-dict entries with decay 0.95**5 * (step / total)**3, and at the
    last step decay 1.0 (the net set to the average). Bit for bit, 12 steps: pulls at 5 and 10, the last at 12."""
    import copy

    torch.manual_seed(0)
    net = cifar.CifarNet(widths=(4, 8, 8))
    ref = copy.deepcopy(net)
    total = 12
    groups = lambda m: [{"params": [p for p in m.parameters() if p.requires_grad]}]  # noqa: E731
    opt = cifar.LookaheadSGD(groups(net), net, lr=0.05, momentum=0.8)
    opt.total_steps = total
    sgd = torch.optim.SGD(groups(ref), lr=0.05, momentum=0.8, nesterov=True)
    ema = {k: v.clone() for k, v in ref.state_dict().items()}  # airbench94's LookaheadState(model)
    alpha = 0.95**5 * (torch.arange(total + 1) / total) ** 3

    def lookahead(decay):
        for avg, cur in zip(ema.values(), ref.state_dict().values()):
            if cur.is_floating_point():
                avg.lerp_(cur, 1 - decay)
                cur.copy_(avg)

    def airbench(step):
        if step % 5 == 0:
            lookahead(alpha[step].item())
        if step == total:
            lookahead(1.0)

    _train_mode_steps(ref, sgd, total, airbench)
    _train_mode_steps(net, opt, total)
    assert opt.step_count == total
    for k, v in ref.state_dict().items():
        assert torch.equal(net.state_dict()[k], v), k
    # The last step set the net to the average: every float tensor of the net equals its average.
    averages, current = opt._pairs()
    assert len(averages) == 2 * 6 + sum(p.requires_grad for p in net.parameters())  # BN statistics, weights
    for avg, cur in zip(averages, current):
        assert torch.equal(avg, cur)


def test_sgd_is_fused_and_an_update_the_scaler_skips_changes_nothing():
    """The recipe's SGD is torch's fused one where torch has it (the CPU and CUDA: one kernel for an update's
    parameters). A fused step can be skipped on the device (GradScaler's found_inf, the Trainer's --nan_policy
    skip), but the lookahead's count and pull would still run on the host: the optimizer asks to be skipped from
    the host, so a skipped update changes nothing, the lookahead's count included."""
    from accel_trainer import RecipeContext, TrainingArguments

    net = cifar.CifarNet(widths=(4, 8, 8))
    ctx = RecipeContext(args=cifar.Args(), targs=TrainingArguments(per_device_train_batch_size=64), world_size=1)
    opt = cifar.build_optimizer(net, ctx)
    assert opt.fused is True  # set in the param groups during a step only: a checkpoint's are the same on any launch
    assert [g["fused"] for g in opt.param_groups] == [None] * 3
    opt.total_steps = 1  # the first step would pull
    before = {k: v.clone() for k, v in net.named_parameters()}
    scaler = torch.amp.GradScaler("cpu")
    net(torch.randn(2, 3, 32, 32)).sum().mul(float("inf")).backward()
    scaler.scale(torch.ones(()))  # the scaler's scale, as a scaled backward makes it
    scaler.step(opt)  # found the gradients not finite: skipped
    assert opt.step_count == 0
    assert all(torch.equal(v, dict(net.named_parameters())[k]) for k, v in before.items())


def _lookahead_run(net, steps, total=8, state=None):
    """LookaheadSGD over all of `net`'s trainable parameters for `steps` train-mode steps on fixed inputs (pulls at
    2, 4, 6 and 8), optionally starting from a saved `state` (a callable that loads into the new optimizer).
    Returns the optimizer."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = cifar.LookaheadSGD([{"params": params}], net, lr=0.05, momentum=0.8, every=2)
    opt.total_steps = total
    if state is not None:
        state(opt)
    for _ in range(steps):
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(opt.step_count))  # this step's batch
        net(x).square().mean().backward()  # train mode: the BatchNorm statistics move too
        opt.step()
        opt.zero_grad()
    return opt


def _earlier_format(opt, net) -> dict:
    """opt.state_dict() as LookaheadSGD wrote it before its state moved into the param groups: a top-level
    "lookahead" key with the step count and one average per floating state-dict entry of the net, in order."""
    sd = opt.state_dict()
    la = sd["param_groups"][0]["lookahead"]
    sd["param_groups"] = [{k: v for k, v in g.items() if k != "lookahead"} for g in sd["param_groups"]]
    sd["state"] = {i: {k: v for k, v in s.items() if k != "lookahead_ema"} for i, s in sd["state"].items()}
    averaged, named = {id(p): opt.state[p]["lookahead_ema"] for p in opt._params()}, dict(net.named_parameters())
    floats = {k: v for k, v in net.state_dict().items() if v.is_floating_point()}
    ema = [averaged.get(id(named[k]), v) if k in named else la["buffers"][k] for k, v in floats.items()]
    return sd | {"lookahead": {"step_count": la["step"], "ema": ema}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on this one process, no group: intended
@pytest.mark.parametrize("how", ["torch.save", "dcp", "earlier format"])
def test_lookahead_state_survives_a_checkpoint(how, tmp_path):
    """Save after 5 steps (pulled at 2 and 4), load into a new net and optimizer, go on to 8:
    bit-identical to 8 steps without a break. torch.save is what Accelerate writes without FSDP; DCP with torch's
    get_/set_optimizer_state_dict is how it saves and loads an FSDP optimizer (and load_resharded on 1 process):
    that kept only "state" and "param_groups" and dropped the lookahead's step count and averages. A checkpoint
    of the earlier format (torch.save) still loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def new_net():
        torch.manual_seed(0)
        return cifar.CifarNet(widths=(4, 8, 8))

    whole = new_net()
    _lookahead_run(whole, 8)
    net = new_net()
    opt = _lookahead_run(net, 5)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    resumed = new_net()
    resumed.load_state_dict(weights)
    if how == "dcp":
        dcp.save({"optimizer": get_optimizer_state_dict(net, opt)}, checkpoint_id=str(tmp_path / "optimizer_0"))

        def load(new_opt):
            state = {"optimizer": get_optimizer_state_dict(resumed, new_opt)}  # a template: DCP loads into it
            dcp.load(state, checkpoint_id=str(tmp_path / "optimizer_0"))
            set_optimizer_state_dict(resumed, new_opt, state["optimizer"])
    else:
        torch.save(opt.state_dict() if how == "torch.save" else _earlier_format(opt, net), tmp_path / "optimizer.bin")

        def load(new_opt):
            new_opt.load_state_dict(torch.load(tmp_path / "optimizer.bin", weights_only=True))

    opt = _lookahead_run(resumed, 3, state=load)
    assert opt.step_count == 8
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), f"{k}: not bit-identical to the run without a break"


# ----------------------------------------------------------------------------------------------------------------
# End to end, as users run it


def run_recipe(args, nproc=1, timeout=240):
    env = child_env()  # this checkout's accel_trainer first (not an installed copy), offline, 1 thread
    return subprocess.run(
        launch_cmd(nproc) + [os.path.join(ROOT, "recipes", "cifar.py")] + [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def tiny_run_args(tiny, out, epochs=4):
    return [
        "--dataset",
        tiny["hub"],
        "--cache_dir",
        str(tiny["root"] / "cache"),
        "--output_dir",
        out,
        "--preset",
        "small",
        "--widths",
        "8,16,16",
        "--batch_size",
        40,
        "--eval_batch_size",
        30,
        "--num_train_epochs",
        epochs,
        "--logging_steps",
        1,
        "--disable_tqdm",
        "--mixed_precision",
        "no",
    ]


def read_run(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        events = [json.loads(line) for line in f]
    with open(os.path.join(out, "run_config.json")) as f:
        config = json.load(f)
    return events, config


def assert_trained(out):
    events, config = read_run(out)
    losses = [e["loss"] for e in events if "loss" in e]
    assert len(losses) >= 8
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses  # loss falls
    final = [e for e in events if "eval_tta_accuracy" in e]
    assert final and 0 <= final[-1]["eval_accuracy"] <= 1 and 0 <= final[-1]["eval_tta_accuracy"] <= 1
    assert os.path.getsize(os.path.join(out, "model.safetensors")) > 0
    return events, config


@pytest.mark.slow
def test_end_to_end_one_process(tiny, tmp_path):
    out = str(tmp_path / "out1")
    proc = run_recipe(tiny_run_args(tiny, out))
    assert proc.returncode == 0, proc.stderr[-5000:]
    events, config = assert_trained(out)
    assert config["num_processes"] == 1 and config["global_train_batch_size"] == 40
    from safetensors.torch import load_file

    assert "whiten.weight" in load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.slow
def test_end_to_end_two_processes(tiny, tmp_path):
    out = str(tmp_path / "out2")
    proc = run_recipe(tiny_run_args(tiny, out), nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    events, config = assert_trained(out)
    assert config["num_processes"] == 2  # a real world of 2, not 2 worlds of 1
    assert config["global_train_batch_size"] == 40  # --batch_size is global: 20 per process


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["small", "muon"])
def test_a_run_resumed_mid_epoch_ends_with_the_uninterrupted_runs_weights(tiny, tmp_path, preset):
    """Through the Trainer's checkpoints (JSON and safetensors), in fp32: a run resumed from its checkpoint of update
    3 (mid-epoch: 6 updates an epoch) ends with the uninterrupted run's model.safetensors, byte for byte. It holds
    what the recipe keeps between updates: the lookahead's count and averages (small: airbench94's SGD), Muon's and
    SGD's momentum (muon), and the loader's position in an epoch augmented at once."""
    import shutil

    runs = {k: str(tmp_path / k) for k in ("whole", "resumed")}
    args = tiny_run_args(tiny, runs["whole"], epochs=2) + ["--preset", preset, "--save_steps", 3]
    proc = run_recipe(args)
    assert proc.returncode == 0, proc.stderr[-5000:]
    step_3 = os.path.join("checkpoints", "step_3")
    shutil.copytree(os.path.join(runs["whole"], step_3), os.path.join(runs["resumed"], step_3))
    args[args.index("--output_dir") + 1] = runs["resumed"]
    proc = run_recipe(args + ["--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert f"Resumed from {runs['resumed']}/checkpoints/step_3 at step 3" in proc.stdout + proc.stderr
    whole, resumed = (open(os.path.join(runs[k], "model.safetensors"), "rb").read() for k in runs)
    assert whole == resumed
    config = read_run(runs["whole"])[1]
    assert config["recipe_args"]["optimizer"] == ("muon" if preset == "muon" else "sgd")


@pytest.mark.slow
def test_missing_dataset_exits_nonzero_with_both_ways(tmp_path):
    proc = run_recipe(
        [
            "--dataset",
            str(tmp_path / "no_such_folder"),
            "--cache_dir",
            str(tmp_path / "cache"),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        timeout=120,
    )
    assert proc.returncode != 0
    assert "uoft-cs/cifar10" in proc.stderr and "cifar-10-batches-py" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_prints_accuracy_time_and_memory(tiny, tmp_path):
    args = tiny_run_args(tiny, "unused")
    args = args[: args.index("--output_dir")] + args[args.index("--output_dir") + 2 :]  # the bench sets it per seed
    env = child_env()
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "cifar.py"),
            "--seeds",
            "2",
            "--target",
            "0.05",
            "--out",
            str(tmp_path / "bench"),
        ]
        + [str(a) for a in args]
        + ["--num_train_epochs", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    for line in ("seed 0: acc", "seed 1: acc", "time to 5.00%", "images/s", "peak memory MB", "process_s"):
        assert line in proc.stdout, proc.stdout
    with open(tmp_path / "bench" / "summary.json") as f:
        summary = json.load(f)
    assert len(summary["runs"]) == 2 and all(
        r["train_s"] > 0 and r["time_to_target_s"] is not None and r["peak_memory_mb"] > 50 for r in summary["runs"]
    )


# ----------------------------------------------------------------------------------------------------------------
# The GPU run's shapes and syncs (issue 29)


def test_every_train_batch_is_full_and_the_run_is_airbenchs_476_updates(tmp_path):
    # 50000 train images in batches of 1024: 48 full batches and 848 left over. Kept, the short batch was a second
    # shape (a recompile, a second cuDNN autotune), 486 updates instead of airbench's ceil(9.9 * 48) = 476, and an
    # update with the full batch's learning rate on 848 images.
    from accel_trainer import Trainer

    train = (np.zeros((50000, 32, 32, 3), np.uint8), np.arange(50000, dtype=np.int64) % 10)
    test = (np.zeros((100, 32, 32, 3), np.uint8), np.arange(100, dtype=np.int64) % 10)
    folder = write_pickle_folder(str(tmp_path / "data"), train, test)
    t = Trainer.from_recipe(cifar, dataset=folder, cache_dir=str(tmp_path / "cache"), output_dir=str(tmp_path / "o"),
                            use_cpu=True, mixed_precision="no", quiet=True, disable_tqdm=True)  # fmt: skip
    assert t.args.num_train_epochs == 9.9 and t.args.per_device_train_batch_size == 1024  # the default preset
    assert len(t.train_loader) == 50000 // 1024 == 48
    assert t.total_steps == int(np.ceil(9.9 * 48)) == 476
    assert t.recipe.build_scheduler and t.optimizer.optimizer.total_steps == 476  # the lr triangle spans 476 updates
    for epoch in (0, 1):
        t.train_loader.set_epoch(epoch)
        sizes = {len(batch["labels"]) for batch in t.train_loader}
        assert sizes == {1024}, sizes
    # --dataloader_drop_last false keeps the short batch, for who wants every image in every epoch
    t = Trainer.from_recipe(cifar, dataset=folder, cache_dir=str(tmp_path / "cache"), output_dir=str(tmp_path / "o2"),
                            use_cpu=True, mixed_precision="no", quiet=True, disable_tqdm=True,
                            dataloader_drop_last=False)  # fmt: skip
    assert len(t.train_loader) == 49 and t.total_steps == 486


def test_normalization_constants_are_built_once_per_loader(monkeypatch):
    # torch.tensor(MEAN, device=cuda) per batch was two blocking host-to-device copies per training step.
    x, y = tiny_arrays(64, 0)
    built = []
    real = torch.tensor

    def counting(*args, **kwargs):
        built.append(args[0] if args else None)
        return real(*args, **kwargs)

    loader = DeviceLoader(x, y, 8, train=True)
    monkeypatch.setattr(torch, "tensor", counting)
    batches = list(loader) + list(DeviceLoader(x, y, 8, train=False))
    assert len(batches) == 16
    assert built.count(cifar_data.MEAN) <= 1 and built.count(cifar_data.STD) <= 1, built  # the eval loader's, once
    monkeypatch.setattr(torch, "tensor", real)
    expected = (torch.from_numpy(x[:8]).float() - torch.tensor(cifar_data.MEAN) * 255) / (
        torch.tensor(cifar_data.STD) * 255
    )
    first = list(DeviceLoader(x, y, 8, train=False))[0]["images"]
    torch.testing.assert_close(first, expected.permute(0, 3, 1, 2))


@pytest.mark.parametrize(
    "device, flag, expected", [("cuda", None, True), ("cuda", "false", False), ("cpu", None, False)]
)
def test_cudnn_benchmark_on_a_cuda_gpu(tiny, tmp_path, monkeypatch, device, flag, expected):
    # airbench sets torch.backends.cudnn.benchmark: the recipe's shapes are fixed, so cuDNN's timed choice of conv
    # algorithms is made once per shape. The recipe sets it where it means something (a CUDA device), unless told not.
    import contextlib
    from types import SimpleNamespace

    from accel_trainer import resolve_args

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    # the whitening images stay on the CPU: this machine's torch may have no CUDA
    on_the_cpu = cifar._whitening_images
    monkeypatch.setattr(cifar, "_whitening_images", lambda images, device: on_the_cpu(images, "cpu"))
    argv = ["--dataset", tiny["pickle"], "--cache_dir", str(tmp_path), "--widths", "8,8,8"]
    _, args, _ = resolve_args(cifar, argv + (["--cudnn_benchmark", flag] if flag else []))
    accelerator = SimpleNamespace(device=torch.device(device), main_process_first=contextlib.nullcontext)
    cifar.build_model(SimpleNamespace(args=args, accelerator=accelerator))
    assert torch.backends.cudnn.benchmark is expected
