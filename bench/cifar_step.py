"""The CIFAR small preset's train step in bf16 autocast vs fp32, in images per second of this process's CPU time
(which other processes on a shared machine disturb less than the wall clock) and of wall time. One JSON line.

    python bench/cifar_step.py bf16 [STEPS] [THREADS] [WIDTHS] [compile]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/cifar_step.py bf16   # as a CPU without bf16

The net of `--preset small` (its widths, or WIDTHS such as 16,64,128), batch 512 of random images, channels_last, forward + backward +
SGD; STEPS (default 3) timed after one warm-up step (and, with `compile`, the model under torch.compile: the
warm-up step compiles, its time is printed). docs/cifar.md has the numbers.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import cifar  # noqa: E402


def main():
    precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    torch.manual_seed(0)
    widths = sys.argv[4] if len(sys.argv) > 4 else cifar.PRESETS["small"]["widths"]
    model = cifar.CifarNet(tuple(int(w) for w in widths.split(","))).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(512, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (512,))
    compiled = len(sys.argv) > 5 and sys.argv[5] == "compile"
    net = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step()  # warm-up: oneDNN primitive creation (and compilation)
    first_step_s = time.perf_counter() - start
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    result = {
        "precision": precision,
        "compiled": compiled,
        "first_step_s": round(first_step_s, 2),
        "widths": widths,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "images_per_cpu_s": 512 * steps / cpu,
        "images_per_wall_s": 512 * steps / wall,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
