"""Checkpoint folders: `output_dir/checkpoints/step_<N>/`, written by `accelerate.save_state` plus our own
`trainer_state.json` (position in the run), `ema.safetensors` (with EMA on) and, last, `manifest.json`.

Atomicity: a checkpoint is written into `.tmp_step_<N>/`; when every process has written its part, the main
process hashes every file (sha256, size; this also fsyncs them), writes `manifest.json` and renames the folder
to `step_<N>`. A kill at any moment leaves either the complete folder or a `.tmp_step_<N>` that is never used.

Verification on resume (verify_checkpoint), whoever wrote the folder: every file in it, listed in the manifest or
not, is checked -- no symbolic link out of the folder, no manifest name outside it, no file that anything reads
left out of the manifest; sizes and hashes against the manifest (truncated/corrupt file -> an error naming it);
every pickled file test-loaded with `weights_only=True`, DCP `.metadata` unpickled with an exact allow-list (code
in a pickle is refused, never run); the model's tensor names and shapes compared with the model being trained.
The manifest is integrity (a truncated or damaged copy), not authenticity: it comes with the checkpoint. `latest`/
`auto` skip a bad newest checkpoint, say why, and use the previous good one. See docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time

from safetensors import safe_open
from safetensors.torch import load_model, save_model

from .errors import UserError

STATE_FILE = "trainer_state.json"
EMA_FILE = "ema.safetensors"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
MODEL_FILE = "model.safetensors"  # accelerate's SAFE_MODEL_NAME + ".safetensors"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)$")
_OLD_DIR = re.compile(r"^\.old_step_(\d+)$")  # a complete checkpoint set aside while the same step is re-saved
_PICKLED = (".bin", ".pkl", ".pt", ".pth")  # what accelerate.load_state reads with torch.load
# Objects registered with accelerator.register_for_checkpointing: load_state loads them with weights_only=False.
_CUSTOM_STATE = re.compile(r"^custom_checkpoint_\d+\.pkl$")
# What torch, Accelerate, DCP or the Trainer read from a checkpoint folder; a file named otherwise is read by none.
_READ = _PICKLED + (".safetensors", ".distcp", ".metadata", ".json")
_STATE_KEYS = ("global_step", "epoch", "batch_in_epoch", "num_processes", "per_device_train_batch_size",
               "gradient_accumulation_steps")  # fmt: skip


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the folder or file and what to do."""


class DiskFullError(UserError):
    """The disk filled while writing a checkpoint or the model; the message names where and the last good step."""


class WriteError(UserError):
    """A checkpoint or the model could not be written for another cause than a full disk (a permission, an object
    that cannot be pickled); the message names the file, the cause and the last good step."""


def checkpoints_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Checkpoint folders (renamed into place, so complete unless damaged afterwards), oldest first."""
    root = checkpoints_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := _STEP_DIR.match(d))]
    return [path for _, path in sorted(found)]


# ------------------------------------------------------------------------------------------------------- writing
def _hash_file(path: str, fsync: bool = True) -> tuple[int, str]:
    """(size, sha256) of a file: for the manifest when writing (fsync), and to verify it before a resume."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:  # on disk before the rename makes the folder visible (power loss, not only kills)
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(dirpath, n), folder) for n in names]
    return sorted(p for p in out if p != MANIFEST_FILE)


def write_manifest(folder: str, state: dict) -> dict:
    """Hash every file of a finished checkpoint folder and write manifest.json (the last file written)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": state["global_step"],
        "epoch": state["epoch"],
        "batch_in_epoch": state["batch_in_epoch"],
        "num_processes": state["num_processes"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {},
    }
    for rel in _files(folder):
        size, digest = _hash_file(os.path.join(folder, rel))
        manifest["files"][rel] = {"size": size, "sha256": digest}
    tmp = os.path.join(folder, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST_FILE))
    _fsync_dir(folder)
    return manifest


def save_checkpoint(
    accelerator,
    output_dir: str,
    step: int,
    state: dict,
    ema=None,
    save_total_limit: int | None = None,
    on_staged=None,
    async_writer=None,
    write_extra=None,
) -> str:
    """Every process calls this (each saves its own RNG state). Returns the final folder. `on_staged(tmp)` runs
    when this process's files are in the temporary folder, before the commit (fault tests kill the run there).
    `write_extra(tmp)` writes this process's own extra state (a stream's position) while training waits, with
    --save_async too: it must be taken at this update, not when the background write ends.
    With `async_writer` (async_save.AsyncWriter, --save_async) it returns once the state is copied: the model and
    optimizer files, then the same commit, follow in the background; the folder exists only once committed."""
    root = checkpoints_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    what = f"checkpoint step_{step} into {root}"
    if accelerator.is_main_process:
        restore_set_aside(output_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    with disk_full_is_one_line(output_dir, what, tmp):
        if write_extra is not None:
            write_extra(tmp)
        if async_writer is None:
            accelerator.save_state(tmp)  # model (safetensors), optimizer, scheduler, scaler, sampler, per-rank RNG
        if accelerator.is_main_process:
            if ema is not None:
                save_model(ema.module, os.path.join(tmp, EMA_FILE))
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(state, f, indent=2)

    def commit():  # main process, once every rank's files are in tmp
        with disk_full_is_one_line(output_dir, what, tmp):
            write_manifest(tmp, state)
        _commit(root, tmp, final, step)
        if save_total_limit:  # only committed (complete) folders are listed: the newest one always stays
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)

    if async_writer is not None:
        with disk_full_is_one_line(output_dir, what, tmp):
            # Only a full disk becomes a message here: the writer names any other failure itself ("in the background").
            guard = lambda: disk_full_is_one_line(output_dir, what, tmp, others=False)  # noqa: E731
            async_writer.start(tmp, commit, on_staged, guard=guard)
        return final
    if on_staged is not None:
        on_staged(tmp)
    accelerator.wait_for_everyone()  # every rank's files are in tmp
    if accelerator.is_main_process:
        commit()
    accelerator.wait_for_everyone()
    return final


def _folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, rel)) for rel in _files(path)) if os.path.isdir(path) else 0


# A full disk in words (errno ENOSPC/EDQUOT as text: safetensors' Rust writer, a message passed on by a library).
_NO_SPACE = ("No space left on device", "os error 28", "StorageFull", "Disk quota")
# torch.save's C++ writer (inline_container.cc) reports a short write without errno or cause (measured on a full
# tmpfs: "unexpected pos 576 vs 534", "basic_ios::clear: iostream error"): a full disk only when the disk is short.
_SHORT_WRITE = ("unexpected pos", "iostream error", "file write failed")
# Other write failures reported without an OSError: safetensors ("I/O error: ... (os error 1)"), torch ("open file
# failed with strerror: Permission denied").
_WRITE_FAILED = _SHORT_WRITE + ("os error", "strerror", "I/O error")


def is_disk_full(error: BaseException, folder: str, needed: int = 0) -> bool:
    """ENOSPC/EDQUOT as an OSError or in a library's words, or -- torch.save's C++ writer reports a full disk
    without errno -- a short write of torch's while the disk of `folder` has less room left than `needed` (what
    the write takes: a checkpoint of this run) or 1 MiB. Nothing else: a permission error or an object that cannot
    be pickled is not a full disk, however little room is left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if any(s in text for s in _NO_SPACE):
        return True
    if isinstance(error, OSError) or not any(s in text for s in _SHORT_WRITE):
        return False
    try:
        return shutil.disk_usage(folder).free < max(1 << 20, needed)
    except OSError:
        return False


def _cannot_pickle(error: BaseException) -> bool:
    """pickle's own error, or the AttributeError/TypeError it raises for a local object or a lock."""
    import pickle

    return isinstance(error, pickle.PicklingError) or (
        isinstance(error, (AttributeError, TypeError)) and "pickle" in str(error)
    )


@contextlib.contextmanager
def disk_full_is_one_line(output_dir: str, what: str, partial: str | None = None, others: bool = True):
    """A write under output_dir that fails for a known cause becomes one line saying which, where, and which
    checkpoint is the last good one (the newest complete one, which a failed write never touches):
    DiskFullError for a full disk (the partial folder or file is deleted, giving its space back), WriteError
    for a file that cannot be written (permissions, a read-only mount) or an object that cannot be pickled
    (`others=False`: these re-raise, for a caller that names them itself). Anything else re-raises as it is."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only the causes above become a message; anything else re-raises
        good = list_checkpoints(output_dir)
        full = is_disk_full(e, output_dir, _folder_size(good[-1]) if good else 0)
        pickling = not full and _cannot_pickle(e)
        if not full and not (
            others and (pickling or isinstance(e, OSError) or any(s in str(e) for s in _WRITE_FAILED))
        ):
            raise
        last = f"the last good checkpoint is step {_step_of(good[-1])} ({good[-1]})" if good else "no checkpoint yet"
        then = "resume with --resume_from_checkpoint latest" if good else "run it again"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        if full:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True) if os.path.isdir(partial) else _remove(partial)
            raise DiskFullError(
                f"The disk is full: writing {what} failed ({type(e).__name__}: {first}); {last}. Free space there, "
                f"then {then}."
            ) from None
        where = getattr(e, "filename", None) or partial or output_dir
        if pickling:
            raise WriteError(
                f"Writing {what} failed: {where}: an object cannot be pickled ({type(e).__name__}: {first}); "
                f"{last}. Make that object picklable or keep it out of the saved state, then {then}."
            ) from None
        cause = getattr(e, "strerror", None) or first
        raise WriteError(
            f"Writing {what} failed: {where}: {cause} ({type(e).__name__}); {last}. Make {os.path.dirname(where)} "
            f"writable (its permissions, a read-only mount, a locked file), then {then}."
        ) from None


def write_file_atomically(path: str, write, output_dir: str, what: str) -> str:
    """`write(tmp)`, fsync, then rename tmp to `path` and fsync the folder: a reader (or a kill) never sees half a
    file, and after a power loss the name points to the whole file or the old one (without the file's fsync the
    rename can reach the disk before the data). A failed write is one line (disk_full_is_one_line). The model
    files (model.safetensors, best/) of plain and sharded runs go here."""
    tmp = path + ".tmp"
    with disk_full_is_one_line(output_dir, what, tmp):
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)  # fsync can report the write's ENOSPC (delayed allocation): inside the guard
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return path


def _remove(path: str):
    with contextlib.suppress(OSError):
        os.remove(path)


def _step_of(path: str) -> int:
    return int(os.path.basename(path).split("_")[1])


def _commit(root: str, tmp: str, final: str, step: int):
    """Rename the written folder into place. A checkpoint of the same step already there (a resumed finished run
    writes its last step again) is first renamed aside to `.old_step_<N>` and deleted only after the new one is
    in place: a kill in between leaves `.old_step_<N>`, which restore_set_aside puts back. Never a moment without
    a complete step_<N>-or-its-copy on disk."""
    old = os.path.join(root, f".old_step_{step}")
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def restore_set_aside(output_dir: str) -> list[str]:
    """Put back a `.old_step_<N>` whose replacement never arrived (killed between _commit's two renames); delete
    one whose replacement is in place. Main process, before checkpoints are listed or written."""
    root = checkpoints_root(output_dir)
    restored = []
    for d in os.listdir(root) if os.path.isdir(root) else []:
        if m := _OLD_DIR.match(d):
            final = os.path.join(root, f"step_{m.group(1)}")
            if os.path.isdir(final):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            else:
                os.replace(os.path.join(root, d), final)
                restored.append(final)
    return restored


def set_aside_newer(output_dir: str, step: int) -> tuple[list[str], str | None]:
    """A run resumed from step K continues a new lineage: checkpoints in output_dir newer than K (a later
    attempt, or another run's) would be preferred by `latest` over this run's own. They are moved, not deleted,
    into `checkpoints/superseded-<time>/`. Returns (moved step folders, that folder)."""
    newer = [p for p in list_checkpoints(output_dir) if int(os.path.basename(p).split("_")[1]) > step]
    if not newer:
        return [], None
    aside = os.path.join(checkpoints_root(output_dir), f"superseded-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for path in newer:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    _fsync_dir(checkpoints_root(output_dir))
    return newer, aside


# ------------------------------------------------------------------------------------------------------- checking
def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


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
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' entry")
    except (ValueError, OSError) as e:
        raise CheckpointError(f"Checkpoint {path}: {file} is unreadable ({e}).") from None
    return manifest


def _why(e: BaseException) -> str:
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
                raise CheckpointError(f"Checkpoint {path}: {full} cannot be read ({_why(e)}).") from None
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
            digest = _hash_file(file, fsync=False)[1]
        except OSError as e:
            raise CheckpointError(f"Checkpoint {path}: {file} cannot be read ({_why(e)}).") from None
        if digest != meta["sha256"]:
            raise CheckpointError(f"Checkpoint {path}: {file} is corrupt (sha256 differs from {MANIFEST_FILE}).")
    check_state(path)
    check_safe_to_load(path, manifest)
    check_safetensors(path, manifest)
    check_dcp_metadata_safe(path, manifest)  # a sharded (FSDP) checkpoint's DCP metadata, read with plain pickle
    return manifest


def check_state(path: str):
    """trainer_state.json is a JSON object with the integers a resume reads."""
    file = os.path.join(path, STATE_FILE)
    try:
        state = read_state(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint {path}: {file} is missing or unreadable ({_why(e)}).") from None
    bad = [k for k in _STATE_KEYS if type(state.get(k)) is not int] if isinstance(state, dict) else ["everything"]
    if bad:
        raise CheckpointError(
            f"Checkpoint {path}: {file} lacks {', '.join(bad)} (integers): not the trainer state of a checkpoint."
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
                    f"Checkpoint {path}: {file} is not a readable safetensors file ({_why(e)})."
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
            load(file, map_location="cpu", mmap=True)
        except Exception as e:  # noqa: BLE001 - any failure means the file cannot be restored
            raise CheckpointError(
                f"Checkpoint {path}: {file} cannot be loaded safely ({_why(e)}). Pickled code "
                "and arbitrary objects are refused (weights_only=True) and were not run."
            ) from None


def _plain_key(name: str) -> str:
    """A tensor name without the wrappers' prefixes (DDP `module.`, torch.compile `_orig_mod.`)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


def check_compatible(path: str, model):
    """The checkpoint was written for a model with these tensor names and shapes. (Another world size is the
    Trainer's to judge: it re-computes the position in the data from the samples seen.)"""
    file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(file):
        return  # e.g. a sharded (FSDP) state: accelerate checks it while loading
    with safe_open(file, framework="pt") as f:
        found = {_plain_key(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    _check_shapes(path, file, found, model)


def _check_shapes(path: str, where: str, found: dict, model):
    """The tensor names and shapes `found` in a checkpoint are this model's (DTensors: their global shapes)."""
    state = model.state_dict()
    expected = {_plain_key(k): tuple(v.shape) for k, v in state.items()}
    problems = [
        f"{k}: {found[k]} in the checkpoint, {expected[k]} in this model"
        for k in expected
        if k in found and found[k] != expected[k]
    ]
    missing, extra = (
        sorted(set(expected) - set(found) - _tied_aliases(state, found)),
        sorted(set(found) - set(expected)),
    )
    if missing:
        problems.append(f"missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected tensors {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path}: {where} does not fit this model ({'; '.join(problems[:5])}). "
            "Resume with the model arguments the checkpoint was written with."
        )


def _tied_aliases(state: dict, found: dict) -> set[str]:
    """Names the checkpoint may lack because they are tied: the model's tensor under that name shares its storage
    with a tensor the checkpoint holds (GPT-2's lm_head.weight is its input embedding; Accelerate's save keeps
    one name of a shared tensor, clean_state_dict_for_safetensors). A name that is not tied in this model stays
    required, so a checkpoint of an untied model still fits only an untied one."""
    from accelerate.utils import id_tensor_storage

    groups: dict = {}
    for k, v in state.items():
        local = v.to_local() if hasattr(v, "to_local") else v  # a DTensor's storage is its local shard's
        if local.numel() == 0:  # empty tensors have no storage to share
            continue
        groups.setdefault((id_tensor_storage(local), local.storage_offset(), tuple(local.shape)), []).append(
            _plain_key(k)
        )
    aliases = set()
    for names in groups.values():
        if len(names) > 1 and any(n in found for n in names):
            aliases.update(n for n in names if n not in found)
    return aliases


# ------------------------------------------------------------------------------------------------------ resolving
def _say(msg: str):
    print(msg, file=sys.stderr, flush=True)


def resolve_resume_path(spec: str, output_dir: str, log=_say) -> str | None:
    """The verified folder `--resume_from_checkpoint` names: a folder, 'latest' (the newest good checkpoint in
    output_dir; an error if there is none) or 'auto' (the same, but None when there is no checkpoint at all).
    A bad newest checkpoint is skipped with a message naming the problem; the previous good one is used."""
    if spec.startswith("auto:"):  # an elastic restart of a run started from another folder: newest here first
        return resolve_resume_path("auto", output_dir, log) or resolve_resume_path(spec[5:], output_dir, log)
    if spec in ("latest", "auto"):
        for path in restore_set_aside(output_dir):
            log(f"Restored {path}: killed while the same step was being written again.")
        found = list_checkpoints(output_dir)
        if not found:
            if spec == "auto":
                return None
            ran = any(os.path.exists(os.path.join(output_dir, f)) for f in (MODEL_FILE, "run_config.json"))
            raise CheckpointError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_root(output_dir)}. "
                + (
                    previous_run_advice(output_dir)
                    if ran
                    else "Drop the flag to start a new run, or pass the folder of a checkpoint."
                )
            )
        errors = []
        for path in reversed(found):
            try:
                verify_checkpoint(path, log)
            except CheckpointError as e:
                errors.append(str(e))
                log(f"warning: skipping checkpoint {path}: {e}")
                continue
            if errors:
                log(
                    f"warning: resuming from {path}, the newest usable checkpoint ({len(errors)} newer one(s) "
                    "skipped, see above)."
                )
            return path
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: none of the {len(found)} checkpoint(s) in "
            f"{checkpoints_root(output_dir)} is usable; the newest: {errors[0]}"
        )
    if not os.path.isdir(spec):
        raise CheckpointError(
            f"--resume_from_checkpoint {spec}: no such folder. Pass a checkpoint folder "
            f"(output_dir/checkpoints/step_<N>), 'latest' or 'auto'."
        )
    if not os.path.isfile(os.path.join(spec, STATE_FILE)):
        raise CheckpointError(f"--resume_from_checkpoint {spec}: not a checkpoint of ours ({STATE_FILE} missing).")
    verify_checkpoint(spec, log)
    return spec


def previous_run_advice(output_dir: str) -> str:
    """What to do with an output_dir that holds a run, naming only ways that work: `latest` where a checkpoint
    can be continued, never for a run without one (`latest` would then refuse, advising to drop the flag)."""
    if list_checkpoints(output_dir):
        return (
            "Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to delete it and start "
            "over, or another --output_dir."
        )
    model = os.path.join(output_dir, MODEL_FILE)
    if os.path.isfile(model):
        return (
            f"That run finished and has no checkpoint to continue from; its model is {model}. To train again, pass "
            "--overwrite_output_dir (deletes that run) or another --output_dir."
        )
    return (
        "It has no checkpoint to continue from (it stopped before its first save): pass --overwrite_output_dir to "
        "delete it and start over, or another --output_dir."
    )


def resolve_on_main(accelerator, spec: str, output_dir: str) -> str | None:
    """resolve_resume_path on the main process only (one reader of the files); the others get its answer, or
    its error, so that every rank resumes from the same folder or every rank stops with the same message."""
    if accelerator.num_processes == 1:
        return resolve_resume_path(spec, output_dir)
    from accelerate.utils import broadcast_object_list

    answer = [None, None]
    if accelerator.is_main_process:
        try:
            answer = [resolve_resume_path(spec, output_dir), None]
        except CheckpointError as e:
            answer = [None, str(e)]
        except Exception as e:  # a bug: the others stop with its name instead of waiting at the broadcast
            broadcast_object_list(
                [None, f"--resume_from_checkpoint {spec}: the main process failed ({_why(e)})."], from_process=0
            )
            raise
    broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        raise CheckpointError(answer[1])
    return answer[0]


def remove_stale_tmp(output_dir: str) -> list[str]:
    """Delete `.tmp_step_*` folders that a killed save left behind (main process, before training)."""
    root = checkpoints_root(output_dir)
    stale = [os.path.join(root, d) for d in (os.listdir(root) if os.path.isdir(root) else []) if _TMP_DIR.match(d)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


# ------------------------------------------------------------------------------------------------------- resuming
def resume(accelerator, path: str, args, model, optimizer, *, ema=None, streaming=False, say=_say) -> tuple[dict, int]:
    """Load the verified checkpoint `path` into the run, on every rank; returns (its trainer state, this rank's
    micro-batch position in the epoch: resumed_position). The main process then tidies output_dir for the run
    that continues: interrupted writes removed, newer checkpoints set aside (`say` prints the first)."""
    saved = read_state(path)
    position = resumed_position(saved, path, args, accelerator.num_processes, streaming)
    state = load_checkpoint(accelerator, path, model, optimizer, ema=ema)
    if accelerator.is_main_process:
        for stale in remove_stale_tmp(args.output_dir):
            say(f"Removed {stale}: a checkpoint whose writing was interrupted.")
        moved, aside = set_aside_newer(args.output_dir, state["global_step"])
        if moved:  # said even when quiet: checkpoints were moved
            _say(
                f"warning: moved {', '.join(os.path.basename(p) for p in moved)} to {aside}: newer than "
                f"step_{state['global_step']}, which this run resumes from, so `latest` would prefer them over "
                "this run's own checkpoints. Delete that folder if you do not need it."
            )
    return state, position


def resumed_position(saved: dict, path: str, args, world: int, streaming: bool = False) -> int:
    """This rank's micro-batch position in the epoch for a checkpoint written by any world size. The order of
    an epoch's samples is a function of (seed, epoch) only, and each global micro-batch is the next
    per_device x processes samples of it, so the samples already seen are batch_in_epoch x per_device x
    processes: the same samples on any world size. Exact when the global batch is unchanged; the per-rank
    random streams are not (a rank that did not exist restarts from the seed)."""
    if streaming and saved["num_processes"] != world:
        raise CheckpointError(
            f"Checkpoint {path} was written by {saved['num_processes']} processes reading their own parts of "
            f"the stream; this run has {world}. A stream's position cannot move to another world size: resume "
            f"on {saved['num_processes']} processes."
        )
    old_micro = saved["per_device_train_batch_size"] * saved["num_processes"]
    old_global = old_micro * saved["gradient_accumulation_steps"]
    new_micro = args.per_device_train_batch_size * world
    new_global = new_micro * args.gradient_accumulation_steps
    if old_global != new_global and not args.allow_global_batch_change:
        raise CheckpointError(
            f"Checkpoint {path} was written with a global batch of {old_global} (per_device_train_batch_size="
            f"{saved['per_device_train_batch_size']} x gradient_accumulation_steps="
            f"{saved['gradient_accumulation_steps']} x {saved['num_processes']} processes); this run's is "
            f"{new_global}. Keep the global batch (e.g. --per_device_train_batch_size "
            f"{old_global // (args.gradient_accumulation_steps * world) or 1} on {world} processes), or pass "
            "--allow_global_batch_change to continue with another (not exact: see docs/fault-tolerance.md)."
        )
    seen = saved["batch_in_epoch"] * old_micro  # samples of this epoch already trained on
    window = new_micro * args.gradient_accumulation_steps
    return seen // window * args.gradient_accumulation_steps  # whole updates; exact when the batch is kept


# -------------------------------------------------------------------------------------------------------- loading
def load_checkpoint(accelerator, path: str, model, optimizer=None, ema=None) -> dict:
    """Restore everything save_checkpoint wrote (the folder was verified by resolve_*); returns the trainer state.
    `model`: the model being trained (wrapped or not), to check tensor names and shapes against first.

    A sharded checkpoint (written under FSDP: DCP folders) loads into an FSDP run on any number of processes
    with accelerator.load_state (DCP reshards), and into a run without FSDP (e.g. 2 FSDP processes -> 1) with
    load_resharded for the model and optimizer plus Accelerate's own loading of the rest. A full checkpoint
    (model.safetensors, a rank-local optimizer.bin) cannot be sharded into an FSDP run: refused."""
    from accelerate.utils import DistributedType

    sharded_run = accelerator.distributed_type == DistributedType.FSDP
    state = read_state(path)
    if is_sharded_checkpoint(path):
        check_compatible_sharded(path, model)
        if sharded_run:
            accelerator.load_state(path)
        else:
            load_sharded_into_unsharded(accelerator, path, model, optimizer)
    else:
        if sharded_run:
            raise CheckpointError(
                f"Checkpoint {path} was written without FSDP (one full model.safetensors and rank 0's optimizer "
                "state); resuming it sharded is not supported. Resume it with the launch it was written with (DDP), "
                "or start a new FSDP run."
            )
        check_compatible(path, model)
        accelerator.load_state(path)
    if ema is not None and os.path.isfile(os.path.join(path, EMA_FILE)):
        # "cpu", not "cpu:0": Accelerate gives multi-process CPU runs the device cpu:0, which safetensors refuses.
        device = "cpu" if accelerator.device.type == "cpu" else str(accelerator.device)
        load_model(ema.module, os.path.join(path, EMA_FILE), device=device)
        # The file holds the averaged weights only. AveragedModel copies the weights instead of averaging while its
        # n_averaged is 0, so a resumed EMA would restart from the current weights: set it to the updates applied
        # (every stepped update averaged once; fp16- and NaN-skipped ones did not).
        ema.n_averaged.fill_(state["global_step"] - state.get("skipped_steps", 0))
    return state


def load_sharded_into_unsharded(accelerator, path: str, model, optimizer):
    """A sharded checkpoint into a run without FSDP: the model and optimizer by DCP (load_resharded, exact bit for
    bit), then what accelerator.load_state restores besides, with Accelerate's own function (scheduler, sampler,
    scaler, this rank's RNG state; a rank the writing run did not have keeps its seeded RNG). Accelerate's
    load_state itself cannot: without FSDP it looks for model.safetensors and optimizer.bin."""
    from accelerate.checkpointing import load_accelerator_state

    load_resharded(path, model, optimizer)
    load_accelerator_state(
        path,
        [],
        [],
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.scaler,
        "cpu",
    )


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
_DCP_META = ".metadata"
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
            f"Checkpoint {path}: {file} cannot be loaded safely ({_why(e)}). Only the classes of "
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
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # what FileSystemReader's metadata holds
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
        ok = isinstance(index, MetadataIndex) and isinstance(index.fqn, str) and isinstance(info, _StorageInfo)
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
        if not os.path.basename(rel).endswith(_DCP_META):
            continue
        file = os.path.join(path, rel)
        _check_dcp_storage(path, file, read_dcp_metadata(path, file))


def _check_dcp_storage(path: str, file: str, meta):
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
                f"Checkpoint {path}: {shard} (item {index.fqn}) cannot be loaded safely ({_why(e)}). Pickled code "
                "and arbitrary objects are refused (weights_only=True) and were not run."
            ) from None


def is_sharded_checkpoint(path: str) -> bool:
    """A checkpoint whose model was saved sharded with DCP (an FSDP run)."""
    from accelerate.utils.constants import FSDP_MODEL_NAME

    return os.path.isfile(os.path.join(path, f"{FSDP_MODEL_NAME}_0", _DCP_META))


def load_resharded(path: str, model, optimizer=None, scheduler=None):
    """Restore the model (and optimizer, scheduler) of a sharded checkpoint into `model` as it is in this run:
    FSDP-sharded over any number of processes, DDP-wrapped or plain on one process. Every rank calls it (with
    several processes it is collective). Weights and optimizer state (AdamW's step, moments) come back bit for
    bit; what cannot move to another world size is the per-rank RNG state and a data position counted in
    per-rank micro-batches -- the caller decides about those. On the same world size, accelerator.load_state
    restores everything (it runs the same DCP load for model and optimizer)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folders = [f"{FSDP_MODEL_NAME}_0"] + ([f"{OPTIMIZER_NAME}_0"] if optimizer is not None else [])
    for folder in folders:  # torch's plain pickle.load reads them next: also when called on an unverified folder
        file = os.path.join(path, folder, _DCP_META)
        _check_dcp_storage(path, file, read_dcp_metadata(path, file))
    state = {"model": get_model_state_dict(model)}  # names without wrapper prefixes, this rank's shapes
    dcp.load(state, checkpoint_id=os.path.join(path, f"{FSDP_MODEL_NAME}_0"))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        opt = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> torch optimizer
        # get_optimizer_state_dict creates AdamW's state (a zero-lr step) so DCP has tensors to load into
        state = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=os.path.join(path, f"{OPTIMIZER_NAME}_0"))
        set_optimizer_state_dict(model, opt, state["optimizer"])
    if scheduler is not None:
        sched = getattr(scheduler, "scheduler", scheduler)  # AcceleratedScheduler -> torch scheduler
        sched.load_state_dict(torch.load(os.path.join(path, f"{SCHEDULER_NAME}.bin"), weights_only=True))


def check_compatible_sharded(path: str, model):
    """check_compatible's tensor names and shapes for a sharded checkpoint, from its DCP metadata (global
    shapes): a checkpoint of another model is an error naming the differences, not a failure deep inside DCP.
    Call after check_dcp_metadata_safe (this unpickles the model's `.metadata` with the same allow-list)."""
    from accelerate.utils.constants import FSDP_MODEL_NAME

    file = os.path.join(path, f"{FSDP_MODEL_NAME}_0", _DCP_META)
    meta = read_dcp_metadata(path, file)
    found = {k.split(".", 1)[1]: tuple(v.size) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    _check_shapes(path, os.path.dirname(file), found, model)
