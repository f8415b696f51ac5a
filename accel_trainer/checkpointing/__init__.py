"""Checkpointing, one job per module (docs/fault-tolerance.md):

manager.py       the object the Trainer talks to: save, wait, resume, the final and preemption saves, the
                 output folder's checks; it collects the run's components' state_dict()s
folder.py        the folder layout on disk, the atomic commit and its manifest, a failed write in one line
verify.py        loading a checkpoint you did not write: layout, manifest, safe unpickling, the DCP allow-list
resume.py        which checkpoint to resume from, whether it fits, this rank's position, resharding
async_writer.py  --save_async: the state copied while training waits, written by a background thread
"""
