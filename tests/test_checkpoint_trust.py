"""Checkpoints you did not write: a catalogue of crafted copies of real checkpoints of recipes/regression.py (1
process, and 2-process FSDP), each resumed as a user would. Whatever the folder holds, nothing in it runs: every
case is refused with one line naming the file (exit 1, no traceback), the attacker's marker file never appears,
and `--resume_from_checkpoint latest` skips every crafted checkpoint, falls back to the previous good one (on
every rank: the main process decides and tells the others) and the run finishes.

The manifest is written by whoever wrote the checkpoint, so most cases re-hash the altered files into it: safety
must come from what is loaded and how, not from the hashes.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from helpers import RECIPES, launcher
from procs import Launch

from accel_trainer.checkpointing import folder as ckpt_folder
from accel_trainer.checkpointing import verify as ckpt_verify

SCRIPT = os.path.join(RECIPES, "regression.py")
ARGS = ["--max_steps", "8", "--save_steps", "4", "--logging_steps", "1", "--disable_tqdm"]
PER_DEVICE = {"1": ["--per_device_train_batch_size", "16"], "fsdp": ["--per_device_train_batch_size", "8"]}
DEADLINE = 240  # seconds any launch may take on a loaded 2-core machine


class Payload:
    """Unpickling this runs a shell command that creates `marker`: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def dotted_name_pickle(marker, module="torch.distributed.checkpoint.metadata", name="os.system") -> bytes:
    """Protocol 4: STACK_GLOBAL of the dotted name `os.system` under torch.distributed.checkpoint.metadata (a module
    DCP metadata's classes live in, which imports os); plain pickle resolves it to os.system, then calls it."""

    def text(s: str) -> bytes:  # BINUNICODE
        return b"X" + struct.pack("<I", len(s.encode())) + s.encode()

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(f"touch {marker}") + b"\x85R."


def torch_payload(marker) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"state": Payload(marker)}, buf)
    return buf.getvalue()


def rehash(folder):
    """What an attacker (or a careless tool) does: rewrite the manifest to match the altered files."""
    ckpt_folder.write_manifest(str(folder), ckpt_folder.read_state(str(folder)))


def unlist(folder, rel):
    """Leave `rel` out of the manifest (the rest stays as written)."""
    path = os.path.join(folder, "manifest.json")
    manifest = json.load(open(path))
    del manifest["files"][rel]
    json.dump(manifest, open(path, "w"))


# Each case alters a copy of a good checkpoint (`folder`) for a run kind ("1" or "fsdp") and returns the file (path
# relative to the folder) its refusal must name. `outside` is a folder next to the checkpoints.
def pickle_listed(folder, kind, marker, outside):
    (folder / "scheduler.bin").write_bytes(torch_payload(marker))
    rehash(folder)
    return "scheduler.bin"


def pickle_unlisted(folder, kind, marker, outside):
    # 1 process: accelerate's weights_only load of optimizer.bin; FSDP: torch's plain pickle.load of a .metadata
    rel = "optimizer.bin" if kind == "1" else "optimizer_0/.metadata"
    (folder / rel).write_bytes(torch_payload(marker) if kind == "1" else pickle.dumps(Payload(marker)))
    unlist(folder, rel)
    return rel


def custom_checkpoint(folder, kind, marker, outside):
    # Accelerate's load_state loads custom_checkpoint_<i>.pkl with weights_only=False
    (folder / "custom_checkpoint_0.pkl").write_bytes(torch_payload(marker))
    rehash(folder)
    return "custom_checkpoint_0.pkl"


def dotted_name(folder, kind, marker, outside):
    rel = "pytorch_model_fsdp_0/.metadata"  # 1 process: the folder makes it look sharded, so torch would read it
    (folder / "pytorch_model_fsdp_0").mkdir(exist_ok=True)
    (folder / rel).write_bytes(dotted_name_pickle(marker))
    rehash(folder)
    return rel


def symlink_out(folder, kind, marker, outside):
    # the very same bytes, outside the folder: the manifest's hashes still match
    rel = "scheduler.bin" if kind == "1" else "optimizer_0"
    target = outside / f"{folder.name}-{rel}"
    shutil.move(str(folder / rel), str(target))
    os.symlink(target, folder / rel)
    return rel


def path_traversal(folder, kind, marker, outside):
    manifest = json.load(open(folder / "manifest.json"))
    rel = "../step_8/trainer_state.json"  # exists, and the hash is right
    manifest["files"][rel] = manifest["files"]["trainer_state.json"]
    json.dump(manifest, open(folder / "manifest.json", "w"))
    return rel


def truncated_metadata(folder, kind, marker, outside):
    rel = "optimizer_0/.metadata"
    data = (folder / rel).read_bytes()
    (folder / rel).write_bytes(data[: len(data) // 2])
    rehash(folder)
    return rel


def empty_metadata(folder, kind, marker, outside):
    rel = "pytorch_model_fsdp_0/.metadata"
    (folder / rel).write_bytes(b"")
    rehash(folder)
    return rel


def malformed_metadata(folder, kind, marker, outside):
    rel = "pytorch_model_fsdp_0/.metadata"  # a valid pickle of something that is not DCP metadata
    (folder / "pytorch_model_fsdp_0").mkdir(exist_ok=True)
    (folder / rel).write_bytes(pickle.dumps({"state_dict_metadata": None}))
    rehash(folder)
    return rel


def truncated_safetensors(folder, kind, marker, outside):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    rehash(folder)
    return "model.safetensors"


CASES = {
    "1": [pickle_listed, pickle_unlisted, custom_checkpoint, dotted_name, symlink_out, path_traversal,
          malformed_metadata, truncated_safetensors],
    "fsdp": [pickle_listed, pickle_unlisted, custom_checkpoint, dotted_name, symlink_out, path_traversal,
             truncated_metadata, empty_metadata, malformed_metadata],
}  # fmt: skip


def start(kind: str, out, *extra, log) -> Launch:
    return Launch(launcher(kind) + [SCRIPT, "--output_dir", str(out)] + ARGS + PER_DEVICE[kind] + list(extra),
                  str(log), deadline=DEADLINE)  # fmt: skip


def finish(run: Launch) -> tuple[int, str]:
    """Its exit code and whole output, once it has ended (bounded)."""
    try:
        return run.wait(), run.output(None)
    finally:
        run.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One finished run per kind (started together: they are mostly start-up time), checkpoints step_4 and step_8."""
    d = tmp_path_factory.mktemp("trust")
    started = {
        kind: Launch(
            launcher(kind) + [SCRIPT, "--output_dir", str(d / kind)] + ARGS + PER_DEVICE[kind],
            str(d / f"{kind}.log"),
            deadline=DEADLINE,
        )  # fmt: skip
        for kind in ("1", "fsdp")
    }
    try:
        for run in started.values():
            run.wait_ok()
    finally:
        for run in started.values():
            run.stop()
    return d


def test_the_payloads_are_live(tmp_path):
    """Each kind of payload runs its command when loaded the way torch and Accelerate load it without our checks."""
    cases = {
        "plain": (pickle.dumps(Payload(tmp_path / "plain")), "import pickle; pickle.load(open(f, 'rb'))"),
        "dotted": (dotted_name_pickle(tmp_path / "dotted"), "import pickle; pickle.load(open(f, 'rb'))"),
        "torch": (torch_payload(tmp_path / "torch"), "import torch; torch.load(f, weights_only=False)"),
    }
    for name, (data, load) in cases.items():
        (tmp_path / f"{name}.pkl").write_bytes(data)
        code = f"f = {str(tmp_path / f'{name}.pkl')!r}; {load}"
        subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize("kind", ["1", "fsdp"])
def test_crafted_checkpoints_are_refused_and_latest_falls_back(runs, kind, tmp_path):
    out, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(runs / kind, out)
    outside.mkdir()
    root = out / "checkpoints"
    crafted = {}
    for i, case in enumerate(CASES[kind]):  # newer than the good step_8, so `latest` meets them first
        folder = root / f"step_{9 + i}"
        shutil.copytree(root / "step_8", folder)
        marker = tmp_path / f"pwned-{case.__name__}"
        crafted[case.__name__] = (folder, case(folder, kind, marker, outside), marker)
    # `latest` in this copy (all crafted checkpoints newer than step_8), and each case resumed by name in a copy of
    # the run of its own (a resume that went through would set the newer folders aside); two at a time
    latest = start(kind, out, "--resume_from_checkpoint", "latest", "--max_steps", "10", log=tmp_path / "latest.log")
    cases, results = [], {}
    for name, (crafted_folder, rel, marker) in crafted.items():
        case_out = tmp_path / "cases" / name
        shutil.copytree(runs / kind, case_out)
        folder = case_out / "checkpoints" / crafted_folder.name
        shutil.copytree(crafted_folder, folder, symlinks=True)
        cases.append((name, case_out, folder, rel, marker))
    started = [latest]
    try:
        for first in range(0, len(cases), 2):
            pair = [(c, start(kind, c[1], "--resume_from_checkpoint", str(c[2]), log=tmp_path / f"{c[0]}.log"))
                    for c in cases[first : first + 2]]  # fmt: skip
            started += [run for _, run in pair]
            results.update({c[0]: finish(run) for c, run in pair})
        latest_rc, latest_log = finish(latest)
    finally:
        for run in started:
            run.stop()
    traceback = re.compile(r"^Traceback" if kind == "1" else r"^\[rank\d+\]: Traceback", re.M)
    problems = []  # every case is tried: the report names each one that fails
    for name, _, folder, rel, marker in cases:
        rc, log = results[name]
        errors = {line for line in log.splitlines() if line.startswith("error: ")}  # every rank prints the same
        named = os.path.normpath(os.path.join(folder, rel))
        if marker.exists():
            problems.append(f"{name}: THE PAYLOAD RAN")
        # no traceback from a process of the run ("[rankN]: " under accelerate launch, whose launcher then prints
        # torchrun's own report of the failed workers: a ChildFailedError traceback of accelerate's, not ours)
        elif rc == 0 or len(errors) != 1 or traceback.search(log) or named not in next(iter(errors)):
            problems.append(f"{name}: exit {rc}, error lines {sorted(errors)}, log ends {log[-1500:]!r}")
    assert not problems, "\n".join(problems)
    rc, log = latest_rc, latest_log
    assert rc == 0, log[-5000:]
    for name, (folder, _, marker) in crafted.items():
        assert f"skipping checkpoint {folder}" in log, f"{name}: {log[-5000:]}"
        assert not marker.exists(), name
    assert f"Resumed from {root / 'step_8'} at step 8" in log, log[-5000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert max(r["step"] for r in rows if "loss" in r) == 10  # it trained on, from step 8 (both ranks, for FSDP)


def test_dcp_metadata_admits_exactly_dcp_classes(runs, tmp_path):
    """The allow-list is exact (module, name) pairs: DCP's real metadata loads; a dotted name under any module it
    admits, or any other global of those modules, is refused without running."""
    fsdp = runs / "fsdp" / "checkpoints" / "step_8"
    for rel in ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"):
        meta = ckpt_verify.read_dcp_metadata(str(fsdp), str(fsdp / rel))
        assert meta.state_dict_metadata and meta.storage_data
    marker = tmp_path / "pwned"
    modules = ["torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem", "torch",
               "torch.serialization", "pathlib", "collections"]  # fmt: skip
    crafted = [dotted_name_pickle(marker)] + [dotted_name_pickle(marker, m) for m in modules]
    crafted += [dotted_name_pickle(marker, m, n) for m, n in [("torch", "load"), ("builtins", "eval"), ("os", "system"),
                ("torch.distributed.checkpoint.metadata", "os"), ("torch.serialization", "load")]]  # fmt: skip
    for i, data in enumerate(crafted):
        (tmp_path / f"{i}.metadata").write_bytes(data)
        with pytest.raises(ckpt_folder.CheckpointError, match=rf"{i}\.metadata cannot be loaded safely"):
            ckpt_verify.read_dcp_metadata(str(tmp_path), str(tmp_path / f"{i}.metadata"))
    assert not marker.exists()
    # DCP's own class without its fields (pickle sets any state): a CheckpointError, not an AttributeError later
    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / "fieldless.metadata").write_bytes(pickle.dumps(Metadata.__new__(Metadata)))
    with pytest.raises(ckpt_folder.CheckpointError, match=r"fieldless\.metadata is not well-formed DCP metadata"):
        ckpt_verify.read_dcp_metadata(str(tmp_path), str(tmp_path / "fieldless.metadata"))


def test_what_the_folder_holds_is_checked_whatever_the_manifest_says(runs, tmp_path):
    good = runs / "1" / "checkpoints" / "step_8"

    def copy(name):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        return folder

    def manifest_with(folder, rel, meta):
        manifest = json.load(open(folder / "manifest.json"))
        manifest["files"][rel] = meta
        json.dump(manifest, open(folder / "manifest.json", "w"))

    folder = copy("absolute")
    manifest_with(folder, "/etc/hostname", {"size": 1, "sha256": "0"})
    with pytest.raises(ckpt_folder.CheckpointError, match="names '/etc/hostname'.*not a plain path inside"):
        ckpt_verify.verify_checkpoint(str(folder))
    folder = copy("malformed_entry")
    manifest_with(folder, "scheduler.bin", {"size": "12"})
    with pytest.raises(ckpt_folder.CheckpointError, match=r"manifest\.json is malformed \(entry 'scheduler\.bin'"):
        ckpt_verify.verify_checkpoint(str(folder))
    folder = copy("fifo")  # hashing it would block forever
    os.mkfifo(folder / "notes")
    with pytest.raises(ckpt_folder.CheckpointError, match="notes is not a regular file"):
        ckpt_verify.verify_checkpoint(str(folder))
    folder = copy("state")
    state = json.load(open(folder / "trainer_state.json"))
    del state["num_processes"]
    json.dump(state, open(folder / "trainer_state.json", "w"))
    ckpt_folder.write_manifest(str(folder), {**state, "num_processes": 1})  # re-hashed: only its content is wrong
    with pytest.raises(ckpt_folder.CheckpointError, match=r"trainer_state\.json lacks num_processes"):
        ckpt_verify.verify_checkpoint(str(folder))
    # an unlisted file nothing reads is named in a warning; the checkpoint stays usable
    folder = copy("readme")
    (folder / "README.txt").write_text("notes")
    said = []
    ckpt_verify.verify_checkpoint(str(folder), said.append)
    assert len(said) == 1 and "README.txt is not listed in manifest.json; nothing reads it" in said[0]
    # ... but one that something reads is refused (here: Accelerate's RNG state, which it would load silently)
    folder = copy("rng")
    unlist(folder, "random_states_0.pkl")
    with pytest.raises(ckpt_folder.CheckpointError, match=r"random_states_0\.pkl is not listed in manifest\.json"):
        ckpt_verify.verify_checkpoint(str(folder))
