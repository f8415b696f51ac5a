"""check_world and the config rules without launching anything (fast); tests/test_topology_launch.py does it for
real. Each case is a world that went wrong in a way people hit, and the error must name the difference and fix."""

from types import SimpleNamespace

import pytest
from accelerate.commands.config.config_args import ClusterConfig

from accel_trainer import accel, world
from accel_trainer.cluster import cluster_config, network
from accel_trainer.errors import UserError
from accel_trainer.world import TopologyError, check_world

TORCHRUN_VARS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK")


def acc(n, index=0):
    return SimpleNamespace(num_processes=n, process_index=index, local_process_index=index)


@pytest.fixture
def torchrun_env(monkeypatch):
    for k in TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)

    def set_env(world, local, machines, group_rank=0):
        for k, v in zip(TORCHRUN_VARS, (world, local, machines, group_rank)):
            monkeypatch.setenv(k, str(v))

    return set_env


def test_topology_error_is_a_runtime_and_user_error():
    assert issubclass(TopologyError, RuntimeError) and issubclass(TopologyError, UserError)


def test_matching_world_passes(torchrun_env):
    torchrun_env(world=4, local=2, machines=2)
    w = check_world(acc(4), {"num_processes": 4, "num_machines": 2})
    assert (w.num_processes, w.num_machines, w.processes_per_machine) == (4, 2, 2)


def test_launched_two_but_each_process_alone(torchrun_env):
    torchrun_env(world=2, local=2, machines=1)
    with pytest.raises(TopologyError, match=r"WORLD_SIZE=2 .* joined a world of 1.*cpu=True"):
        check_world(acc(1))


def test_num_processes_read_as_per_machine(torchrun_env):
    # The config said num_processes=8 meaning "8 per machine" on 2 machines: torchrun started 4 per machine.
    torchrun_env(world=8, local=4, machines=2)
    with pytest.raises(TopologyError) as e:
        check_world(acc(8), {"num_processes": 16, "num_machines": 2})
    msg = str(e.value)
    assert "total processes: expected 16, joined 8" in msg
    assert "processes on this machine: expected 8, started 4" in msg
    assert "TOTAL over all machines" in msg


def test_not_divisible_names_the_floor(torchrun_env):
    torchrun_env(world=2, local=1, machines=2)
    with pytest.raises(
        TopologyError,
        match=r"not divisible by num_machines=2; accelerate starts num_processes // "
        r"num_machines = 1 per machine",
    ):
        check_world(acc(2), {"num_processes": 3, "num_machines": 2})


def test_fewer_machines_joined(torchrun_env):
    torchrun_env(world=8, local=8, machines=1)
    with pytest.raises(TopologyError, match="machines: expected 2, joined 1"):
        check_world(acc(8), {"num_processes": 8, "num_machines": 2, "processes_per_machine": 8})


def test_machine_rank_out_of_range(torchrun_env):
    torchrun_env(world=2, local=1, machines=2, group_rank=2)
    with pytest.raises(TopologyError, match="Machine rank 2 is out of range for 2 machines"):
        check_world(acc(2))


def test_plain_python_is_a_world_of_one(torchrun_env, monkeypatch):
    monkeypatch.setattr(world, "launcher_world", lambda: None)
    assert check_world(acc(1)).num_processes == 1


def test_launch_command_line_is_read_like_accelerate_reads_it(tmp_path):
    w = world.world_from_launch_argv(["--cpu", "--num_processes", "2", "train.py", "--num_processes", "9"])
    assert (w.num_processes, w.num_machines, w.distributed_type, w.launcher_flags) == (2, 1, "MULTI_CPU", "--cpu")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: true\n")
    w = world.world_from_launch_argv(["--config_file", str(cfg), "train.py"])
    assert (w.num_processes, w.distributed_type) == (2, "MULTI_CPU")
    # Flags win over the file, as in accelerate.
    w = world.world_from_launch_argv(
        ["--config_file", str(cfg), "--num_processes", "4", "--num_machines", "2", "train.py"]
    )
    assert (w.num_processes, w.num_machines, w.processes_per_machine) == (4, 2, 2)
    assert world._launch_argv_of(["/usr/bin/python3", "/x/bin/accelerate", "launch", "--cpu", "t.py"]) == [
        "--cpu",
        "t.py",
    ]
    assert world._launch_argv_of(["python", "-m", "accelerate.commands.launch", "t.py"]) == ["t.py"]
    assert world._launch_argv_of(["python", "train.py", "launch"]) is None


def test_multi_cpu_trap_from_the_launch_line_names_the_fix(torchrun_env, monkeypatch):
    monkeypatch.setattr(
        world, "launcher_world", lambda: world.world_from_launch_argv(["--cpu", "--num_processes", "2", "t.py"])
    )
    with pytest.raises(TopologyError, match=r"expected 2, joined 1.*ONE process.*--multi_gpu"):
        check_world(acc(1))


def config(**kw):
    base = dict(
        compute_environment="LOCAL_MACHINE",
        distributed_type="MULTI_GPU",
        mixed_precision="no",
        use_cpu=False,
        debug=False,
        num_processes=16,
        num_machines=2,
        main_process_ip="10.0.0.1",
        main_process_port=29500,
    )
    base.update(kw)
    return ClusterConfig(**base)


@pytest.mark.parametrize(
    "kw, gpus, words",
    [
        (dict(num_processes=15, num_machines=2), None, "not a multiple of num_machines"),
        (dict(distributed_type="MULTI_CPU", num_processes=2, num_machines=1, use_cpu=True), None, "ONE process"),
        (dict(main_process_port=70000), None, "out of range"),
        (dict(main_process_ip=None), None, "main_process_ip is required"),
        (dict(machine_rank=2), None, "machine_rank=2 is out of range"),
        (dict(rdzv_backend="etcd"), None, "rdzv_backend"),
        (dict(), 0, "no GPU is visible"),
        (dict(), 4, "only 4 GPUs are visible"),
        (dict(distributed_type="DEEPSPEED"), None, "Shard with FSDP instead"),
        (dict(distributed_type="FSDP", fsdp_config={"fsdp_version": 1}), None, "FSDP2 only"),
        (dict(distributed_type="FSDP", use_cpu=True, num_processes=1, num_machines=1), None, "nothing to shard over"),
        (dict(use_cpu=True, mixed_precision="fp16"), None, "fp16 mixed precision needs a GPU"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(kw, gpus, words):
    problems = cluster_config.validate_config(config(**kw), gpus_detected=gpus)
    assert any(words in p for p in problems), problems


def test_good_config_has_no_problems():
    assert cluster_config.validate_config(config(), gpus_detected=8) == []
    assert cluster_config.validate_config(config(), gpus_detected=None) == []


def test_port_checks_are_bounded_and_say_why():
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        free, why = network.port_free(port)
        assert not free and "already in use" in why
        up, why = network.reachable("127.0.0.1", port, timeout_s=2)
        assert up and "accepts connections" in why
    assert network.port_free(port)[0]
    up, why = network.reachable("127.0.0.1", port, timeout_s=2)
    assert up and "nothing listens" in why
    up, why = network.reachable("machine0.invalid", port, timeout_s=2)
    assert not up and "cannot resolve" in why


def test_rendezvous_flags():
    assert cluster_config.rdzv_flags("static", 30) == ["--rdzv_backend", "static", "--rdzv_conf", "timeout=30"]
    assert cluster_config.rdzv_flags("c10d", 30) == [
        "--rdzv_backend",
        "c10d",
        "--rdzv_conf",
        "join_timeout=30,read_timeout=30",
    ]


def test_process_group_timeout_is_bounded_and_validated():
    import datetime

    assert accel.process_group_kwargs(90).timeout == datetime.timedelta(seconds=90)
    with pytest.raises(ValueError, match="positive"):
        accel.process_group_kwargs(0)


def test_launched_world_is_read_from_the_launcher_environment(torchrun_env):
    assert world.launched_world() is None  # no launcher: one plain process
    torchrun_env(world=4, local=2, machines=2, group_rank=1)
    w = world.launched_world()
    assert (w.num_processes, w.num_machines, w.processes_per_machine, w.machine_rank) == (4, 2, 2, 1)
    from accel_trainer.world import launched_world_size

    assert launched_world_size() == 4


def test_route_to_loopback_and_the_network_settings_it_implies(monkeypatch):
    r = network.route_to("127.0.0.1")
    assert (r.main_ip, r.local_ip, r.is_main) == ("127.0.0.1", "127.0.0.1", True) and r.interface is not None
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PET_LOCAL_ADDR"):
        monkeypatch.delenv(k, raising=False)
    new, kept = network.network_env(r)
    assert new == {
        "PET_LOCAL_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": r.interface,
        "NCCL_SOCKET_IFNAME": "=" + r.interface,
    }
    assert kept == {}
    # The user's own settings always win.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    new, kept = network.network_env(r)
    assert "GLOO_SOCKET_IFNAME" not in new and kept == {"GLOO_SOCKET_IFNAME": "ib0"}
    with pytest.raises(UserError, match="cannot resolve machine 0's address 'machine0.invalid'"):
        network.route_to("machine0.invalid")


def test_c10d_host_role_machine_0_hosts_when_it_owns_the_address_others_never():
    mine = network.Route("10.0.0.1", "10.0.0.1", "10.0.0.1", "eth1", True)
    other = network.Route("10.0.0.1", "10.0.0.1", "10.0.0.2", "eth1", False)
    conf = "join_timeout=60,read_timeout=60"
    assert network.host_role(conf, "c10d", 0, mine) == conf + ",is_host=1"
    assert network.host_role(conf, "c10d", 1, other) == conf + ",is_host=0"
    assert network.host_role(conf, "c10d", 0, other) == conf  # behind NAT: torch decides
    assert network.host_role(conf + ",is_host=0", "c10d", 0, mine) == conf + ",is_host=0"  # the user's wins
    assert network.host_role("timeout=60", "static", 0, mine) == "timeout=60"  # static: machine 0 hosts anyway


def test_launch_plan_keeps_the_users_interface_and_host_role(tmp_path, monkeypatch):
    from accel_trainer.cluster import launch, wizard

    argv = ["--dir", str(tmp_path), "--name", "two", "--no-interactive", "--machines", "2", "--cpu"]
    assert wizard.main(argv + ["--main-ip", "127.0.0.1", "--rdzv", "c10d"]) == 0
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "myif")
    cfg = str(tmp_path / "two.yaml")
    p = launch.plan(
        ["--config_file", cfg, "--machine_rank", "1", "--rdzv_conf", "is_host=1", "t.py", "--ddp_timeout", "7"]
    )
    assert p.env["GLOO_SOCKET_IFNAME"] == "myif" and p.env["PET_LOCAL_ADDR"] == "127.0.0.1"
    assert p.cmd[p.cmd.index("--rdzv_conf") + 1] == "is_host=1" and "--rdzv_backend" in p.cmd
    assert p.lost_after_s == 7  # machine 1 gives up on a silent machine 0 after the script's --ddp_timeout
    p = launch.plan(["--config_file", cfg, "--machine_rank", "0", "t.py"])
    assert p.cmd[p.cmd.index("--rdzv_conf") + 1].endswith(",is_host=1") and p.lost_after_s is None


def test_launch_takes_the_machine_rank_from_a_per_machine_config_unless_the_flag_says_otherwise(tmp_path):
    """A per-machine accelerate config (`accelerate config` writes machine_rank into it) is what accelerate launch
    reads; `accel-trainer launch` must read it too, or machines 1..N-1 plan as machine 0 (no machine-0 watch, the
    c10d store host role, wrong notes). The flag, when given, wins -- as in accelerate."""
    import yaml

    from accel_trainer.cluster import launch, wizard

    argv = ["--dir", str(tmp_path), "--name", "two", "--no-interactive", "--machines", "2", "--cpu"]
    assert wizard.main(argv + ["--main-ip", "127.0.0.1", "--rdzv", "c10d"]) == 0
    cfg = tmp_path / "two.yaml"
    data = yaml.safe_load(cfg.read_text())
    data["machine_rank"] = 1
    cfg.write_text(yaml.safe_dump(data))
    p = launch.plan(["--config_file", str(cfg), "t.py", "--ddp_timeout", "7"])
    assert p.machine_rank == 1 and p.lost_after_s == 7  # machine 1 watches machine 0
    assert p.cmd[p.cmd.index("--rdzv_conf") + 1].endswith(",is_host=0") and "machine 1:" in p.notes[0]
    p = launch.plan(["--config_file", str(cfg), "--machine_rank", "0", "t.py"])
    assert p.machine_rank == 0 and p.lost_after_s is None
    assert p.cmd[p.cmd.index("--rdzv_conf") + 1].endswith(",is_host=1")


@pytest.fixture
def machine0_name_is_loopback(tmp_path, monkeypatch):
    """A 2-machine c10d config naming machine 0 `node0`, which resolves here to 127.0.1.1 (Debian's default
    /etc/hosts line for the machine's own name), on a machine whose other address is 10.9.9.9 on eth7."""
    import socket

    from accel_trainer.cluster import wizard

    real = socket.getaddrinfo

    def fake(host, *a, **k):
        return real("127.0.1.1" if host == "node0" else host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    monkeypatch.setattr(network, "cluster_addresses", lambda: [("10.9.9.9", "eth7")])
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PET_LOCAL_ADDR"):
        monkeypatch.delenv(k, raising=False)
    argv = ["--dir", str(tmp_path), "--name", "two", "--no-interactive", "--machines", "2", "--cpu"]
    assert wizard.main(argv + ["--main-ip", "node0", "--rdzv", "c10d"]) == 0
    return str(tmp_path / "two.yaml")


def test_machine_0_whose_name_resolves_to_loopback_announces_its_network_address(machine0_name_is_loopback):
    """Not lo / 127.0.0.1: c10d would hand that to the other machines as the store address."""
    from accel_trainer.cluster import launch

    p = launch.plan(["--config_file", machine0_name_is_loopback, "--machine_rank", "0", "t.py"])
    assert p.env["PET_LOCAL_ADDR"] == "10.9.9.9" and p.env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert p.env["NCCL_SOCKET_IFNAME"] == "=eth7"
    assert p.cmd[p.cmd.index("--rdzv_conf") + 1].endswith(",is_host=1")  # machine 0 hosts the store
    said = "\n".join(p.notes)
    assert "'node0' resolves to 127.0.1.1" in said and "using 10.9.9.9 (eth7" in said, said


def test_machine_0_loopback_name_with_several_candidate_addresses_is_refused(machine0_name_is_loopback, monkeypatch):
    from accel_trainer.cluster import launch

    monkeypatch.setattr(network, "cluster_addresses", lambda: [("10.9.9.9", "eth7"), ("10.8.8.8", "eth8")])
    monkeypatch.setattr(network, "_default_route_interface", lambda: None)
    with pytest.raises(UserError, match=r"resolves to 127\.0\.1\.1 .* 10\.9\.9\.9 \(eth7\), 10\.8\.8\.8 \(eth8\)"):
        launch.plan(["--config_file", machine0_name_is_loopback, "--machine_rank", "0", "t.py"])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth8")  # the user's choice settles it
    p = launch.plan(["--config_file", machine0_name_is_loopback, "--machine_rank", "0", "t.py"])
    assert p.env["PET_LOCAL_ADDR"] == "10.8.8.8"


def test_other_machine_whose_name_for_machine_0_resolves_to_loopback_is_refused(machine0_name_is_loopback):
    from accel_trainer.cluster import launch

    with pytest.raises(UserError, match="a loopback address, this machine itself, not machine 0"):
        launch.plan(["--config_file", machine0_name_is_loopback, "--machine_rank", "1", "t.py"])
