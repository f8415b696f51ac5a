"""What a run imports before its first update is start-up time (bench/startup.py): asking whether a train set is a
stream must not import `datasets` (0.5-0.9 s) when the recipe never did."""

import subprocess
import sys

from helpers import env

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
