"""CIFAR-10 data for recipes/cifar.py: load once into uint8 arrays, then serve batches from the device.

Two pieces, both usable on their own:

* `load_cifar10(source, cache_dir)` -> {"train": (images, labels), "test": (images, labels)}, images uint8
  [N, 32, 32, 3] (HWC, like the original arrays), labels int64 [N]. `source` is a Hub id (`uoft-cs/cifar10`,
  needs the network once), a local folder in the same Hub layout (parquet with PNG images), or the original
  `cifar-10-batches-py` pickle folder. Decoding 60k PNGs takes seconds, so the arrays are cached as .npy under
  `cache_dir` and the second start skips `datasets` entirely.

* `DeviceLoader`: the whole split lives on the device as uint8; at each epoch's start this rank's share of it is
  shuffled, flipped and translated with one gather on the device (as airbench94 augments the whole train set per
  epoch), and each batch is a slice of that, normalized. No per-sample Python, no worker processes. Under N
  processes every rank takes its own slice of each global batch, so every sample is seen exactly once per epoch
  across ranks, and the order (and the augmentation) depends only on (seed, epoch): the same seed gives the same
  global batches on any number of processes. Implements the Trainer's "batch loader" protocol
  (docs/architecture.md).
"""

import hashlib
import io
import itertools
import os
import pickle

import numpy as np
import torch

from accel_trainer.errors import need
from accel_trainer.kit.hub import is_local_path

DEFAULT_DATASET = "uoft-cs/cifar10"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# Per-channel statistics of the train split on a 0-1 scale (the usual CIFAR-10 numbers).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
SPLITS = ("train", "test")


class CifarDataError(FileNotFoundError):
    """No CIFAR-10 data could be found at the given source."""


def _how_to_supply(source):
    return (
        f"Could not load CIFAR-10 from {source!r}.\n"
        "Supply the data in one of two ways:\n"
        f"  1. a Hub dataset id, with network access to the Hugging Face Hub: --dataset {DEFAULT_DATASET}\n"
        "  2. a local folder: either a copy in the Hub layout (plain_text/train-*.parquet, test-*.parquet;\n"
        "     e.g. --dataset ../shared/data/cifar10), or the original pickle folder from\n"
        "     https://www.cs.toronto.edu/~kriz/cifar.html (--dataset /path/to/cifar-10-batches-py)."
    )


# ----------------------------------------------------------------------------------------------------------------
# Loading: three layouts, one result


def _pickle_dir(path):
    """The `cifar-10-batches-py` folder at or directly under `path`, or None."""
    for d in (path, os.path.join(path, "cifar-10-batches-py")):
        if os.path.isfile(os.path.join(d, "data_batch_1")) and os.path.isfile(os.path.join(d, "test_batch")):
            return d
    return None


def _numpy_globals():
    """What the original CIFAR-10 pickles (and a Python 3 / NumPy 2 re-pickle of them) name: an array's
    reconstructor, its class and its dtype, and `_codecs.encode` (how protocols 0-2 spell bytes in Python 3: str to
    bytes, nothing more). Compared by identity after resolution, so no other object passes under these names."""
    import _codecs

    from numpy._core import multiarray, numeric

    return {multiarray._reconstruct, np.ndarray, np.dtype, numeric._frombuffer, _codecs.encode}


class _ArraysOnly(pickle.Unpickler):
    """The data files are pickles: unpickled with an allow-list of NumPy's array globals, so that a file crafted
    to run code (a `__reduce__` naming `os.system`) is refused instead of run. Nothing read from a data file runs."""

    NAMES = {  # checked before anything is imported: naming a module in a pickle must not import it
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) in self.NAMES:
            obj = super().find_class(module, name)
            if any(obj is allowed for allowed in _numpy_globals()):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not a NumPy array global; refused, not run")


def _load_pickle_dir(d):
    def read(name):
        path = os.path.join(d, name)
        try:
            with open(path, "rb") as f:
                batch = _ArraysOnly(f, encoding="bytes").load()
            if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
                raise ValueError("not a dict with b'data' and b'labels'")
        except (pickle.UnpicklingError, ValueError, EOFError) as e:
            raise CifarDataError(f"{path} is not a CIFAR-10 batch file ({e}); it was not run.") from None
        # Rows are 3072 bytes: the red plane, then green, then blue (CHW); we keep HWC like the Hub images.
        images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return images, np.asarray(batch[b"labels"], dtype=np.int64)

    train = [read(f"data_batch_{i}") for i in range(1, 6)]
    return {
        "train": (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])),
        "test": read("test_batch"),
    }


def _columns(features):
    """(image column, label column) of a CIFAR-like `datasets` split: `img`/`label` on uoft-cs/cifar10."""
    import datasets

    image_cols = [k for k, v in features.items() if isinstance(v, datasets.Image)]
    label_cols = [k for k, v in features.items() if isinstance(v, datasets.ClassLabel)] or [
        k for k in features if k in ("label", "labels", "fine_label")
    ]
    if not image_cols or not label_cols:
        raise CifarDataError(f"expected an image column and a label column, got features {dict(features)}")
    return image_cols[0], label_cols[0]


def _decode_split(ds):
    import datasets

    Image = need("PIL.Image", "cifar", "recipes/cifar_data.py (decoding CIFAR images)", "Pillow")

    img_col, label_col = _columns(ds.features)
    # Decode ourselves from the raw PNG bytes: one pass, no PIL objects kept around.
    raw = ds.cast_column(img_col, datasets.Image(decode=False)).with_format("arrow")[:]
    images = np.stack(
        [np.asarray(Image.open(io.BytesIO(x["bytes"])).convert("RGB")) for x in raw.column(img_col).to_pylist()]
    )
    labels = raw.column(label_col).to_numpy().astype(np.int64)
    if images.shape[1:] != (32, 32, 3):
        raise CifarDataError(f"expected 32x32 RGB images, got {images.shape[1:]}")
    return images, labels


def _load_hub_layout(source):
    import datasets

    try:
        dsd = datasets.load_dataset(source)
    except Exception as e:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
        raise CifarDataError(_how_to_supply(source) + f"\n(datasets said: {type(e).__name__}: {e})") from e
    missing = [s for s in SPLITS if s not in dsd]
    if missing:
        raise CifarDataError(f"{source!r} has splits {list(dsd)}, missing {missing}")
    return {s: _decode_split(dsd[s]) for s in SPLITS}


def _cache_key(source):
    """Changes when the source changes: the Hub id, or the local folder's files (names, sizes, mtimes)."""
    h = hashlib.sha256()
    if is_local_path(source):
        root = os.path.abspath(os.path.expanduser(source))
        h.update(root.encode())
        for dirpath, _, files in sorted(os.walk(root)):
            for f in sorted(files):
                st = os.stat(os.path.join(dirpath, f))
                h.update(f"{os.path.relpath(os.path.join(dirpath, f), root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        h.update(source.encode())
    name = os.path.basename(os.path.normpath(source)) or "cifar10"
    return f"{name}-{h.hexdigest()[:12]}"


def default_cache_dir():
    base = os.environ.get("ACCEL_TRAINER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "accel-trainer"
    )
    return os.path.join(base, "cifar10")


def _save_atomic(path, array):
    # Several processes may decode at once on the first start: write aside, then rename (atomic on POSIX).
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def load_cifar10(source=DEFAULT_DATASET, cache_dir=None, use_cache=True):
    """{"train": (uint8 [50000,32,32,3], int64 [50000]), "test": (...)} from a Hub id, Hub-layout or pickle folder."""
    if is_local_path(source):
        path = os.path.expanduser(source)
        if not os.path.isdir(path):
            raise CifarDataError(_how_to_supply(source) + f"\n({path!r} is not a folder.)")
    cache = os.path.join(cache_dir or default_cache_dir(), _cache_key(source)) if use_cache else None
    files = (
        {s: (os.path.join(cache, f"{s}_images.npy"), os.path.join(cache, f"{s}_labels.npy")) for s in SPLITS}
        if cache
        else {}
    )
    if cache and all(os.path.exists(p) for pair in files.values() for p in pair):
        return {s: (np.load(xi), np.load(yi)) for s, (xi, yi) in files.items()}

    pickles = _pickle_dir(os.path.expanduser(source)) if is_local_path(source) else None
    data = _load_pickle_dir(pickles) if pickles else _load_hub_layout(source)
    if cache:
        os.makedirs(cache, exist_ok=True)
        for s, (xi, yi) in files.items():
            _save_atomic(xi, data[s][0])
            _save_atomic(yi, data[s][1])
    return data


# ----------------------------------------------------------------------------------------------------------------
# Augmentation: flip + translate as one gather


def augment_gather(images, index, flip, dy, dx, pad):
    """out[n] = translate(flip(images[index[n]])), for uint8 NHWC images, all on images' device.

    `flip` (bool [B]) mirrors left-right; `dy`, `dx` (int [B], in [-pad, pad]) shift the content: output pixel
    (i, j) reads source pixel (i + dy, j + dx) of the (flipped) image, with reflect padding at the borders
    (what `F.pad(x, (pad,)*4, mode="reflect")` then a crop at offset (pad + dy, pad + dx) gives).
    """
    size = images.shape[1]
    ar = torch.arange(size, device=images.device)

    def reflect(i):  # reflect-pad index: -1 -> 1, size -> size - 2
        i = i.abs()
        return torch.where(i >= size, 2 * (size - 1) - i, i)

    rows = reflect(ar[None, :] + dy[:, None])  # [B, H]
    cols = reflect(ar[None, :] + dx[:, None])  # [B, W], in flipped coords
    cols = torch.where(flip[:, None], size - 1 - cols, cols)  # back to source coords
    del pad  # the range of dy/dx is the caller's business; kept in the signature for readability
    return images[index[:, None, None], rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]


def normalization(device, dtype=torch.float32):
    """(mean, std) on the 0-255 scale as tensors on `device`. Built once per loader: torch.tensor(MEAN, device=cuda)
    is a copy from host memory that blocks the host, twice per batch when it was built in normalize()."""
    return torch.tensor(MEAN, dtype=dtype).mul(255).to(device), torch.tensor(STD, dtype=dtype).mul(255).to(device)


def normalize(images_nhwc_uint8, dtype=torch.float32, stats=None):
    """uint8 NHWC -> normalized float NCHW; the permute makes it channels_last in memory, which convs like.
    `stats`: normalization(device, dtype), built once by the caller (else built here, for one-off calls)."""
    mean, std = stats if stats is not None else normalization(images_nhwc_uint8.device, dtype)
    return ((images_nhwc_uint8.to(dtype) - mean) / std).permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------------------------------------------
# The loader


class CifarSplit(torch.utils.data.Dataset):
    """One split as uint8 arrays (images [N,32,32,3], labels [N]): a map-style dataset the Trainer can cut
    (--max_train_samples, via select) and hand to DeviceLoader, which batches it on the device."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"images": torch.as_tensor(self.images[i]), "labels": int(self.labels[i])}

    def select(self, indices):
        indices = np.asarray(list(indices))
        return CifarSplit(self.images[indices], self.labels[indices])


class DeviceLoader:
    """Batches of {"images": float [B,3,32,32] (channels_last), "labels": int64 [B]} from data already on `device`.

    batch_size is per rank; the global batch is batch_size * world_size. Train mode (`train=True`): shuffled each
    epoch from (seed, epoch), augmented with flip and translate. The last, short global batch is kept by default so
    every sample is seen once per epoch (`drop_last=True` drops it; recipes/cifar.py does, as airbench does). Ranks split each global batch into contiguous
    parts whose sizes differ by at most one, so all ranks yield the same number of batches.

    flip: "alternate" (airbench: each image gets a random flip in epoch 0, then the opposite flip every other
    epoch, so it is seen both ways in any two consecutive epochs), "random" (a fresh coin per sample per epoch),
    or "none".
    """

    def __init__(
        self,
        images,
        labels,
        batch_size,
        *,
        train,
        device="cpu",
        seed=0,
        rank=0,
        world_size=1,
        flip="alternate",
        translate=2,
        drop_last=False,
        dtype=torch.float32,
    ):
        if flip not in ("alternate", "random", "none"):
            raise ValueError(f"flip must be 'alternate', 'random' or 'none', got {flip!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in a world of {world_size}")
        self.images = torch.as_tensor(images).to(device)  # uint8 [N, 32, 32, 3]: 150 MB for train
        self.labels = torch.as_tensor(labels, dtype=torch.int64).to(device)
        self.batch_size, self.train, self.device = int(batch_size), train, torch.device(device)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.flip, self.translate, self.drop_last, self.dtype = flip, int(translate), drop_last, dtype
        self.epoch = 0
        self.stats = normalization(self.device, dtype)
        self.global_batch = self.batch_size * self.world_size
        n = len(self.labels)
        self.num_batches = n // self.global_batch if drop_last else -(-n // self.global_batch)
        if self.num_batches == 0:
            raise ValueError(f"{n} samples make no global batch of {self.global_batch} with drop_last")

    def __len__(self):
        return self.num_batches

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def _generator(self, stream):
        # A CPU generator seeded from (seed, epoch, stream): identical on every rank and every device type.
        # (Not Python's hash(): it is salted per process for strings.)
        return torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 4 + stream)

    def epoch_plan(self):
        """(order, flip, dy, dx) for the whole epoch, in global order; every rank computes the same plan."""
        n = len(self.labels)
        if not self.train:
            zeros = torch.zeros(n, dtype=torch.int64)
            return torch.arange(n), zeros.bool(), zeros, zeros
        order = torch.randperm(n, generator=self._generator(1))
        r = self.translate
        g = self._generator(2)
        dy = torch.randint(-r, r + 1, (n,), generator=g)
        dx = torch.randint(-r, r + 1, (n,), generator=g)
        if self.flip == "random":
            flip = torch.rand(n, generator=g) < 0.5
        elif self.flip == "alternate":
            # Per-sample coin fixed for the whole run (seeded from seed only), XOR the epoch's parity.
            base = torch.rand(n, generator=torch.Generator().manual_seed(self.seed * 4 + 3)) < 0.5
            flip = base[order] ^ bool(self.epoch % 2)
        else:
            flip = torch.zeros(n, dtype=torch.bool)
        return order, flip, dy, dx

    def rank_slice(self, step):
        """[start, end) of this rank's part of global batch `step`, in the epoch's global order."""
        n = len(self.labels)
        lo, hi = step * self.global_batch, min((step + 1) * self.global_batch, n)
        size, extra = divmod(hi - lo, self.world_size)
        start = lo + self.rank * size + min(self.rank, extra)
        return start, start + size + (self.rank < extra)

    def __iter__(self):
        return self.skip_first_batches(0)

    def skip_first_batches(self, n):
        """The epoch's batches from batch n on. Train: this rank's images of those batches are flipped and
        translated at once, in one gather on the device (airbench94 augments the whole split per epoch), and each
        batch is a slice of them; the epoch's plan is a function of (seed, epoch), so a resumed epoch gets the
        batches the uninterrupted one had. Eval: slices of the split as it is (its order is the split's)."""
        spans = [self.rank_slice(step) for step in range(n, self.num_batches)]
        images, labels = self.images, self.labels
        if self.train and spans:
            rows = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in spans]))  # this rank's positions
            order, flip, dy, dx = (t[rows].to(self.device) for t in self.epoch_plan())
            images = augment_gather(self.images, order, flip, dy, dx, self.translate)  # [rows, H, W, C], uint8
            labels = self.labels[order]
            ends = list(itertools.accumulate(b - a for a, b in spans))
            spans = list(zip([0, *ends[:-1]], ends))  # each batch's rows in `images`
        for a, b in spans:
            yield {"images": normalize(images[a:b], self.dtype, self.stats), "labels": labels[a:b]}
