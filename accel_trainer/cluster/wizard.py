"""`accel-trainer config`: describe your hardware once, get an accelerate config that is right.

Asks what a person knows -- machines, processes (GPUs) *per machine*, where machine 0 is -- and writes
`accelerate_configs/<name>.yaml` with accelerate's own `ClusterConfig`, so `accelerate launch` reads exactly
what we wrote. One file serves every machine; the machine rank is given at launch. Prints the launch line for
each machine and, on request, a SLURM batch script. Interactive at a terminal, flags for scripts:

    accel-trainer config --machines 2 --gpus-per-machine 8 --mixed-precision bf16 --rdzv c10d \
        --main-ip 10.0.0.1 --name 2x8_c10d --slurm
"""

import argparse
import os
import shlex
import socket
import sys

from accel_trainer.cluster import cluster_config, network
from accel_trainer.faults import EXIT_PREEMPTED

MIXED = ("no", "bf16", "fp16")
SHARDING = ("none", "fsdp", "deepspeed")

# FSDP2 basics; TRANSFORMER_BASED_WRAP wraps each block listed in a transformers model's `_no_split_modules`.
FSDP_CONFIG = {
    "fsdp_version": 2,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_reshard_after_forward": True,
    "fsdp_offload_params": False,
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    "fsdp_cpu_ram_efficient_loading": False,
    "fsdp_activation_checkpointing": False,
}


def detect() -> dict:
    """What this machine has, to offer as defaults."""
    import torch

    from ..precision import has_fast_bf16

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
        "bf16": bool(gpus) and has_fast_bf16("cuda"),  # native: a V100 emulates it
        "cpus": os.cpu_count() or 1,
    }


def build_config(
    machines=1,
    per_machine=1,
    cpu=False,
    main_ip=None,
    main_port=None,
    rdzv="static",
    mixed_precision="no",
    compile=False,
    sharding="none",
    zero_stage=2,
):
    """An accelerate ClusterConfig for the topology. Never MULTI_CPU: accelerate launches that as ONE process;
    several CPU processes are MULTI_GPU-typed with use_cpu, which goes through torchrun and forms a real world."""
    from accelerate.commands.config.config_args import ClusterConfig

    total = machines * per_machine
    if sharding == "fsdp":
        dtype = "FSDP"
    elif sharding == "deepspeed":
        dtype = "DEEPSPEED"
    else:
        dtype = "MULTI_GPU" if total > 1 else "NO"
    return ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type=dtype,
        mixed_precision=mixed_precision,
        use_cpu=cpu,
        debug=False,
        num_processes=total,
        num_machines=machines,
        machine_rank=0,
        main_process_ip=main_ip if machines > 1 else None,
        main_process_port=main_port if (machines > 1 or main_port) else None,
        rdzv_backend=rdzv,
        same_network=False,
        fsdp_config=dict(FSDP_CONFIG) if sharding == "fsdp" else {},
        deepspeed_config={"zero_stage": zero_stage, "offload_optimizer_device": "none", "offload_param_device": "none"}
        if sharding == "deepspeed"
        else {},
        dynamo_config={"dynamo_backend": "INDUCTOR"} if compile else {},
    )


PREEMPT_NOTICE_S = 120  # SLURM's warning before the time limit: time to reach an update boundary and checkpoint


def slurm_script(
    config_path,
    config,
    script,
    rdzv_timeout_s,
    max_restarts=0,
    job_name="accel-trainer",
    requeue=True,
    notice_s=PREEMPT_NOTICE_S,
) -> str:
    """A batch script: one `accel-trainer launch` per node via srun (it picks each node's interface on the route
    to the first node); the rank comes from SLURM_NODEID *on that node* (single quotes: expanded by each task, not
    once on the batch host -- the every-node-is-rank-0 bug).

    Preemption: SLURM sends SIGUSR1 to the batch shell `notice_s` before the time limit (`--signal=B:USR1@`), or
    when asked (`scancel --batch --signal=USR1 <job>`); the shell passes it to srun, srun to the launchers, and
    the launchers to the workers (once each). The workers checkpoint and exit 75 (faults.EXIT_PREEMPTED), which
    `accel-trainer launch` returns; the script then requeues the job (`--requeue`, `scontrol requeue`) and the
    next run continues from the newest checkpoint (`--resume_from_checkpoint auto`).

    The config and script paths reach the task as arguments of `bash -c` ($1, $2), quoted for the batch shell: the
    single-quoted body holds no pasted text, so a space or a `'` in a path can neither split it nor end the quote.

    Over 60 lines because most of it is the script itself: one template, so that it reads as the file it writes."""
    per = config.num_processes // config.num_machines
    # --exclusive: the whole node (all its CPUs) for its one task. Without it SLURM allocates one CPU per task, and
    # the node's workers and their data loader workers would share that one core. srun's step gets every CPU of
    # the job on the node (srun uses all of them unless --exact).
    gres = "" if config.use_cpu else f"#SBATCH --gpus-per-node={per}\n"
    restarts = f" --max_restarts {max_restarts}" if max_restarts else ""
    # A fresh rendezvous store per restart round (see cluster_config.RESTART_SAFE_ENV).
    restart_env = (
        f"export {cluster_config.RESTART_SAFE_ENV}=1\n" if max_restarts and config.rdzv_backend == "c10d" else ""
    )
    rdzv = ""
    if config.num_machines > 1:
        rdzv = (
            f" \\\n    --rdzv_backend {config.rdzv_backend} "
            f"--rdzv_conf {cluster_config.rdzv_conf(config.rdzv_backend, rdzv_timeout_s)}"
        )
    requeue_line = "#SBATCH --requeue\n" if requeue else ""
    # Preempted: a launcher said 75, or the notice came and the run did not finish (with several nodes, srun's
    # --kill-on-bad-exit may end the other nodes' tasks while they report 75, and srun then returns their signal).
    preempted = f'[ "$rc" -eq {EXIT_PREEMPTED} ] || {{ [ "$rc" -ne 0 ] && [ -n "$NOTICE" ]; }}'
    on_75 = (
        f"""if {preempted}; then
    echo "preempted: the checkpoint is written; requeueing job $SLURM_JOB_ID (it resumes from the checkpoint)"
    scontrol requeue "$SLURM_JOB_ID"
fi
"""
        if requeue
        else f"""if {preempted}; then
    echo "preempted: the checkpoint is written; resubmit this script to resume (written with --no-requeue)"
fi
"""
    )
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={config.num_machines}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
{gres}#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@{notice_s}
{requeue_line}# One `accel-trainer launch` per node; each starts {per} process(es). Extra arguments go to the training script.
# Preemption: USR1 reaches this shell {notice_s} s before the time limit (or `scancel --batch --signal=USR1 <job>`);
# it is passed on to the workers, which checkpoint and exit {EXIT_PREEMPTED}; then the job {"requeues itself and " if requeue else ""}resumes
# from the newest checkpoint (--resume_from_checkpoint auto). docs/topology.md, "Tested under SLURM".
set -uo pipefail
export MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MAIN_PORT={config.main_process_port or network.DEFAULT_PORT}
{restart_env}echo "job $SLURM_JOB_ID start (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST"
SRUN= NOTICE=
trap 'NOTICE=1; echo "USR1: preemption notice, passing it to the launchers"; [ -n "$SRUN" ] && kill -USR1 "$SRUN"' USR1
srun --kill-on-bad-exit=1 bash -c 'exec accel-trainer launch --config_file "$1" \\
    --machine_rank "$SLURM_NODEID" \\
    --main_process_ip "$MAIN_HOST" --main_process_port "$MAIN_PORT"{rdzv}{restarts} \\
    "$2" --resume_from_checkpoint auto "${{@:3}}"' _ {shlex.quote(config_path)} {shlex.quote(script)} "$@" &
SRUN=$!
# `wait` returns early when the trap runs: wait again until srun has really ended.
while :; do wait "$SRUN"; rc=$?; kill -0 "$SRUN" 2>/dev/null || break; done
echo "job $SLURM_JOB_ID: the launchers exited with $rc"
{on_75}exit "$rc"
"""


# ----------------------------------------------------------------------------------------------------------
# Prompts


def ask(question, default, parse=str, check=None, why=""):
    """Ask until the answer parses (and passes `check`); an empty answer takes the default (None: no default,
    an answer is required)."""
    while True:
        try:
            raw = input(f"{question} [{default}]: " if default is not None else f"{question}: ").strip()
        except EOFError:
            raise SystemExit("config: input ended before all questions were answered; nothing written.") from None
        if not raw and default is None:
            print(f"  not valid: {why or 'an answer is required'}")
            continue
        try:
            value = parse(raw) if raw else (parse(str(default)) if not isinstance(default, bool) else default)
            if check is None or check(value):
                return value
        except ValueError:
            pass
        print(f"  not valid: {why or 'try again'}")


def yes_no(raw: str) -> bool:
    if raw.lower() in ("y", "yes", "true", "1"):
        return True
    if raw.lower() in ("n", "no", "false", "0"):
        return False
    raise ValueError(raw)


def interactive(a, hw):
    """Fill the flags in `a` from prompts; flags already given become the defaults."""
    print("accel-trainer config: describe the machines this will run on (Enter takes the [default]).")
    gpu_line = f"{hw['gpus']} x {hw['gpu_name']}" if hw["gpus"] else "no GPU"
    print(f"Detected here: {gpu_line}, bf16 {'yes' if hw['bf16'] else 'no'}, {hw['cpus']} CPU cores.")
    a.machines = ask("How many machines?", a.machines or 1, int, lambda v: v >= 1, "a whole number >= 1")
    _ask_processes(a, hw)
    if a.machines > 1:
        _ask_rendezvous(a)
    mp_default = a.mixed_precision or ("bf16" if hw["bf16"] and not a.cpu else "no")
    a.mixed_precision = ask(
        "Mixed precision (no/bf16/fp16)?", mp_default, str, lambda v: v in MIXED, "no, bf16 or fp16"
    )
    a.compile = ask("Use torch.compile? (yes/no)", "yes" if a.compile else "no", yes_no, why="yes or no")
    # FSDP2 on GPUs and on CPU (gloo; accel_trainer/sharding.py). DeepSpeed is not offered: it is refused.
    a.sharding = ask(
        "Shard the model with FSDP (parameters, gradients and optimizer state split over the processes): none or fsdp?",
        a.sharding,
        str,
        lambda v: v in ("none", "fsdp"),
        "none or fsdp",
    )
    a.name = ask("Config name?", a.name or default_name(a), str, lambda v: v and "/" not in v, "a file name")
    if a.machines > 1:
        a.slurm = ask("Also write a SLURM batch script? (yes/no)", "yes" if a.slurm else "no", yes_no, why="yes or no")
    return a


def _ask_processes(a, hw):
    """GPUs or CPU processes, and how many per machine, settled against the GPUs visible here."""
    a.cpu = not ask("Use GPUs? (yes/no)", "no" if a.cpu or not hw["gpus"] else "yes", yes_no, why="yes or no")
    if not a.cpu and not hw["gpus"] and not a.skip_device_check:
        # The common case (a login node writing the GPU machines' config): settle it now, not after every answer.
        a.skip_device_check = ask(
            "No GPU is visible here. Is this config for other machines, the GPU machines? (yes: write it, and check "
            "it there; no: use CPU processes here)",
            "yes",
            yes_no,
            why="yes or no",
        )
        a.cpu = not a.skip_device_check
    what = "CPU processes" if a.cpu else "GPUs (processes)"
    a.per_machine = ask(
        f"How many {what} per machine?",
        a.per_machine or (1 if a.cpu else max(hw["gpus"], 1)),
        int,
        lambda v: v >= 1,
        "a whole number >= 1",
    )
    if not a.cpu and 0 < hw["gpus"] < a.per_machine and not a.skip_device_check:
        a.skip_device_check = ask(
            f"Only {hw['gpus']} GPUs are visible here. Is this config for other machines? (yes: write it, and "
            "check it there; no: ask again)",
            "yes",
            yes_no,
            why="yes or no",
        )
        if not a.skip_device_check:
            a.per_machine = ask(
                f"How many GPUs (processes) per machine, at most {hw['gpus']}?",
                hw["gpus"],
                int,
                lambda v: 1 <= v <= hw["gpus"],
                f"a whole number 1..{hw['gpus']}",
            )


def _ask_rendezvous(a):
    """Several machines: where machine 0 is, and how the machines meet (and restart)."""
    # Never loopback as the default here: the other machines cannot reach it (typed, it is accepted: several
    # launches on this one machine).
    a.main_ip = ask(
        "Address of machine 0, as every machine reaches it?",
        a.main_ip or _my_address(),
        str,
        lambda v: bool(v),
        "an IP address or host name",
    )
    a.main_port = ask(
        "Port on machine 0 for the rendezvous?",
        a.main_port or network.DEFAULT_PORT,
        int,
        lambda v: 1 <= v <= 65535,
        "a port number 1..65535",
    )
    a.rdzv = ask(
        "Rendezvous: static (fixed machines) or c10d (elastic, restarts)?",
        a.rdzv or "static",
        str,
        lambda v: v in ("static", "c10d"),
        "static or c10d",
    )
    a.rdzv_timeout = ask(
        "Seconds to wait for all machines to join?",
        a.rdzv_timeout,
        int,
        lambda v: v > 0,
        "a positive number of seconds",
    )
    if a.rdzv == "c10d":
        a.max_restarts = ask(
            "Restarts allowed after a worker fails?", a.max_restarts, int, lambda v: v >= 0, "a whole number >= 0"
        )


def _my_address() -> str | None:
    """This machine's address on the network, to offer as machine 0's: the host name's, unless that is loopback
    (the Debian /etc/hosts line `127.0.1.1 <name>`), else the only non-loopback address; None (no default: the
    answer is required) when there is none or several."""
    try:
        mine = socket.gethostbyname(socket.gethostname())
    except OSError:
        mine = None
    if mine and not network.is_loopback(mine):
        return mine
    found = sorted({ip for ip, _ in network.cluster_addresses()})
    return found[0] if len(found) == 1 else None


def default_name(a) -> str:
    kind = "cpu" if a.cpu else "gpu"
    name = f"{a.machines}x{a.per_machine}{kind}"
    if a.machines > 1:
        name += f"_{a.rdzv}"
    if a.sharding != "none":
        name += f"_{a.sharding}"
    if a.mixed_precision and a.mixed_precision != "no":
        name += f"_{a.mixed_precision}"
    return name


# ----------------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser):
    # One flag a statement, in --help's order: a flat list over 60 lines, read a flag at a time (split, it would
    # scatter --help).
    p.add_argument("--name", help="config name; written to <dir>/<name>.yaml (default: from the topology)")
    p.add_argument("--dir", default="accelerate_configs", help="where to write (default: accelerate_configs)")
    p.add_argument("--machines", type=int, help="number of machines (nodes)")
    p.add_argument(
        "--gpus-per-machine",
        "--processes-per-machine",
        dest="per_machine",
        type=int,
        help="processes per machine: GPUs per machine, or CPU processes with --cpu",
    )
    p.add_argument("--cpu", action="store_true", help="CPU processes (gloo) instead of GPUs")
    p.add_argument("--main-ip", help="address of machine 0 as all machines reach it (several machines)")
    p.add_argument("--main-port", type=int, help=f"rendezvous port on machine 0 (default {network.DEFAULT_PORT})")
    p.add_argument("--rdzv", choices=("static", "c10d"), default=None, help="rendezvous backend (default static)")
    p.add_argument(
        "--rdzv-timeout",
        type=int,
        default=cluster_config.DEFAULT_RDZV_TIMEOUT_S,
        help="seconds to wait for all machines to join (goes on the launch line)",
    )
    p.add_argument("--max-restarts", type=int, default=0, help="worker restarts after a failure (c10d)")
    p.add_argument("--mixed-precision", choices=MIXED, help="default: bf16 where supported, else no")
    p.add_argument("--compile", action="store_true", help="torch.compile (inductor)")
    p.add_argument(
        "--fsdp",
        dest="sharding",
        action="store_const",
        const="fsdp",
        default="none",
        help="shard parameters, gradients and optimizer state with FSDP2 (GPUs, or CPU processes with --cpu)",
    )
    p.add_argument("--deepspeed", dest="sharding", action="store_const", const="deepspeed", help="refused: use --fsdp")
    p.add_argument("--zero-stage", type=int, default=2, help=argparse.SUPPRESS)  # DeepSpeed, refused
    p.add_argument("--slurm", action="store_true", help="also write <dir>/<name>.slurm.sh")
    p.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        help="SLURM script: on preemption (exit 75) do not requeue the job (default: it requeues itself)",
    )
    p.add_argument(
        "--preempt-notice",
        type=int,
        default=PREEMPT_NOTICE_S,
        help=f"SLURM script: seconds before the time limit at which USR1 asks for a checkpoint "
        f"(default {PREEMPT_NOTICE_S})",
    )
    p.add_argument("--script", default="recipes/<recipe>.py", help="training script shown in launch lines")
    p.add_argument(
        "--skip-device-check",
        action="store_true",
        help="the config is for other machines: do not compare with the GPUs detected here",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument(
        "--interactive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask questions (default: when run at a terminal without --machines)",
    )


def write_config(a) -> int:
    """Write the config (and the SLURM script) the arguments `a` describe, print the launch lines; 0 on success."""
    from accelerate.commands.config.config_args import load_config_from_file

    hw = detect()
    if a.interactive is None:
        a.interactive = sys.stdin.isatty() and a.machines is None
    if a.interactive:
        interactive(a, hw)
    refusal = _settle(a, hw)
    if refusal:
        return _refuse(refusal)

    config = build_config(
        a.machines,
        a.per_machine,
        a.cpu,
        a.main_ip,
        a.main_port,
        a.rdzv,
        a.mixed_precision,
        a.compile,
        a.sharding,
        a.zero_stage,
    )
    problems = cluster_config.validate_config(config, None if a.skip_device_check else hw["gpus"])
    if not a.cpu and a.mixed_precision == "bf16" and hw["gpus"] and not hw["bf16"] and not a.skip_device_check:
        problems.append(f"bf16 is not supported by the detected {hw['gpu_name']}; use fp16 or no.")
    if problems:
        return _refuse(problems)

    name = a.name or default_name(a)
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"{name}.yaml")
    if os.path.exists(path) and not a.force:
        return _refuse([f"{path} exists; pass --force to overwrite or choose another --name."])
    config.to_yaml_file(path)
    load_config_from_file(path)  # what `accelerate launch` will read; fails loudly if it cannot

    restarts = a.max_restarts if a.rdzv == "c10d" else 0
    _print_launch_lines(a, config, path, restarts)
    if a.slurm:
        spath = os.path.join(a.dir, f"{name}.slurm.sh")
        with open(spath, "w") as f:
            f.write(
                slurm_script(
                    path, config, a.script, a.rdzv_timeout, restarts, name, requeue=a.requeue, notice_s=a.preempt_notice
                )
            )
        os.chmod(spath, 0o755)
        print(f"Wrote {spath}: sbatch {shlex.quote(spath)} [script arguments]")
    return 0


def _settle(a, hw) -> list[str] | None:
    """The defaults for what was neither given nor asked; the refusal of flags that cannot go together (None: none)."""
    a.machines = a.machines or 1
    a.per_machine = a.per_machine or (1 if a.cpu or not hw["gpus"] else hw["gpus"])
    a.rdzv = a.rdzv or "static"
    if a.mixed_precision is None:
        a.mixed_precision = "bf16" if hw["bf16"] and not a.cpu else "no"
    if a.machines > 1 and a.main_port is None:
        a.main_port = network.DEFAULT_PORT
    if a.machines > 1 and not a.main_ip:
        return [
            "--main-ip is required with several machines: the address of machine 0 as every "
            "machine reaches it (e.g. its cluster-network IP)."
        ]
    if a.sharding == "deepspeed":
        from accel_trainer.sharding import DEEPSPEED_REFUSAL

        return [DEEPSPEED_REFUSAL.format(where="--deepspeed ")]
    if a.rdzv_timeout <= 0:
        return [f"--rdzv-timeout {a.rdzv_timeout}: must be a positive number of seconds."]
    if a.max_restarts and a.rdzv != "c10d":
        return ["--max-restarts needs --rdzv c10d (the static rendezvous cannot re-form a world)."]
    return None


def _print_launch_lines(a, config, path: str, restarts: int):
    print(f"Wrote {path}")
    print("  " + cluster_config.describe(config).replace("\n", "\n  "))
    print("Launch (the same file on every machine; only --machine_rank differs):")
    shown = range(a.machines) if a.machines <= 4 else (0, 1, a.machines - 1)
    for r in shown:
        cmd = cluster_config.launch_command(path, config, r, a.script, a.rdzv_timeout, restarts)
        print(f"  machine {r}: {cmd}")
    if a.machines > 4:
        print(f"  (machines 2..{a.machines - 2}: the same with their own --machine_rank)")
    if a.machines > 1 and a.rdzv == "c10d":
        print("  c10d assigns ranks at rendezvous; --machine_rank only has to be distinct.")
    print(
        f"Check each machine first: accel-trainer check --config_file {shlex.quote(path)}"
        + (" --machine_rank <r>" if a.machines > 1 else "")
    )
    if a.skip_device_check and not a.cpu:
        print(
            f"Written for other machines: nothing here was compared with their GPUs. On each, `accel-trainer check` "
            f"confirms {a.per_machine} visible GPU(s), NCCL"
            + (" and bf16" if a.mixed_precision == "bf16" else "")
            + (f", and that machine 0's address {a.main_ip} is reachable" if a.machines > 1 else "")
            + "."
        )


def _refuse(problems) -> int:
    print("config: refusing to write this configuration:", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    return 2


def add_parser(sub):
    """Register `accel-trainer config` on the console script's subparsers."""
    p = sub.add_parser(
        "config",
        help="write an accelerate config for your machines (the wizard)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=write_config)
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="accel-trainer config", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return write_config(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
