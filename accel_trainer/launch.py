"""`accel-trainer launch`: `accelerate launch`, with what accelerate leaves out for several machines.

It takes the same arguments as `accelerate launch` and adds the rendezvous flags accelerate does not read from the
config file (`--rdzv_backend`; a bounded `--rdzv_conf` timeout), refuses at once a config that would run the wrong
world, a machine rank out of range and an address that does not resolve, passes the output through, and when the
run fails says who was missing and what to check (`diagnose`, shared with `accel-trainer check`).
"""

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys

from accel_trainer import topology
from accel_trainer.errors import UserError


def diagnose(output: str, config=None, machine_rank: int = 0) -> str:
    """What the usual torch/accelerate failure messages mean: who was missing and what to check."""
    n = int(getattr(config, "num_machines", 0) or 0)
    where = f"{config.main_process_ip}:{config.main_process_port}" if n > 1 else "machine 0's address and port"
    net = (
        f"that every machine reaches {where} (run `accel-trainer check --config_file <file> --machine_rank R` on "
        "each), that the firewall lets that TCP port in on machine 0, and the interface variables "
        "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (docs/topology.md)"
    )
    if "TopologyError" in output:
        return "the processes formed a different world than the config describes (see the TopologyError above)"
    m = re.search(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", output)
    if m:
        waited, joined, total = map(int, m.groups())
        return (
            f"machine 0 waited {waited} s but only {joined} of {total} machines joined ({total - joined} "
            f"missing: those with --machine_rank 1..{total - 1} that never connected). Check that they were "
            f"started with the same config and their own --machine_rank, {net}."
        )
    if "RendezvousTimeoutError" in output:
        return (
            f"not all {n or 'the'} machines joined the c10d rendezvous within the timeout (this is machine "
            f"{machine_rank}). Check that every machine was started with the same config, {net}."
        )
    if "utilizing it" in output or "Address already in use" in output or "EADDRINUSE" in output:
        return (
            "the rendezvous port is busy on machine 0 (an earlier run still alive?): stop it or choose "
            "another --main_process_port on every machine"
        )
    if "RendezvousConnectionError" in output or "DistNetworkError" in output or "Connection refused" in output:
        return f"could not connect to machine 0: start it, and check {net}"
    if "NCCL" in output:
        return f"NCCL failed: rerun with NCCL_DEBUG=INFO; check {net}"
    return "see the output above"


def add_parser(sub):
    """`accel-trainer launch ...`: the arguments are `accelerate launch`'s, passed through unparsed."""
    p = sub.add_parser(
        "launch",
        prefix_chars="+",
        add_help=False,
        help="accelerate launch, with rendezvous flags from the config and a diagnosis on failure",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: launch(a.argv))
    return p


def launch(argv: list[str], rdzv_timeout_s: int = topology.DEFAULT_RDZV_TIMEOUT_S) -> int:
    """Run `accelerate launch <argv>`: refuse a config that would run the wrong world, add the rendezvous flags
    accelerate does not take from the file (--rdzv_backend, a bounded --rdzv_conf), and on failure say who
    was missing and what to check. Output is passed through unchanged (progress bars included)."""
    from accelerate.commands.launch import launch_command_parser

    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: accel-trainer launch [accelerate launch arguments] script.py [script arguments]\n"
            "  like `accelerate launch`; several machines get --rdzv_backend from the config and "
            f"--rdzv_conf with a {rdzv_timeout_s} s timeout unless given"
        )
        return 0 if argv else 2
    args, _ = launch_command_parser().parse_known_args(argv)
    try:
        config = topology.load_config(args.config_file) if args.config_file else None
    except UserError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    if config is not None:
        problems = topology.validate_config(config)
        if problems:
            print(
                "launch: refusing to launch " + args.config_file + ":\n" + "\n".join(f"  - {p}" for p in problems),
                file=sys.stderr,
            )
            return 2
    at = argv.index(args.training_script)  # our flags go before the script; its own arguments stay after it
    given = {a.split("=")[0] for a in argv[:at]}
    machines = int(args.num_machines or getattr(config, "num_machines", 1) or 1)
    rank = int(args.machine_rank or 0)
    if machines > 1 and not 0 <= rank < machines:
        print(
            f"launch: --machine_rank {rank} is out of range for {machines} machines (valid: 0..{machines - 1}); "
            "give each machine its own rank.",
            file=sys.stderr,
        )
        return 2
    host = args.main_process_ip or getattr(config, "main_process_ip", None)
    if machines > 1 and rank > 0 and host:
        try:  # a name that does not resolve fails here, at once, instead of after the rendezvous timeout
            socket.getaddrinfo(host, None)
        except socket.gaierror as e:
            print(
                f"launch: cannot resolve machine 0's address {host!r} ({e}); pass --main_process_ip with its "
                "cluster-network IP.",
                file=sys.stderr,
            )
            return 2
    extra = []
    if machines > 1:
        backend = args.rdzv_backend if "--rdzv_backend" in given else getattr(config, "rdzv_backend", "static")
        if "--rdzv_backend" not in given:
            extra += ["--rdzv_backend", backend]
        if "--rdzv_conf" not in given:
            extra += ["--rdzv_conf", topology.rdzv_conf(backend, rdzv_timeout_s)]
    env = dict(os.environ)
    backend = dict(zip(extra[::2], extra[1::2])).get("--rdzv_backend", args.rdzv_backend)
    if args.max_restarts and backend == "c10d":
        env.setdefault(topology.RESTART_SAFE_ENV, "1")  # a fresh store per restart round (see topology.py)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *argv[:at], *extra, *argv[at:]]
    print("accel-trainer launch: accelerate launch " + shlex.join(cmd[3:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    tail = b""
    try:
        while chunk := os.read(proc.stdout.fileno(), 65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            tail = (tail + chunk)[-65536:]
        rc = proc.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to the launcher too; give it a bounded time to stop
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    if rc != 0:
        if config is not None and args.main_process_ip:
            config.main_process_ip = args.main_process_ip
        if config is not None and args.main_process_port:
            config.main_process_port = args.main_process_port
        why = diagnose(tail.decode(errors="replace"), config, args.machine_rank or 0)
        print(f"accel-trainer launch: the run failed (exit {rc}): {why}", file=sys.stderr, flush=True)
    return rc
