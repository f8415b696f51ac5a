"""`accel-trainer check`: the preflight prints the topology, fails loudly (exit 1, nothing launched) on what would
break a run, and runs a real collective across the launched processes -- on one machine and on two (loopback)."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, call, env, free_port, two_machine_config

from accel_trainer.cluster import check as preflight

CHECK = [sys.executable, "-m", "accel_trainer.cli", "check"]
CONFIGS = os.path.join(ROOT, "accelerate_configs")


@pytest.mark.slow
def test_collective_across_two_cpu_processes():
    cmd = CHECK + ["--config_file", "accelerate_configs/cpu_2proc.yaml", "--main_process_port", str(free_port())]
    proc = call(cmd + ["--timeout", "30"], 150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 machine(s) x 2 CPU process(es) per machine = 2 processes in total" in proc.stdout
    assert "[ ok ] collective OK: 2 processes on 1 machine(s) (2 per machine), backend gloo" in proc.stdout
    assert "[FAIL]" not in proc.stdout


@pytest.mark.slow
def test_collective_across_two_machines_on_loopback(tmp_path):
    cfg = two_machine_config(tmp_path, port=free_port())
    procs = [
        subprocess.Popen(
            CHECK + ["--config_file", cfg, "--machine_rank", str(r), "--timeout", "40"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(),
            cwd=ROOT,
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    assert "collective OK: 2 processes on 2 machine(s) (1 per machine)" in outs[0]
    assert "this machine's processes took part in the collective" in outs[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_config_on_a_machine_without_gpu_fails_before_launching(capsys):
    assert preflight.main(["--config_file", os.path.join(CONFIGS, "gpu_1x8_bf16.yaml")]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] this config uses GPUs (8 per machine) but no CUDA device is visible" in out
    assert "Nothing was launched" in out


def test_missing_and_broken_files(tmp_path, capsys):
    assert preflight.main(["--config_file", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml: no such config file" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nnum_procesess: 3\n")
    assert preflight.main(["--config_file", str(bad)]) == 1
    assert "unknown keys" in capsys.readouterr().out


def test_multi_cpu_config_is_refused(tmp_path, capsys):
    cfg = tmp_path / "multi_cpu.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: true\n")
    assert preflight.main(["--config_file", str(cfg)]) == 1
    assert "is launched by accelerate as ONE process" in capsys.readouterr().out


def test_busy_port_on_machine_0_and_rank_out_of_range(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = two_machine_config(tmp_path, port=port)
        capsys.readouterr()
        assert preflight.main(["--config_file", cfg, "--machine_rank", "0"]) == 1
        out = capsys.readouterr().out
        assert f"[FAIL] port {port} is already in use on this machine" in out and "Nothing was launched" in out
    assert preflight.main(["--config_file", cfg, "--machine_rank", "2"]) == 1
    assert "--machine_rank 2 is out of range for 2 machines" in capsys.readouterr().out


def test_unresolvable_main_address_and_stale_env(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif0")
    assert (
        preflight.main(
            [
                "--config_file",
                os.path.join(CONFIGS, "gpu_2x8_bf16_static.yaml"),
                "--machine_rank",
                "1",
                "--no-collective",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "[FAIL] cannot resolve machine 0's address 'machine0.invalid'" in out
    assert "[warn] WORLD_SIZE exported in this shell" in out
    assert "[FAIL] NCCL_SOCKET_IFNAME=nosuchif0: no interface named nosuchif0" in out
