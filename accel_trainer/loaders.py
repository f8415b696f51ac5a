"""The data loaders of a run, from a recipe's build_data, and the order the loop reads them in:

    build_loaders          {"train", "eval"?, "collate"?, "loader"?} -> the train loader, the eval loader, the data
                           position (MapPosition, or streaming.Stream for a stream)
    check_lengths_agree    every rank's loaders give the same number of batches (one gather at start-up)
    take, draw             --max_train_samples (the first N) / --max_eval_samples (N drawn with --seed)
    epoch_batches          one epoch of the train loader from a batch on (a resumed run skips what it has seen)
    MapPosition            where the run is in map-style data: the micro-batches of each optimizer update from
                           there (aligned to epoch starts), its state_dict, the run length
    last_batch_rows        the samples in each rank's last batch of an epoch (Accelerate pads it with repeats)

A stream (an iterable train dataset) is read through streaming.py's per-rank loader; everything else through the
recipe's own batch loader or a DataLoader that Accelerate shards over the processes.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Subset

from . import micro_batch, streaming
from .errors import UserError
from .recipe import RecipeError


class ShortEpochError(UserError):
    pass


class UnevenLengthError(UserError):
    pass


def build_loaders(data: dict, args, accelerator, recipe_name: str):
    """build_data's {"train", "eval"?, "collate"?, "loader"?} -> (train loader, eval loader or None, the data
    position: a streaming.Stream for a stream, else a MapPosition). Datasets are cut to --max_train_samples/
    --max_eval_samples here (take, draw), for every recipe; then either the recipe's `loader(dataset,
    batch_size=, train=, drop_last=)` batches them (a batch loader, or None for ours) or a DataLoader that
    Accelerate shards over the processes."""
    if not isinstance(data, dict) or "train" not in data:
        got = f"a dict with keys {sorted(data)}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise RecipeError(
            f"Recipe {recipe_name}: build_data returned {got}; it must return a dict with a 'train' entry: "
            "return {'train': train_set, 'eval': eval_set} (docs/architecture.md)."
        )
    unknown = set(data) - {"train", "eval", "collate", "loader", "tokenizer"}  # tokenizer: saved with the model
    if unknown:
        raise RecipeError(
            f"Recipe {recipe_name}: build_data returned unknown keys {sorted(unknown)}; it takes 'train', 'eval', "
            "'collate', 'loader' and 'tokenizer' (the evaluation set, validation or test, is 'eval')."
        )
    make = data.get("loader")
    stream = None

    def loader(dataset, train: bool):
        nonlocal stream
        if dataset is None:
            return None
        if isinstance(dataset, DataLoader):  # else taken for a stream: "has no state_dict()", the wrong fix
            raise RecipeError(
                f"Recipe {recipe_name}: build_data's {'train' if train else 'eval'} entry is a DataLoader; return "
                "its dataset (the Trainer batches, shuffles and shards it; its collate_fn as 'collate'), or a "
                "'loader' factory if the recipe batches the data itself (docs/architecture.md)."
            )
        if streaming.is_iterable_dataset(dataset):
            batches = _stream_loader(dataset, train, data, args, recipe_name)
            group = streaming.epoch_group(accelerator, args.ddp_timeout)
            stream = streaming.Stream(batches, accelerator.process_index, group, accelerator.device)
            return batches
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise RecipeError(
                f"Recipe {recipe_name}: build_data's {'train' if train else 'eval'} entry is a "
                f"{type(dataset).__name__}, not a map-style dataset (__getitem__, __len__). Return the dataset, "
                "and a 'loader' factory if the recipe batches it itself (docs/architecture.md)."
            )
        dataset = take(dataset, args.max_train_samples) if train else draw(dataset, args.max_eval_samples, args.seed)
        batch_size = args.per_device_train_batch_size if train else args.per_device_eval_batch_size
        drop_last = args.dataloader_drop_last if train else False
        batches = make(dataset, batch_size=batch_size, train=train, drop_last=drop_last) if make else None
        if batches is not None:
            for attr in ("__iter__", "__len__", "set_epoch"):
                if not hasattr(batches, attr):
                    raise RecipeError(f"Recipe {recipe_name}: its loader lacks {attr} (docs/architecture.md).")
            return batches
        return accelerator.prepare_data_loader(
            DataLoader(
                dataset,
                sampler=train_sampler(dataset, args.seed) if train else None,
                collate_fn=data.get("collate") or functools.partial(default_collate, recipe_name),
                num_workers=args.dataloader_num_workers,
                batch_size=batch_size,
                drop_last=drop_last,
                # Pinned by the DataLoader's pin thread when workers load the batches, then copied with non_blocking
                # (accel.py's DataLoaderConfiguration). Without workers the training thread would pin each batch
                # itself, one more host copy on the thread a GPU waits for: not worth what the copy saves.
                pin_memory=torch.cuda.is_available() and args.dataloader_num_workers > 0,
                # Own generator: creating an iterator must not draw from the global RNG (dropout's), or a
                # resumed run would see other random numbers than the uninterrupted one.
                generator=torch.Generator().manual_seed(args.seed),
            ),
            # On a CPU the batches are where they are used: without this, Accelerate walks every batch to move
            # each tensor to the CPU it is on, a cost per batch (docs/benchmarks.md, "Choices the numbers decided").
            device_placement=accelerator.device.type != "cpu",
        )

    train = loader(data["train"], True)
    return train, loader(data.get("eval"), False), stream or MapPosition(train, accelerator)


def default_collate(recipe_name: str, samples: list):
    """torch's default collate, its failure on samples of different sizes or on PIL images one line naming the fix
    (it said only "stack expects each tensor to be equal size", or "found <class 'PIL...'>", from inside the
    DataLoader)."""
    try:
        return torch.utils.data.default_collate(samples)
    except TypeError as e:
        found = str(e).rpartition("found ")[2]  # "<class 'PIL.PngImagePlugin.PngImageFile'>"
        if "'PIL." not in found:
            raise
        kind = found.strip("<>").removeprefix("class ").strip("'")
        raise RecipeError(
            f"Recipe {recipe_name}: its samples hold PIL images ({kind}), which the default collate cannot batch: "
            "give the dataset a transform that makes tensors of them, e.g. dataset.with_transform(fn) with "
            "transformers' AutoImageProcessor or torchvision's ToTensor in fn, or give build_data a 'collate' "
            "that does."
        ) from None
    except RuntimeError as e:
        # in a worker process torch stacks into shared memory sized from the first sample, and says "Trying to
        # resize storage that is not resizable" instead
        if "equal size" not in str(e) and "not resizable" not in str(e):
            raise
        raise RecipeError(
            f"Recipe {recipe_name}: its samples hold tensors of different sizes, which the default collate cannot "
            f"stack into a batch ({str(e).splitlines()[0]}): give build_data a 'collate' that pads them (e.g. "
            "transformers' DataCollatorWithPadding, or torch.nn.utils.rnn.pad_sequence), or pad them in the dataset."
        ) from None


def check_lengths_agree(accelerator, train_loader, eval_loader, recipe_name: str):
    """Every rank's train (and eval) loader gives the same number of batches per epoch: each rank computes the run
    length from its own len(), and every update and evaluation batch is a collective, so a rank with one batch more
    would wait in one until --ddp_timeout and then be blamed as dead. One all-gather of two numbers at start-up
    (Accelerate's DataLoaders are even by construction; a recipe's own loader may not be); a mismatch stops every
    rank in one line naming each rank's count. A stream has no length: streaming.py keeps its ranks together."""
    if accelerator.num_processes == 1:
        return
    lengths = [len(train_loader), -1 if eval_loader is None else len(eval_loader)]
    counts = accelerator.gather(torch.tensor(lengths, dtype=torch.int64, device=accelerator.device)).view(-1, 2)
    for column, (name, loader) in enumerate((("train", train_loader), ("eval", eval_loader))):
        per_rank = counts[:, column].tolist()
        if len(set(per_rank)) == 1:
            continue
        which = "its build_data 'loader'" if not isinstance(loader, DataLoader) else "its DataLoader"
        ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
        raise UnevenLengthError(
            f"The {name} loader of recipe {recipe_name} ({which}) gives each rank another number of batches per "
            f"epoch ({ranks}); every rank must run the same updates and evaluation batches, or the others wait for "
            "it until --ddp_timeout. Make its __len__ and __iter__ give every rank the same number of batches "
            "(drop or pad the remainder)."
        )


def train_sampler(dataset, seed: int) -> DistributedSampler:
    """The train order: epoch e (set_epoch) is torch.randperm(n) from a generator seeded with seed + e, a function
    of (seed, epoch) alone, so a resumed run reads what the uninterrupted one did. It is the order of Accelerate's
    SeedableRandomSampler with data_seed = --seed (a test compares them). torch's DistributedSampler over one
    replica gives it: the whole permutation on every rank, which Accelerate then shards batch by batch, the same on
    any world size. Why not Accelerate's sampler: it yields each index through two Python generators, a cost per
    sample in the training process (docs/benchmarks.md, "Choices the numbers decided"); this one hands out a list
    iterator."""
    return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)


def _stream_loader(dataset, train: bool, data: dict, args, recipe_name: str):
    """This rank's StatefulDataLoader over an iterable train dataset (streaming.py: why not Accelerate's)."""
    if not train:
        raise UserError(
            f"Recipe {recipe_name}: its eval data is an iterable dataset; evaluation counts every sample "
            "once on any world size and needs a map-style one (e.g. load the validation split without streaming)."
        )
    if args.max_steps <= 0:
        raise UserError(
            "The training data is a stream (an iterable dataset) of unknown length: pass --max_steps N "
            "(the number of optimizer updates) instead of --num_train_epochs."
        )
    if args.max_train_samples is not None:
        dataset = dataset.take(args.max_train_samples)
    return streaming.stream_loader(
        dataset,
        batch_size=args.per_device_train_batch_size,
        collate=data.get("collate"),
        num_workers=args.dataloader_num_workers,
        drop_last=args.dataloader_drop_last,
        seed=args.seed,
    )


def take(dataset, n: int | None, indices=None):
    """The first n samples (--max_train_samples), or the samples at `indices`, for every kind of dataset."""
    if n is None or n >= len(dataset):
        return dataset
    indices = range(n) if indices is None else indices
    return dataset.select(indices) if hasattr(dataset, "select") else Subset(dataset, indices)


def draw(dataset, n: int | None, seed: int):
    """n samples drawn from the whole eval split with `seed` (--max_eval_samples), kept in the split's order. The
    first n of a split sorted by label (CIFAR-10's test split) hold one label: accuracy 0 or 1, whatever the model.
    A function of (seed, len) alone, drawn before Accelerate shards the split: the same samples on any world size."""
    if n is None or n >= len(dataset):
        return dataset
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:n]
    return take(dataset, n, chosen.sort().values.tolist())


def epoch_batches(loader, epoch: int, skip: int, accelerator):
    """An iterator over epoch `epoch` of the train loader from batch `skip` on, on the device."""
    loader.set_epoch(epoch)  # the order is a function of (seed, epoch) only
    if skip == 0:
        return iter(loader)
    if isinstance(loader, DataLoader):  # DataLoaderShard is one
        return iter(accelerator.skip_first_batches(loader, skip))
    if hasattr(loader, "skip_first_batches"):
        return iter(loader.skip_first_batches(skip))
    it = iter(loader)
    for _ in range(skip):
        next(it)
    return it


class MapPosition:
    """Where a run is in its map-style training data: `epoch`, and `batch_in_epoch` (micro-batches of the epoch
    consumed, always a window boundary). The data position's interface, which streaming.Stream shares: windows()
    from the position on, moving it as each window is handed out (so a checkpoint written after a window's update
    resumes right after it); state_dict()/load_state_dict() for trainer_state.json; save_rank_files()/
    load_rank_files() for per-rank state (none here: the position is a function of the samples seen, the same on
    any world size); run_length(); epoch_float(); batches() for fetch_batch()."""

    per_rank = False  # the position moves to another world size (checkpointing.resume.resumed_position)

    def __init__(self, loader, accelerator):
        self.loader, self.accelerator = loader, accelerator
        self.epoch = self.batch_in_epoch = 0
        self.batches_per_epoch: int | None = None
        self._batches = None  # the current epoch's batches from the position on (next_window)
        self.last_rows = last_batch_rows(loader)  # each rank's samples in an epoch's last batch (None: all full)
        sharded = self.last_rows is not None and accelerator.num_processes > 1  # Accelerate's repeats fill them up
        self.tail_rows = self.last_rows[accelerator.process_index] if sharded else None

    def run_length(self, args, eval_loader, recipe_name: str) -> tuple[int, int, int]:
        """(micro-batches per epoch on this rank, updates per epoch, total updates)."""
        # before the zero check: a rank that raised alone would leave the others waiting in this collective
        check_lengths_agree(self.accelerator, self.loader, eval_loader, recipe_name)
        micro_batches = len(self.loader)
        if micro_batches == 0:
            raise UserError(
                "The training data gives no batch on this process: fewer samples than "
                "per_device_train_batch_size x processes? Lower the batch size or add data."
            )
        self.batches_per_epoch = micro_batches
        updates = math.ceil(micro_batches / args.gradient_accumulation_steps)
        total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates)
        return micro_batches, updates, total

    def windows(self, accumulation: int):
        """The windows from the position on, each handed out by next_window: an iterator that calls it, with no
        generator frame of its own to resume per window."""
        self._batches = None  # from the position as it is now (after a resume, or a notebook's rewind)
        return iter(functools.partial(self.next_window, accumulation), None)

    def next_window(self, accumulation: int) -> list:
        """The micro-batches of the next update, the position moved past them (a checkpoint written after their
        update resumes right after them): `accumulation` of them, aligned to the start of every epoch (an epoch's
        last window may be shorter). The number of updates was computed from len(), so an epoch that yields fewer
        batches is an error, not a silent re-run of the epoch; one that yields more is read up to len()."""
        per_epoch, start = self.batches_per_epoch, self.batch_in_epoch
        if self._batches is None:  # an epoch's first window, or the first from a resumed position
            self._batches = self.batches(self.epoch, start)
        wanted = min(accumulation, per_epoch - start)
        window = list(itertools.islice(self._batches, wanted))
        if len(window) < wanted:
            raise ShortEpochError(
                f"The train loader yielded {start + len(window)} batches in epoch {self.epoch} but its len() is "
                f"{per_epoch}: the number of updates and the schedule are computed from len(). Make __len__ match "
                "what __iter__ yields (after set_epoch)."
            )
        if start + wanted < per_epoch:
            self.batch_in_epoch = start + wanted
            return window
        self.epoch, self.batch_in_epoch, self._batches = self.epoch + 1, 0, None
        return window if self.tail_rows is None else self._without_repeats(window)

    def _without_repeats(self, window: list) -> list:
        """An epoch's last window, its last batch cut to this rank's real samples: Accelerate fills the ranks' last
        batches up with repeats of the epoch's first samples, which would be trained on and weighed as items, so 1
        and N processes would make different last updates. A batch of repeats alone (no sample of this rank) is kept
        whole, for the forward and backward every rank takes part in, and weighed by zero items (update.py)."""
        if self.tail_rows:
            return [*window[:-1], micro_batch.first_samples(window[-1], self.tail_rows)]
        return RepeatsLast(window)

    def batches(self, epoch: int, skip: int = 0):
        return epoch_batches(self.loader, epoch, skip, self.accelerator)

    def epoch_float(self) -> float:
        return self.epoch + self.batch_in_epoch / self.batches_per_epoch

    def epoch_just_ended(self) -> bool:
        return self.batch_in_epoch == 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict):
        self.epoch, self.batch_in_epoch, self._batches = state["epoch"], state["batch_in_epoch"], None

    def save_rank_files(self, folder: str, step: int):
        pass

    def load_rank_files(self, folder: str, saved: dict):
        pass


class RepeatsLast(list):
    """A window whose last batch holds no sample of this rank, only Accelerate's repeats (MapPosition)."""

    repeats_last = True


def last_batch_rows(loader) -> list[int] | None:
    """How many samples each rank's last batch of an epoch holds; None when every batch is full, or the loader is
    not a DataLoader (a recipe's own batches). Accelerate's sharding: rank r of W takes batch i*W + r of the epoch's
    batches of the per-device size b, and, without drop_last, fills the last global batch up to W*b with repeats
    of the epoch's first samples (BatchSamplerShard, even_batches), after the real ones."""
    sampler = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
    ranks = 1
    if isinstance(sampler, BatchSamplerShard):
        if sampler.split_batches or not sampler.even_batches:
            return None
        ranks, sampler = sampler.num_processes, sampler.batch_sampler
    if not isinstance(sampler, BatchSampler) or sampler.drop_last:
        return None
    b, n = sampler.batch_size, len(sampler.sampler)
    first = (len(loader) - 1) * ranks * b  # the first sample of the epoch's last global batch
    rows = [min(max(n - first - r * b, 0), b) for r in range(ranks)]
    return None if all(k == b for k in rows) else rows
