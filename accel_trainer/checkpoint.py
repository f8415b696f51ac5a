"""Checkpoint folders: `output_dir/checkpoints/step_<N>/`, written by `accelerator.save_state` plus our own
`trainer_state.json` (position in the run) and, with EMA on, `ema.safetensors`.

A checkpoint is written under a temporary name and renamed into place when every process has finished, so a
kill during a save never leaves a `step_<N>` folder that `latest` would pick up half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from safetensors.torch import load_model, save_model

from .errors import UserError

STATE_FILE = "trainer_state.json"
EMA_FILE = "ema.safetensors"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the folder or file and what to do."""


def checkpoints_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoint folders, oldest first."""
    root = checkpoints_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := _STEP_DIR.match(d))]
    return [path for _, path in sorted(found) if os.path.isfile(os.path.join(path, STATE_FILE))]


def resolve_resume_path(spec: str, output_dir: str) -> str:
    """The folder `--resume_from_checkpoint` names: a path, or 'latest' in output_dir."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_root(output_dir)}. "
                                  "Drop the flag to start a new run, or pass the folder of a checkpoint.")
        return found[-1]
    if not os.path.isdir(spec):
        raise CheckpointError(f"--resume_from_checkpoint {spec}: no such folder. Pass a checkpoint folder "
                              f"(output_dir/checkpoints/step_<N>) or 'latest'.")
    if not os.path.isfile(os.path.join(spec, STATE_FILE)):
        raise CheckpointError(f"--resume_from_checkpoint {spec}: not a checkpoint of ours ({STATE_FILE} missing).")
    return spec


def save_checkpoint(accelerator, output_dir: str, step: int, state: dict, ema=None,
                    save_total_limit: int | None = None) -> str:
    """Every process calls this (each saves its own RNG state). Returns the final folder."""
    root = checkpoints_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # model (safetensors), optimizer, scheduler, scaler, sampler, per-rank RNG
    if accelerator.is_main_process:
        if ema is not None:
            save_model(ema.module, os.path.join(tmp, EMA_FILE))
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(state, f, indent=2)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.isdir(final):  # a checkpoint of the same step from an earlier attempt: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if save_total_limit:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def load_checkpoint(accelerator, path: str, ema=None) -> dict:
    """Restore everything save_checkpoint wrote; returns the trainer state."""
    state = read_state(path)
    accelerator.load_state(path)
    if ema is not None and os.path.isfile(os.path.join(path, EMA_FILE)):
        load_model(ema.module, os.path.join(path, EMA_FILE), device=str(accelerator.device))
    return state
