"""`accel-trainer launch`: `accelerate launch`, with what accelerate leaves out for several machines.

It takes the same arguments as `accelerate launch` and:
- adds the rendezvous flags accelerate does not read from the config file (`--rdzv_backend`; a bounded
  `--rdzv_conf` timeout) and, for c10d, which machine hosts the rendezvous store (`is_host`);
- finds, on this machine, the address and interface on the route to machine 0 and makes gloo, NCCL and
  torchrun use them (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, torchrun's local address) -- the user's own
  settings win;
- refuses at once a config that would run the wrong world, a machine rank out of range and an address that does
  not resolve or has no route;
- turns a preemption into one signal per worker and exit code 75 (faults.EXIT_PREEMPTED), which torchrun would
  report as 1, so that a job script can requeue;
- passes the output through (torch elastic's ChildFailedError report left out: output.py), and when the run fails
  ends with the ranks' exit codes, who was missing or lost and what to check (`diagnose`, shared with
  `accel-trainer check`), and the ranks' `error:` lines.
"""

import argparse
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from accel_trainer import faults, sharding, world
from accel_trainer.cluster import cluster_config, network
from accel_trainer.cluster.output import Passthrough, describe_exit_codes, error_lines
from accel_trainer.errors import UserError
from accel_trainer.faults import EXIT_PREEMPTED

FORWARD_GRACE_S = 2.0  # a signal sent to every process of a job step reaches the workers directly within this
# After machine 0 is declared lost and this machine's workers are ended, torchrun's agent gets this long to exit by
# itself, then SIGTERM, then SIGKILL after as long again: under c10d it otherwise waits on the rendezvous store on
# the unreachable machine 0 (each store operation bounded by read_timeout, and retried) for many minutes.
AGENT_GRACE_S = 10.0


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
    lost = sorted({int(r) for grp in faults.DEAD_RANKS.findall(output) for r in grp.split(",")})
    if lost:  # the Trainer's PeerFailure named them (rank 0 does; other ranks only know rank 0 stopped answering)
        per = int(getattr(config, "num_processes", 0) or 0) // max(n, 1)
        which = ""
        if n > 1 and per:
            groups = sorted({r // per for r in lost})
            if getattr(config, "rdzv_backend", "static") == "c10d":
                which = f" (on the machine(s) that joined the c10d rendezvous as {', '.join(map(str, groups))})"
            else:
                which = f" = machine {', '.join(map(str, groups))}"
        return (
            f"rank(s) {', '.join(map(str, lost))}{which} stopped answering: that machine or the link to it is gone. "
            "Resume with --resume_from_checkpoint latest (c10d with --max_restarts rejoins by itself when it is back)."
        )
    if "connectFullMesh" in output and "remote=[127." in output:
        return (
            "gloo advertised a loopback address (the host name resolves to 127.x here): set GLOO_SOCKET_IFNAME to the "
            "interface on the cluster network (`accel-trainer launch` does, from the route to machine 0)"
        )
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


@dataclass
class Plan:
    """What `accel-trainer launch` will run on this machine, and why."""

    cmd: list[str]
    env: dict[str, str]
    config: object = None
    machines: int = 1
    machine_rank: int = 0
    max_restarts: int = 0
    notes: list[str] = field(default_factory=list)
    route: network.Route | None = None  # machines > 1: how this machine reaches machine 0
    main_port: int = network.DEFAULT_PORT
    lost_after_s: float | None = None  # machines 1..N-1: stop when machine 0 stops answering for this long
    rdzv_timeout_s: float = cluster_config.DEFAULT_RDZV_TIMEOUT_S  # how long the rendezvous may wait for the machines


def _refuse(msg: str):
    raise UserError(msg)


def plan(argv: list[str], rdzv_timeout_s: int = cluster_config.DEFAULT_RDZV_TIMEOUT_S) -> Plan:
    """The `accelerate launch` command and environment for `argv` on this machine; UserError when it would fail."""
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(argv)
    config = cluster_config.load_config(args.config_file) if args.config_file else None
    problems = cluster_config.validate_config(config) if config is not None else []
    problems += sharding.launch_problems(args, config)  # --use_deepspeed; --cpu with an FSDP config
    if problems:
        _refuse(
            f"refusing to launch {args.config_file or args.training_script}:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    at = argv.index(args.training_script)  # our flags go before the script; its own arguments stay after it
    given = {a.split("=")[0] for a in argv[:at]}
    machines = int(args.num_machines or getattr(config, "num_machines", 1) or 1)
    # The flag wins, else the config's (a per-machine config from `accelerate config` holds it), as in accelerate.
    rank = int(args.machine_rank if args.machine_rank is not None else getattr(config, "machine_rank", 0) or 0)
    problem = world.machine_rank_problem(rank, machines) if machines > 1 else None
    if problem:
        _refuse(f"{problem}; give each machine its own rank.")
    host = args.main_process_ip or getattr(config, "main_process_ip", None)
    port = int(args.main_process_port or getattr(config, "main_process_port", None) or network.DEFAULT_PORT)
    backend = args.rdzv_backend if "--rdzv_backend" in given else getattr(config, "rdzv_backend", None) or "static"
    if config is not None:  # for the diagnosis: the address, port and backend this launch really uses
        config.main_process_ip, config.main_process_port, config.rdzv_backend = host, port, backend
    env, notes, extra, route = dict(os.environ), [], [], None
    if machines > 1 and host:
        # Fails at once on a name that does not resolve or an address without a route, instead of after the
        # rendezvous timeout.
        route = network.route_to(host, port)
        route, fixed = network.loopback_route(route, rank, env)  # machine 0's name resolving to 127.0.1.1
        if fixed:
            notes.append(fixed)
        new, kept = network.network_env(route, env)
        env.update(new)
        notes.append(
            f"machine {rank}: {route.describe()}; "
            + " ".join(f"{k}={v}" for k, v in new.items())
            + (f" (yours kept: {' '.join(f'{k}={v}' for k, v in kept.items())})" if kept else "")
        )
    if machines > 1:
        if "--rdzv_backend" not in given:
            extra += ["--rdzv_backend", backend]
        conf = args.rdzv_conf if "--rdzv_conf" in given else cluster_config.rdzv_conf(backend, rdzv_timeout_s)
        conf = network.host_role(conf or "", backend, rank, route)
        if "--rdzv_conf" in given:  # the user's value, with the host role added when they did not set it
            argv = _replace_flag(argv[:at], "--rdzv_conf", conf) + argv[at:]
            at = argv.index(args.training_script)
        else:
            extra += ["--rdzv_conf", conf]
    env[faults.LAUNCHED_ENV] = "1"  # the workers keep a SIGUSR1 during set-up (faults.keep_early_preemption)
    if args.max_restarts and backend == "c10d":
        env.setdefault(cluster_config.RESTART_SAFE_ENV, "1")  # a fresh store per restart round (see cluster_config.py)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *argv[:at], *extra, *argv[at:]]
    lost_after = _ddp_timeout(argv[at + 1 :]) if machines > 1 and rank > 0 and route is not None else None
    rdzv_wait = _rdzv_timeout(cmd, rdzv_timeout_s)
    return Plan(
        cmd, env, config, machines, rank, int(args.max_restarts or 0), notes, route, port, lost_after, rdzv_wait
    )


def _rdzv_timeout(cmd: list[str], default: float) -> float:
    """The rendezvous wait in the command's --rdzv_conf (c10d join_timeout, static timeout), else `default`."""
    conf = next((cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--rdzv_conf"), "")
    conf = next((a.split("=", 1)[1] for a in cmd if a.startswith("--rdzv_conf=")), conf)
    for item in conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() in ("join_timeout", "timeout"):
            try:
                return float(value)
            except ValueError:
                pass
    return float(default)


def _ddp_timeout(script_args: list[str]) -> float:
    """The script's --ddp_timeout (the Trainer's bound on every collective), else TrainingArguments' default."""
    for i, a in enumerate(script_args):
        try:
            if a == "--ddp_timeout" and i + 1 < len(script_args):
                return float(script_args[i + 1])
            if a.startswith("--ddp_timeout="):
                return float(a.split("=", 1)[1])
        except ValueError:
            break
    from accel_trainer.args import TrainingArguments

    return float(TrainingArguments.__dataclass_fields__["ddp_timeout"].default)


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            out += [flag, value]
            skip = True
        elif a.startswith(flag + "="):
            out.append(f"{flag}={value}")
        else:
            out.append(a)
    return out


def launch(argv: list[str], rdzv_timeout_s: int = cluster_config.DEFAULT_RDZV_TIMEOUT_S) -> int:
    """Run `accelerate launch <argv>` as planned (see the module docstring). Output is passed through unchanged
    (progress bars included). Exit code: the launcher's, 75 when the workers stopped for a preemption."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: accel-trainer launch [accelerate launch arguments] script.py [script arguments]\n"
            "  like `accelerate launch`; several machines get --rdzv_backend from the config, --rdzv_conf with a "
            f"{rdzv_timeout_s} s timeout unless given, and the network interface on the route to machine 0"
        )
        return 0 if argv else 2
    try:
        p = plan(argv, rdzv_timeout_s)
    except UserError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    for note in p.notes:
        print(f"accel-trainer launch: {note}", flush=True)
    print("accel-trainer launch: accelerate launch " + shlex.join(p.cmd[3:]), flush=True)
    run = _Run(p)
    rc, text = run.wait()
    if rc != 0 and faults.PREEMPTED.search(text):
        # From here on the answer is 75: a late SIGTERM (srun --kill-on-bad-exit ends the other nodes' tasks as soon
        # as one exits 75) must not turn it into a death by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(
            f"accel-trainer launch: preempted: the workers wrote a checkpoint and stopped; exit {EXIT_PREEMPTED} "
            "(requeue the job, or rerun with --resume_from_checkpoint auto)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    if run.lost and rc < 0:  # the agent ended by the launcher (a signal) after the loss: exit 1, not -15
        rc = 1
    if rc != 0:
        why = diagnose(text, p.config, p.machine_rank)
        if run.lost:
            why = (
                f"{run.lost}: the link to machine 0, or machine 0 itself, is gone. Resume with "
                "--resume_from_checkpoint latest (c10d with --max_restarts rejoins by itself when it is back)."
            )
        if run.signalled:
            why = f"{run.signalled} arrived and no preemption checkpoint was reported; " + why
        # The output ends with what the user acts on: the exit codes and the ranks' error lines (which torch
        # elastic's report used to follow), after the diagnosis.
        codes = describe_exit_codes(run.passthrough.exit_codes())
        errors = error_lines(text)
        if errors and why == "see the output above":
            why = "the ranks' error line follows" if len(errors) == 1 else "the ranks' error lines follow"
        lines = [f"accel-trainer launch: the run failed (exit {rc}{'; ' + codes if codes else ''}): {why}", *errors]
        print("\n".join(lines), file=sys.stderr, flush=True)
    return rc


class _MachineZeroWatch:
    """On machines 1..N-1: is machine 0 still there? A TCP connect to its rendezvous port every PROBE_S seconds
    (the store lives there for the whole run): refused means the host is up (it may have finished); no answer,
    no route or this machine's interface down means the link or machine 0 is gone.

    Why: when the link is cut, the workers here can wait far longer than --ddp_timeout (a gloo send that never
    completes is bounded only by the group's own timeout, 30 min for groups created without one), so this
    machine would never stop. After `lost_after_s` without an answer the launcher ends the workers; torchrun
    then exits, or with --max_restarts and c10d tries to rejoin (and does, if machine 0 is reachable again)."""

    PROBE_S = 2.0

    def __init__(self, p: Plan):
        import threading

        self.route, self.port, self.after = p.route, p.main_port, p.lost_after_s
        self.silent_since: float | None = None
        self.named = False  # this silence was declared a loss (once per silence)
        self.why = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _answer(self) -> tuple[bool, str]:
        import psutil

        iface = self.route.interface
        if iface:
            stats = psutil.net_if_stats().get(iface)
            if stats is not None and not stats.isup:
                return False, f"this machine's interface {iface} is down"
        try:
            with socket.create_connection((self.route.main_ip, self.port), timeout=self.PROBE_S):
                return True, ""
        except ConnectionRefusedError:
            return True, ""
        except OSError as e:
            return False, f"{self.route.main_ip}:{self.port} does not answer ({e.strerror or type(e).__name__})"

    def _loop(self):
        while not self._stop.is_set():
            ok, why = self._answer()
            if ok:
                self.silent_since, self.named = None, False
            elif self.silent_since is None:
                self.silent_since, self.why = time.monotonic(), why
            self._stop.wait(self.PROBE_S)

    def lost(self) -> bool:
        silent = self.silent_since
        return not self.named and silent is not None and time.monotonic() - silent >= self.after

    def silent(self) -> bool:
        return self.silent_since is not None

    def stop(self):
        self._stop.set()


class _Run:
    """The `accelerate launch` child, its output passed through, and preemption signals turned into exactly one
    SIGUSR1 per worker on this machine.

    A preemption signal may reach only this launcher (`kill`, SLURM's `--signal=B:...` forwarded by the batch
    script through srun with process-group tracking) or every process of the job step at once (SLURM with
    cgroup or linuxproc tracking). The Trainer treats a second signal as "stop now, no checkpoint", so the
    launcher waits FORWARD_GRACE_S, reads which ranks already said "[rank N] SIGUSR1 received", and signals
    only the others. torchrun's agent ignores SIGUSR1 (it would otherwise die of it and orphan the workers);
    after the workers stopped, an agent with --max_restarts is told to stop instead of restarting them."""

    def __init__(self, p: Plan):
        self.plan, self.signalled, self.forwarded, self.signal_at = p, None, False, 0.0
        self.passthrough = Passthrough()  # what of the output is shown
        self.received: set[int] = set()
        self.proc = subprocess.Popen(
            p.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=p.env,
            preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN),  # inherited by the agent only
        )
        self.previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGUSR1, signal.SIGTERM)}
        self.watch = _MachineZeroWatch(p) if p.lost_after_s is not None else None
        self.lost = None  # why machine 0 was declared lost
        self.workers_ended_at = 0.0  # when _machine_zero_lost ended this machine's workers
        self.end_agent_at: float | None = None  # when to end torchrun's agent after a loss (see AGENT_GRACE_S)
        self.agent_termed_at: float | None = None

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signalled is None:
            self.signalled, self.signal_at = name, time.monotonic()
            os.write(2, f"accel-trainer launch: {name}: the workers checkpoint and stop\n".encode())
        elif signum == signal.SIGTERM:  # a second SIGTERM: stop now (the agent terminates the workers)
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)

    def _workers(self):
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for k in kids:
            try:
                rank = k.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None:
                out.append((int(rank), k))
        return out

    def _forward(self):
        """Once, FORWARD_GRACE_S after the signal: SIGUSR1 to each worker that did not report one."""
        self.forwarded = True
        workers = self._workers()
        for rank, w in workers:
            if rank not in self.received:
                try:
                    w.send_signal(signal.SIGUSR1)
                except Exception:  # noqa: BLE001 - it exited meanwhile
                    pass
        self.watched = [w for _, w in workers]

    def _stop_restarts(self):
        """With --max_restarts the agent would restart workers that stopped for a preemption: once they are all
        gone, tell it to stop (a worker it restarted meanwhile gets SIGTERM, a preemption signal too)."""
        if self.plan.max_restarts and self.forwarded and self.watched is not None:
            if all(not w.is_running() or w.status() == "zombie" for w in self.watched):
                self.watched = None
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> tuple[int, str]:
        self.watched = None
        fd, tail, text = self.proc.stdout.fileno(), b"", ""
        try:
            while True:
                try:
                    ready, _, _ = select.select([fd], [], [], 0.25)
                except InterruptedError:
                    ready = []
                if ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    sys.stdout.buffer.write(self.passthrough.feed(chunk))
                    sys.stdout.buffer.flush()
                    tail = (tail + chunk)[-262144:]
                    text = tail.decode(errors="replace")
                    self.received |= {int(r) for r, _ in faults.RECEIVED.findall(text)}
                if self.signalled and not self.forwarded and time.monotonic() - self.signal_at >= FORWARD_GRACE_S:
                    self._forward()
                self._stop_restarts()
                if self.watch is not None and self.watch.lost():
                    self._machine_zero_lost()
                self._end_agent_if_stuck()
            rc = self.proc.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to the launcher too; give it a bounded time to stop
            try:
                rc = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        finally:
            sys.stdout.buffer.write(self.passthrough.end())
            sys.stdout.buffer.flush()
            for s, h in self.previous.items():
                signal.signal(s, h)
            if self.watch is not None:
                self.watch.stop()
        return rc, tail.decode(errors="replace")

    def _machine_zero_lost(self):
        w = self.watch
        self.lost = (
            f"lost machine 0 ({w.why}, for {time.monotonic() - w.silent_since:.0f} s; the bound is --ddp_timeout "
            f"{w.after:g})"
        )
        os.write(2, f"accel-trainer launch: {self.lost}; ending this machine's workers\n".encode())
        w.named = True  # once per silence: with --max_restarts the agent may rejoin when it answers again
        for _, p in self._workers():
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - it exited meanwhile
                pass
        # Then the agent must exit too. With c10d and --max_restarts it may rejoin when machine 0 answers again:
        # it gets the rendezvous timeout for that first.
        wait = AGENT_GRACE_S
        if self.plan.max_restarts:
            wait += self.plan.rdzv_timeout_s
        self.workers_ended_at = time.monotonic()
        self.end_agent_at = self.workers_ended_at + wait

    def _end_agent_if_stuck(self):
        """After a loss: end torchrun's agent once its time is up (SIGTERM, then SIGKILL), and whatever it left."""
        now = time.monotonic()
        if self.end_agent_at is None or now < self.end_agent_at or self.proc.poll() is not None:
            return
        if self.plan.max_restarts and not self.watch.silent():  # machine 0 answers again: the agent rejoins
            self.end_agent_at = None
            return
        if self.agent_termed_at is None:
            self.agent_termed_at = now
            os.write(
                2,
                f"accel-trainer launch: torchrun's agent still runs {now - self.workers_ended_at:.0f} s after this "
                "machine's workers ended (it waits on machine 0, where the rendezvous store is); ending it\n".encode(),
            )
            self._signal_tree(signal.SIGTERM)
        elif now - self.agent_termed_at >= AGENT_GRACE_S:
            self._signal_tree(signal.SIGKILL)

    def _signal_tree(self, sig):
        """`sig` to the agent and to every process under it (a worker's own children would keep the output open)."""
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
