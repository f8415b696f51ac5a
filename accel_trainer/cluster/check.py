"""`accel-trainer check`: preflight an accelerate config on this machine before a real run.

Prints the topology the file describes, validates it, checks the port (machine 0) or the reachability of the
main address (other machines), the backend, the visible devices and the environment variables that change
how processes find each other, then launches the config for real (`accelerate launch`, this module as the
script) and runs a short collective across all processes. Every wait is bounded by --timeout.
On several machines, run it on every machine at the same time, each with its own --machine_rank.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys

from accel_trainer import accel, world
from accel_trainer.cluster import cluster_config, network
from accel_trainer.cluster.launch import diagnose, plan
from accel_trainer.errors import UserError

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
    """Register `accel-trainer check` on the console script's subparsers."""
    p = sub.add_parser(
        "check",
        help="preflight an accelerate config on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=check)
    return p


def check(a) -> int:
    """The whole preflight for the arguments `a` (add_arguments); 0 when every check passed."""
    r = Report()
    try:
        config = cluster_config.load_config(a.config_file)
    except UserError as e:  # missing file, bad YAML (file:line), unknown keys: one line
        r.fail(str(e))
        return 1
    if a.main_process_ip:
        config.main_process_ip = a.main_process_ip
    if a.main_process_port is not None:
        config.main_process_port = a.main_process_port
    config.machine_rank = a.machine_rank
    machines = int(config.num_machines or 1)

    print(f"Topology of {a.config_file} (this is machine {a.machine_rank}):")
    print("  " + cluster_config.describe(config).replace("\n", "\n  "))
    problems = cluster_config.validate_config(config, gpus_detected=None)
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
    problem = world.machine_rank_problem(rank, machines)
    if problem:
        r.fail(problem)
        return
    port = network.DEFAULT_PORT if config.main_process_port is None else int(config.main_process_port)
    if machines == 1 and port == 0:
        r.ok("main_process_port 0: accelerate picks a free port at launch")
        return
    if machines == 1:
        free, why = network.port_free(port)
        # On one machine accelerate falls back to a free port by itself, so a busy one is only worth a warning.
        (r.ok if free else r.warn)(why + ("" if free else "; accelerate will pick another port on one machine"))
        return
    host = config.main_process_ip
    try:
        route = network.route_to(host, port)
        route, fixed = network.loopback_route(route, rank)  # machine 0's name resolving to 127.0.1.1
    except UserError as e:  # no such name, no route from here, or a loopback machine 0 that cannot be made right
        r.fail(str(e))
        return
    if fixed:
        r.warn(fixed)
    new, kept = network.network_env(route)
    sets = " ".join(f"{k}={v}" for k, v in new.items())
    r.ok(
        f"machine {rank}: {route.describe()}; `accel-trainer launch` sets {sets or 'nothing'}"
        + (f" and keeps yours: {' '.join(f'{k}={v}' for k, v in kept.items())}" if kept else "")
    )
    if rank == 0:
        free, why = network.port_free(port)
        if not free:
            r.fail(
                f"{why}. Machine 0 must listen on it: stop the other run, or choose another "
                "--main_process_port on every machine."
            )
            return
        r.ok(why)
        if not route.is_main:
            r.warn(
                f"{host} is not an address of this machine, so machine 0 cannot listen on it: fine behind NAT/port "
                "forwarding, otherwise set main_process_ip to this machine's cluster-network address."
            )
    else:
        up, why = network.reachable(host, port, timeout_s=min(timeout, 10))
        (r.ok if up else r.fail)(why)


def launch_argv(a, config) -> list[str]:
    """`accel-trainer launch` arguments for this config with this module as the script (the `--worker` mode)."""
    argv = ["--config_file", a.config_file]
    if a.main_process_ip:
        argv += ["--main_process_ip", a.main_process_ip]
    if a.main_process_port is not None:
        argv += ["--main_process_port", str(a.main_process_port)]
    if int(config.num_machines or 1) > 1:
        argv += ["--machine_rank", str(a.machine_rank)] + cluster_config.rdzv_flags(config.rdzv_backend, a.timeout)
    return argv + ["-m", "accel_trainer.cluster.check", "--worker", "--timeout", str(a.timeout)]


def run_collective(a, config, r) -> bool:
    """Launch the workers as `accel-trainer launch` would (same interface, address and host role: launch.plan)."""
    try:
        p = plan(launch_argv(a, config), a.timeout)
    except UserError as e:
        r.fail(str(e))
        return False
    # Bounded: rendezvous (timeout) + process group and collective (timeout) + start-up slack.
    limit = 2 * a.timeout + 60
    proc = subprocess.Popen(
        p.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=p.env, start_new_session=True
    )
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


# ----------------------------------------------------------------------------------------------------------
# The launched side: one short all-reduce and all-gather across every process.


def worker(timeout_s: int) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    acc = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[accel.process_group_kwargs(timeout_s)])
    joined = world.check_world(acc)
    ones = torch.ones(1, device=acc.device)
    total = acc.reduce(ones, reduction="sum").item()
    # Where each machine's processes talk from: the address torchrun announced for it and gloo's interface.
    here = os.environ.get("PET_LOCAL_ADDR") or socket.gethostname()
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        here += f" ({os.environ['GLOO_SOCKET_IFNAME']})"
    hosts = gather_object([here])
    if total != acc.num_processes:
        raise world.TopologyError(f"all-reduce of ones gave {total}, expected {acc.num_processes}")
    if acc.is_main_process:
        print(
            f"{OK_LINE}: {acc.num_processes} processes on {joined.num_machines} machine(s) "
            f"({joined.processes_per_machine} per machine), backend {acc.state.backend or 'none'}, "
            f"device {acc.device.type}, machines at {sorted(set(hosts))}",
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
    return check(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
