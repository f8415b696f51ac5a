"""The run's model as the rest of the ecosystem loads it, and its upload to the Hugging Face Hub.

A transformers model (anything with `save_pretrained` and a `config`) is written as a `save_pretrained` folder:
config.json, model.safetensors (tied weights stored once, the transformers way), generation_config.json where the
model generates, and the tokenizer or processor the recipe handed over (build_data's "tokenizer"), so that
`AutoModelFor*.from_pretrained(folder)` and `pipeline(..., model=folder)` load it. The full state dict is the one
the caller gathered (under FSDP: once, on every rank); only the main process calls `write_folder`.

Why through a temporary folder: save_pretrained writes its files in place, one after the other; written aside and
renamed in, a kill leaves either the previous model or the new one, never a config beside half the weights.
"""

from __future__ import annotations

import fnmatch
import os
import shutil

from ..errors import UserError
from .folder import disk_full_is_one_line, follow_umask, fsync_path

# output_dir entries that never go to the Hub: the run's checkpoints, best models, half-written files.
NOT_PUSHED = ["checkpoints/*", "best/*", "best.previous-*/*", "*.tmp", "*.tmp/*", "error_after_training.txt"]


class HubPushError(UserError):
    """--push_to_hub failed; the saved model is where it was."""


def is_pretrained(model) -> bool:
    """A transformers model: it can write a save_pretrained folder."""
    return callable(getattr(model, "save_pretrained", None)) and getattr(model, "config", None) is not None


def tied_groups(model) -> list[list[str]]:
    """Groups of state-dict names that are one tensor in `model` (GPT-2's lm_head and wte, say)."""
    by_id: dict[int, list[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def write_folder(model, state_dict: dict, folder: str, output_dir: str, tokenizer=None) -> str:
    """`model.save_pretrained(folder)` of `state_dict` (the evaluated, full weights) and `tokenizer.save_pretrained`,
    written aside and renamed into `folder` (which may hold other files: output_dir's logs, best.json).
    Main process only. A full disk or an unwritable folder is one line (folder.disk_full_is_one_line)."""
    sd = {k: v.detach().to("cpu") for k, v in state_dict.items()}
    # A gathered (FSDP) or EMA state dict holds tied weights as separate tensors: tied again here, save_pretrained
    # stores them once, under the name from_pretrained expects, and ties them on loading.
    for names in tied_groups(model):
        present = [n for n in names if n in sd]
        for other in present[1:]:
            sd[other] = sd[present[0]]
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, ".pretrained.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with disk_full_is_one_line(output_dir, f"the model to {folder}", tmp):
        model.save_pretrained(tmp, state_dict=sd)  # it removes the tied names from the dict it is given
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        written = sorted(os.listdir(tmp))
        for name in written:
            follow_umask(os.path.join(tmp, name))  # safetensors writes 0600; colleagues read the model too
            fsync_path(os.path.join(tmp, name))
    # Weights of an earlier save that this one does not replace (sharded then, one file now) would be read as
    # this model's: removed first.
    for name in os.listdir(folder):
        if name not in written and fnmatch.fnmatch(name, "model*.safetensors*"):
            os.remove(os.path.join(folder, name))
    # The weights last: a folder with this run's model.safetensors has this run's config and tokenizer too.
    for name in sorted(written, key=lambda n: n.startswith("model")):
        os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    os.rmdir(tmp)
    fsync_path(folder)
    return folder


def push_to_hub(output_dir: str, repo_id: str, step: int) -> str:
    """Upload output_dir (the final model and the run's logs; not checkpoints/ nor best/) to the Hub model repo
    `repo_id`, created if missing, with huggingface_hub's public API and its usual token resolution (HF_TOKEN, or
    `hf auth login`). Returns the commit's URL. Any failure is one HubPushError line; nothing local is touched."""
    import huggingface_hub

    try:
        api = huggingface_hub.HfApi()
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=output_dir,
            repo_type="model",
            ignore_patterns=list(NOT_PUSHED),
            commit_message=f"accel-trainer: the model at step {step}",
        )
    except Exception as e:  # noqa: BLE001 - whatever the Hub or the network says becomes one line
        cause = (str(e).strip().splitlines() or [""])[0][:300].rstrip(".")
        raise HubPushError(
            f"Pushing {output_dir} to the Hub as {repo_id} failed: {type(e).__name__}: {cause}. The model is saved "
            f"in {output_dir}; push it later with: hf upload {repo_id} {output_dir} . --exclude 'checkpoints/*' 'best/*'"
        ) from None
    return str(getattr(commit, "commit_url", commit))
