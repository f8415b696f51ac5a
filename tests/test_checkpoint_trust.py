"""Checkpoints you did not write, and output folders an unlucky operator left: a catalogue of attacks on real runs of
recipes/regression.py (1 process, and 2-process FSDP) and of a streamed causal_lm run, each resumed as a user would.

Every checkpoint here is crafted as an attacker would: the test's own code writes the bytes -- JSON, safetensors
headers (struct + json), pickles, FIFOs, links -- and re-hashes the manifest itself; nothing of accel_trainer's
writers is used. A crafted checkpoint is a copy of the run's step_8 relabelled step_<N> (N > 8: trainer_state,
manifest, each JSON file's "step", the safetensors "step" metadata, the scheduler's and the optimizer's step counts),
so that it is consistent, newer than the good step_8, and refused only for what the case changed.

The promise (README, docs/fault-tolerance.md), case by case, resumed by folder: nothing in a checkpoint runs code
(the case's marker file, which each payload creates when unpickled unsafely, never appears: test_the_payloads_are_live
shows each payload is live), the resume ends (no wait without a bound) with exit 1 and ONE line `error: ...` naming
the file (every rank says the same line) and no traceback from a process of the run; nothing of the run is lost or
overwritten; a second run on a running folder is refused. With `latest`, every crafted checkpoint of a run (all newer
than step_8) is skipped, naming it, and the run resumes from step_8 and trains on.

The five classes of issue 39, each on 1 process and FSDP:
- code execution: pickles under the old names (optimizer.bin, random_states_0.pkl, model/.metadata, .distcp), a
  pickle in place of the weights, a checkpoint of the pickle-based format;
- hangs: FIFOs and devices in a checkpoint, FIFOs named like leftover folders (.tmp_step_<N>) or like the lock, the
  run's log files as FIFOs in the output folder;
- lost: a second run on a running folder (the test holds the folder's OS lock, as the first run does), a checkpoints/
  linked into a running run's folder, the run's files as links out of the output folder;
- silent wrong resumes: files of another checkpoint of the same run (JSON, safetensors, DCP shards), DCP offsets
  moved to another rank's place, an optimizer state of another model size, int8, NaN and Inf weights, RNG states
  `{}` or of wrong types, a scheduler or epoch far ahead of global_step, a stream's position reset;
- tracebacks where a line belongs: size bombs (huge and deep JSON, a manifest linked to an 8 GiB file, safetensors
  headers that lie), duplicate JSON keys, NaN/huge/negative/bool values where integers belong, codec tags used
  wrongly (@tensor byte counts, unknown dtypes, unhashable @dict keys, @numpy out of range), optimizer param groups
  of other kinds, a batch_in_epoch past the epoch, read-only and full output folders.

Cases that fail today because of a product bug are marked xfail(strict=True) with the bug as the reason: remove the
mark once fixed. Cost: one finished run per kind (started together), every case's launch two at a time (hang-prone
ones in the background, bounded), two `latest` launches per kind.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RECIPES, ROOT, launch_cmd, launcher
from procs import Launch

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py)

SCRIPT = os.path.join(RECIPES, "regression.py")
ARGS = ["--save_steps", "4", "--logging_steps", "1", "--disable_tqdm"]
PER_DEVICE = {"1": ["--per_device_train_batch_size", "16"], "fsdp": ["--per_device_train_batch_size", "8"]}
BATCHES_PER_EPOCH = 16  # 256 samples / 16 per update, on either kind
DEADLINE = 240  # seconds any launch may take on a loaded 2-core machine
HANG_DEADLINE = 90  # a launch that may hang (a FIFO in the output folder): started first, in the background
KINDS = ("1", "fsdp")


# ================================================================================================ the attacker's tools
class Payload:
    """Unpickling this runs a shell command that creates `marker`: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def torch_payload(marker) -> bytes:
    """A torch.save zip whose data.pkl runs the command (torch.load(weights_only=False), Accelerate's old loads)."""
    buf = io.BytesIO()
    torch.save({"state": Payload(marker)}, buf)
    return buf.getvalue()


def plain_payload(marker) -> bytes:
    """A plain pickle that runs the command (DCP's FileSystemReader read .metadata with pickle.load)."""
    return pickle.dumps(Payload(marker))


def rehash(folder: Path, skip=()):
    """What an attacker does after altering files: a manifest listing every regular file with its size and sha256."""
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            if rel == "manifest.json" or rel in skip or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            data = open(path, "rb").read()
            files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["files"] = dict(sorted(files.items()))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def edit_json(path: Path, change):
    """Load a JSON file, let `change(obj)` alter it in place, write it back (Python's json, not the codec)."""
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj, indent=1))


def st_read(path: Path) -> tuple[dict, bytes]:
    """A safetensors file as (its JSON header, the bytes after it)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def st_write(path: Path, header: dict | None, data: bytes, raw_header: bytes | None = None):
    head = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I8": np.int8, "I64": np.int64, "U8": np.uint8}
_CODES = {np.dtype(v).name: k for k, v in _DTYPES.items()}


def st_load(path: Path) -> tuple[dict, dict]:
    """({name: numpy array}, metadata) of a safetensors file, read by hand."""
    header, data = st_read(path)
    meta = header.pop("__metadata__", {})
    out = {}
    for name, entry in header.items():
        a, b = entry["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"]).copy()
    return out, meta


def st_save(path: Path, tensors: dict, meta: dict | None):
    header, chunks, offset = ({"__metadata__": meta} if meta is not None else {}), [], 0
    for name in sorted(tensors):
        raw = np.array(tensors[name], order="C", copy=True)  # (ascontiguousarray would make a 0-d step 1-d)
        data = raw.tobytes()
        header[name] = {
            "dtype": _CODES[raw.dtype.name],
            "shape": list(raw.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    st_write(path, header, b"".join(chunks))


def st_edit(path: Path, change):
    """`change(tensors, metadata)` alters a safetensors file's tensors (numpy) and metadata in place."""
    tensors, meta = st_load(path)
    change(tensors, meta)
    st_save(path, tensors, meta)


def relabel(folder: Path, step: int):
    """A good checkpoint made to say `step` everywhere, as a careful forger would: then it is refused only for what a
    case changes on top."""
    state = json.loads((folder / "trainer_state.json").read_text())
    delta = step - state["global_step"]
    state["global_step"] = step
    state["epoch"], state["batch_in_epoch"] = divmod(step, BATCHES_PER_EPOCH)
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.suffix == ".json" and rel not in ("manifest.json", "trainer_state.json"):
            doc = json.loads(path.read_text())
            doc["step"] = step
            if rel == "scheduler.json":
                doc["state"]["last_epoch"] += delta
                doc["state"]["_step_count"] += delta
            path.write_text(json.dumps(doc, indent=1))
        elif path.suffix == ".safetensors":

            def restep(tensors, meta):
                for name in tensors:
                    if name.endswith(".step"):  # Adam's per-parameter step count
                        tensors[name] = tensors[name] + np.float32(delta)
                if "step" in meta:
                    meta["step"] = str(step)

            st_edit(path, restep)
            if re.search(r"\.step_\d+\.safetensors$", path.name):  # DCP shards are named for their step
                path.rename(path.with_name(re.sub(r"\.step_\d+\.", f".step_{step}.", path.name)))
    edit_json(
        folder / "manifest.json",
        lambda m: m.update(step=step, epoch=state["epoch"], batch_in_epoch=state["batch_in_epoch"]),
    )
    rehash(folder)


def hold_lock(out: Path) -> int:
    """What a running run does to its output folder: an exclusive flock on .accel-trainer.lock, with who holds it."""
    fd = os.open(out / ".accel-trainer.lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now", "command": "the first run"}
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (links not followed) with its bytes' sha256: to show nothing was touched."""
    out = {}
    for dirpath, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            out[os.path.relpath(path, folder)] = (
                hashlib.sha256(open(path, "rb").read()).hexdigest() if stat.S_ISREG(mode) else stat.S_IFMT(mode)
            )
    return out


# ============================================================================================================ cases
@dataclass
class Ctx:
    """What a case works on: `folder` the crafted checkpoint (a relabelled copy of step_8; None for a case on the
    output folder), `out` the run's output folder (a copy of a finished run), `spec` what --resume_from_checkpoint
    gets. A case may change `out` and `spec`, add `cleanups`, and set `check` (its own assertion)."""

    kind: str
    out: Path
    folder: Path | None
    marker: Path
    outside: Path
    spec: str
    cleanups: list = field(default_factory=list)
    check: object = None

    @property
    def root(self) -> Path:
        return self.out / "checkpoints"

    def shards(self, part: str = "model") -> list[Path]:
        return sorted((self.folder / part).iterdir())

    def weights(self) -> list[Path]:
        """The model's weight files: model.safetensors, or every rank's DCP shard."""
        return [self.folder / "model.safetensors"] if self.kind == "1" else self.shards()

    def good(self, rel: str) -> Path:
        return self.root / "step_4" / rel


@dataclass
class Case:
    name: str
    craft: object  # craft(ctx) -> what the error line must name: a path, or a list of strings (None: the folder)
    kinds: dict  # kind -> None (passes today) or the product bug that makes it fail (xfail strict)
    level: str = "checkpoint"  # "checkpoint": resumed by folder, and in the `latest` runs; "run": resumed with latest
    loaded: bool = False  # refused only when loaded (after `latest` chose it), not by the verifier
    background: bool = False  # may hang: launched first, alongside the others, with HANG_DEADLINE
    mount: str | None = None  # "full" or "ro": the run copied onto a small tmpfs first (root only)
    max_steps: int = 10  # the resumed run's --max_steps


CASES: list[Case] = []


def case(kinds: dict, **kw):
    def register(fn):
        CASES.append(Case(fn.__name__, fn, kinds, **kw))
        return fn

    return register


BOTH = {"1": None, "fsdp": None}
ONE = {"1": None}
FSDP = {"fsdp": None}

# ------------------------------------------------------------------------------------------------ code execution


@case(ONE)
def pickle_listed(c: Ctx):
    (c.folder / "optimizer.bin").write_bytes(torch_payload(c.marker))  # Accelerate's old name, honestly listed
    rehash(c.folder)
    return c.folder / "optimizer.bin"


@case(BOTH)
def pickle_unlisted(c: Ctx):
    rel = "random_states_0.pkl" if c.kind == "1" else "optimizer/__0_0.distcp"
    (c.folder / rel).write_bytes(torch_payload(c.marker))
    return c.folder / rel


@case(FSDP)
def dcp_metadata_pickle(c: Ctx):
    (c.folder / "model").mkdir(exist_ok=True)  # on 1 process this makes the checkpoint look sharded
    (c.folder / "model" / ".metadata").write_bytes(plain_payload(c.marker))
    rehash(c.folder)
    return c.folder / "model" / ".metadata"


@case(ONE)
def pickle_as_weights(c: Ctx):
    target = c.weights()[0]
    target.write_bytes(torch_payload(c.marker))
    rehash(c.folder)
    return target


@case(ONE)
def pickle_format_checkpoint(c: Ctx):
    (c.folder / "pytorch_model_fsdp_0").mkdir()
    (c.folder / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(torch_payload(c.marker))
    rehash(c.folder)
    edit_json(c.folder / "manifest.json", lambda m: m.update(format=1))
    return c.folder / "manifest.json"


# ------------------------------------------------------------------------------------------------------------ hangs


@case(BOTH)
def fifo_in_checkpoint(c: Ctx):
    os.mkfifo(c.folder / "notes")  # hashing it would block forever
    return c.folder / "notes"


@case(ONE)
def device_as_json(c: Ctx):
    os.remove(c.folder / "scheduler.json")
    try:
        os.mknod(c.folder / "scheduler.json", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: never ends
    except PermissionError:
        os.mkfifo(c.folder / "scheduler.json")
    return c.folder / "scheduler.json"


@case({"1": None, "fsdp": None}, level="run")  # fmt: skip
def fifo_named_like_a_leftover(c: Ctx):
    os.mkfifo(c.root / ".tmp_step_99")
    return c.root / ".tmp_step_99"


@case({"1": None}, level="run", background=True)  # fmt: skip
def fifos_in_the_output_folder(c: Ctx):
    for name in ("run_config.json", "metrics.jsonl"):
        os.remove(c.out / name)
        os.mkfifo(c.out / name)
    return [("run_config.json", "metrics.jsonl")]  # either one


@case({"1": None}, level="run")  # fmt: skip
def fifo_as_the_lock(c: Ctx):
    os.remove(c.out / ".accel-trainer.lock")
    os.mkfifo(c.out / ".accel-trainer.lock")
    return c.out / ".accel-trainer.lock"


# ---------------------------------------------------------------------------------------- links, names, traversal


@case(ONE)
def link_to_the_same_bytes(c: Ctx):
    target = c.outside / "scheduler.json"  # the very same bytes: the manifest's hash still matches
    shutil.move(c.folder / "scheduler.json", target)
    os.symlink(target, c.folder / "scheduler.json")
    return c.folder / "scheduler.json"


@case(FSDP)
def linked_shard_folder(c: Ctx):
    shutil.move(c.folder / "model", c.outside / "model")
    os.symlink(c.outside / "model", c.folder / "model")
    return c.folder / "model"


@case(ONE)
def manifest_linked_to_a_huge_file(c: Ctx):
    with open(c.outside / "huge", "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that costs nothing
    os.remove(c.folder / "manifest.json")
    os.symlink(c.outside / "huge", c.folder / "manifest.json")
    return c.folder / "manifest.json"


@case(ONE)
def step_folder_is_a_link(c: Ctx):
    real = c.outside / c.folder.name
    shutil.move(c.folder, real)
    os.symlink(real, c.folder)
    return c.folder


@case(ONE)
def traversal_in_the_manifest(c: Ctx):
    edit_json(
        c.folder / "manifest.json",
        lambda m: m["files"].update({"../step_8/trainer_state.json": m["files"]["trainer_state.json"]}),
    )
    return c.folder / "manifest.json"


@case({"1": None})  # fmt: skip
def newline_in_a_manifest_name(c: Ctx):
    fake = "notes\nerror: nothing is wrong, resuming"
    edit_json(c.folder / "manifest.json", lambda m: m["files"].update({fake: {"size": 1, "sha256": "0" * 64}}))
    return c.folder / "manifest.json"


@case({"1": None}, level="run")  # fmt: skip
def links_out_of_the_output_folder(c: Ctx):
    victims = {}
    for name in ("run_config.json", "metrics.jsonl"):
        victim = c.outside / f"precious-{name}"
        victim.write_text("precious\n")
        os.remove(c.out / name)
        os.symlink(victim, c.out / name)
        victims[victim] = "precious\n"

    def untouched(result) -> list[str]:
        changed = [str(v) for v, text in victims.items() if v.read_text() != text]
        return [f"files outside the output folder written through links: {changed}"] if changed else []

    c.check = untouched
    return []


# ------------------------------------------------------------------------------------------------------ size bombs


@case(ONE)
def huge_json(c: Ctx):
    (c.folder / "scheduler.json").write_text('{"format": 2, "step": 0, "state": {"pad": "' + "x" * (65 << 20) + '"}}')
    rehash(c.folder)
    return c.folder / "scheduler.json"


@case(ONE)
def deep_json(c: Ctx):
    (c.folder / "scheduler.json").write_text('{"format": 2, "step": 0, "state": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rehash(c.folder)
    return c.folder / "scheduler.json"


@case(ONE)
def header_claims_a_huge_shape(c: Ctx):
    target = c.weights()[0]
    header, data = st_read(target)
    header["0.bias"]["shape"] = [1 << 40, 1 << 40]
    st_write(target, header, data)
    rehash(c.folder)
    return target


@case({"fsdp": None})  # fmt: skip
def deep_sharding_info(c: Ctx):
    target = c.shards()[0]
    header, data = st_read(target)
    header["__metadata__"]["DCP_SHARDING_INFO"] = "[" * 100_000 + "]" * 100_000
    st_write(target, header, data)
    rehash(c.folder)
    return target


# ------------------------------------------------------------------------------------- JSON values and codec tags


@case(ONE)
def duplicate_keys(c: Ctx):
    raw = (c.folder / "trainer_state.json").read_text()
    step = json.loads(raw)["global_step"]
    (c.folder / "trainer_state.json").write_text(
        raw.replace(f'"global_step": {step},', f'"global_step": {step}, "global_step": 1000,')
    )
    rehash(c.folder)
    return c.folder / "trainer_state.json"


@case(ONE)
def epoch_2_70(c: Ctx):
    edit_json(c.folder / "trainer_state.json", lambda s: s.update(epoch=2**70))
    edit_json(c.folder / "manifest.json", lambda m: m.update(epoch=2**70))
    rehash(c.folder)
    return c.folder / "manifest.json"  # read first: the safe reader refuses the integer beyond 64 bits there


@case(ONE)
def num_processes_1e12(c: Ctx):
    edit_json(c.folder / "trainer_state.json", lambda s: s.update(num_processes=10**12))
    edit_json(c.folder / "manifest.json", lambda m: m.update(num_processes=10**12))
    rehash(c.folder)
    return c.folder / "trainer_state.json"


@case(ONE)
def bool_for_int(c: Ctx):
    edit_json(c.folder / "trainer_state.json", lambda s: s.update(per_device_train_batch_size=True))
    rehash(c.folder)
    return c.folder / "trainer_state.json"


@case(ONE)
def inline_tensor_of_the_wrong_size(c: Ctx):
    edit_json(c.folder / "rng_state_0.json", lambda d: d["state"]["torch"]["@tensor"].update(shape=[17]))
    rehash(c.folder)
    return c.folder / "rng_state_0.json"


@case({"1": None})  # fmt: skip
def unhashable_dict_key(c: Ctx):
    edit_json(
        c.folder / "scheduler.json", lambda d: d["state"].update(lr_lambdas=[{"@dict": [[{"@tuple": [[1]]}, 1]]}])
    )
    rehash(c.folder)
    return c.folder / "scheduler.json"


@case({"1": None})  # fmt: skip
def numpy_scalar_out_of_range(c: Ctx):
    edit_json(
        c.folder / "rng_state_0.json",
        lambda d: d["state"]["numpy"]["@tuple"].__setitem__(2, {"@numpy": ["uint8", 300]}),
    )
    rehash(c.folder)
    return c.folder / "rng_state_0.json"


# ------------------------------------------------------------------------------------ consistency, silent resumes


@case(ONE)
def step_of_another_folder(c: Ctx):
    edit_json(c.folder / "trainer_state.json", lambda s: s.update(global_step=1000))
    edit_json(c.folder / "manifest.json", lambda m: m.update(step=1000))
    rehash(c.folder)
    return c.folder / "trainer_state.json"


@case(ONE)
def json_of_another_checkpoint(c: Ctx):
    shutil.copy(c.good("scheduler.json"), c.folder / "scheduler.json")
    rehash(c.folder)
    return c.folder / "scheduler.json"


@case({"1": None, "fsdp": None})  # fmt: skip
def weights_of_another_checkpoint(c: Ctx):
    for target in c.weights():  # a careless copy: step_4's files as they are, over this checkpoint's
        target.unlink()
        source = c.good(str(target.relative_to(c.folder)))
        if c.kind != "1":  # DCP shards: step_4's, under their own names
            source = next(source.parent.glob(re.sub(r"\.step_\d+\.", ".step_*.", source.name)))
        shutil.copy(source, target.parent / source.name)
    rehash(c.folder)
    return c.weights()[0] if c.kind == "1" else c.folder / "model"


@case({"fsdp": None})  # fmt: skip
def shard_offsets_swapped(c: Ctx):
    a, b = c.shards()
    (ha, da), (hb, db) = st_read(a), st_read(b)
    info = "DCP_SHARDING_INFO"
    ha["__metadata__"][info], hb["__metadata__"][info] = hb["__metadata__"][info], ha["__metadata__"][info]
    st_write(a, ha, da)
    st_write(b, hb, db)
    rehash(c.folder)
    return c.folder / "model"


@case(FSDP)
def shard_offsets_overlap(c: Ctx):
    target = c.shards()[1]
    header, data = st_read(target)
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info["0.weight"]["saved_offsets"] = [8, 0]
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    st_write(target, header, data)
    rehash(c.folder)
    return [str(c.folder), "0.weight"]


@case({"fsdp": None})  # fmt: skip
def empty_chunk_at_a_ranks_offsets(c: Ctx):
    model = c.folder / "model"
    for i in range(50):  # torch's reader takes the last file listed for a chunk's offsets: make it ours
        extra = model / f"x{i}.safetensors"
        st_save(extra, {"0.weight": np.zeros((0, 16), dtype=np.float32)},
                {"DCP_SHARDING_INFO": json.dumps({"0.weight": {"saved_offsets": [0, 0]}})})  # fmt: skip
        if os.listdir(model)[-1] == extra.name:
            break
        os.remove(extra)
    rehash(c.folder)
    return c.folder / "model"


@case(ONE)
def rng_state_empty(c: Ctx):
    edit_json(c.folder / "rng_state_0.json", lambda d: d.update(state={}))
    rehash(c.folder)
    return c.folder / "rng_state_0.json"


@case({"1": None, "fsdp": None}, loaded=True)  # fmt: skip
def rng_state_of_wrong_types(c: Ctx):
    rel = "rng_state_0.json" if c.kind == "1" else "rng_state_1.json"
    edit_json(c.folder / rel, lambda d: d.update(state={"python": "x", "numpy": 1, "torch": [1]}))
    rehash(c.folder)
    return c.folder / rel


@case({"1": None}, loaded=True)  # fmt: skip
def rng_state_out_of_range(c: Ctx):
    edit_json(
        c.folder / "rng_state_0.json", lambda d: d["state"]["python"]["@tuple"][1]["@tuple"].__setitem__(0, 2**70)
    )
    rehash(c.folder)
    return c.folder / "rng_state_0.json"


@case(ONE, loaded=True)
def weights_as_int8(c: Ctx):
    for target in c.weights():
        st_edit(target, lambda t, m: t.update({"0.weight": (t["0.weight"] * 100).astype(np.int8)}))
    rehash(c.folder)
    return c.weights()[0] if c.kind == "1" else c.folder / "model"


@case(BOTH)
def weights_nan(c: Ctx):
    target = c.weights()[0]
    st_edit(target, lambda t, m: t["0.weight"].__setitem__((0, 0), np.nan))
    rehash(c.folder)
    return target


@case({"1": None})
def weights_inf(c: Ctx):
    target = c.weights()[0]
    st_edit(target, lambda t, m: t["0.weight"].__setitem__((0, 0), np.inf))
    rehash(c.folder)
    return target


@case({"1": None})  # fmt: skip
def two_sets_of_weights(c: Ctx):
    tensors, _ = st_load(c.good("model.safetensors"))
    (c.folder / "model").mkdir()
    info = {k: {"saved_offsets": [0] * v.ndim} for k, v in tensors.items()}
    st_save(
        c.folder / "model" / "shard-00001-model-00001-of-00001.safetensors",
        tensors,
        {"DCP_SHARDING_INFO": json.dumps(info)},
    )
    rehash(c.folder)
    return c.folder / "model"


@case(BOTH, loaded=True)
def optimizer_of_another_model_size(c: Ctx):
    if c.kind == "1":
        st_edit(c.folder / "optimizer.safetensors",
                lambda t, m: t.update({k: np.zeros((64,) + v.shape[1:], np.float32) for k, v in t.items()
                                       if k.startswith("state.0.") and not k.endswith(".step")}))  # fmt: skip
    else:
        for r, shard in enumerate(c.shards("optimizer")):

            def grow(t, m, r=r):
                info = json.loads(m["DCP_SHARDING_INFO"])
                for k in [k for k in t if k.startswith("state.0.")]:
                    t[k] = np.zeros((32,) + t[k].shape[1:], np.float32)
                    info[k]["saved_offsets"][0] = 32 * r
                m["DCP_SHARDING_INFO"] = json.dumps(info)

            st_edit(shard, grow)
    rehash(c.folder)
    return [str(c.folder), "optimizer"]


@case({"1": None})  # fmt: skip
def optimizer_references_swapped(c: Ctx):
    def swap(d):
        s = d["state"]["state"]
        s["0.bias"]["exp_avg"], s["3.bias"]["exp_avg"] = s["3.bias"]["exp_avg"], s["0.bias"]["exp_avg"]

    edit_json(c.folder / "optimizer.json", swap)
    rehash(c.folder)
    return c.folder / "optimizer.json"


@case({"1": None})  # fmt: skip
def param_group_of_another_kind(c: Ctx):
    edit_json(c.folder / "optimizer.json", lambda d: d["state"]["param_groups"][0].update(lr="0.01"))
    rehash(c.folder)
    return c.folder / "optimizer.json"


@case({"1": None})  # fmt: skip
def optimizer_step_count_negative(c: Ctx):
    st_edit(c.folder / "optimizer.safetensors",
            lambda t, m: t.update({k: np.array(-1.0, np.float32) for k in t if k.endswith(".step")}))  # fmt: skip
    rehash(c.folder)
    return [str(c.folder), "optimizer"]


@case({"1": None})  # fmt: skip
def nan_learning_rate(c: Ctx):
    edit_json(c.folder / "optimizer.json", lambda d: d["state"]["param_groups"][0].update(lr=float("nan")))
    rehash(c.folder)
    return c.folder / "optimizer.json"


@case(ONE, loaded=True)
def scheduler_with_extra_keys(c: Ctx):
    edit_json(c.folder / "scheduler.json", lambda d: d["state"].update(optimizer="x", __class__="y"))
    rehash(c.folder)
    return c.folder / "scheduler.json"


@case({"1": None})  # fmt: skip
def scheduler_far_ahead(c: Ctx):
    edit_json(c.folder / "scheduler.json", lambda d: d["state"].update(last_epoch=10**6))
    rehash(c.folder)
    return c.folder / "scheduler.json"


@case({"1": None})  # fmt: skip
def epoch_far_ahead(c: Ctx):
    edit_json(c.folder / "trainer_state.json", lambda s: s.update(epoch=2**39))
    edit_json(c.folder / "manifest.json", lambda m: m.update(epoch=2**39))
    rehash(c.folder)
    return c.folder / "trainer_state.json"


@case({"1": None})  # fmt: skip
def batch_past_the_epoch(c: Ctx):
    edit_json(c.folder / "trainer_state.json", lambda s: s.update(batch_in_epoch=1000))
    edit_json(c.folder / "manifest.json", lambda m: m.update(batch_in_epoch=1000))
    rehash(c.folder)
    return c.folder / "trainer_state.json"


# ------------------------------------------------------------------------------------- lost: two runs, one folder


@case(BOTH, level="run")
def second_run_on_a_running_folder(c: Ctx):
    fd = hold_lock(c.out)  # the first run
    c.cleanups.append(lambda: os.close(fd))
    before = snapshot(c.root)
    c.check = lambda result: [] if snapshot(c.root) == before else ["the running run's checkpoints changed"]
    return [f"{c.out} is in use by another run (process {os.getpid()} "]


@case({"1": None},
      level="run", max_steps=12)  # fmt: skip
def checkpoints_linked_into_a_running_run(c: Ctx):
    fd = hold_lock(c.out)  # the first run, in c.out
    c.cleanups.append(lambda: os.close(fd))
    before = snapshot(c.root)
    first = c.root
    c.out = c.out.parent / "second"
    c.out.mkdir()
    os.symlink(first, c.out / "checkpoints")
    c.check = lambda result: [] if snapshot(first) == before else ["the running run's checkpoints were written over"]
    return []


# ------------------------------------------------------------------------------------ read-only and full folders


@case(FSDP, level="run", mount="ro")
def read_only_output_folder(c: Ctx):
    return [str(c.out), "Read-only file system"]


@case({"1": None, "fsdp": None}, level="run", mount="full")  # fmt: skip
def full_output_folder(c: Ctx):
    return [str(c.out), "disk is full"]


# ====================================================================================================== the harness
def command(kind: str, out, *extra) -> list[str]:
    return launcher(kind) + [SCRIPT, "--output_dir", str(out)] + ARGS + PER_DEVICE[kind] + list(extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One finished run per kind (started together: they are mostly start-up time): step_4 and step_8."""
    d = tmp_path_factory.mktemp("trust")
    started = {kind: Launch(command(kind, d / kind, "--max_steps", "8"), str(d / f"{kind}.log"), deadline=DEADLINE)
               for kind in KINDS}  # fmt: skip
    try:
        for run in started.values():
            run.wait_ok()
    finally:
        for run in started.values():
            run.stop()
    return d


@dataclass
class Result:
    rc: int | None  # None: still running at its deadline (killed)
    log: str
    problems: list = field(default_factory=list)
    skipped: str | None = None


def crafted_copy(runs: Path, kind: str, dest: Path, cases: list[Case], first_step: int = 9) -> dict:
    """The finished run of `kind` copied to `dest` with a crafted checkpoint per case (step_9, step_10, ...; the
    case's craft applied on a relabelled copy of step_8). Returns {case name: (ctx, what its refusal names)}."""
    shutil.copytree(runs / kind, dest)
    out = {}
    for i, c in enumerate(cases):
        folder = dest / "checkpoints" / f"step_{first_step + i}"
        shutil.copytree(dest / "checkpoints" / "step_8", folder)
        relabel(folder, first_step + i)
        ctx = Ctx(kind, dest, folder, dest.parent / f"pwned-{c.name}", dest.parent / f"outside-{c.name}", str(folder))
        ctx.outside.mkdir(exist_ok=True)
        out[c.name] = (ctx, c.craft(ctx))
    return out


def named_strings(ctx: Ctx, named) -> list:
    """What the error line must name: each entry a string, a tuple of alternatives, or a file (a Path: its path, or
    the checkpoint's folder and the file's name, as in "Checkpoint <folder>: manifest.json names ...")."""
    if named is None:
        return [str(ctx.folder)]
    out = []
    for n in named if isinstance(named, list) else [named]:
        if isinstance(n, Path) and ctx.folder is not None and n.parent == ctx.folder:
            n = (str(n), (str(ctx.folder), n.name))
        out.append(str(n) if isinstance(n, Path) else n)
    return out


def refusal_problems(kind: str, ctx: Ctx, named: list, rc, log: str) -> list[str]:
    """The promise for one resume: bounded, exit 1, one `error:` line (every rank the same) naming `named` (each
    entry a string, or a tuple of alternatives), no traceback from a process of the run, no rank saying it resumed,
    the marker never made."""
    problems = []
    if ctx.marker.exists():
        return ["THE PAYLOAD RAN"]
    if rc is None:
        return [f"still running after its deadline (killed); log ends {log[-1500:]!r}"]
    errors = sorted({line for line in log.splitlines() if line.startswith("error: ")})
    # under accelerate launch its launcher then prints torch elastic's report of the failed workers: a
    # ChildFailedError traceback of accelerate's, not ours
    traceback = re.compile(r"^Traceback" if kind == "1" else r"^\[rank\d+\]: Traceback", re.M)
    resumed = "Resumed from" in log  # a refused resume must not say it resumed (on any rank)
    # a rank that aborted after its line (a process group left to the interpreter's exit) is a crash to the launcher
    aborted = "terminate called" in log or "SIGABRT" in log
    if rc != 1 or len(errors) != 1 or traceback.search(log) or resumed or aborted:
        problems.append(
            f"exit {rc}, error lines {errors}, traceback {bool(traceback.search(log))}, said resumed {resumed}, "
            f"a rank aborted {aborted}"
        )
    else:
        for n in named:
            alternatives = n if isinstance(n, tuple) else (n,)  # an alternative: a string, or a tuple of all of
            if not any(all(p in errors[0] for p in (a if isinstance(a, tuple) else (a,))) for a in alternatives):
                problems.append(f"the line does not name {n!r}: {errors[0]}")
    if problems:
        problems.append(f"log ends {log[-2500:]!r}")
    return problems


def _mount(ctx: Ctx, how: str) -> str | None:
    """The run copied onto a small tmpfs, full or read-only; None, or why it cannot be done here."""
    disk = ctx.out.parent / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        return f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}"
    ctx.cleanups.append(lambda: subprocess.run(["umount", "-l", str(disk)], capture_output=True))
    shutil.copytree(ctx.out, disk / "run")
    ctx.out = disk / "run"
    if how == "full":
        # the run's folder copied without its dot files (cp -r out/* ...): the lock file is created anew. (With the
        # old one there, its page is reused and the disk fills only at the next checkpoint, one line on 1 process.)
        os.remove(ctx.out / ".accel-trainer.lock")
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            for size in (65536, 4096, 1):  # to the last byte: a write that fails leaves what it did not take
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError:
                    pass
        finally:
            os.close(fd)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    return None


def run_catalogue(runs: Path, kind: str, work: Path) -> dict[str, Result]:
    """Every case of `kind` crafted in a copy of the run of its own and resumed (checkpoint cases by folder, output
    folder cases with latest), two at a time, hang-prone ones in the background; then the two `latest` runs."""
    mine = [c for c in CASES if kind in c.kinds]
    prepared: dict[str, tuple[Case, Ctx, list, str | None]] = {}
    for i, c in enumerate(mine):
        case_dir = work / c.name
        case_dir.mkdir(parents=True)
        if c.level == "checkpoint":
            ctx, named = crafted_copy(runs, kind, case_dir / "run", [c], first_step=9 + i)[c.name]
        else:
            shutil.copytree(runs / kind, case_dir / "run")
            ctx = Ctx(kind, case_dir / "run", None, case_dir / "pwned", case_dir / "outside", "latest")
            ctx.outside.mkdir()
            skipped = _mount(ctx, c.mount) if c.mount else None
            if skipped:
                prepared[c.name] = (c, ctx, [], skipped)
                continue
            named = c.craft(ctx)
        prepared[c.name] = (c, ctx, named_strings(ctx, named), None)
    results: dict[str, Result] = {}
    started: list[Launch] = []

    def start(name: str, deadline: float) -> Launch:
        c, ctx, _, _ = prepared[name]
        run = Launch(command(kind, ctx.out, "--resume_from_checkpoint", ctx.spec, "--max_steps", str(c.max_steps)),
                     str(work / f"{name}.log"), deadline=deadline)  # fmt: skip
        started.append(run)
        return run

    def finish(name: str, run: Launch, timeout: float | None = None):
        c, ctx, named, _ = prepared[name]
        try:
            rc = run.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            run.stop()
            release(ctx)
        log = run.output(None)
        problems = (ctx.check(Result(rc, log)) or []) if ctx.check else []
        if not ctx.check or named:
            problems += refusal_problems(kind, ctx, named, rc, log)
        elif rc is None or ctx.marker.exists():
            problems += refusal_problems(kind, ctx, [], rc, log)[:1]
        elif re.search(r"^Traceback" if kind == "1" else r"^\[rank\d+\]: Traceback", log, re.M):
            problems.append(f"a traceback: {log[-2500:]!r}")
        results[name] = Result(rc, log, problems)

    try:
        for name, (_, _, _, skipped) in prepared.items():
            if skipped:
                results[name] = Result(None, "", skipped=skipped)
        since = time.monotonic()
        background = [(n, start(n, HANG_DEADLINE)) for n, p in prepared.items() if p[0].background and not p[3]]
        pending = [n for n, p in prepared.items() if not p[0].background and not p[3]]
        for first in range(0, len(pending), 2):
            pair = [(n, start(n, DEADLINE)) for n in pending[first : first + 2]]
            for name, run in pair:
                finish(name, run)
        for name, run in background:  # their deadline counts from their start
            finish(name, run, max(1.0, HANG_DEADLINE - (time.monotonic() - since)))
        results.update(run_latest(runs, kind, work, mine))
    finally:
        for run in started:
            run.stop()
        for _, ctx, _, _ in prepared.values():
            release(ctx)
    return results


def release(ctx: Ctx):
    """Run a case's cleanups once each (a lock's descriptor closed twice could close another file)."""
    while ctx.cleanups:
        ctx.cleanups.pop()()


def run_latest(runs: Path, kind: str, work: Path, mine: list[Case]) -> dict[str, Result]:
    """`latest` in a copy of the run holding crafted checkpoints newer than its good step_8: the ones refused today
    by the verifier ("latest"), and every checkpoint case of the catalogue ("latest_all")."""
    checkpoint_cases = [c for c in mine if c.level == "checkpoint"]
    sets = {"latest": [c for c in checkpoint_cases if c.kinds[kind] is None and not c.loaded],
            "latest_all": checkpoint_cases}  # fmt: skip
    launches, crafted = {}, {}
    for name, cases in sets.items():
        crafted[name] = crafted_copy(runs, kind, work / name / "run", cases)
        launches[name] = Launch(command(kind, work / name / "run", "--resume_from_checkpoint", "latest", "--max_steps", "10"),
                                str(work / f"{name}.log"), deadline=DEADLINE)  # fmt: skip
    out = {}
    for name, run in launches.items():
        try:
            rc = run.wait()
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            run.stop()
        log = run.output(None)
        problems = [] if rc == 0 else [f"exit {rc}"]
        for case_name, (ctx, _) in crafted[name].items():
            if ctx.marker.exists():
                problems.append(f"{case_name}: THE PAYLOAD RAN")
            if f"skipping checkpoint {ctx.folder}:" not in log and f"skipping {ctx.folder}:" not in log:
                problems.append(f"{case_name}: {ctx.folder.name} not skipped")
        root = work / name / "run" / "checkpoints"
        if f"Resumed from {root / 'step_8'} at step 8" not in log:
            problems.append("not resumed from step_8")
        rows = [json.loads(line) for line in open(work / name / "run" / "metrics.jsonl")]
        if max(r["step"] for r in rows if "loss" in r) != 10:
            problems.append("did not train on to step 10")
        if problems:
            problems.append(f"log ends {log[-3000:]!r}")
        out[name] = Result(rc, log, problems)
    return out


@pytest.fixture(scope="module")
def catalogue(runs, tmp_path_factory):
    """Each kind's results, computed the first time a test of that kind asks."""
    done: dict[str, dict] = {}

    def results(kind: str) -> dict[str, Result]:
        if kind not in done:
            done[kind] = run_catalogue(runs, kind, tmp_path_factory.mktemp(f"catalogue-{kind}"))
        return done[kind]

    return results


def params():
    for kind in KINDS:
        for c in CASES:
            if kind in c.kinds:
                bug = c.kinds[kind]
                marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
                yield pytest.param(kind, c.name, marks=marks, id=f"{kind}-{c.name}")


# ============================================================================================================ tests
def test_the_payloads_are_live(tmp_path):
    """Each payload runs its command when loaded as torch and Accelerate loaded it before: unsafely."""
    cases = {
        "plain": (plain_payload(tmp_path / "plain"), "import pickle; pickle.load(open(f, 'rb'))"),
        "torch": (torch_payload(tmp_path / "torch"), "import torch; torch.load(f, weights_only=False)"),
    }
    for name, (data, load) in cases.items():
        (tmp_path / f"{name}.pkl").write_bytes(data)
        code = f"f = {str(tmp_path / f'{name}.pkl')!r}; {load}"
        subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize("kind,name", list(params()))
def test_a_crafted_checkpoint_or_output_folder_is_one_line(catalogue, kind, name):
    result = catalogue(kind)[name]
    if result.skipped:
        pytest.skip(result.skipped)
    assert not result.problems, "\n".join(result.problems)


@pytest.mark.parametrize("kind", KINDS)
def test_crafted_checkpoints_are_refused_and_latest_falls_back(catalogue, kind):
    """Every crafted checkpoint the verifier refuses today is skipped by `latest`, naming it; the run resumes from
    the good step_8 (on every rank) and trains on."""
    result = catalogue(kind)["latest"]
    assert not result.problems, "\n".join(result.problems)


@pytest.mark.parametrize("kind", KINDS)
def test_latest_skips_every_crafted_checkpoint(catalogue, kind):
    """Every crafted checkpoint at once, all newer than step_8: `latest` skips each one, naming it -- those the
    verifier refuses and those refused by the checks against the run -- and resumes from step_8."""
    result = catalogue(kind)["latest_all"]
    assert not result.problems, "\n".join(result.problems)


# ============================================================================================ a stream's position
STREAM_ARGS = ["--streaming", "--block_size", "16", "--per_device_train_batch_size", "2", "--save_steps", "4",
               "--logging_steps", "1", "--sample_max_new_tokens", "0", "--disable_tqdm"]  # fmt: skip
STREAM_CASES = {
    # name: (how data_state_rank0.json's state changes, the bug today or None)
    "copied_from_step_4": (None, None),
    "loader_state_garbage": (
        lambda s: s.update(loader={"_sampler_iter_state": "x", "_num_yielded": "y", "dataset_state": [1]}),
        None,
    ),
    "loader_state_reset": (
        lambda s: s.update(loader={}),
        None,
    ),
}


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    """A finished 1-process causal_lm run on a streamed corpus (tiny GPT-2): step_4 and step_8, each with
    data_state_rank0.json."""
    from text_fixtures import make_tiny_gpt2, offline_env, sentences

    d = tmp_path_factory.mktemp("stream")
    make_tiny_gpt2(str(d / "gpt2"))
    (d / "shards").mkdir()
    for s in range(8):
        lines = [f"doc {s} {i} {t}" for i, t in enumerate(sentences(3, seed=s))]
        (d / "shards" / f"part{s:02d}.txt").write_text("\n".join(lines) + "\n")
    base = [os.path.join(RECIPES, "causal_lm.py"), "--model_name_or_path", str(d / "gpt2"), "--train_file",
            str(d / "shards" / "*.txt"), *STREAM_ARGS]  # fmt: skip
    env = offline_env(d)
    run = Launch(launch_cmd(1) + base + ["--max_steps", "8", "--output_dir", str(d / "run")], str(d / "run.log"),
                 env=env, cwd=ROOT, deadline=DEADLINE)  # fmt: skip
    run.wait_ok()
    return d, base, env


@pytest.fixture(scope="module")
def stream_results(stream_run, tmp_path_factory):
    d, base, env = stream_run
    work = tmp_path_factory.mktemp("stream-cases")
    prepared, results = {}, {}
    for name, (change, _) in STREAM_CASES.items():
        out = work / name
        shutil.copytree(d / "run", out)
        folder = out / "checkpoints" / "step_8"
        if change is None:
            shutil.copy(out / "checkpoints" / "step_4" / "data_state_rank0.json", folder / "data_state_rank0.json")
        else:
            edit_json(folder / "data_state_rank0.json", lambda doc: change(doc["state"]))
        rehash(folder)
        ctx = Ctx("1", out, folder, work / f"pwned-{name}", work, str(folder))
        prepared[name] = ctx
    names = list(prepared)
    for first in range(0, len(names), 2):
        pair = []
        for name in names[first : first + 2]:
            cmd = launch_cmd(1) + base + ["--max_steps", "12", "--output_dir", str(prepared[name].out),
                                          "--resume_from_checkpoint", prepared[name].spec]  # fmt: skip
            pair.append((name, Launch(cmd, str(work / f"{name}.log"), env=env, cwd=ROOT, deadline=DEADLINE)))
        for name, run in pair:
            try:
                rc = run.wait()
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                run.stop()
            ctx = prepared[name]
            log = run.output(None)
            results[name] = refusal_problems("1", ctx, [str(ctx.folder / "data_state_rank0.json")], rc, log)
    return results


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=bug)] if bug else [])
        for n, (_, bug) in STREAM_CASES.items()
    ],
)
def test_a_crafted_stream_position_is_one_line(stream_results, name):
    problems = stream_results[name]
    assert not problems, "\n".join(problems)
