"""Loading checkpoints you did not write: verify_checkpoint checks a folder before anything in it is loaded.

A checkpoint holds JSON and safetensors only (state.py), read by Python's json (strict: safe_read.read_json)
and by safetensors: neither can run code, whatever the bytes. What is checked, on the main process, before a
resume loads anything (a failure is one line naming the file, and `latest` falls back to the checkpoint before):

- the folder: only regular files and folders, no symbolic link, no file of a name the run reads that the manifest
  does not list, and no file of the older pickle-based format (.bin, .pkl, .pt, .distcp, .metadata: refused unread);
- the manifest: every file's size and sha256 (a truncated or damaged copy);
- trainer_state.json: the integers a resume reads, within the bounds a run writes, and the same step, epoch,
  position and world as the manifest and the folder's name;
- every JSON file: what codec.encode writes, of this format, with this checkpoint's step (a file copied in from
  another checkpoint is named), the model, optimizer, scheduler and each writing rank's RNG state all there;
- every counter against the step (counters.py): the scheduler's steps, the optimizer's per-parameter `step`, the
  data position, micro_batch_size, and run_args.json's batch, accumulation and world against trainer_state.json;
- every safetensors file: its header, no NaN in a floating tensor; sharded (FSDP) ones: each tensor's chunks
  cover its global shape exactly once (a chunk moved to another rank's place leaves a gap or an overlap), and the
  optimizer's references all resolve, each tensor used once.

Whether the checkpoint fits this run (tensor names, shapes and dtypes against the model and the optimizer, the
scheduler's fields, the global batch) is checked when it is loaded (resume.py), on every rank. The manifest is
integrity (a truncated or damaged copy), not authenticity: it comes with the checkpoint. See
docs/fault-tolerance.md.
"""

from __future__ import annotations

import math
import os
import re
import stat

from .. import safe_read
from ..errors import one_line, why
from . import codec
from . import state as ckpt_state
from .counters import check_counters
from .folder import EMA_FILE, MANIFEST_FILE, STATE_FILE, CheckpointError, hash_file
from .tensors import read_header, sharded_tensors

STREAM_FILE = re.compile(r"^data_state_rank(\d+)\.json$")  # a stream's per-rank position (streaming.py)
RNG_FILE = re.compile(r"^rng_state_(\d+)\.json$")
_TOP = {
    MANIFEST_FILE, STATE_FILE, EMA_FILE, ckpt_state.MODEL_FILE, ckpt_state.OPTIMIZER_FILE,
    ckpt_state.OPTIMIZER_TENSORS, ckpt_state.SCHEDULER_FILE, ckpt_state.SCALER_FILE, ckpt_state.FROZEN_FILE,
    ckpt_state.RECORD_FILE,
}  # fmt: skip
_SHARD_DIRS = (ckpt_state.SHARDED_MODEL, ckpt_state.SHARDED_OPTIMIZER)
# The files of accel-trainer <= 0.2's checkpoints (Accelerate's save_state, DCP's FileSystemWriter): pickles.
_PICKLE_FORMAT = (".bin", ".pkl", ".pt", ".pth", ".distcp", ".metadata")
_OLD_FORMAT_ADVICE = (
    "accel-trainer >= 0.3 reads no pickle from a checkpoint (docs/fault-tolerance.md); nothing in it was read. "
    "Resume it with the accel-trainer that wrote it (pip install 'accel-trainer<0.3'), or start a new run."
)
# The integers a resume reads: (least value a run writes, the bound past which no run gets).
_STATE_KEYS = {"global_step": (0, 1 << 40), "epoch": (0, 1 << 40), "batch_in_epoch": (0, 1 << 40),
               "num_processes": (1, 1 << 20), "per_device_train_batch_size": (1, 1 << 31),
               "gradient_accumulation_steps": (1, 1 << 31)}  # fmt: skip
_MANIFEST_KEYS = {"step": "global_step", "epoch": "epoch", "batch_in_epoch": "batch_in_epoch",
                  "num_processes": "num_processes"}  # fmt: skip


def read_json_file(path: str, file: str, max_bytes: int = safe_read.MAX_JSON_BYTES):
    try:
        return safe_read.read_json(file, max_bytes)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint {path}: {file} is unreadable ({why(e)}).") from None


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST_FILE)
    if not os.path.lexists(file):
        raise CheckpointError(
            f"Checkpoint {path}: no {MANIFEST_FILE}, so it is not a complete checkpoint written "
            "by accel-trainer; it cannot be verified."
        )
    manifest = read_json_file(path, file)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"Checkpoint {path}: {file} is unreadable (not a JSON object with a 'files' object).")
    if manifest.get("format") != ckpt_state.FORMAT:
        raise CheckpointError(
            f"Checkpoint {path}: {file} says format {manifest.get('format')!r}: written by an older accel-trainer "
            f"in Accelerate's pickle-based format. {_OLD_FORMAT_ADVICE}"
        )
    return manifest


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


def _read_by_us(rel: str) -> bool:
    """A file a resume reads (by its name)."""
    top, _, name = rel.partition(os.sep)
    if name:
        return top in _SHARD_DIRS and os.sep not in name and name.endswith(".safetensors")
    return rel in _TOP or bool(RNG_FILE.match(rel) or STREAM_FILE.match(rel))


def check_layout(path: str, manifest: dict, log=None):
    """What the folder holds, whatever its manifest says (links are never followed): only regular files and
    folders; no file of the pickle-based format; every file a resume reads listed in the manifest; every manifest
    entry a plain name inside the folder with an integer size and a sha256. A file nothing reads is named by
    `log` in a warning."""
    if os.path.islink(path):
        raise CheckpointError(
            f"Checkpoint {path} is a symbolic link to {os.path.realpath(path)}: a checkpoint is a folder the run "
            "wrote. Pass the folder it points to, or copy it (cp -rL)."
        )
    found = []
    pending = [""]
    while pending:
        folder = pending.pop()
        with os.scandir(os.path.join(path, folder)) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                rel = os.path.join(folder, entry.name)
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    raise CheckpointError(
                        f"Checkpoint {path}: {entry.path} is a symbolic link (to {os.path.realpath(entry.path)}); "
                        "a checkpoint holds only the files the run wrote. Copy the files themselves (cp -rL)."
                    )
                if entry.name.endswith(_PICKLE_FORMAT) or rel in ("pytorch_model_fsdp_0", "optimizer_0"):
                    raise CheckpointError(
                        f"Checkpoint {path}: {entry.path} is a file of the older, pickle-based checkpoint format. "
                        + _OLD_FORMAT_ADVICE
                    )
                if stat.S_ISDIR(mode):
                    pending.append(rel)
                elif stat.S_ISREG(mode):
                    found.append(rel)
                else:  # a FIFO would block the hashing forever, a device never end
                    raise CheckpointError(f"Checkpoint {path}: {entry.path} is not a regular file; refused.")
    files = manifest["files"]
    for rel, meta in files.items():
        if not _plain_relative(rel):
            raise CheckpointError(
                f"Checkpoint {path}: {MANIFEST_FILE} names {rel!r} ({os.path.normpath(os.path.join(path, str(rel)))})"
                ", which is not a plain path inside the checkpoint folder (absolute, or with '..'); refused."
            )
        size = meta.get("size") if isinstance(meta, dict) else None
        if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str) and type(size) is int and size >= 0):
            raise CheckpointError(
                f"Checkpoint {path}: {os.path.join(path, MANIFEST_FILE)} is malformed (entry {rel!r} has no integer "
                "size and sha256 string)."
            )
    for rel in found:
        if rel == MANIFEST_FILE or rel in files:
            continue
        if _read_by_us(rel):
            raise CheckpointError(
                f"Checkpoint {path}: {os.path.join(path, rel)} is not listed in {MANIFEST_FILE}, and resuming would "
                "read it; refused (added after the checkpoint was written?). Remove it, or use a checkpoint as it was "
                "written."
            )
        if log is not None:
            log(one_line(f"warning: checkpoint {path}: {os.path.join(path, rel)} is not listed in {MANIFEST_FILE}; "
                         "nothing reads it, ignored."))  # fmt: skip


def verify_checkpoint(path: str, log=None) -> dict:
    """Everything a resume from `path` reads, checked before any of it is loaded (the module's docstring). Returns
    the trainer state; raises CheckpointError naming the first bad file (one line). `log`: warnings."""
    manifest = read_manifest(path)
    check_layout(path, manifest, log)
    for rel, meta in manifest["files"].items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file) or os.path.islink(file):
            raise CheckpointError(f"Checkpoint {path}: {file} is missing (listed in {MANIFEST_FILE}).")
        size = os.path.getsize(file)
        if size != meta["size"]:
            raise CheckpointError(
                f"Checkpoint {path}: {file} is truncated or altered: {size} bytes, {meta['size']} expected."
            )
        if not _read_by_us(rel):  # hashing it would prove nothing a resume uses, and could read without end
            if log is not None:
                log(one_line(f"warning: checkpoint {path}: {file} is listed in {MANIFEST_FILE} but nothing reads "
                             "it; ignored."))  # fmt: skip
            continue
        _check_size_of_its_format(path, rel, file, size)  # before the hash reads it all
        try:
            digest = hash_file(file, fsync=False)[1]
        except OSError as e:
            raise CheckpointError(f"Checkpoint {path}: {file} cannot be read ({why(e)}).") from None
        if digest != meta["sha256"]:
            raise CheckpointError(f"Checkpoint {path}: {file} is corrupt (sha256 differs from {MANIFEST_FILE}).")
    state = check_state(path, manifest)
    check_complete(path, manifest, state)
    tensors = check_tensor_files(path, manifest, state["global_step"], state["num_processes"])
    check_counters(path, state, check_json_files(path, manifest, state, tensors))
    return state


def _check_size_of_its_format(path: str, rel: str, file: str, size: int) -> None:
    """A file's size against what its own format declares, read from its first bytes: a sparse file of terabytes
    listed with its true size would otherwise be hashed to its end (a resume that never ends, printing nothing)."""
    if rel.endswith(".json") and size > safe_read.MAX_JSON_BYTES:
        raise CheckpointError(
            f"Checkpoint {path}: {file} is {size} bytes, more than the {safe_read.MAX_JSON_BYTES} a checkpoint's JSON "
            "file holds; refused."
        )
    if rel.endswith(".safetensors"):
        from safetensors import safe_open

        try:  # safetensors checks that the header's offsets end where the file ends, reading the header only
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - any failure means the file cannot be restored
            raise CheckpointError(f"Checkpoint {path}: {file} is not a readable safetensors file ({why(e)}).") from None


def check_state(path: str, manifest: dict | None = None) -> dict:
    """trainer_state.json is a JSON object with the integers a resume reads, within what a run writes, and says
    what the manifest and the folder's name say; returns it."""
    file = os.path.join(path, STATE_FILE)
    state = read_json_file(path, file, 1 << 20)
    bad = [k for k in _STATE_KEYS if type(state.get(k)) is not int] if isinstance(state, dict) else ["everything"]
    if bad:
        said = (
            [f"{k} {str(state[k])[:40]}" if k in state else f"no {k}" for k in bad]
            if isinstance(state, dict)
            else [f"a {type(state).__name__}, not an object of counters"]
        )
        raise CheckpointError(
            f"Checkpoint {path}: {file} holds {', '.join(said)}, where an integer belongs: not the trainer state "
            "of a checkpoint."
        )
    step, skipped = state["global_step"], state.get("skipped_steps", 0)
    best, best_step = state.get("best_metric"), state.get("best_step")
    wrong = [f"{k} {state[k]}" for k, (least, most) in _STATE_KEYS.items() if not least <= state[k] < most]
    if type(skipped) is not int or not 0 <= skipped <= step:
        wrong.append(f"skipped_steps {skipped!r}")
    if best is not None and (type(best) not in (int, float) or not math.isfinite(best)):
        wrong.append(f"best_metric {best!r}")
    if best_step is not None and (type(best_step) is not int or not 0 <= best_step <= step):
        wrong.append(f"best_step {best_step!r}")
    if 0 <= step < state["epoch"]:  # every epoch has at least one update
        wrong.append(f"epoch {state['epoch']} at global_step {step}")
    optional = {  # what the run's components write besides: None, or a value of this kind
        "micro_batch_size": lambda v: type(v) is int and 1 <= v < 1 << 31,
        "items_per_rank": lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0,
        "evals_without_improvement": lambda v: type(v) is int and 0 <= v <= max(step, 0),
        "seed": lambda v: type(v) is int,
        "debug_steps": lambda v: type(v) is int and 0 <= v <= max(step, 0),
        "global_batch_changed_at": lambda v: type(v) is int and 0 <= v <= max(step, 0),
    }
    wrong += [f"{k} {state[k]!r}" for k, ok in optional.items() if state.get(k) is not None and not ok(state[k])]
    if wrong:
        raise CheckpointError(
            f"Checkpoint {path}: {file} holds {', '.join(str(w)[:80] for w in wrong)}, which no run writes (steps, "
            "epoch and position from 0, the epoch up to the step, processes and batch sizes from 1, skipped_steps and "
            "best_step up to global_step, best_metric a finite number or null): it cannot be resumed."
        )
    said = []
    if manifest is not None:
        said = [f"{k} {manifest.get(k)!r} in {MANIFEST_FILE}" for k, s in _MANIFEST_KEYS.items()
                if manifest.get(k) != state[s]]  # fmt: skip
    m = re.match(r"^step_(\d+)$", os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != step:
        said.append(f"the folder's name step_{m.group(1)}")
    if said:
        raise CheckpointError(
            f"Checkpoint {path}: {file} says global_step {step}, epoch {state['epoch']}, batch_in_epoch "
            f"{state['batch_in_epoch']}, num_processes {state['num_processes']}; disagreeing: {'; '.join(said)}. "
            "Its files do not belong together: resume from another checkpoint."
        )
    return state


def check_complete(path: str, manifest: dict, state: dict):
    """The manifest lists what every checkpoint of ours holds: the model, the optimizer and the scheduler and each
    writing rank's RNG state (and none of a rank that did not write)."""
    files, ranks = manifest["files"], state["num_processes"]
    sharded = any(rel.startswith(ckpt_state.SHARDED_MODEL + os.sep) for rel in files)
    needed = [ckpt_state.OPTIMIZER_FILE, ckpt_state.SCHEDULER_FILE, ckpt_state.RECORD_FILE]
    needed += [f"rng_state_{r}.json" for r in range(ranks)]
    if sharded and ckpt_state.MODEL_FILE in files:
        raise CheckpointError(
            f"Checkpoint {path}: {MANIFEST_FILE} lists both {ckpt_state.MODEL_FILE} and the shards of "
            f"{ckpt_state.SHARDED_MODEL}/: two sets of weights, of which a resume would take one. Resume from "
            "another checkpoint."
        )
    missing = [name for name in needed + ([] if sharded else [ckpt_state.MODEL_FILE]) if name not in files]
    extra = [rel for rel in files if (m := RNG_FILE.match(rel)) and int(m.group(1)) >= ranks]
    if missing or extra:
        names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        what = f"lists no {names}" if missing else f"lists {extra[0]}"
        raise CheckpointError(
            f"Checkpoint {path}: {MANIFEST_FILE} {what}, which a checkpoint written by {ranks} process(es) "
            f"{'holds' if missing else 'does not hold'}: it cannot continue the run it comes from. Resume from "
            "another checkpoint (--resume_from_checkpoint latest takes the newest complete one)."
        )


def trained_names(path: str, manifest: dict) -> set:
    """The model's tensors that train: the parameters the optimizer's param groups name (optimizer.json, read as
    JSON only: the names are in it as written)."""
    try:
        doc = safe_read.read_json(os.path.join(path, ckpt_state.OPTIMIZER_FILE))
        groups = doc["state"]["param_groups"]
        return {p for g in groups for p in g["params"] if isinstance(p, str)}
    except (OSError, ValueError, TypeError, KeyError):
        return set()  # check_json_files names what is wrong with it


def check_tensor_files(path: str, manifest: dict, step: int, ranks: int | None = None) -> dict:
    """Every safetensors file readable, NaN-free and of this step; the sharded folders' chunks tile their tensors.
    Returns {file group: {tensor name: (global shape, dtype)}} for the model, EMA and optimizer."""
    files = manifest["files"]
    trained = trained_names(path, manifest)
    out: dict = {}
    for rel, finite in ((ckpt_state.MODEL_FILE, trained), (EMA_FILE, trained), (ckpt_state.OPTIMIZER_TENSORS, True)):
        if rel in files:
            out[rel] = read_header(path, os.path.join(path, rel), step, True, finite)[0]
    for folder, finite in ((ckpt_state.SHARDED_MODEL, trained), (ckpt_state.SHARDED_OPTIMIZER, True)):
        shards = sorted(rel for rel in files if rel.startswith(folder + os.sep))
        if shards:
            out[folder] = sharded_tensors(path, [os.path.join(path, rel) for rel in shards], True, step, ranks, finite)
    return out


def check_json_files(path: str, manifest: dict, state: dict, tensors: dict) -> dict:
    """Every JSON state file decodes (codec.decode) and belongs to this step; the optimizer's references resolve to
    its tensor files, each tensor used once; each RNG state is a dict of generators. Returns {file name: its state},
    the optimizer's tensors as their names."""
    step = state["global_step"]
    decoded = {}
    for rel in manifest["files"]:
        if not rel.endswith(".json") or rel in (MANIFEST_FILE, STATE_FILE) or not _read_by_us(rel):
            continue
        file = os.path.join(path, rel)
        names = {}
        if rel == ckpt_state.OPTIMIZER_FILE:
            names = {**tensors.get(ckpt_state.OPTIMIZER_TENSORS, {}), **tensors.get(ckpt_state.SHARDED_OPTIMIZER, {})}
        used: set = set()
        value = decoded[rel] = read_state_file(path, file, step, {n: n for n in names}, used)
        if used != set(names):
            raise CheckpointError(
                f"Checkpoint {path}: {file} does not use the tensors {sorted(set(names) - used)[:3]} of its files: "
                "they do not belong together."
            )
        if rel == ckpt_state.RECORD_FILE:
            from . import record

            ok = isinstance(value, dict) and all(isinstance(value.get(k), dict) for k in ("training", "recipe"))
            if wrong := ("not the run's arguments" if not ok else record.problem(value)):
                raise CheckpointError(
                    f"Checkpoint {path}: {file}: {wrong}, not a value the run could have had (an edited or damaged "
                    "record). Resume from another checkpoint."
                )
        if RNG_FILE.match(rel):
            try:
                ckpt_state.check_rng_states(value)
            except ValueError as e:
                raise CheckpointError(
                    f"Checkpoint {path}: {file} {e}: the run would continue with other random numbers. Resume from "
                    "another checkpoint."
                ) from None
    return decoded


def read_state_file(path: str, file: str, step: int, tensors: dict | None = None, used: set | None = None):
    """A JSON state file of the checkpoint (state.write_json): its decoded state, checked to be of this format and
    of this checkpoint's step."""
    doc = read_json_file(path, file)
    if not (isinstance(doc, dict) and set(doc) == {"format", "step", "state"} and doc["format"] == ckpt_state.FORMAT):
        raise CheckpointError(f"Checkpoint {path}: {file} is not a state file of this format.")
    if doc["step"] != step:
        raise CheckpointError(
            f"Checkpoint {path}: {file} was written at step {doc['step']!r}, not at this checkpoint's step {step}: a "
            "file of another checkpoint. Resume from another checkpoint."
        )
    try:
        return codec.decode(doc["state"], tensors, used)
    except (codec.DecodeError, RecursionError) as e:
        raise CheckpointError(f"Checkpoint {path}: {file} holds what no run writes ({why(e)}).") from None


def is_sharded_checkpoint(path: str) -> bool:
    """A checkpoint whose model was saved sharded (an FSDP run): a folder of DCP safetensors shards."""
    return os.path.isdir(os.path.join(path, ckpt_state.SHARDED_MODEL))
