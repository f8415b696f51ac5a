"""What a run imports before its first update is start-up time (bench/startup.py): asking whether a train set is a
stream must not import `datasets` (0.5-0.9 s) when the recipe never did."""

import subprocess
import sys

import pytest
from helpers import env

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

CODE = """
import sys, torch
from accel_trainer.streaming import is_iterable_dataset
assert not is_iterable_dataset(torch.utils.data.TensorDataset(torch.zeros(2)))
assert is_iterable_dataset(iter([1, 2]))
print("datasets imported:", "datasets" in sys.modules)
"""


def test_asking_for_a_stream_does_not_import_datasets():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "datasets imported: False" in out.stdout


# Importing the package must change nothing process-wide (issue 30): whatever a run changes (the malloc thresholds,
# inductor's config, the SIGUSR1 a launched worker keeps during set-up, the accelerate state) is the Trainer's doing
# when it is built, never a side effect of `import accel_trainer` in a notebook, a test or another library.
# The baseline is taken after importing the third-party packages the package itself imports: their own import
# effects are theirs. Private reads, each with why: torch's inductor/dynamo settings live in those config modules
# only, and accelerate has no reader of PartialState's shared state that would not create the state.
INERT = """
import faulthandler, json, logging, os, signal, sys, warnings
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as a worker of `accel-trainer launch` arrives (launch.py)
import accelerate, accelerate.state, safetensors.torch, torch, torch._dynamo.config, torch._inductor.config, tqdm.auto
import transformers


def snapshot():
    return {
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
        "environ": dict(os.environ),
        "torch": [torch.get_num_threads(), str(torch.get_default_dtype()), torch.get_float32_matmul_precision(),
                  torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
                  torch.backends.cudnn.deterministic, torch.is_grad_enabled()],
        "inductor": repr(sorted(torch._inductor.config.get_config_copy().items())),
        "dynamo": repr(sorted(torch._dynamo.config.get_config_copy().items())),
        "accelerate": [accelerate.state.is_initialized(), len(accelerate.state.PartialState._shared_state)],
        "python": [sys.getrecursionlimit(), sys.getswitchinterval(), repr(sys.excepthook), faulthandler.is_enabled(),
                   len(warnings.filters), logging.root.level, len(logging.root.handlers)],
    }


before = snapshot()
import accel_trainer, accel_trainer.cli, accel_trainer.kit.metrics, accel_trainer.kit.text  # noqa: E401
after = snapshot()
changed = {}
for k in before:
    if isinstance(before[k], dict):  # only the entries that changed
        keys = sorted(set(before[k]) | set(after[k]))
        changed[k] = {n: [before[k].get(n), after[k].get(n)] for n in keys if before[k].get(n) != after[k].get(n)}
    elif before[k] != after[k]:
        changed[k] = [before[k], after[k]]
print(json.dumps({k: v for k, v in changed.items() if v}))
"""

# What `accelerate launch` / torchrun and `accel-trainer launch` put in a worker's environment.
LAUNCHED = {
    "ACCEL_TRAINER_LAUNCHED": "1",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "ACCELERATE_USE_CPU": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "TORCHELASTIC_RUN_ID": "none",
}


def test_importing_the_package_changes_no_process_wide_setting():
    import json

    for extra in ({}, LAUNCHED):  # alone, and as a launched worker
        out = subprocess.run(
            [sys.executable, "-c", INERT], capture_output=True, text=True, env=env(**extra), timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        changed = json.loads(out.stdout.strip().splitlines()[-1])
        assert changed == {}, f"import accel_trainer{' in a launched worker' if extra else ''} changed: {changed}"
