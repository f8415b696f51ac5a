"""Loading checkpoints you did not write: verify_checkpoint checks a folder before anything in it is loaded.

Whoever wrote the folder, every file in it, listed in the manifest or not, is checked -- no symbolic link out of
the folder, no manifest name outside it, no file that anything reads left out of the manifest; sizes and hashes
against the manifest (truncated/corrupt file -> an error naming it); every pickled file test-loaded with
`weights_only=True`, DCP `.metadata` unpickled with an exact allow-list (code in a pickle is refused, never run).
The manifest is integrity (a truncated or damaged copy), not authenticity: it comes with the checkpoint. See
docs/fault-tolerance.md.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import re
import stat

from safetensors import safe_open

from .. import privates
from .folder import MANIFEST_FILE, STATE_FILE, CheckpointError, hash_file, read_state

_PICKLED = (".bin", ".pkl", ".pt", ".pth")  # what accelerate.load_state reads with torch.load
# Objects registered with accelerator.register_for_checkpointing: load_state loads them with weights_only=False.
_CUSTOM_STATE = re.compile(r"^custom_checkpoint_\d+\.pkl$")
# What torch, Accelerate, DCP or the Trainer read from a checkpoint folder; a file named otherwise is read by none.
_READ = _PICKLED + (".safetensors", ".distcp", ".metadata", ".json")
# the integers a resume reads, each with the least value a run writes
_STATE_KEYS = {"global_step": 0, "epoch": 0, "batch_in_epoch": 0, "num_processes": 1, "per_device_train_batch_size": 1,
               "gradient_accumulation_steps": 1}  # fmt: skip


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"Checkpoint {path}: no {MANIFEST_FILE}, so it is not a complete checkpoint written "
            "by accel-trainer (or was written by an older version); it cannot be verified."
        )
    try:
        with open(file) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a JSON object with a 'files' object")
    except (ValueError, OSError, RecursionError) as e:  # RecursionError: JSON nested too deep to parse
        raise CheckpointError(f"Checkpoint {path}: {file} is unreadable ({e}).") from None
    return manifest


def why(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _inside(root: str, path: str) -> bool:
    """`path`, links resolved, is `root` (a realpath) or under it."""
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


def _plain_relative(rel) -> bool:
    """A name inside a folder: relative, normalised (no `.`, `..`, `//`), not empty."""
    return (
        isinstance(rel, str)
        and rel not in ("", ".")
        and "\0" not in rel
        and not os.path.isabs(rel)
        and os.path.normpath(rel) == rel
        and ".." not in rel.split(os.sep)
    )


def check_layout(path: str, manifest: dict, log=None):
    """What the folder holds, whatever its manifest says. Refused, naming the file: a manifest name that is not a
    plain path inside the folder (absolute, `..`), a malformed manifest entry, a symbolic link (file or folder)
    that leads out of the folder, anything but regular files and folders, and a file that torch, Accelerate or the
    Trainer would read (by its name) but the manifest does not list. Any other unlisted file is read by nothing:
    `log` names it in a warning."""
    root = os.path.realpath(path)
    unlisted = []
    for dirpath, dirnames, filenames in os.walk(path):  # links are not followed: a linked folder is checked here
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full) and not _inside(root, full):
                raise CheckpointError(
                    f"Checkpoint {path}: {full} is a symbolic link to {os.path.realpath(full)}, outside the "
                    "checkpoint folder; refused. Copy the files themselves into the folder (e.g. cp -rL)."
                )
        for name in filenames:
            full = os.path.join(dirpath, name)
            try:
                regular = stat.S_ISREG(os.stat(full).st_mode)
            except OSError as e:  # e.g. a link to a file that is not there
                raise CheckpointError(f"Checkpoint {path}: {full} cannot be read ({why(e)}).") from None
            if not regular:  # a FIFO would block the hashing forever, a device never end
                raise CheckpointError(f"Checkpoint {path}: {full} is not a regular file; refused.")
            rel = os.path.relpath(full, path)
            if rel != MANIFEST_FILE and rel not in manifest["files"]:
                unlisted.append((rel, full))
    for rel, meta in manifest["files"].items():
        if not _plain_relative(rel) or not _inside(root, os.path.join(path, rel)):
            raise CheckpointError(
                f"Checkpoint {path}: {MANIFEST_FILE} names {rel!r} ({os.path.normpath(os.path.join(path, str(rel)))})"
                ", which is not a plain path inside the checkpoint folder (absolute, or with '..'); refused."
            )
        ok = isinstance(meta, dict) and isinstance(meta.get("sha256"), str)
        if not (ok and isinstance(meta.get("size"), int) and not isinstance(meta.get("size"), bool)):
            raise CheckpointError(
                f"Checkpoint {path}: {os.path.join(path, MANIFEST_FILE)} is malformed (entry {rel!r} has no integer "
                "size and sha256 string)."
            )
    for rel, full in unlisted:
        if rel.endswith(_READ):
            raise CheckpointError(
                f"Checkpoint {path}: {full} is not listed in {MANIFEST_FILE}, and resuming would read it; refused "
                "(added after the checkpoint was written?). Remove it, or use a checkpoint as it was written."
            )
        if log is not None:
            log(f"warning: checkpoint {path}: {full} is not listed in {MANIFEST_FILE}; nothing reads it, ignored.")


def verify_checkpoint(path: str, log=None) -> dict:
    """Everything a resume from `path` would read, before any of it is loaded: check_layout (every file in the
    folder, listed or not), sizes and sha256 of every file in the manifest, the trainer state, and a safe
    test-load of every file that is unpickled (pickles, DCP metadata) or parsed (safetensors headers).
    Returns the manifest; raises CheckpointError naming the first bad file (one line). `log`: warnings."""
    manifest = read_manifest(path)
    check_layout(path, manifest, log)
    for rel, meta in manifest["files"].items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"Checkpoint {path}: {file} is missing (listed in {MANIFEST_FILE}).")
        size = os.path.getsize(file)
        if size != meta["size"]:
            raise CheckpointError(
                f"Checkpoint {path}: {file} is truncated or altered: {size} bytes, {meta['size']} expected."
            )
        try:
            digest = hash_file(file, fsync=False)[1]
        except OSError as e:
            raise CheckpointError(f"Checkpoint {path}: {file} cannot be read ({why(e)}).") from None
        if digest != meta["sha256"]:
            raise CheckpointError(f"Checkpoint {path}: {file} is corrupt (sha256 differs from {MANIFEST_FILE}).")
    state = check_state(path)
    check_complete(path, manifest, state)
    check_safe_to_load(path, manifest)
    check_safetensors(path, manifest)
    check_dcp_metadata_safe(path, manifest)  # a sharded (FSDP) checkpoint's DCP metadata, read with plain pickle
    return manifest


def check_state(path: str) -> dict:
    """trainer_state.json is a JSON object with the integers a resume reads; returns it."""
    file = os.path.join(path, STATE_FILE)
    try:
        state = read_state(path)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"Checkpoint {path}: {file} is missing or unreadable ({why(e)}).") from None
    bad = [k for k in _STATE_KEYS if type(state.get(k)) is not int] if isinstance(state, dict) else ["everything"]
    if bad:
        raise CheckpointError(
            f"Checkpoint {path}: {file} lacks {', '.join(bad)} (integers): not the trainer state of a checkpoint."
        )
    step, skipped = state["global_step"], state.get("skipped_steps", 0)
    best, best_step = state.get("best_metric"), state.get("best_step")
    wrong = [f"{k} {state[k]}" for k, least in _STATE_KEYS.items() if state[k] < least]
    if type(skipped) is not int or not 0 <= skipped <= step:
        wrong.append(f"skipped_steps {skipped!r}")
    if best is not None and (type(best) not in (int, float) or not math.isfinite(best)):
        wrong.append(f"best_metric {best!r}")
    if best_step is not None and (type(best_step) is not int or not 0 <= best_step <= step):
        wrong.append(f"best_step {best_step!r}")
    if wrong:
        raise CheckpointError(
            f"Checkpoint {path}: {file} holds {', '.join(wrong)}, which no run writes (steps, epoch and position "
            "from 0, processes and batch sizes from 1, skipped_steps and best_step up to global_step, best_metric "
            "a finite number or null): it cannot be resumed."
        )
    return state


def check_complete(path: str, manifest: dict, state: dict):
    """The manifest lists what every checkpoint of ours holds: the model, the optimizer and the scheduler (full
    files, or under FSDP the DCP folders) and each writing rank's RNG state. Accelerate's load_state skips a missing
    RNG file with a log line, so a checkpoint without one resumed with other random numbers (dropout), silently."""
    files, ranks = manifest["files"], state["num_processes"]

    def has(name: str, folder: str | None = None) -> bool:
        return name in files or (folder is not None and any(rel.startswith(folder + "/") for rel in files))

    needed = [("model.safetensors", "pytorch_model_fsdp_0"), ("optimizer.bin", "optimizer_0"), ("scheduler.bin", None)]
    needed += [(f"random_states_{rank}.pkl", None) for rank in range(ranks)]
    missing = [name if folder is None else f"{name} (or {folder}/)" for name, folder in needed if not has(name, folder)]
    if missing:
        raise CheckpointError(
            f"Checkpoint {path}: {MANIFEST_FILE} lists no {', '.join(missing)}, which every checkpoint written by "
            f"{ranks} process(es) holds: it is incomplete and cannot continue the run it comes from. Resume from "
            "another checkpoint (--resume_from_checkpoint latest takes the newest complete one)."
        )


def check_safetensors(path: str, manifest: dict):
    """Every safetensors file (model, EMA) opens and its header lists tensors (safetensors is data: no code)."""
    for rel in manifest["files"]:
        if rel.endswith(".safetensors"):
            file = os.path.join(path, rel)
            try:
                with safe_open(file, framework="pt") as f:
                    for k in f.keys():
                        f.get_slice(k).get_shape()
            except Exception as e:  # noqa: BLE001 - any failure means the file cannot be restored
                raise CheckpointError(
                    f"Checkpoint {path}: {file} is not a readable safetensors file ({why(e)})."
                ) from None


def check_safe_to_load(path: str, manifest: dict):
    """Unpickle every pickled file the way accelerate's load_state will, with `weights_only=True` (no code runs;
    mmap: tensor data is not read). This also turns accelerate's silent "Could not load random states" into an
    error: a resumed run with other random numbers would not be the run it continues. Accelerate's
    `custom_checkpoint_<i>.pkl` (loaded with weights_only=False) is refused unread: the Trainer registers none."""
    from accelerate.utils.other import load  # weights_only=True plus the numpy types RNG states need

    for rel in manifest["files"]:
        file = os.path.join(path, rel)
        if _CUSTOM_STATE.match(os.path.basename(rel)):
            raise CheckpointError(
                f"Checkpoint {path}: {file} is the state of an object registered with Accelerate's "
                "register_for_checkpointing, which load_state unpickles with weights_only=False (any code in it "
                "would run); accel-trainer registers none, so it is refused unread. Remove it to resume."
            )
        if not rel.endswith(_PICKLED):
            continue
        try:
            try:
                load(file, map_location="cpu", mmap=True)
            except RuntimeError as e:  # a legacy (pre-zipfile) torch.save file cannot be mapped: read it
                if "mmap" not in str(e):
                    raise
                load(file, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"Checkpoint {path}: {file} holds pickled code or objects that a safe load refuses ({_refused(e)}); "
                "nothing in it was run. Do not load it with weights_only=False: resume from another checkpoint."
            ) from None
        except Exception as e:  # noqa: BLE001 - any failure means the file cannot be restored
            raise CheckpointError(
                f"Checkpoint {path}: {file} cannot be loaded safely ({why(e)}). Pickled code "
                "and arbitrary objects are refused (weights_only=True) and were not run."
            ) from None


def _refused(error: Exception) -> str:
    """What torch's weights_only unpickler refused (the GLOBAL it names), not the text around it: torch's message
    first tells how to load the file with weights_only=False, which would run the code."""
    lines = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line]
    # its first sentence: older torch goes on in the same line with how to allow the global (add_safe_globals)
    return (lines[0].split(". ")[0] if lines else "weights_only=True refused it").rstrip(".")[:200]


# ------------------------------------------------------------------------------- sharded (FSDP2) checkpoints, DCP
# Under FSDP, `accelerator.save_state` writes the model and the optimizer with torch.distributed.checkpoint
# (DCP): folders `pytorch_model_fsdp_0/` and `optimizer_0/`, each with one `__<rank>_0.distcp` per rank and a
# `.metadata` (which tensor chunk is where, by parameter name and global offsets). save_checkpoint and
# write_manifest list and hash them like any other file. Two additions for them:
#  - check_safe_to_load's promise (no pickled code runs) needs check_dcp_metadata_safe. torch reads `.metadata`
#    with a plain `pickle.load`: we unpickle it first with an allow-list of the classes DCP writes. In a `.distcp`,
#    tensors are read with torch.load(weights_only=True), but the non-tensor items (an optimizer's param_groups:
#    lr, betas, the parameter names, ...) with torch.load(weights_only=False) (torch 2.13,
#    DefaultLoadPlanner.load_bytes): we test-load each of those with weights_only=True first.
#  - load_resharded restores model and optimizer of a DCP checkpoint into a model on any number of processes,
#    sharded or not (DCP matches tensors by name and global offsets): a 2-process FSDP checkpoint resumes on 1.
DCP_META = ".metadata"
# Every global a DCP `.metadata` names, as exact (module, name) pairs; found by unpickling the `.metadata` of real
# FSDP checkpoints (torch 2.13) with a recording find_class. Besides these: torch's dtypes, ("torch", "float32")...
_DCP_GLOBALS = (
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum: TensorProperties' memory format
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's reduce: a lookup of torch's layouts by name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),  # where Python >= 3.13 pickles pathlib's classes from
    ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"),
    ("pathlib._local", "PureWindowsPath"),
    ("collections", "OrderedDict"),
)


@functools.cache
def _dcp_allowed() -> dict:
    """(module, name) -> the object: _DCP_GLOBALS that exist in this Python and torch, and torch's dtypes."""
    import importlib

    import torch

    allowed = {}
    for module, name in _DCP_GLOBALS:
        try:
            allowed[(module, name)] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # pathlib._local: Python >= 3.13 only
            continue
    allowed.update({("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


def _dcp_unpickler(file):
    """An unpickler that admits exactly the globals of _dcp_allowed: the pair must be listed (a dotted name never
    is -- protocol 4 would resolve `os.system` under any module that imports os), and what pickle resolves it to
    must be the very object listed."""
    import pickle

    allowed = _dcp_allowed()

    class DcpMetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            expected = allowed.get((module, name)) if "." not in name else None
            if expected is None or super().find_class(module, name) is not expected:
                raise pickle.UnpicklingError(f"global {module}.{name} is not one DCP metadata uses")
            return expected

    return DcpMetadataUnpickler(file)


def read_dcp_metadata(path: str, file: str):
    """The DCP metadata in `file` (of checkpoint `path`), unpickled with the allow-list and checked to be DCP's
    Metadata; CheckpointError (one line naming the file) for anything else: empty, truncated, foreign, unsafe."""
    try:
        with open(file, "rb") as f:
            meta = _dcp_unpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure means torch's pickle.load must not see it
        raise CheckpointError(
            f"Checkpoint {path}: {file} cannot be loaded safely ({why(e)}). Only the classes of "
            "torch.distributed.checkpoint metadata are admitted; nothing in it was run."
        ) from None
    if not _well_formed_dcp(meta):
        raise CheckpointError(
            f"Checkpoint {path}: {file} is not well-formed DCP metadata (it holds {type(meta).__name__}); the "
            "checkpoint is damaged."
        )
    return meta


def _well_formed_dcp(meta) -> bool:
    """The fields DCP and this module read, present and of their types: an allowed class can still be built
    without its fields (pickle sets __dict__ to anything), which would fail later as an AttributeError."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def item(name, v) -> bool:  # state_dict_metadata: a tensor's global shape and chunks, or a pickled item
        if isinstance(v, TensorStorageMetadata):
            ok = isinstance(v.size, torch.Size) and isinstance(v.chunks, list)
            return isinstance(name, str) and ok and isinstance(v.properties, TensorProperties)
        return isinstance(name, str) and isinstance(v, BytesStorageMetadata)

    def stored(index, info) -> bool:  # storage_data: where an item's bytes are
        ok = (
            isinstance(index, MetadataIndex)
            and isinstance(index.fqn, str)
            and isinstance(info, privates.dcp_storage_info_class())
        )
        return ok and isinstance(info.relative_path, str) and type(info.offset) is int and type(info.length) is int

    try:
        return (
            isinstance(meta, Metadata)
            and isinstance(meta.state_dict_metadata, dict)
            and isinstance(meta.storage_data, dict)
            and all(item(k, v) for k, v in meta.state_dict_metadata.items())
            and all(stored(i, v) for i, v in meta.storage_data.items())
        )
    except AttributeError:
        return False


def check_dcp_metadata_safe(path: str, manifest: dict):
    """Before torch reads a checkpoint's DCP folders: unpickle every `.metadata` with an allow-list of DCP's own
    classes (torch uses plain pickle), check that every storage entry names a file of its folder, then test-load
    every non-tensor item of the `.distcp` files it points to with weights_only=True (torch loads those with
    weights_only=False). Raises CheckpointError naming the file; nothing in it runs."""
    for rel in manifest["files"]:
        if not os.path.basename(rel).endswith(DCP_META):
            continue
        file = os.path.join(path, rel)
        check_dcp_storage(path, file, read_dcp_metadata(path, file))


def check_dcp_storage(path: str, file: str, meta):
    """Every storage entry of a well-formed `meta` names a file of its folder; its non-tensor items load with
    weights_only=True."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = os.path.dirname(file)
    items = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in meta.storage_data.items():
        if not _plain_relative(info.relative_path) or os.sep in info.relative_path:
            raise CheckpointError(
                f"Checkpoint {path}: {file} names a storage file outside its folder ({info.relative_path!r}); refused."
            )
        shard = os.path.join(folder, info.relative_path)
        if not os.path.isfile(shard):
            raise CheckpointError(f"Checkpoint {path}: {shard}, named in {file}, is missing.")
        if index.fqn not in items:
            continue
        if info.transform_descriptors:  # compressed or otherwise transformed streams: not ours to decode
            raise CheckpointError(f"Checkpoint {path}: {shard} holds transformed items that cannot be checked.")
        try:
            with open(shard, "rb") as f:
                f.seek(info.offset)
                torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means torch's weights_only=False load must not see it
            raise CheckpointError(
                f"Checkpoint {path}: {shard} (item {index.fqn}) cannot be loaded safely ({why(e)}). Pickled code "
                "and arbitrary objects are refused (weights_only=True) and were not run."
            ) from None


def is_sharded_checkpoint(path: str) -> bool:
    """A checkpoint whose model was saved sharded with DCP (an FSDP run)."""
    from accelerate.utils.constants import FSDP_MODEL_NAME

    return os.path.isfile(os.path.join(path, f"{FSDP_MODEL_NAME}_0", DCP_META))
