"""The whitening conv's precision under autocast: for each whitened channel, the relative error (over a batch of
test images) of a bf16 and an fp16 autocast forward against fp32. One JSON line.

    python bench/cifar_whitening.py --dataset ../shared/data/cifar10 [--cache_dir DIR]

Two rows per precision: "conv under autocast", the 2x2 whitening conv run under autocast (what the recipe did
before the whitening moved out of autocast), and "recipe", the channel as recipes/cifar.py's forward computes it
now (read by a forward hook on net.whiten). Whitening statistics from the first 5000 train images, as build_model
takes them; errors over 256 test images. docs/cifar.md has the numbers.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import cifar  # noqa: E402
from cifar_data import load_cifar10, normalize  # noqa: E402


def relative(a, b):
    return (torch.linalg.vector_norm(a - b, dim=(0, 2, 3)) / torch.linalg.vector_norm(b, dim=(0, 2, 3))).tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="../shared/data/cifar10")
    p.add_argument("--cache_dir", default=None)
    a = p.parse_args()
    data = load_cifar10(a.dataset, a.cache_dir)
    net = cifar.CifarNet((64, 256, 256))
    net.init_whitening(normalize(torch.from_numpy(data["train"][0][:5000])))
    images = normalize(torch.from_numpy(data["test"][0][:256])).contiguous(memory_format=torch.channels_last)
    seen = []
    net.whiten.register_forward_hook(lambda module, inputs, out: seen.append(out.detach().float()))
    w, b = net.whiten.weight.detach(), net.whiten.bias.detach()
    result = {}
    with torch.no_grad():
        exact = F.conv2d(images, w, b)
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            with torch.autocast("cpu", dtype=dtype):
                conv = F.conv2d(images, w, b).float()
                net(images[:8])  # the recipe's forward: its hook keeps the whitened channels
            seen.clear()
            with torch.autocast("cpu", dtype=dtype):
                net(images)
            half = len(w) // 2  # the second half is the first negated: the same errors
            result[name] = {
                "conv under autocast, max": max(relative(conv, exact)[:half]),
                "conv under autocast, per channel (largest eigenvalue first)": relative(conv, exact)[:half],
                "recipe, max": max(relative(seen[0], exact)[:half]),
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
