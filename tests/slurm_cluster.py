"""A real SLURM cluster in a temporary folder: munged, slurmctld and slurmd (Debian's slurm-wlm, which `.ci/run`
installs; nothing is installed here), with a generated slurm.conf and free ports. One node on loopback, or two
nodes on two network namespaces (tests/netns.py): slurmctld and node 0 at 10.77.0.1, node 1 at 10.77.0.2, each
slurmd in its namespace with the node names in its own /etc/hosts (a private mount namespace; nothing outside the
temporary folder changes).

`stop()` cancels the jobs and ends every process this started (the daemons by pid, the job steps by their
SLURM_CONF), whatever state they are in. Needs root (slurmd runs jobs as their user) and the binaries.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time

import psutil

# How long a job credential lives, which is also how long SLURM holds a requeued job before it may start again
# (default 120 s): shorter, with a scheduler pass every 2 s (default 60 s), so that a requeued job restarts within
# seconds here.
CRED_EXPIRE_S = 10
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; .ci/run installs slurm-wlm and munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(b: str) -> str:
    return shutil.which(b) or f"/usr/sbin/{b}"


class LocalSlurm:
    def __init__(self, root, hosts=None):
        self.root = str(root)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.daemons: list[subprocess.Popen] = []
        self.hosts = hosts  # netns.TwoHosts: two nodes, one per namespace
        if hosts is None:
            self.nodes = [(socket.gethostname(), "127.0.0.1")]
        else:
            self.nodes = [(f"{ns}n", addr) for ns, addr in zip(hosts.ns, hosts.addr)]
        self.node = self.nodes[0][0]

    def _in(self, machine: int, argv: list[str]) -> list[str]:
        return argv if self.hosts is None else self.hosts.cmd(machine, argv, self._path("hosts"))

    @property
    def env(self) -> dict:
        return {"SLURM_CONF": self.conf}

    def _path(self, *p) -> str:
        return os.path.join(self.root, *p)

    def start(self, timeout: float = 60):
        for d in ("state", "log", *(os.path.join("spool", n) for n, _ in self.nodes)):
            os.makedirs(self._path(d), exist_ok=True)
        key = self._path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = self._path("munge.sock")
        cpus = os.cpu_count() or 2
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in self.nodes)
        with open(self._path("hosts"), "w") as f:  # the node names, for the namespaces' /etc/hosts
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.nodes))
        with open(self.conf, "w") as f:
            f.write(
                f"""ClusterName=accel_trainer_test
SlurmctldHost={socket.gethostname()}({self.nodes[0][1]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={self._path("state")}
SlurmdSpoolDir={self._path("spool")}/%n
SlurmctldPidFile={self._path("slurmctld.pid")}
SlurmdPidFile={self._path("slurmd-%n.pid")}
SlurmctldLogFile={self._path("log", "slurmctld.log")}
SlurmdLogFile={self._path("log", "slurmd-%n.log")}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
{nodes}
PartitionName=test Nodes={",".join(n for n, _ in self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
            )
        env = {**os.environ, **self.env}
        log = open(self._path("log", "daemons.out"), "w")
        munged = [
            _which("munged"),
            "-F",
            "--force",
            f"--socket={sock}",
            f"--key-file={key}",
            f"--pid-file={self._path('munged.pid')}",
            f"--log-file={self._path('log', 'munged.log')}",
            f"--seed-file={self._path('munged.seed')}",
        ]
        cmds = [munged, self._in(0, [_which("slurmctld"), "-D", "-f", self.conf])]
        for i, (name, _) in enumerate(self.nodes):
            cmds.append(self._in(i, [_which("slurmd"), "-D", "-f", self.conf, "-N", name]))
        for cmd in cmds:
            self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            if cmd is munged:
                self._until(lambda: os.path.exists(sock), 20, "munged did not create its socket")
        self._until(lambda: self.node_state() in ("idle", "mixed"), timeout, "the nodes did not become idle")
        return self

    def _until(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} (dead: {dead}); logs:\n{self.logs()}")
            time.sleep(0.3)

    def cmd(self, *argv, timeout=30, check=True, env=None, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol, ...) against this cluster, from node 0."""
        return subprocess.run(
            self._in(0, list(argv)),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env={**(env or os.environ), **self.env},
            **kw,
        )

    def node_state(self) -> str:
        """The state of every node, or the one state they share ("idle")."""
        states = set(self.cmd("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10).stdout.split())
        return states.pop() if len(states) == 1 else ",".join(sorted(states))

    def sbatch(self, script: str, args: list[str], cwd: str, env: dict) -> str:
        r = self.cmd("sbatch", "--parsable", script, *args, cwd=cwd, env=env)
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        r = self.cmd("scontrol", "-o", "show", "job", job_id, check=False, timeout=10)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float, log: str | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                tail = open(log).read()[-4000:] if log and os.path.exists(log) else ""
                raise AssertionError(f"job {job_id} not in {states} within {timeout} s: {info}\n{tail}")
            time.sleep(0.5)

    def logs(self) -> str:
        out = []
        for name in ("daemons.out", "slurmctld.log", *(f"slurmd-{n}.log" for n, _ in self.nodes)):
            p = self._path("log", name)
            if os.path.exists(p):
                out.append(f"--- {name}\n" + open(p).read()[-3000:])
        return "\n".join(out)

    def _job_processes(self) -> list[psutil.Process]:
        """Processes of this cluster's jobs: slurmstepd and the tasks carry our SLURM_CONF in their environment."""
        mine = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get("SLURM_CONF") == self.conf and p.pid not in {d.pid for d in self.daemons}:
                    mine.append(p)
            except (psutil.Error, OSError):
                pass
        return mine

    def stop(self):
        try:
            self.cmd("scancel", "--full", "--user", "root", check=False, timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            pass
        for d in reversed(self.daemons):  # slurmd, slurmctld, munged
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
        for d in self.daemons:
            try:
                d.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait(timeout=5)
        left = self._job_processes()
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        self.daemons = []
