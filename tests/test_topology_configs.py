"""Every shipped file in accelerate_configs/ loads in Accelerate's own loader, is valid by our rules, and makes
accelerate's launcher start the topology its README promises (processes per machine, machines, launcher)."""

import glob
import os

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
from helpers import ROOT, free_port

from accel_trainer.cluster import cluster_config

CONFIGS = os.path.join(ROOT, "accelerate_configs")

# name -> (launcher, processes per machine, machines, mixed precision, use_cpu)
SHIPPED = {
    "cpu_1proc": ("simple", 1, 1, "no", True),
    "cpu_2proc": ("torchrun", 2, 1, "no", True),
    "gpu_1": ("simple", 1, 1, "no", False),
    "gpu_1x8_bf16": ("torchrun", 8, 1, "bf16", False),
    "gpu_2x8_bf16_static": ("torchrun", 8, 2, "bf16", False),
    "gpu_2x8_bf16_c10d": ("torchrun", 8, 2, "bf16", False),
    "gpu_1x8_fsdp_bf16": ("torchrun", 8, 1, "bf16", False),
}


def test_every_yaml_is_listed_and_documented():
    names = {os.path.basename(p)[: -len(".yaml")] for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))}
    assert names == set(SHIPPED)
    readme = open(os.path.join(CONFIGS, "README.md")).read()
    for name in names:
        assert f"{name}.yaml" in readme, f"{name}.yaml is not described in accelerate_configs/README.md"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_loads_and_launches_the_promised_topology(name, monkeypatch):
    launcher, per_machine, machines, mp, cpu = SHIPPED[name]
    path = os.path.join(CONFIGS, f"{name}.yaml")
    config = load_config_from_file(path)  # accelerate's own loader
    assert cluster_config.validate_config(config, gpus_detected=None) == []
    assert config.num_processes == per_machine * machines  # the TOTAL, not per machine
    assert config.num_machines == machines and bool(config.use_cpu) == cpu
    assert str(config.mixed_precision) == mp

    # What `accelerate launch --config_file <file> x.py` derives from the file (its own validation code).
    argv = ["--config_file", path]
    if machines > 1:
        argv += ["--machine_rank", "1", *cluster_config.rdzv_flags(config.rdzv_backend, 30)]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv + ["x.py"]))
    torchrun = args.multi_gpu or args.use_fsdp
    assert ("torchrun" if torchrun else "simple") == launcher
    if torchrun:
        args.main_process_port = free_port()  # do not depend on 29500 being free on a shared machine
        env = prepare_multi_gpu_env(args)
        assert args.nproc_per_node == str(per_machine)
        assert int(getattr(args, "nnodes", 1)) == machines
        assert env["ACCELERATE_MIXED_PRECISION"] == mp
        assert (env.get("ACCELERATE_USE_FSDP") == "true") == ("fsdp" in name)
        if machines > 1:
            assert args.rdzv_endpoint == f"{config.main_process_ip}:{args.main_process_port}"
            assert args.rdzv_backend == ("c10d" if "c10d" in name else "static")
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
        assert env["ACCELERATE_USE_CPU"] == str(cpu)


def test_c10d_from_the_config_file_alone_is_ignored_by_accelerate():
    """Why launch lines carry --rdzv_backend: accelerate's flag default ("static") wins over the file."""
    path = os.path.join(CONFIGS, "gpu_2x8_bf16_c10d.yaml")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "x.py"]))
    assert load_config_from_file(path).rdzv_backend == "c10d"
    assert args.rdzv_backend == "static"
    assert "--rdzv_backend c10d" in cluster_config.launch_command(path, load_config_from_file(path), 1)
