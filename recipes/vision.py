"""Image classification with a transformers vision model (ViT, DeiT, ConvNeXt, ...): a short recipe to copy and change.

    python recipes/vision.py --model_name_or_path <Hub id or save_pretrained folder> \\
        --dataset_name ../shared/data/cifar10 --output_dir runs/vit-cifar10
    accelerate launch recipes/vision.py ...        # any number of processes, same flags

The data goes through `datasets` as it is stored (PIL images); the model's own image processor (resize, rescale,
normalise) turns each batch into pixel values when it is read (`with_transform`); `loss` mirrors about half of the
training images. The classification head is new, with the dataset's class names. The processor is handed to the
Trainer as build_data's "tokenizer": the output folder is a save_pretrained folder with it, so that
`AutoModelForImageClassification.from_pretrained(output_dir)` and
`pipeline("image-classification", model=output_dir)` load it as written.
"""

import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from accel_trainer import UserError
from accel_trainer.kit.text import load_pretrained, load_text_dataset

name = "vision"
# transformers' run_image_classification.py: batch 32, lr 5e-5 with 10% warm-up, 3 epochs, eval after each epoch.
defaults = {
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 64,
    "num_train_epochs": 3,
    "learning_rate": 5e-5,
    "warmup_ratio": 0.1,
    "weight_decay": 0.01,
}


@dataclass
class Args:
    model_name_or_path: str = field(
        default="google/vit-base-patch16-224-in21k",
        metadata={"help": "Hub id or local folder (save_pretrained) of the model and its image processor."},
    )
    dataset_name: str = field(
        default="uoft-cs/cifar10",
        metadata={"help": "Hub id or local folder in Hub layout (e.g. ../shared/data/cifar10): an image column and "
                  "a class-label column."},
    )  # fmt: skip
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's config, if it has several."})
    eval_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on (default: validation, else test)."}
    )
    horizontal_flip: bool = field(default=True, metadata={"help": "Mirror each training image with probability 1/2."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloads and datasets' cache go."})


@functools.cache
def image_dataset(dataset_name: str, config_name: str | None, cache_dir: str | None):
    """The splits and their (image, label) column names, loaded once per process (build_model reads the class
    names, build_data the images)."""
    import datasets

    splits = load_text_dataset(dataset_name, config_name, cache_dir=cache_dir)  # any load_dataset; errors in a line
    features = splits["train"].features
    image = [c for c, f in features.items() if isinstance(f, datasets.Image)]
    label = [c for c, f in features.items() if isinstance(f, datasets.ClassLabel)]
    if not image or not label:
        raise UserError(f"dataset {dataset_name!r} needs an image column and a class-label column; it has {features}.")
    return splits, image[0], label[0]


def build_model(ctx):
    from transformers import AutoModelForImageClassification

    args = ctx.args
    with ctx.accelerator.main_process_first():  # the main process downloads and prepares, the others read
        splits, _, label = image_dataset(args.dataset_name, args.dataset_config_name, args.cache_dir)
    names = splits["train"].features[label].names
    return load_pretrained(
        AutoModelForImageClassification,
        args.model_name_or_path,
        num_labels=len(names),
        id2label=dict(enumerate(names)),  # the pipeline's labels: "cat", not "LABEL_3"
        label2id={n: i for i, n in enumerate(names)},
        ignore_mismatched_sizes=True,  # a pretrained head of other classes (ImageNet's 1000) is replaced
        cache_dir=args.cache_dir,
    )


def build_data(ctx):
    from transformers import AutoImageProcessor

    args = ctx.args
    processor = load_pretrained(AutoImageProcessor, args.model_name_or_path, cache_dir=args.cache_dir)
    with ctx.accelerator.main_process_first():
        splits, image, label = image_dataset(args.dataset_name, args.dataset_config_name, args.cache_dir)
    eval_split = args.eval_split or ("validation" if "validation" in splits else "test")
    if eval_split not in splits:
        raise UserError(f"dataset {args.dataset_name!r} has no split {eval_split!r}; it has {list(splits)}.")
    # Partials of a module-level function, not closures: loader workers started by spawn can pickle them.
    train = functools.partial(preprocess, processor=processor, image=image, label=label, flip=args.horizontal_flip)
    test = functools.partial(preprocess, processor=processor, image=image, label=label, flip=False)
    # "tokenizer": the processor is saved with the model, so that from_pretrained and pipeline() load both
    return {"train": splits["train"].with_transform(train), "eval": splits[eval_split].with_transform(test),
            "tokenizer": processor}  # fmt: skip


def preprocess(batch, processor, image, label, flip):
    """The rows datasets reads (a batch of them: PIL images and class ids) -> pixel values, labels, and whether
    `loss` may mirror the image (the training split with --horizontal_flip)."""
    pixels = processor([im.convert("RGB") for im in batch[image]], return_tensors="pt")["pixel_values"]
    return {"pixel_values": pixels, "labels": torch.tensor(batch[label]), "flip": torch.full((len(pixels),), flip)}


def loss(model, batch):
    pixels = batch["pixel_values"]
    # The coin is tossed here, not in preprocess: the loader reads a batch ahead of the update that trains on it, so
    # a toss there would come before the checkpoint that holds the generator, and a resumed run would toss again.
    mirror = batch["flip"] & (torch.rand(len(pixels), device=pixels.device) < 0.5)
    pixels = torch.where(mirror[:, None, None, None], pixels.flip(-1), pixels)
    return model(pixel_values=pixels, labels=batch["labels"]).loss, len(batch["labels"])  # the mean over the images


def eval_step(model, batch):
    with torch.no_grad():
        logits = model(pixel_values=batch["pixel_values"]).logits.float()
    # per image, so that the images Accelerate repeats to even out the ranks are dropped exactly
    per_image = F.cross_entropy(logits, batch["labels"], reduction="none")
    return {"loss": per_image, "n_items": torch.ones_like(per_image), "predictions": logits.argmax(-1),
            "references": batch["labels"]}  # fmt: skip


def build_metrics(ctx):
    from accel_trainer import load_metric

    return {"accuracy": load_metric("accuracy")}


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
