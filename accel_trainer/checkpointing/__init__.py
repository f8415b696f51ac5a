"""Checkpointing, one job per module (docs/fault-tolerance.md):

manager.py       the object the Trainer talks to: save, wait, resume, the final and preemption saves, the
                 output folder's checks; it collects the run's components' state_dict()s
folder.py        the folder layout on disk, the atomic commit and its manifest, a failed write in one line
state.py         what a checkpoint holds and how it is written: JSON and safetensors, no pickle (codec.py)
verify.py        a checkpoint you did not write, checked before anything is loaded
resume.py        which checkpoint to resume from, whether it fits, this rank's position
load.py          loading it on every rank, each part checked against the run; resharding
lock.py          the run's lock on its output folder
async_writer.py  --save_async: the state copied while training waits, written by a background thread
"""
