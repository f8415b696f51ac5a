"""A tiny learnable CIFAR-10 in both on-disk layouts, and a tiny ViT with its image processor, written by the tests
themselves (no download)."""

import io
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import cifar_data  # noqa: E402

# A tiny learnable CIFAR: class k is a noisy image whose mean colour and a bright row depend on k.


def tiny_arrays(n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 80, (n, 32, 32, 3)).astype(np.int64)
    images[np.arange(n), 3 * labels] += 150  # a bright row whose position is the class
    images[..., 0] += (labels * 10)[:, None, None]  # and a class-dependent red tint
    return images.clip(0, 255).astype(np.uint8), labels.astype(np.int64)


def write_hub_layout(root, train, test):
    """Parquet files with PNG images, as uoft-cs/cifar10 (and ../shared/data/cifar10) are laid out."""
    import datasets
    from PIL import Image

    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=list(cifar_data.CLASSES))}
    )
    os.makedirs(os.path.join(root, "plain_text"), exist_ok=True)
    for split, (x, y) in (("train", train), ("test", test)):
        pngs = []
        for img in x:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            pngs.append({"bytes": buf.getvalue(), "path": None})
        ds = datasets.Dataset.from_dict({"img": pngs, "label": y.tolist()}, features=features)
        ds.to_parquet(os.path.join(root, "plain_text", f"{split}-00000-of-00001.parquet"))
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write(
            "---\nconfigs:\n- config_name: plain_text\n  data_files:\n  - split: train\n    path: plain_text/train-*\n"
            "  - split: test\n    path: plain_text/test-*\n  default: true\n---\n# tiny CIFAR-10 for tests\n"
        )


def write_pickle_folder(root, train, test):
    """The original cifar-10-batches-py layout: 5 train batches + test_batch, rows of 3072 bytes in CHW order."""
    d = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(d)
    parts = np.array_split(np.arange(len(train[1])), 5)
    files = [(f"data_batch_{i + 1}", train[0][p], train[1][p]) for i, p in enumerate(parts)]
    for name, x, y in files + [("test_batch", test[0], test[1])]:
        with open(os.path.join(d, name), "wb") as f:
            pickle.dump({b"data": x.transpose(0, 3, 1, 2).reshape(len(x), -1), b"labels": y.tolist()}, f)
    return d


def make_tiny_cifar(root, n_train=240, n_test=60) -> dict:
    train, test = tiny_arrays(n_train, 0), tiny_arrays(n_test, 1)
    write_hub_layout(os.path.join(root, "hub"), train, test)
    pickles = write_pickle_folder(os.path.join(root, "pickle"), train, test)
    return {"hub": os.path.join(root, "hub"), "pickle": pickles, "train": train, "test": test}


def make_tiny_vit(folder: str) -> str:
    """A 2-layer, 32-wide ViT encoder (no classification head: the recipe adds one, as on a pretrained checkpoint)
    of 16x16 images in 4x4 patches, and its image processor (resize to 16x16, scale to [-1, 1]), saved in `folder`."""
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ViTModel(config, add_pooling_layer=False).save_pretrained(folder)
    ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        folder
    )
    return folder
