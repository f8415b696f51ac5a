"""Topology: is the world we joined the world the accelerate config describes?

The failures this module exists for are silent ones: `accelerate launch --cpu --num_processes 2` or a
`MULTI_CPU` config runs ONE process and exits 0; an Accelerator built without `cpu=True` on a machine without
CUDA makes each launched process its own world of 1; `num_processes` read as "per machine" gives the wrong
world. `check_world()` turns each of these into a `TopologyError` at start-up, before any training happens.

Where the expected world comes from, in order:
  1. the `expected` dict the caller passes,
  2. the `accelerate launch` command line that started this process (parsed with accelerate's own parser,
     its config file loaded with accelerate's own loader) -- this is the only place the `--cpu` and
     MULTI_CPU traps are visible, because that launcher passes no topology to the process it starts,
  3. the torchrun environment (WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE), which is always checked.

It also holds the small helpers shared by the wizard and the `check` command: config validation, ports,
addresses, the rendezvous timeout flags, and the launch command line for each machine.
"""

import datetime
import errno
import os
import shlex
import socket
from dataclasses import dataclass

from accel_trainer.errors import UserError

# torchrun waits 900 s (static) or 600 s (c10d) for a missing machine by default; we bound it tighter.
DEFAULT_RDZV_TIMEOUT_S = 120
DEFAULT_PORT = 29500
# How the processes find each other: the store address torchrun gives the workers, and the interfaces gloo and
# NCCL use. Recorded in run_config.json's topology and shown by `accel-trainer check`.
NETWORK_ENV = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class TopologyError(UserError):
    """The world this process joined is not the world the config describes (or cannot be formed).
    A UserError (a RuntimeError), so `run()` prints its message as one line and exits 1."""


@dataclass
class World:
    num_processes: int  # total over all machines
    num_machines: int
    processes_per_machine: int
    source: str  # where these numbers come from, for messages
    distributed_type: str | None = None  # as the launcher saw it (config or flags)
    launcher_flags: str | None = None  # e.g. "--cpu", for the fix hint
    machine_rank: int | None = None  # GROUP_RANK under torchrun (c10d assigns it at the rendezvous)


# ----------------------------------------------------------------------------------------------------------
# Reading the world: what the config / launcher describes, and what the environment says


def load_config(path: str):
    """An accelerate config file, read with accelerate's own loader (what `accelerate launch` reads), or a
    UserError whose one line names the file, the line and the fix -- not a YAML parser traceback."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    fix = "Fix the file, or write a new one with `accel-trainer config`."
    if not os.path.isfile(path):
        raise UserError(
            f"{path}: no such config file. Write one with `accel-trainer config` or pick one in accelerate_configs/."
        )
    try:
        return load_config_from_file(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        ctx, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if ctx and cmark is not None and mark is not None and cmark.line != mark.line:
            what += f"; {ctx} started at line {cmark.line + 1}"
        raise UserError(f"{where}: not valid YAML ({what}). {fix}") from None
    except AttributeError:  # yaml.safe_load gave a list or a string: accelerate calls .get on it
        raise UserError(
            f"{path}: not an accelerate config (the YAML is not a mapping of keys to values). {fix}"
        ) from None
    except (ValueError, TypeError, KeyError) as e:  # unknown keys, a bad enum value, a missing field
        raise UserError(f"{path}: accelerate cannot load it: {' '.join(str(e).split()).rstrip('.')}. {fix}") from None


def world_from_config(config, source="config") -> World:
    """The world an accelerate `ClusterConfig` describes. `num_processes` is the TOTAL over all machines."""
    machines = max(int(config.num_machines or 1), 1)
    total = int(config.num_processes)
    return World(total, machines, total // machines, source, _dtype(config.distributed_type))


def _dtype(value) -> str:
    return str(getattr(value, "value", value))


def _launch_argv_of(cmdline: list[str]) -> list[str] | None:
    """The arguments after `launch` if `cmdline` is an `accelerate launch` (or accelerate-launch) process."""
    for i, tok in enumerate(cmdline):
        base = os.path.basename(tok)
        if base == "accelerate" and i + 1 < len(cmdline) and cmdline[i + 1] == "launch":
            return cmdline[i + 2 :]
        if base == "accelerate-launch" or tok == "accelerate.commands.launch":
            return cmdline[i + 1 :]
    return None


def launcher_world(max_depth: int = 4) -> World | None:
    """The world described by the `accelerate launch` that started this process, or None if there is none.

    accelerate's simple launcher (used for `--cpu` and MULTI_CPU) passes no topology to the process it starts,
    so the only record of `--num_processes 2` is the launcher's own command line: we read it from /proc via
    psutil (the launcher is our parent, or an ancestor under srun/bash). Best effort: a surprise returns None.
    """
    try:
        import psutil

        proc = psutil.Process()
        for _ in range(max_depth):
            proc = proc.parent()
            if proc is None:
                return None
            argv = _launch_argv_of(proc.cmdline())
            if argv is not None:
                return world_from_launch_argv(argv, proc.cwd())
    except Exception:
        return None
    return None


def world_from_launch_argv(argv: list[str], cwd: str = ".") -> World | None:
    """The world `accelerate launch <argv>` starts, parsed with accelerate's own parser and config loader."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(argv)
    # Same precedence as accelerate's _validate_launch_command: flags win over the config file; the default
    # config file is read unless --cpu is given.
    config, path = None, args.config_file
    if path is not None:
        path = os.path.join(cwd, path)
    elif os.path.isfile(default_config_file) and not args.cpu:
        path = default_config_file
    if path is not None:
        config = load_config_from_file(path)
    total = args.num_processes if args.num_processes is not None else getattr(config, "num_processes", None)
    if total is None or int(total) < 1:
        return None  # accelerate will guess from the devices; nothing to compare against
    machines = int(args.num_machines or getattr(config, "num_machines", 1) or 1)
    if args.cpu:
        dtype, flags = "MULTI_CPU", "--cpu"
    elif args.multi_gpu:
        dtype, flags = "MULTI_GPU", "--multi_gpu"
    else:
        dtype, flags = (_dtype(config.distributed_type) if config else "NO"), None
    src = "`accelerate launch " + " ".join(shlex.quote(a) for a in argv[:14]) + "`"
    return World(int(total), machines, int(total) // machines, src, dtype, flags)


def launched_world() -> World | None:
    """The world the launcher formed (torchrun, which `accelerate launch` uses for several processes, SLURM +
    torchrun, `notebook_launcher`), from its environment; None when no launcher set WORLD_SIZE (one plain process).

    The one place that reads WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE and GROUP_RANK: the Accelerator
    builder, the world check, run_config.json's topology and `accel-trainer check` all ask here."""
    if "WORLD_SIZE" not in os.environ:
        return None
    total = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", total))
    machines = int(os.environ.get("GROUP_WORLD_SIZE", max(total // max(local, 1), 1)))
    rank = os.environ.get("GROUP_RANK")
    return World(
        total,
        machines,
        local,
        "the launcher's environment (WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE)",
        machine_rank=None if rank is None else int(rank),
    )


# ----------------------------------------------------------------------------------------------------------
# The check


_FIX_ONE_WORLD = (
    "Fix: on a machine without CUDA, build the Accelerator with `Accelerator(cpu=True)` (the Trainer does this "
    "when WORLD_SIZE>1 and CUDA is unavailable); on GPUs check that `torch.cuda.is_available()` is True in "
    "every process (CUDA_VISIBLE_DEVICES, driver)."
)


def _fix_for(expected: World, actual_total: int) -> str:
    if actual_total == 1 and launched_world() is None:  # accelerate's simple launcher ran it: one process
        how = {"--cpu": "`--cpu`", None: f"a `distributed_type: {expected.distributed_type}` launch"}.get(
            expected.launcher_flags, expected.launcher_flags
        )
        return (
            f"Cause: accelerate launches {how} with its simple launcher, which starts ONE process whatever "
            "num_processes says. Fix: launch with `--multi_gpu --num_processes N` (torchrun; the Trainer uses "
            "the CPU with gloo when there is no CUDA), e.g. `accelerate launch --config_file "
            "accelerate_configs/cpu_2proc.yaml ...`."
        )
    if expected.num_processes % expected.num_machines:
        return (
            f"Cause: num_processes={expected.num_processes} is not divisible by num_machines="
            f"{expected.num_machines}; accelerate starts num_processes // num_machines = "
            f"{expected.num_processes // expected.num_machines} per machine. num_processes is the TOTAL over all "
            "machines: set it to machines x processes-per-machine (`accel-trainer config` does this)."
        )
    return (
        "Fix: num_processes in the config is the TOTAL over all machines (machines x processes per machine); "
        "every machine must launch with the same config and its own --machine_rank. Run `accel-trainer check "
        "--config_file <file>` on each machine to see the topology it describes."
    )


def check_world(accelerator, expected: dict | None = None) -> World:
    """Stop with a TopologyError when the world this process joined differs from the one it should have joined.

    Call right after creating the Accelerator, on every process (no collective is used, so it cannot hang).
    `expected` may hold `num_processes` (total), `num_machines` and `processes_per_machine`; without it the
    `accelerate launch` command line that started us is read (see `launcher_world`). Returns the actual world.
    """
    total = int(accelerator.num_processes)
    env = launched_world()
    local = env.processes_per_machine if env else total
    machines = env.num_machines if env else 1
    actual = World(total, machines, local, "this Accelerator")
    here = f"(process {accelerator.process_index}, local {accelerator.local_process_index})"

    # 1. The classic silent failure: the launcher started N processes, each of which formed its own world of 1.
    if env is not None and env.num_processes > 1 and total == 1:
        raise TopologyError(
            f"The launcher started a world of WORLD_SIZE={env.num_processes} processes, but this process "
            f"{here} joined a world of 1: each process would train alone on the full data and they would "
            f"overwrite each other's outputs. {_FIX_ONE_WORLD}"
        )
    if env is not None and env.num_processes != total:
        raise TopologyError(
            f"The launcher says WORLD_SIZE={env.num_processes} but the Accelerator joined a world of {total} "
            f"{here}. Check for stale WORLD_SIZE/RANK/LOCAL_RANK variables exported in your shell or job script."
        )
    rank = env.machine_rank if env else None
    if rank is not None and not 0 <= rank < machines:
        raise TopologyError(f"Machine rank {rank} is out of range for {machines} machines (valid: 0..{machines - 1}).")

    # 2. The world the caller / the launch command / the config file describes.
    if expected is not None:
        want_total = int(expected["num_processes"])
        want_machines = int(expected.get("num_machines", 1))
        want_local = int(expected.get("processes_per_machine", want_total // want_machines))
        want = World(want_total, want_machines, want_local, expected.get("source", "the expected topology"))
    else:
        want = launcher_world()
    if want is None:
        return actual
    diffs = []
    if want.num_processes != total:
        diffs.append(f"total processes: expected {want.num_processes}, joined {total}")
    if want.num_machines != machines:
        diffs.append(f"machines: expected {want.num_machines}, joined {machines}")
    if want.processes_per_machine != local:
        diffs.append(f"processes on this machine: expected {want.processes_per_machine}, started {local}")
    if diffs:
        raise TopologyError(
            f"The world this process {here} joined differs from the one described by {want.source}: "
            + "; ".join(diffs)
            + ". "
            + _fix_for(want, total)
        )
    return actual


def process_group_kwargs(timeout_s: float):
    """Accelerate kwargs handler bounding process-group setup and every collective to `timeout_s` seconds.

    With gloo a collective that waits on a dead peer raises after this timeout; with NCCL the watchdog aborts
    the communicator after it and, with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (accel.nccl_error_handling), the next
    use of the group raises (torch's default, 3, ends the process from the watchdog instead).
    """
    from accelerate.utils import InitProcessGroupKwargs

    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"The process-group timeout must be a positive number of seconds, got {timeout_s!r}.")
    return InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=float(timeout_s)))


# ----------------------------------------------------------------------------------------------------------
# Validation shared by the wizard and `accel-trainer check`


def validate_config(config, gpus_detected: int | None = None) -> list[str]:
    """Problems (each naming the fix) with an accelerate ClusterConfig; empty when it is good.

    `gpus_detected`: GPUs on the machine that will run it, or None when unknown (config written elsewhere).
    """
    p = []
    dtype = _dtype(config.distributed_type)
    total, machines = int(config.num_processes), int(config.num_machines or 1)
    cpu = bool(config.use_cpu)
    if machines < 1:
        p.append(f"num_machines={machines}: must be at least 1.")
        machines = 1
    if total < 1:
        p.append(f"num_processes={total}: must be at least 1 (it is the TOTAL over all machines).")
    elif total % machines:
        p.append(
            f"num_processes={total} is not a multiple of num_machines={machines}: it is the TOTAL over all "
            f"machines and accelerate would start {total // machines} per machine. Use machines x per-machine."
        )
    if dtype == "MULTI_CPU" and total > 1 and not config.mpirun_config:
        p.append(
            "distributed_type MULTI_CPU with num_processes>1 is launched by accelerate as ONE process (its simple "
            "launcher); use distributed_type MULTI_GPU with use_cpu: true (see accelerate_configs/cpu_2proc.yaml)."
        )
    if dtype == "NO" and total > 1:
        p.append(f"distributed_type NO runs one process but num_processes={total}; use MULTI_GPU.")
    if dtype == "MULTI_GPU" and total < 2:
        p.append("distributed_type MULTI_GPU needs num_processes >= 2 (accelerate refuses it); use NO for one.")
    if not 0 <= int(config.machine_rank or 0) < machines:
        p.append(f"machine_rank={config.machine_rank} out of range for {machines} machines (0..{machines - 1}).")
    port = config.main_process_port
    if port is not None and not 0 <= int(port) <= 65535:
        p.append(f"main_process_port={port} is out of range (1..65535; 0 means pick a free one, one machine only).")
    if machines > 1:
        if not config.main_process_ip:
            p.append("main_process_ip is required with several machines: the address of machine 0 as seen by all.")
        if not port:
            p.append("main_process_port is required with several machines (a fixed port open on machine 0).")
    if config.rdzv_backend not in ("static", "c10d"):
        p.append(f"rdzv_backend={config.rdzv_backend!r}: use 'static' (fixed machines) or 'c10d' (elastic).")
    mp = str(config.mixed_precision or "no")
    from .sharding import config_problems

    p += config_problems(config)  # DeepSpeed is refused; FSDP must be version 2, with >= 2 processes on CPU
    if cpu:
        if mp == "fp16":
            p.append("fp16 mixed precision needs a GPU; on CPU use bf16 or no.")
    elif gpus_detected is not None:
        per = total // machines if total >= 1 else 0
        if gpus_detected == 0:
            p.append(
                "This is a GPU topology but no GPU is visible here; for CPU set use_cpu (wizard: --cpu), or pass "
                "--skip-device-check if the config is for other machines."
            )
        elif per > gpus_detected:
            p.append(
                f"{per} processes per machine but only {gpus_detected} GPUs are visible here: one process per GPU. "
                "Lower the per-machine count, or pass --skip-device-check if the config is for other machines."
            )
    return p


# ----------------------------------------------------------------------------------------------------------
# Network helpers: every one of them is bounded


def port_free(port: int, host: str = "") -> tuple[bool, str]:
    """Can this machine listen on `port`? (False, why) when busy or when `host` is not a local address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False, f"port {port} is already in use on this machine (another run or service)"
            if e.errno == errno.EADDRNOTAVAIL:
                return False, f"{host} is not an address of this machine, so machine 0 cannot listen on it"
            return False, f"cannot listen on {host or '*'}:{port}: {e}"
    return True, f"port {port} is free"


def reachable(host: str, port: int, timeout_s: float = 5.0) -> tuple[bool, str]:
    """Is `host` reachable on `port` within `timeout_s`? A refused connection still proves the host is up."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return False, f"cannot resolve {host!r}: {e}. Check the name / use the IP address of machine 0."
    addr = infos[0][4]
    try:
        with socket.create_connection(addr[:2], timeout=timeout_s):
            return True, f"{host}:{port} accepts connections (machine 0 is listening)"
    except ConnectionRefusedError:
        return True, f"{host} is reachable; nothing listens on port {port} yet (start machine 0)"
    except TimeoutError:
        return False, (
            f"no answer from {host}:{port} within {timeout_s:.0f} s: wrong address, machine 0 down or cut off, or a "
            f"firewall dropping the port (open TCP {port} on machine 0)"
        )
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return False, (
                f"no answer from {host}:{port} ({e.strerror}): nothing answers at that address on this network: "
                "wrong address, or machine 0 is down or cut off"
            )
        return False, f"cannot reach {host}:{port}: {e} (check the address and the route/interface)"


@dataclass
class Route:
    """How this machine reaches machine 0: the address and interface its traffic to `main_ip` leaves from."""

    main: str  # machine 0's address as configured (an IP or a host name)
    main_ip: str  # ... resolved here
    local_ip: str  # this machine's source address on the route to main_ip
    interface: str | None  # the interface that owns local_ip (None: not found)
    is_main: bool  # this machine owns main_ip (it is machine 0, or everything runs on loopback)

    def describe(self) -> str:
        via = f"interface {self.interface}" if self.interface else "an interface not found by name"
        shown = self.main if self.main == self.main_ip else f"{self.main} = {self.main_ip}"
        if self.is_main:
            return f"this machine owns machine 0's address {shown} ({via})"
        return f"this machine reaches machine 0's address {shown} from {self.local_ip} ({via})"


def local_addresses() -> dict[str, str]:
    """Every address of this machine (IPv4 and IPv6) -> the interface that owns it."""
    import psutil  # an accelerate dependency; the standard library cannot list addresses per interface

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.setdefault(a.address.split("%")[0], name)
    return out


def is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return addr == "localhost"


def cluster_addresses() -> list[tuple[str, str]]:
    """This machine's IPv4 addresses that another machine could reach, as (address, interface): on an interface
    that is up, neither loopback nor link-local (169.254.x)."""
    import psutil

    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and name in up and not is_loopback(a.address):
                if not a.address.startswith("169.254."):
                    out.append((a.address, name))
    return out


def route_to(host: str, port: int = DEFAULT_PORT) -> Route:
    """The address and interface this machine uses to reach `host`. A UDP socket's connect() asks the kernel for
    the route and the source address without sending anything (what `ip route get` prints, without iproute2).
    UserError when the name does not resolve or no route leads there."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise UserError(
            f"cannot resolve machine 0's address {host!r} ({e}); use its IP address on the cluster network "
            "(main_process_ip / --main_process_ip)."
        ) from None
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            local = s.getsockname()[0]
    except OSError as e:
        shown = host if host == addr[0] else f"{host} ({addr[0]})"
        raise UserError(
            f"no route from this machine to machine 0's address {shown}: {e.strerror or e}. Check the "
            "address, and that this machine's network interface on that network is up (`ip addr`, `ip route`)."
        ) from None
    mine = local_addresses()
    return Route(host, addr[0], local, mine.get(local), addr[0] in mine)


def _default_route_interface() -> str | None:
    """The interface of this machine's default route (Linux /proc/net/route), or None."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def loopback_route(route: Route, machine_rank: int, environ=None) -> tuple[Route, str | None]:
    """A multi-machine route whose machine 0 address resolves to loopback here, made right or refused.

    The Debian default /etc/hosts maps the host name to 127.0.1.1, and SLURM scripts name machine 0 by host name:
    machine 0 would then pin gloo/NCCL to `lo` and announce 127.0.0.1, which c10d hands to every other machine as
    the store address. Machine 0 uses instead the address other machines can reach: the interface the user named
    in GLOO_SOCKET_IFNAME, else the name's own non-loopback address, else this machine's only one, else the one
    of the default route; several and none of these: refused, naming them. On machines 1..N-1 a name that
    resolves to loopback points at the machine itself: refused. An address given as loopback (127.0.0.1,
    localhost) is kept: several launches on one machine. Returns (route, a note for the user or None)."""
    if not is_loopback(route.main_ip) or is_loopback(route.main):
        return route, None
    seen = f"machine 0's address {route.main!r} resolves to {route.main_ip} on this machine (machine {machine_rank})"
    fix = "set main_process_ip (--main_process_ip) to machine 0's IP address on the cluster network, or fix /etc/hosts"
    if machine_rank != 0:
        raise UserError(f"{seen}: a loopback address, this machine itself, not machine 0. Fix: {fix} here.")
    environ = os.environ if environ is None else environ
    candidates = cluster_addresses()
    ip, why = None, ""
    wanted = environ.get("GLOO_SOCKET_IFNAME")
    named = [a for a in candidates if a[1] == wanted]
    try:
        own = {i[4][0] for i in socket.getaddrinfo(route.main, None, socket.AF_INET)} - {route.main_ip}
    except OSError:
        own = set()
    own_here = [a for a in candidates if a[0] in own]
    default = [a for a in candidates if a[1] == _default_route_interface()]
    if named:
        (ip, iface), why = named[0], f"GLOO_SOCKET_IFNAME={wanted}"
    elif len(own_here) == 1:
        (ip, iface), why = own_here[0], f"the other address of {route.main}"
    elif len(candidates) == 1:
        (ip, iface), why = candidates[0], "this machine's only non-loopback address"
    elif len(default) == 1:
        (ip, iface), why = default[0], "the default route's"
    if ip is None:
        have = ", ".join(f"{a} ({i})" for a, i in candidates) or "none"
        raise UserError(
            f"{seen}: a loopback address that the other machines cannot reach (the Debian `127.0.1.1 <name>` line "
            f"in /etc/hosts?), and which of this machine's addresses they reach is not clear (non-loopback: {have}). "
            f"Fix: {fix}, or set GLOO_SOCKET_IFNAME to the cluster network's interface."
        )
    note = (
        f"{seen}, a loopback address the other machines cannot reach (the Debian `127.0.1.1 <name>` /etc/hosts "
        f"line?); using {ip} ({iface}, {why}) instead. To choose, {fix}."
    )
    return Route(route.main, ip, ip, iface, True), note


def network_env(route: Route, environ=None) -> tuple[dict[str, str], dict[str, str]]:
    """The variables that make gloo, NCCL and torchrun use the route to machine 0: (to set, already set by the
    user -- theirs win). Without them gloo and torchrun use the address the host name resolves to, which on many
    clusters (containers, several NICs, a management network) is not the training network: gloo advertises
    127.0.0.1 and the other machines get "Connection refused"; c10d workers are handed machine 0's host name.

    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the interface gloo / NCCL bind to ("=" is NCCL's exact match).
    PET_LOCAL_ADDR: torchrun's `--local_addr` (its `PET_` variables are its flags' defaults), which accelerate
    launch does not pass on: the address this machine's agent announces, and under c10d the MASTER_ADDR the
    workers get from machine 0."""
    environ = os.environ if environ is None else environ
    want = {"PET_LOCAL_ADDR": route.local_ip}
    if route.interface:
        want["GLOO_SOCKET_IFNAME"] = route.interface
        want["NCCL_SOCKET_IFNAME"] = "=" + route.interface
    new = {k: v for k, v in want.items() if not environ.get(k)}
    kept = {k: environ[k] for k in want if environ.get(k)}
    return new, kept


def host_role(rdzv_conf_value: str, backend: str, machine_rank: int, route: Route | None) -> str:
    """`rdzv_conf` with the c10d store's host role made explicit, unless the user set `is_host`.

    torch decides by comparing the endpoint with the host name's addresses, so machine 0 does not recognise its
    cluster address (10.77.0.1 is not what `vm` resolves to) and nobody hosts the store; on one host with two
    launches both would try. Machine 0 hosts when it owns the address; the others never do."""
    if backend != "c10d" or "is_host" in rdzv_conf_value:
        return rdzv_conf_value
    if machine_rank != 0:
        role = "is_host=0"
    elif route is not None and route.is_main:
        role = "is_host=1"
    else:
        return rdzv_conf_value  # machine 0 does not own the address (NAT, forwarding): leave it to torch
    return f"{rdzv_conf_value},{role}" if rdzv_conf_value else role


# ----------------------------------------------------------------------------------------------------------
# Launch command lines


def rdzv_conf(backend: str, timeout_s: int) -> str:
    """The torchrun `--rdzv_conf` value bounding the wait for missing machines.

    static: machine 0 hosts a TCPStore that waits `timeout` seconds for the others (torchrun passes 900 s),
    then fails with "Timed out after N seconds waiting for clients. k/n clients joined.".
    c10d: `join_timeout` bounds the rendezvous (default 600 s), then RendezvousTimeoutError; `read_timeout`
    (default 60 s) bounds each store operation, including a machine's first connection to machine 0's store,
    so we raise it to the same value: a machine started early then waits as long as the rendezvous does.
    An accelerate config file cannot hold this (ClusterConfig has no field), so it goes on the command line.
    """
    t = int(timeout_s)
    return f"timeout={t}" if backend == "static" else f"join_timeout={t},read_timeout={t}"


# With c10d, torchrun's agents share one TCPStore with the workers across restarts (torch >= 2.5), and each
# machine counts restarts on its own, so after one machine restarts, workers can read the previous round's
# addresses and fail to connect (pytorch/pytorch#135712; measured here with gloo). This opt-out gives each
# round a fresh store. Needed only with --max_restarts.
RESTART_SAFE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def rdzv_flags(backend: str, timeout_s: int) -> list[str]:
    """`--rdzv_backend` and `--rdzv_conf` for a multi-machine launch.

    The backend must be on the command line: accelerate 1.15 ignores `rdzv_backend` from the config file
    (its `--rdzv_backend` flag defaults to "static", and config values only fill flags that are None), so a
    c10d config launched without the flag silently runs a static rendezvous -- no elastic restarts.
    """
    return ["--rdzv_backend", backend or "static", "--rdzv_conf", rdzv_conf(backend or "static", timeout_s)]


def launch_command(
    config_path: str,
    config,
    machine_rank: int = 0,
    script: str = "recipes/<recipe>.py",
    rdzv_timeout_s: int = DEFAULT_RDZV_TIMEOUT_S,
    max_restarts: int = 0,
) -> str:
    """The `accel-trainer launch` line to run on machine `machine_rank` (one config file for all machines).

    `accel-trainer launch` rather than `accelerate launch`: on each machine it finds the interface on the route to
    machine 0 and the c10d host role (launch.py); the rendezvous flags are written out so that the line shows
    what runs (and the wizard's timeout applies)."""
    cmd = ["accel-trainer", "launch", "--config_file", config_path]
    if int(config.num_machines or 1) > 1:
        cmd += ["--machine_rank", str(machine_rank)] + rdzv_flags(config.rdzv_backend, rdzv_timeout_s)
    if max_restarts:
        cmd += ["--max_restarts", str(max_restarts)]
    return " ".join(shlex.quote(c) for c in cmd) + f" {script} --output_dir runs/<name>"


def describe(config) -> str:
    """One paragraph saying what a config means, in the words people get wrong."""
    w = world_from_config(config)
    kind = "CPU" if config.use_cpu else "GPU"
    lines = [
        f"{w.num_machines} machine(s) x {w.processes_per_machine} {kind} process(es) per machine = "
        f"{w.num_processes} processes in total (num_processes is the total)",
        f"distributed_type {w.distributed_type}, backend {'gloo' if config.use_cpu else 'nccl'}, "
        f"mixed precision {config.mixed_precision or 'no'}",
    ]
    if w.num_machines > 1:
        lines.append(
            f"rendezvous {config.rdzv_backend} at {config.main_process_ip}:{config.main_process_port} (machine 0)"
        )
    return "\n".join(lines)
