"""The regression recipe in a process where reading a pickle from a file fails: torch.load, pickle.load, and a
pickle.Unpickler over anything but an in-memory buffer (the process group's object collectives unpickle the ranks'
own objects from memory) raise at once. A resume that finishes here read its checkpoint without an unpickler."""

import io
import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from regression import *  # noqa: E402, F403
from regression import Args  # noqa: E402, F401


class Tripped(RuntimeError):
    pass


def _refuse(what):
    def tripped(*args, **kwargs):
        raise Tripped(f"tripwire: {what} called while resuming")

    return tripped


class _MemoryOnlyUnpickler(pickle.Unpickler):
    def __init__(self, file, *args, **kwargs):
        if not isinstance(file, io.BytesIO):
            raise Tripped(f"tripwire: pickle.Unpickler over {type(file).__name__}")
        super().__init__(file, *args, **kwargs)


torch.load = _refuse("torch.load")
torch.serialization.load = _refuse("torch.serialization.load")
pickle.load = _refuse("pickle.load")
pickle.Unpickler = _MemoryOnlyUnpickler

if __name__ == "__main__":
    from accel_trainer import run

    run(sys.modules[__name__])
