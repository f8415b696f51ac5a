"""`accel-trainer config`: non-interactively for each shipped topology (it reproduces the shipped file), refusals,
interactively through a pseudo-terminal, and the SLURM script run against stand-in srun/scontrol/accelerate."""

import os
import subprocess
import sys

import pexpect
import pytest
from accelerate.commands.config.config_args import load_config_from_file
from helpers import ROOT, env, two_machine_config

from accel_trainer.cluster import wizard

SKIP = ["--skip-device-check"]  # GPU topologies are written here for other machines
TWO_X8 = ["--machines", "2", "--gpus-per-machine", "8", "--mixed-precision", "bf16", "--main-ip", "machine0.invalid"]
SHIPPED_FLAGS = {
    "cpu_1proc": ["--machines", "1", "--processes-per-machine", "1", "--cpu"],
    "cpu_2proc": ["--machines", "1", "--processes-per-machine", "2", "--cpu"],
    "gpu_1": ["--machines", "1", "--gpus-per-machine", "1", "--mixed-precision", "no"] + SKIP,
    "gpu_1x8_bf16": ["--machines", "1", "--gpus-per-machine", "8", "--mixed-precision", "bf16"] + SKIP,
    "gpu_2x8_bf16_static": TWO_X8 + ["--rdzv", "static"] + SKIP,
    "gpu_2x8_bf16_c10d": TWO_X8 + ["--rdzv", "c10d", "--max-restarts", "3", "--slurm"] + SKIP,
    "gpu_1x8_fsdp_bf16": ["--machines", "1", "--gpus-per-machine", "8", "--mixed-precision", "bf16", "--fsdp"] + SKIP,
}


def read(path):
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(SHIPPED_FLAGS))
def test_wizard_reproduces_each_shipped_config(name, tmp_path, capsys):
    assert wizard.main(["--dir", str(tmp_path), "--name", name, "--no-interactive", *SHIPPED_FLAGS[name]]) == 0
    out = capsys.readouterr().out
    written = tmp_path / f"{name}.yaml"
    assert read(written) == read(os.path.join(ROOT, "accelerate_configs", f"{name}.yaml"))
    config = load_config_from_file(str(written))  # accelerate's loader
    # One launch line per machine, differing only by --machine_rank, with the rendezvous bounded.
    for r in range(config.num_machines):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"machine {r}:"))
        assert f"--config_file {written}" in line
        if config.num_machines > 1:
            assert f"--machine_rank {r}" in line
            assert f"--rdzv_backend {config.rdzv_backend}" in line and "timeout=" in line
    if "--slurm" in SHIPPED_FLAGS[name]:  # the shipped script is the one the wizard writes
        shipped = read(os.path.join(ROOT, "accelerate_configs", f"{name}.slurm.sh"))
        assert read(tmp_path / f"{name}.slurm.sh") == shipped.replace(f"accelerate_configs/{name}.yaml", str(written))


def fake_hw(gpus, bf16=True):
    return lambda: {"gpus": gpus, "gpu_name": "Fake GPU" if gpus else None, "bf16": bf16 and gpus > 0, "cpus": 2}


@pytest.mark.parametrize(
    "flags, gpus, reason",
    [
        (["--machines", "1", "--gpus-per-machine", "1"], 0, "no GPU is visible here"),
        (["--machines", "1", "--gpus-per-machine", "8"], 2, "8 processes per machine but only 2 GPUs"),
        (
            ["--machines", "2", "--gpus-per-machine", "1", "--cpu", "--main-ip", "10.0.0.1", "--main-port", "70000"],
            0,
            "main_process_port=70000 is out of range",
        ),
        (["--machines", "1", "--processes-per-machine", "2", "--cpu", "--deepspeed"], 0, "Shard with FSDP instead"),
        (["--machines", "1", "--gpus-per-machine", "8", "--deepspeed"], 8, "--deepspeed asks for DeepSpeed"),
        (["--machines", "1", "--processes-per-machine", "1", "--cpu", "--fsdp"], 0, "nothing to shard over"),
        (["--machines", "2", "--gpus-per-machine", "8"], 8, "--main-ip is required"),
        (
            ["--machines", "1", "--processes-per-machine", "2", "--cpu", "--mixed-precision", "fp16"],
            0,
            "fp16 mixed precision needs a GPU",
        ),
        (["--machines", "1", "--gpus-per-machine", "8", "--mixed-precision", "bf16"], 8, "bf16 is not supported"),
        (
            ["--machines", "2", "--gpus-per-machine", "1", "--cpu", "--main-ip", "h", "--max-restarts", "2"],
            0,
            "--max-restarts needs --rdzv c10d",
        ),
    ],
)
def test_bad_combinations_are_refused(flags, gpus, reason, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wizard, "detect", fake_hw(gpus, bf16="bf16 is not" not in reason))
    assert wizard.main(["--dir", str(tmp_path), "--name", "x", "--no-interactive", *flags]) == 2
    err = capsys.readouterr().err
    assert "refusing" in err and reason in err, err
    assert not os.listdir(tmp_path)  # nothing written


def test_existing_file_needs_force(tmp_path, capsys):
    flags = ["--dir", str(tmp_path), "--name", "x", "--no-interactive", "--machines", "1", "--cpu"]
    assert wizard.main(flags) == 0
    assert wizard.main(flags) == 2 and "--force" in capsys.readouterr().err
    assert wizard.main(flags + ["--force"]) == 0


def wizard_at_a_terminal(tmp_path, answers: list[tuple[str, str | None]]):
    """`accel-trainer config` in a pseudo-terminal on a machine without GPUs: expect each prompt (a regex), answer it
    (None: answer nothing, e.g. after an error line), run to the end. Returns (the closed child, {prompt: match})."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "accel_trainer.cluster.wizard", "--dir", str(tmp_path)],
        cwd=ROOT,
        env={**env(), "CUDA_VISIBLE_DEVICES": ""},
        encoding="utf-8",
        timeout=60,
    )
    matches = {}
    for prompt, answer in answers:
        child.expect(prompt)
        matches[prompt] = child.match
        if answer is not None:
            child.sendline(answer)
    child.expect(pexpect.EOF)
    child.close()
    return child, matches


@pytest.mark.slow
def test_interactive_through_a_pseudo_terminal(tmp_path):
    answers = [
        ("How many machines", "zero"),  # not a number: asked again
        ("not valid", None),
        ("How many machines", "2"),
        ("Use GPUs", ""),  # default: no (no GPU detected)
        ("How many CPU processes per machine", "1"),
        ("Address of machine 0", "127.0.0.1"),
        ("Port on machine 0", "29555"),
        ("Rendezvous", "c10d"),
        ("Seconds to wait", "45"),
        ("Restarts allowed", "1"),
        ("Mixed precision", ""),
        ("torch.compile", "no"),
        ("Shard the model with FSDP", ""),  # default: none
        ("Config name", "pty"),
        ("SLURM", "yes"),
    ]
    child, _ = wizard_at_a_terminal(tmp_path, answers)
    assert child.exitstatus == 0, child.before
    out = child.before
    config = load_config_from_file(str(tmp_path / "pty.yaml"))
    assert (config.num_machines, config.num_processes, config.use_cpu) == (2, 2, True)
    assert (config.main_process_ip, config.main_process_port, config.rdzv_backend) == ("127.0.0.1", 29555, "c10d")
    assert str(config.distributed_type.value) == "MULTI_GPU"  # several CPU processes: torchrun, never MULTI_CPU
    assert "--rdzv_conf join_timeout=45,read_timeout=45 --max_restarts 1" in out
    assert "accel-trainer launch --config_file" in out  # it picks each machine's interface and the store's host
    assert (tmp_path / "pty.slurm.sh").exists()


@pytest.mark.slow
def test_interactive_on_a_login_node_without_gpus_asks_once_early_and_writes_the_gpu_config(tmp_path):
    """The common case: a cluster's 2 x 8 GPU config written on a login node with no GPU. The wizard asks right
    after "Use GPUs? yes" whether the config is for other machines, then writes it (never throws the answers
    away) and says what to check on the GPU machines. Machine 0's default address is never loopback."""
    answers = [
        ("How many machines", "2"),
        ("Use GPUs", "yes"),
        ("No GPU is visible here. Is this config for other machines", ""),  # default: yes
        ("How many GPUs \\(processes\\) per machine", "8"),
        ("Address of machine 0, as every machine reaches it\\?([^:]*):", "10.1.2.3"),
        ("Port on machine 0", ""),
        ("Rendezvous", "c10d"),
        ("Seconds to wait", ""),
        ("Restarts allowed", ""),
        ("Mixed precision", "bf16"),
        ("torch.compile", ""),
        ("Shard the model with FSDP", ""),
        ("Config name", "login"),
        ("SLURM", "yes"),
    ]
    child, matches = wizard_at_a_terminal(tmp_path, answers)
    offered = next(m for prompt, m in matches.items() if prompt.startswith("Address")).group(1)  # its default
    out = child.before
    assert child.exitstatus == 0, out
    assert "127." not in offered, offered  # the other machine cannot reach a loopback address
    config = load_config_from_file(str(tmp_path / "login.yaml"))
    assert (config.num_machines, config.num_processes, config.use_cpu) == (2, 16, False)
    assert (config.main_process_ip, str(config.mixed_precision)) == ("10.1.2.3", "bf16")
    assert "refusing" not in out and (tmp_path / "login.slurm.sh").exists()
    assert "Written for other machines" in out and "confirms 8 visible GPU(s), NCCL and bf16" in out, out


@pytest.mark.slow
def test_interactive_without_gpus_for_this_machine_switches_to_cpu_processes(tmp_path):
    answers = [
        ("How many machines", "1"),
        ("Use GPUs", "yes"),
        ("No GPU is visible here", "no"),
        ("How many CPU processes per machine", "2"),
        ("Mixed precision", ""),
        ("torch.compile", ""),
        ("Shard the model with FSDP", ""),
        ("Config name", "here"),
    ]
    child, _ = wizard_at_a_terminal(tmp_path, answers)
    assert child.exitstatus == 0, child.before
    config = load_config_from_file(str(tmp_path / "here.yaml"))
    assert (config.num_processes, config.use_cpu) == (2, True)


@pytest.mark.parametrize(
    "hostname_ip, interfaces, offered",
    [
        ("127.0.1.1", [("10.0.0.5", "eth0")], "10.0.0.5"),  # Debian's /etc/hosts: the interface's address instead
        ("127.0.0.1", [("10.0.0.5", "eth0"), ("192.168.1.5", "eth1")], None),  # which one? no default: asked
        ("127.0.0.1", [], None),
        ("10.0.0.7", [("10.0.0.7", "eth0"), ("192.168.1.5", "eth1")], "10.0.0.7"),
    ],
)
def test_machine_0_default_address_is_never_loopback(hostname_ip, interfaces, offered, monkeypatch):
    import socket

    from accel_trainer.cluster import network

    monkeypatch.setattr(socket, "gethostbyname", lambda name: hostname_ip)
    monkeypatch.setattr(network, "cluster_addresses", lambda: interfaces)
    assert wizard._my_address() == offered


FAKE_SRUN = """#!/bin/bash
# Stand-in srun: run the command once per node, as SLURM does, each with its own SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
for node in 0 1; do SLURM_NODEID=$node "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/bin/bash
# Stand-in scontrol: the job's host names; records a requeue.
if [ "$1" = requeue ]; then echo "$*" >> "$SCONTROL_LOG"; else printf 'node-a\\nnode-b\\n'; fi
"""
FAKE_LAUNCHER = '#!/bin/bash\necho "LAUNCH $*"\nexit "${FAKE_EXIT:-0}"\n'


@pytest.mark.slow
def test_slurm_script_gives_each_node_its_own_rank(tmp_path):
    slurm = ["--max-restarts", "1", "--slurm", "--script", "recipes/regression.py"]
    two_machine_config(tmp_path, rdzv="c10d", main_ip="unused", name="s", extra=slurm)
    script = tmp_path / "s.slurm.sh"
    text = read(script)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
    assert "#SBATCH --exclusive" in text  # every CPU of the node, not one (tests/test_topology_slurm.py runs it)
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("accel-trainer", FAKE_LAUNCHER)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    e = {**env(), "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "7"}
    e["SCONTROL_LOG"] = str(tmp_path / "scontrol.log")
    proc = subprocess.run(
        ["bash", str(script), "--output_dir", "runs/x y"], capture_output=True, text=True, timeout=30, env=e
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LAUNCH")]
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert f"--machine_rank {rank} " in line  # not every node rank 0
        assert "--main_process_ip node-a --main_process_port 29500" in line  # first node hosts the rendezvous
        assert "--rdzv_backend c10d --rdzv_conf join_timeout=120,read_timeout=120 --max_restarts 1" in line
        assert line.startswith("LAUNCH launch --config_file")
        assert line.endswith("recipes/regression.py --resume_from_checkpoint auto --output_dir runs/x y")
    assert not (tmp_path / "scontrol.log").exists()  # no requeue after a run that ended

    # Exit 75 (preempted, as `accel-trainer launch` reports it): the job requeues itself and keeps the code.
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=30, env={**e, "FAKE_EXIT": "75"}
    )
    assert proc.returncode == 75 and "requeueing job 7" in proc.stdout, proc.stdout + proc.stderr
    assert read(tmp_path / "scontrol.log").split() == ["requeue", "7"]


# Stand-ins that record each argument on its own line (NUL-separated): a split or merged argument shows.
RECORDING_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$RECORD_DIR/srun.argv"
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 "$@"
"""
RECORDING_LAUNCHER = '#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD_DIR/launch.argv"\n'


@pytest.mark.slow
def test_slurm_script_passes_paths_with_spaces_and_quotes_whole(tmp_path):
    # A config folder and a training script whose names hold a space and a single quote: each must reach
    # `accel-trainer launch` as one argument, and the script must stay valid shell (the body of `bash -c '...'`
    # is single-quoted: a pasted `'` would end it).
    folder = tmp_path / "my configs" / "it's here"
    recipe = str(tmp_path / "my recipes" / "bob's recipe.py")
    argv = ["--dir", str(folder), "--name", "q", "--no-interactive", "--machines", "2"]
    argv += ["--processes-per-machine", "1", "--cpu", "--main-ip", "unused", "--slurm", "--script", recipe]
    assert wizard.main(argv) == 0
    script = folder / "q.slurm.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("srun", RECORDING_SRUN), ("scontrol", FAKE_SCONTROL), ("accel-trainer", RECORDING_LAUNCHER)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    e = {**env(), "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "7"}
    e |= {"RECORD_DIR": str(tmp_path), "SCONTROL_LOG": str(tmp_path / "scontrol.log")}
    proc = subprocess.run(
        ["bash", str(script), "--output_dir", "runs/x y", "--note", "it's"],
        capture_output=True, text=True, timeout=30, env=e,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read(tmp_path / "srun.argv").split("\0")[:3] == ["--kill-on-bad-exit=1", "bash", "-c"]
    got = read(tmp_path / "launch.argv").split("\0")[:-1]
    assert got[:3] == ["launch", "--config_file", str(folder / "q.yaml")]
    assert got[got.index("--machine_rank") + 1] == "0"
    assert got[-7:] == [recipe, "--resume_from_checkpoint", "auto", "--output_dir", "runs/x y", "--note", "it's"]
