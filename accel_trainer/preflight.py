"""`accel-trainer check`: preflight an accelerate config on this machine before a real run.

Prints the topology the file describes, validates it, checks the port (machine 0) or the reachability of the
main address (other machines), the backend, the visible devices and the environment variables that change
how processes find each other, then launches the config for real (`accelerate launch`, this module as the
script) and runs a short collective across all processes. Every wait is bounded by --timeout.
On several machines, run it on every machine at the same time, each with its own --machine_rank.

Also `accel-trainer launch`: `accelerate launch` with the rendezvous flags taken from the config (accelerate
ignores `rdzv_backend` in the file) and a bounded timeout, which says who was missing when a run fails.
"""

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys

from accel_trainer import sharding, topology

ENV_VARS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",  # set by launchers; stale ones mislead
    "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "OMP_NUM_THREADS",
    "SLURM_JOB_ID",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "SLURM_PROCID",
)
OK_LINE = "collective OK"


class Report:
    def __init__(self):
        self.failed = 0

    def ok(self, msg):
        print(f"[ ok ] {msg}", flush=True)

    def warn(self, msg):
        print(f"[warn] {msg}", flush=True)

    def fail(self, msg):
        self.failed += 1
        print(f"[FAIL] {msg}", flush=True)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--config_file", "--config-file", required=True, help="the accelerate config to check")
    p.add_argument("--machine_rank", "--machine-rank", type=int, default=0, help="this machine's rank")
    p.add_argument("--main_process_ip", "--main-ip", help="override the config's main_process_ip")
    p.add_argument("--main_process_port", "--main-port", type=int, help="override the config's main_process_port")
    p.add_argument(
        "--timeout",
        type=int,
        default=60,
        help="seconds to wait for peers (rendezvous) and for the collective (default 60)",
    )
    p.add_argument("--no-collective", action="store_true", help="skip launching the processes")


def add_parser(sub):
    """Register `accel-trainer check` (and `accel-trainer launch`) on the console script's subparsers."""
    add_launch_parser(sub)
    p = sub.add_parser(
        "check",
        help="preflight an accelerate config on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(a) -> int:
    from accelerate.commands.config.config_args import load_config_from_file

    r = Report()
    try:
        config = load_config_from_file(a.config_file)
    except Exception as e:  # missing file, bad YAML, unknown keys: accelerate's own message says which
        r.fail(f"{a.config_file}: accelerate cannot load it: {e}")
        return 1
    if a.main_process_ip:
        config.main_process_ip = a.main_process_ip
    if a.main_process_port is not None:
        config.main_process_port = a.main_process_port
    config.machine_rank = a.machine_rank
    machines = int(config.num_machines or 1)

    print(f"Topology of {a.config_file} (this is machine {a.machine_rank}):")
    print("  " + topology.describe(config).replace("\n", "\n  "))
    problems = topology.validate_config(config, gpus_detected=None)
    for p in problems:
        r.fail(p)
    if not problems:
        r.ok("config is valid and accelerate's loader reads it")

    check_devices(config, r)
    check_env(config, r)
    check_network(config, a.machine_rank, machines, a.timeout, r)

    if r.failed:
        print(f"{r.failed} problem(s); fix them before launching. Nothing was launched.")
        return 1
    if a.no_collective:
        return 0
    if machines > 1:
        print(
            f"Launching the collective: run this check on all {machines} machines now "
            f"(waiting up to {a.timeout} s for them).",
            flush=True,
        )
    ok = run_collective(a, config, r)
    return 0 if ok else 1


def check_devices(config, r):
    import torch
    import torch.distributed as dist

    per = int(config.num_processes) // max(int(config.num_machines or 1), 1)
    if config.use_cpu:
        r.ok(
            f"backend gloo (CPU) {'available' if dist.is_gloo_available() else 'MISSING'}; {os.cpu_count()} CPU "
            f"cores for {per} process(es)"
        )
        if not dist.is_gloo_available():
            r.fail("torch was built without gloo; CPU multi-process training needs it")
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        r.fail(
            f"this config uses GPUs ({per} per machine) but no CUDA device is visible here "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, driver, torch build "
            f"{torch.__version__}); for CPU use a use_cpu config such as accelerate_configs/cpu_2proc.yaml"
        )
        return
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(n)}))
    if per > n:
        r.fail(f"{per} processes per machine but only {n} GPUs visible ({names}): one process per GPU")
    else:
        r.ok(f"{n} GPU(s) visible ({names}) for {per} process(es) per machine")
    if not dist.is_nccl_available():
        r.fail("torch was built without NCCL; multi-GPU training needs it")
    else:
        r.ok(f"backend nccl available (NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})")
    if str(config.mixed_precision) == "bf16" and not torch.cuda.is_bf16_supported():
        r.fail(f"bf16 is not supported on {names}; use fp16 or no")


def check_env(config, r):
    shown = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    print("  environment: " + (", ".join(f"{k}={v}" for k, v in shown.items()) or "none of the relevant variables"))
    stale = [k for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ]
    if stale:
        r.warn(
            f"{', '.join(stale)} exported in this shell: launchers set these per process; stale values can make "
            "a process join the wrong world. Unset them unless you know why they are set."
        )
    names = {name for _, name in socket.if_nameindex()}
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = os.environ.get(var, "")
        wanted = [v.lstrip("=") for v in value.split(",") if v and not v.startswith("^")]
        missing = [v for v in wanted if v not in names and not any(n.startswith(v) for n in names)]
        if missing:
            r.fail(f"{var}={value}: no interface named {', '.join(missing)} here (have {', '.join(sorted(names))})")
    nnodes = os.environ.get("SLURM_NNODES")
    if nnodes and int(nnodes) != int(config.num_machines or 1):
        r.fail(f"SLURM gave this job {nnodes} nodes but the config describes {config.num_machines} machines")


def check_network(config, rank, machines, timeout, r):
    if not 0 <= rank < machines:
        r.fail(f"--machine_rank {rank} is out of range for {machines} machine(s) (valid: 0..{machines - 1})")
        return
    port = topology.DEFAULT_PORT if config.main_process_port is None else int(config.main_process_port)
    if machines == 1 and port == 0:
        r.ok("main_process_port 0: accelerate picks a free port at launch")
        return
    if machines == 1:
        free, why = topology.port_free(port)
        # On one machine accelerate falls back to a free port by itself, so a busy one is only worth a warning.
        (r.ok if free else r.warn)(why + ("" if free else "; accelerate will pick another port on one machine"))
        return
    host = config.main_process_ip
    if rank == 0:
        free, why = topology.port_free(port)
        if not free:
            r.fail(
                f"{why}. Machine 0 must listen on it: stop the other run, or choose another "
                "--main_process_port on every machine."
            )
            return
        r.ok(why)
        mine, why = topology.port_free(port, host)
        if not mine and "not an address" in why:
            r.warn(
                f"{why}: fine behind NAT/port forwarding, otherwise set main_process_ip to this machine's "
                "cluster-network address."
            )
    else:
        up, why = topology.reachable(host, port, timeout_s=min(timeout, 10))
        (r.ok if up else r.fail)(why)


def launch_argv(a, config) -> list[str]:
    """`accelerate launch` for this config with this module as the script (the `--worker` mode below)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", a.config_file]
    if a.main_process_ip:
        cmd += ["--main_process_ip", a.main_process_ip]
    if a.main_process_port is not None:
        cmd += ["--main_process_port", str(a.main_process_port)]
    if int(config.num_machines or 1) > 1:
        cmd += ["--machine_rank", str(a.machine_rank)] + topology.rdzv_flags(config.rdzv_backend, a.timeout)
    return cmd + ["-m", "accel_trainer.preflight", "--worker", "--timeout", str(a.timeout)]


def run_collective(a, config, r) -> bool:
    cmd = launch_argv(a, config)
    # Bounded: rendezvous (timeout) + process group and collective (timeout) + start-up slack.
    limit = 2 * a.timeout + 60
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        r.fail(f"the launched processes did not finish within {limit} s; last output:\n{_tail(out)}")
        return False
    line = next((ln for ln in out.splitlines() if OK_LINE in ln), None)
    if proc.returncode == 0 and (line or a.machine_rank != 0):
        r.ok(line or "this machine's processes took part in the collective (machine 0 prints the result)")
        return True
    r.fail(f"the launch failed (exit {proc.returncode}): {diagnose(out, config, a.machine_rank)}\n{_tail(out)}")
    return False


def _tail(text, n=25):
    return "\n".join("    " + ln for ln in text.strip().splitlines()[-n:])


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


def add_launch_parser(sub):
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
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: accel-trainer launch [accelerate launch arguments] script.py [script arguments]\n"
            "  like `accelerate launch`; several machines get --rdzv_backend from the config and "
            f"--rdzv_conf with a {rdzv_timeout_s} s timeout unless given"
        )
        return 0 if argv else 2
    args, _ = launch_command_parser().parse_known_args(argv)
    config = load_config_from_file(args.config_file) if args.config_file else None
    problems = topology.validate_config(config) if config is not None else []
    problems += sharding.launch_problems(args, config)  # --use_deepspeed; --cpu with an FSDP config
    if problems:
        print(
            f"launch: refusing to launch {args.config_file or args.training_script}:\n"
            + "\n".join(f"  - {p}" for p in problems),
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


# ----------------------------------------------------------------------------------------------------------
# The launched side: one short all-reduce and all-gather across every process.


def worker(timeout_s: int) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    acc = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[topology.process_group_kwargs(timeout_s)])
    world = topology.check_world(acc)
    ones = torch.ones(1, device=acc.device)
    total = acc.reduce(ones, reduction="sum").item()
    hosts = gather_object([socket.gethostname()])
    if total != acc.num_processes:
        raise topology.TopologyError(f"all-reduce of ones gave {total}, expected {acc.num_processes}")
    if acc.is_main_process:
        print(
            f"{OK_LINE}: {acc.num_processes} processes on {world.num_machines} machine(s) "
            f"({world.processes_per_machine} per machine), backend {acc.state.backend or 'none'}, "
            f"device {acc.device.type}, hosts {sorted(set(hosts))}",
            flush=True,
        )
    acc.end_training()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # how run_collective launches this module
        wp = argparse.ArgumentParser()
        wp.add_argument("--worker", action="store_true")
        wp.add_argument("--timeout", type=int, default=60)
        return worker(wp.parse_args(argv).timeout)
    ap = argparse.ArgumentParser(prog="accel-trainer check", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
