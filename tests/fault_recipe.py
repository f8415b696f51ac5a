"""The regression recipe with faults injected through the Trainer's named events, for the fault-tolerance tests.
Nothing of this lives in the Trainer: it is a recipe that attaches to update_end and checkpoint_staged.

    --faults "key=value,..."   step_delay=S   sleep S s after every update (slows a run so a test can kill it)
                               save_delay=S   sleep S s while a checkpoint is staged, before its commit (a kill
                                              lands mid-save)
                               exit_at=R:N    rank R exits with status 3 after update N, on the first elastic
                                              attempt only
                               hang_at=R:N    rank R stops making progress after update N (SIGTERM ends it)
                               sleep_in_loss=R:N  rank R sleeps inside `loss` during update N (SIGTERM ends it)
                               build_delay=S  sleep S s in build_data (a slow set-up: tokenising, loading)
                               save_fail=R:N  rank R fails writing the checkpoint of step N (PermissionError)
                               raise_at=N     every rank raises a RuntimeError after update N (a bug in a handler)
                               nan_at=N       the loss is NaN from update N on (--nan_policy stop ends the run)
                               nan_sample=I   training sample I's features are NaN (a bad row in the data: its
                                              batch's loss is NaN; --nan_policy stop names and saves it)
                               sigint_at=N    every rank gets SIGINT (Ctrl-C) after update N
                               store_delay=S  from the last update on, the stack-dump watcher's store answers
                                              its poll S s late (a loaded machine): the watcher is inside that
                                              call (torch's, the GIL let go) when training ends; fit_end fails if
                                              the watcher outlived the training loop
                               oom_above=B[:R]  `loss` raises torch.OutOfMemoryError on a training batch of more
                                              than B samples (on rank R only, if given), as a forward would
                               oom_once=R:K   rank R's K-th `loss` call with gradients raises it, once
                               forward_oom_above=B  `loss` in train mode raises it on a batch of more than B
                                              samples also under no_grad, as a forward whose first activation
                                              alone does not fit (seen on an H100): the first-batch check too
                               buffer=1       the model has a buffer (DDP broadcasts it in a window's first forward)
                               gate_at=N      after update N every rank waits (at most 120 s) until the file
                                              <output_dir>.gate exists: a test acts while the run is mid-flight
                               hold_save=N    the background write (--save_async) of step N holds before its
                                              commit until one of the three faults above has fired, then until
                                              the process is exiting or 3 s have passed: a run that leaves fit()
                                              without waiting for the write loses the checkpoint, every time

Under FSDP its `loss` also checks that no gradient was synced inside an accumulation window (see loss()).
"""

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
import regression  # noqa: E402
from regression import (  # noqa: E402,F401
    build_metrics,
    build_optimizer,
    build_scheduler,
    configure,
    defaults,
    eval_step,
)

from accel_trainer.faults import restart_count  # noqa: E402

name = "regression"
_faulted = threading.Event()  # raise_at / nan_at / sigint_at has fired (read by hold_save's background wait)


@dataclass
class Args(regression.Args):
    faults: str = ""  # see the module docstring


def loss(model, batch):
    """regression.loss. Under FSDP, first: no sharded gradient exists yet. The Trainer keeps gradient sync off
    (set_requires_gradient_sync) until the last micro-batch of a window, so FSDP2 holds the window's gradients
    unsharded and writes the sharded .grad only at that last backward; the optimizer step then clears it. A sync
    on an earlier micro-batch would show here as a .grad at the next loss() call."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        synced = [name for name, p in model.named_parameters() if p.grad is not None]
        assert not synced, f"FSDP reduced gradients inside an accumulation window: {synced}"
    if _sleep_now:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a process stuck in C code: torchrun's SIGTERM ends it
        time.sleep(600)  # sleep_in_loss: the line a hang report must name
    spec = _parse(_args.faults) if _args is not None else {}
    oom = spec.get("oom_above")
    if "oom_once" in spec and torch.is_grad_enabled() and spec["oom_once"][0] == _rank():
        global _calls
        _calls += 1
        if _calls == spec["oom_once"][1]:
            raise torch.OutOfMemoryError(f"test fault: loss call {_calls} does not fit (oom_once)")
    if oom and torch.is_grad_enabled() and len(batch["x"]) > oom[0] and oom[1:] in ((), (_rank(),)):
        # Only with gradients on, as activations kept for the backward would: the first-batch check (no_grad) fits.
        raise torch.OutOfMemoryError(f"test fault: {len(batch['x'])} samples do not fit (oom_above={oom[0]})")
    forward_oom = spec.get("forward_oom_above")
    if forward_oom and model.training and len(batch["x"]) > forward_oom[0]:
        raise torch.OutOfMemoryError(
            f"test fault: {len(batch['x'])} samples do not fit (forward_oom_above). {CUDA_OOM}"
        )
    loss, n = regression.loss(model, batch)
    if _nan_now:
        _faulted.set()
        return loss * float("nan"), n
    return loss, n


_nan_now = False  # set by nan_at, from the update_end before that update
_sleep_now = False  # set by sleep_in_loss, likewise


_args = None  # the recipe's Args, from build_data
# The rest of the line CUDA's caching allocator raised on an H100 (bench/gpu.py's auto_micro_batch row).
CUDA_OOM = (
    "Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 78.47 GiB is free. Including "
    "non-PyTorch memory, this process has 712.00 MiB memory in use. 686.00 MiB allowed; Of the allocated memory 2.81 "
    "MiB is allocated by PyTorch, and 1.19 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
_calls = 0  # loss calls with gradients on this rank (oom_once)


def build_model(ctx):
    model = regression.build_model(ctx)
    if "buffer" in _parse(ctx.args.faults):
        model.register_buffer("seen", torch.zeros(1))
    return model


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def build_data(ctx):
    global _args
    _args = ctx.args
    delay = _parse(ctx.args.faults).get("build_delay", 0)
    if delay:
        rank = os.environ.get("RANK", "0")
        print(f"[test fault] rank {rank} builds its data for {delay:g} s", file=sys.stderr, flush=True)
        time.sleep(delay)
    if "store_delay" in _parse(ctx.args.faults):
        _slow_watcher_store(_parse(ctx.args.faults)["store_delay"])
    data = regression.build_data(ctx)
    bad = _parse(ctx.args.faults).get("nan_sample")
    if bad is not None:
        data["train"].tensors["x"][bad[0]] = float("nan")
    return data


KEYS = ("gate_at", "step_delay", "save_delay", "exit_at", "hang_at", "build_delay", "save_fail", "raise_at", "nan_at", "sigint_at",
        "hold_save", "sleep_in_loss", "nan_sample", "store_delay", "oom_above", "oom_once", "forward_oom_above", "buffer")  # fmt: skip


def _faults(trainer) -> dict:
    return _parse(trainer.recipe_args.faults)


def _parse(faults: str) -> dict:
    spec = {}
    for item in filter(None, (s.strip() for s in faults.split(","))):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise ValueError(f"--faults: unknown key {key!r}")
        spec[key] = float(value) if key.endswith("delay") else tuple(int(v) for v in value.split(":"))
    return spec


_last_update = threading.Event()  # store_delay: training's last update is done
_watcher_waits = threading.Event()  # store_delay: the watcher is inside its slow store call


def _slow_watcher_store(delay: float):
    """store_delay: the stack-dump watcher (peers.StackDumps) gets a store whose poll, from the last update on,
    first waits `delay` s inside the store's own C++ wait (on a key nobody sets), as a slow answer would."""
    from datetime import timedelta

    from accel_trainer import peers

    class SlowStore:
        def __init__(self, store):
            self.store = store

        def check(self, keys):
            if _last_update.is_set():
                _watcher_waits.set()
                try:
                    self.store.wait(["test_fault/never_set"], timedelta(seconds=delay))
                except Exception:  # noqa: BLE001 - the wait's timeout: the slow answer is over
                    pass
            return self.store.check(keys)

        def get(self, key):
            return self.store.get(key)

    real = peers.StackDumps._store
    peers.StackDumps._store = lambda self: (lambda s: SlowStore(s) if s is not None else None)(real(self))


def on_fit_end(trainer, metrics):
    if "store_delay" in _faults(trainer):
        left = [t.name for t in threading.enumerate() if t.name == "accel_trainer-stack-dumps" and t.is_alive()]
        assert not left, f"test fault: the stack-dump watcher outlived the training loop ({left})"


def on_update_end(trainer):
    f, rank, step = _faults(trainer), trainer.accelerator.process_index, trainer.global_step
    time.sleep(f.get("step_delay", 0))
    if "store_delay" in f and step >= trainer.total_steps:  # the loop ends while the watcher's call is slow
        _last_update.set()
        _watcher_waits.wait(timeout=5)
        time.sleep(0.1)  # inside the store's wait by now (it lets the GIL go)
    if f.get("gate_at") == (step,):
        gate, waited = trainer.args.output_dir.rstrip("/") + ".gate", time.monotonic()
        while not os.path.exists(gate) and time.monotonic() - waited < 120:
            time.sleep(0.05)
    if f.get("exit_at") == (rank, step) and restart_count() == 0:
        print(f"[test fault] rank {rank} exits with status 3 after step {step}", file=sys.stderr, flush=True)
        os._exit(3)
    if f.get("hang_at") == (rank, step):
        print(f"[test fault] rank {rank} hangs after step {step}", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(1)
    global _nan_now, _sleep_now
    if f.get("nan_at") == (step + 1,):
        _nan_now = True
    if f.get("sleep_in_loss") == (rank, step + 1):
        print(f"[test fault] rank {rank} sleeps in loss during update {step + 1}", file=sys.stderr, flush=True)
        _sleep_now = True
    if f.get("raise_at") == (step,):
        _faulted.set()
        raise RuntimeError(f"test fault: a handler fails after step {step}")
    if f.get("sigint_at") == (step,):
        _faulted.set()
        # Ctrl-C at a terminal, where Python's handler is installed. A process started in the background of a
        # script (`cmd &`, as CI's lanes are) inherits SIGINT ignored, and Python then installs none: put it back.
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)  # Python's default handler: KeyboardInterrupt in the main thread, now


def on_checkpoint_staged(trainer, folder):
    f = _faults(trainer)
    time.sleep(f.get("save_delay", 0))
    if f.get("hold_save") == (int(folder.rsplit("_", 1)[1]),):
        # In the background thread. The main thread has stopped training (or will within a second of the fault);
        # a process that exits without waiting for this write ends this thread at its next step (interpreter
        # shutdown): then the checkpoint is never committed.
        assert threading.current_thread() is not threading.main_thread(), "hold_save needs --save_async"
        _faulted.wait(timeout=120)
        until = time.monotonic() + 3
        while threading.main_thread().is_alive() and time.monotonic() < until:
            time.sleep(0.05)
    if f.get("save_fail") == (trainer.accelerator.process_index, int(folder.rsplit("_", 1)[1])):
        raise PermissionError(13, "Permission denied (test fault)", folder)


if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
