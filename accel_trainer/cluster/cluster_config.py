"""Accelerate cluster configs and launch lines: read and validate a config (the wizard, `accel-trainer check` and
`accel-trainer launch` share one validation), the rendezvous flags, the launch command for each machine.
"""

import os
import shlex

from ..errors import UserError
from ..world import _dtype, machine_rank_problem, world_from_config

# torchrun waits 900 s (static) or 600 s (c10d) for a missing machine by default; we bound it tighter.
DEFAULT_RDZV_TIMEOUT_S = 120


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


def validate_config(config, gpus_detected: int | None = None) -> list[str]:
    """Problems (each naming the fix) with an accelerate ClusterConfig; empty when it is good.

    `gpus_detected`: GPUs on the machine that will run it, or None when unknown (config written elsewhere).
    A flat list of independent checks in the order of the config's fields, each a few lines read on its own: over
    60 lines, but split it would only scatter them.
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
    problem = machine_rank_problem(int(config.machine_rank or 0), machines, label="machine_rank=")
    if problem:
        p.append(problem + ".")
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
    from ..sharding import config_problems

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
    return " ".join(shlex.quote(c) for c in [*cmd, script]) + " --output_dir runs/<name>"


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
