"""What a run shows about itself: throughput/time/memory fields in every log row (combined over ranks), MFU from
counted FLOPs, --profile_steps traces with collective time, --lr_scaling on 1 and 2 processes, and no progress
bar flooding a log file. Real launches (`accelerate launch`, gloo) with the world size asserted."""

import math
import os
import sys
import time

import pytest
from helpers import RECIPES, metrics, run, run_config

sys.path.insert(0, RECIPES)
import regression  # noqa: E402

from accel_trainer import Trainer  # noqa: E402

FIELDS = ("samples_per_second", "items_per_second", "step_time_s", "data_wait_fraction", "peak_memory_mb")
COMMON = ["--max_steps", "8", "--logging_steps", "2", "--save_steps", "0", "--lr_scheduler_type",
          "constant_with_warmup", "--warmup_steps", "4", "--lr_scaling", "linear", "--lr_base_batch_size", "16",
          "--profile_steps", "5-6", "--num_eval_samples", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """1 process x batch 16 and 2 processes x batch 16: global batches of 16 and 32."""
    out = {}
    for nproc in (1, 2):
        d = str(tmp_path_factory.mktemp(f"obs{nproc}"))
        proc = run("regression.py", ["--output_dir", d, "--per_device_train_batch_size", "16"] + COMMON, nproc=nproc)
        assert run_config(d)["num_processes"] == nproc
        out[nproc] = (d, proc)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_every_train_row_has_throughput_time_and_memory(launched, nproc):
    d, _ = launched[nproc]
    rows = [m for m in metrics(d) if "loss" in m]
    assert [m["step"] for m in rows] == [2, 4, 6, 8]
    for m in rows:
        assert all(m[k] > 0 or k == "data_wait_fraction" for k in FIELDS), m
        assert 0 <= m["data_wait_fraction"] < 1
        # the rate is over the global batch (summed over ranks), the step time the slowest rank's
        assert m["samples_per_second"] * m["step_time_s"] == pytest.approx(16 * nproc, rel=1e-6)
        # every sample has 4 targets (no masking): items are all-reduced, not counted once per rank
        assert m["items_per_second"] == pytest.approx(4 * m["samples_per_second"], rel=1e-6)
        assert m["peak_memory_mb"] > 50  # a Python process with torch loaded: its peak RSS


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_lr_scaling_by_the_global_batch_composes_with_warmup(launched, nproc):
    d, _ = launched[nproc]
    lr = run_config(d)["learning_rate"]
    assert lr == {"used": 1e-2 * nproc, "base": 1e-2, "scaling": "linear", "base_batch_size": 16}
    assert run_config(d)["args"]["learning_rate"] == 1e-2  # the user's value; the scaled one is its own
    rows = {m["step"]: m["learning_rate"] for m in metrics(d) if "loss" in m}
    # warmup over 4 updates to the scaled value, then constant
    assert rows[2] == pytest.approx(1e-2 * nproc * 2 / 4) and rows[6] == rows[8] == pytest.approx(1e-2 * nproc)


def test_sqrt_lr_scaling(tmp_path):
    t = Trainer.from_recipe(regression, output_dir=str(tmp_path), lr_scaling="sqrt", lr_base_batch_size=4,
                            per_device_train_batch_size=16, gradient_accumulation_steps=2, quiet=True)  # fmt: skip
    assert t.learning_rate == t.ctx.learning_rate == pytest.approx(1e-2 * math.sqrt(32 / 4))
    assert t.args.learning_rate == 1e-2  # the user's, not rewritten
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * math.sqrt(32 / 4))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_profile_traces_every_rank_and_names_collective_time(launched, nproc):
    d, proc = launched[nproc]
    files = os.listdir(os.path.join(d, "profile"))
    for rank in range(nproc):
        assert any(f.startswith(f"rank{rank}.") and f.endswith(".pt.trace.json") for f in files), files
        assert f"summary_rank{rank}.txt" in files
    assert "Profile of updates 5-6, rank 0" in proc.stdout and "in collectives" in proc.stdout
    summary = open(os.path.join(d, "profile", "summary_rank0.txt")).read()
    collective_ms = float(summary.split(" ms (")[0].rsplit(", ", 1)[1])
    assert (collective_ms > 0) == (nproc == 2), summary  # gloo all-reduces on 2 processes, none on 1


@pytest.mark.slow
def test_no_progress_bar_off_a_terminal(launched):
    _, proc = launched[1]
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr  # tqdm frames would flood a log file
    assert sum(line.startswith("step=") and "samples_per_second=" in line for line in proc.stdout.splitlines()) == 4


def test_mfu_from_the_counted_flops_of_an_update(tmp_path):
    t = Trainer.from_recipe(regression, output_dir=str(tmp_path), peak_tflops=1.0, max_steps=4, logging_steps=2,
                            save_steps=0, quiet=True, disable_tqdm=True)  # fmt: skip
    t.fit()
    # MLP 16 -> 32 -> 4, batch 16: forward 2*16*(16*32 + 32*4); backward: the second layer's input and weight
    # gradients, the first layer's weight gradient only (its input needs none).
    forward = 2 * 16 * (16 * 32 + 32 * 4)
    assert t.meter.flops_per_update == forward + 2 * 16 * 32 * 4 * 2 + 2 * 16 * 16 * 32
    rows = [m for m in metrics(t.args.output_dir) if "loss" in m]
    for m in rows:
        expected = t.meter.flops_per_update / m["step_time_s"] / 1e12
        assert m["mfu"] == pytest.approx(expected, rel=0.05)


def test_evaluation_time_is_not_update_time(tmp_path):
    # An evaluation between two log rows (here made slow by an evaluate_end handler) must not inflate the next row's
    # step time: it used to (1.67 s instead of ~0.01 s after each eval in the README picture).
    t = Trainer.from_recipe(regression, output_dir=str(tmp_path), max_steps=6, logging_steps=2, eval_steps=1,
                            save_steps=0, quiet=True, disable_tqdm=True)  # fmt: skip
    # Counted, each 0.5 s eval would add >= 0.5 s to an update (an eval after every update); an update takes ~5 ms.
    # The bound is half the sleep: a loaded CI machine once stalled a 2-update window past 0.3 s with a 0.3 s sleep.
    t.on("evaluate_end", lambda trainer, m, final: time.sleep(0.5))
    t.fit()
    rows = [m for m in metrics(t.args.output_dir) if "loss" in m]
    step_times = [m["step_time_s"] for m in rows]
    assert len(rows) == 3 and all(s < 0.25 for s in step_times), step_times


# torch.cuda.get_device_name() strings -> the dense bf16 peak (TFLOP/s), or None where the model is not in the
# table. Each pair of neighbours used to be confused by a substring match ("H100" in "NVIDIA H100 PCIe", "A10" in
# "NVIDIA A10G", "A100" in "NVIDIA RTX A1000", "L4" in "NVIDIA L40").
GPU_PEAKS = {
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "A100-SXM4-40GB": 312.0,  # older drivers leave out the vendor
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA RTX A1000": None,
    "NVIDIA A10": 125.0,
    "NVIDIA A10G": None,  # AWS's variant: no data-sheet peak, so no MFU rather than a wrong one
    "NVIDIA L4": 121.0,
    "NVIDIA L40": 181.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA GeForce RTX 4090": None,
}


@pytest.mark.parametrize("name", GPU_PEAKS)
def test_peak_tflops_by_exact_gpu_model(monkeypatch, name):
    import torch

    from accel_trainer.throughput import detected_peak_tflops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert detected_peak_tflops("bf16") == GPU_PEAKS[name]
    assert detected_peak_tflops("no") is None  # fp32 runs on other units: no bf16 peak applies


class _Accelerator:
    device, num_processes = "cpu", 1


def test_peak_memory_is_the_peak_since_the_last_row_on_cpu():
    # A 300 MB buffer held only during the first window: the second row must not report it (it did: the process's
    # lifetime peak RSS, never reset).
    import numpy as np

    from accel_trainer.throughput import Meter

    meter = Meter(_Accelerator())
    buffer = np.ones(300 * 2**20 // 8)  # touched pages: resident
    del buffer
    meter.updated(1, 1)
    first = meter.row()["peak_memory_mb"]
    meter.updated(1, 1)
    second = meter.row()["peak_memory_mb"]
    assert first > second + 250, (first, second)


class FakeAcceleratorMemory:
    """A device module's allocator statistics (torch.cuda/xpu): allocated bytes, and the peak since a reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def allocate(self, mb):
        self.allocated += mb * 2**20
        self.peak = max(self.peak, self.allocated)

    def max_memory_allocated(self, device=None):
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated


def test_peak_memory_of_an_accelerator_is_reset_at_each_row(monkeypatch):
    import torch

    from accel_trainer import throughput

    fake = FakeAcceleratorMemory()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    fake.allocate(100)  # the model, held throughout
    throughput.reset_peak_memory("cuda:0")  # a window starts
    fake.allocate(500)  # activations of the first window
    fake.allocate(-500)
    assert throughput.peak_memory_mb("cuda:0") == 600
    throughput.reset_peak_memory("cuda:0")  # the row: the next window starts
    fake.allocate(50)
    assert throughput.peak_memory_mb("cuda:0") == 150


def test_host_floats_takes_any_scalar_mix_in_one_copy_or_one_at_a_time():
    # The log row's one stack for losses, norms and item counts: bf16 losses beside fp32 norms, (1,)-shaped losses,
    # int counts, and plain numbers (which cannot be stacked) all come back as the same Python floats.
    import torch

    from accel_trainer.throughput import host_floats, stacked_floats

    bf16 = torch.tensor(2.3, dtype=torch.bfloat16)
    cases = [
        [torch.tensor(1.5), torch.tensor(2.5)],
        [bf16, torch.tensor(0.25)],
        [torch.tensor([1.5]), torch.tensor([3.0])],
        [torch.tensor(7), torch.tensor(9.5)],
        [torch.tensor(1.5), 2, 3.25],
        [torch.tensor(float("nan")), torch.tensor(float("inf"))],
    ]
    for convert in (host_floats, stacked_floats):  # stacked_floats: what host_floats does on an accelerator
        for values in cases:
            got = convert(values)
            assert all(type(v) is float for v in got), (values, got)
            want = [float(v) for v in values]
            assert [str(v) for v in got] == [str(v) for v in want], (values, got)  # str: NaN == NaN
        assert convert([]) == []
        with pytest.raises((ValueError, RuntimeError)):
            convert([torch.ones(2)])  # not a scalar: an error, not a silent first element


def test_item_counts_that_are_numbers_and_tensors_add_up_in_the_row():
    import torch

    from accel_trainer.throughput import Meter

    meter = Meter(_Accelerator())
    for items in (10, torch.tensor(20), torch.tensor(30.0), 40):
        meter.updated(8, items)
    row = meter.row()
    # rate x seconds per update x updates: the count itself
    assert row["items_per_second"] * row["step_time_s"] * 4 == pytest.approx(100)
    assert row["samples_per_second"] * row["step_time_s"] == pytest.approx(8)


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under `folder`, by tag: (step, value) in the order written.
    Event files are TFRecords (8-byte length, 4-byte CRC, the serialized Event, 4-byte CRC), read with the protobuf
    classes tensorboardX ships (the dev extra installs it; Accelerate's tensorboard tracker writes with it when
    the tensorboard package is absent)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    found: dict[str, list[tuple[int, float]]] = {}
    for dirpath, _, names in os.walk(folder):
        for name in sorted(n for n in names if n.startswith("events.out.tfevents")):
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            pos = 0
            while pos < len(data):
                (length,) = struct.unpack("<Q", data[pos : pos + 8])
                event = Event.FromString(data[pos + 12 : pos + 12 + length])
                pos += 12 + length + 4
                for v in event.summary.value:
                    if v.HasField("simple_value"):
                        found.setdefault(v.tag, []).append((event.step, v.simple_value))
    return found


@pytest.mark.slow
def test_report_to_tensorboard_logs_the_loss_there(tmp_path):
    # Read back from the tracker's own files: every logged loss, at its step, is what metrics.jsonl says.
    out = tmp_path / "run"
    args = ["--output_dir", out, "--max_steps", "6", "--logging_steps", "2", "--disable_tqdm"]
    run("regression.py", args + ["--report_to", "tensorboard", "--run_name", "tb"])
    assert run_config(out)["args"]["report_to"] == "tensorboard"
    expected = [(m["step"], m["loss"]) for m in metrics(out) if "loss" in m]
    assert [s for s, _ in expected] == [2, 4, 6]
    scalars = _tensorboard_scalars(out / "tb")
    assert [s for s, _ in scalars["loss"]] == [2, 4, 6], scalars.keys()
    assert [v for _, v in scalars["loss"]] == pytest.approx([v for _, v in expected], rel=1e-6)
