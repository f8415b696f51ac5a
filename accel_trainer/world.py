"""What world this process is in, and is it the world the accelerate config describes?

The only reader of the launcher's environment (WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, GROUP_RANK) and of
the `accelerate launch` command line that started this process.

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
"""

import os
import shlex
from dataclasses import dataclass

from .errors import UserError

# How the processes find each other: the store address torchrun gives the workers, and the interfaces gloo and
# NCCL use. Recorded in run_config.json's topology (runlog.py) and shown by `accel-trainer check`.
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
    problem = None if rank is None else machine_rank_problem(rank, machines, label="Machine rank ")
    if problem:
        raise TopologyError(problem + ".")

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


def launched_world_size() -> int:
    """The world size the launcher (accelerate launch / torchrun / SLURM+torchrun) announced; 1 without one."""
    world = launched_world()
    return world.num_processes if world else 1


def machine_rank_problem(rank: int, machines: int, label: str = "--machine_rank ") -> str | None:
    """The one machine-rank range check (launch, check, config validation, the world check); None when fine."""
    if 0 <= rank < machines:
        return None
    return f"{label}{rank} is out of range for {machines} machines (valid: 0..{machines - 1})"
