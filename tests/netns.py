"""Two "machines" on a real (virtual) network: two Linux network namespaces joined by a veth pair.

Each namespace has its own loopback, its own interface and its own address (10.77.0.1 and 10.77.0.2, created
here, inside the namespaces: nothing else is ever addressed), its own port space and routes, so traffic between
the machines crosses a network interface, and a link can be cut (`ip link set ... down`). The file system is
shared, like a cluster's network file system. Needs root and iproute2; `skip_reason()` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

ADDRS = ("10.77.0.1", "10.77.0.2")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


class TwoHosts:
    """`up()` builds both namespaces and the link; `down()` kills every process inside them and removes them,
    whatever state they are in. Names carry the pid so that concurrent test runs do not collide."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.ns = (f"at{tag}m0", f"at{tag}m1")
        self.ifname = (f"at{tag}v0", f"at{tag}v1")
        self.addr = ADDRS
        self.procs: list[subprocess.Popen] = []

    def up(self):
        self.down()  # leftovers of a killed earlier run with the same pid
        a, b = self.ns
        va, vb = self.ifname
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((a, va, ADDRS[0]), (b, vb, ADDRS[1])):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def cmd(self, machine: int, argv: list[str], hosts_file: str | None = None) -> list[str]:
        """`argv` on machine `machine`. With `hosts_file`: in a private mount namespace where that file is
        /etc/hosts (host names for the machines; nothing outside changes), entering only the network namespace
        (`ip netns exec` would also remount /sys, hiding the cgroup file systems slurmd needs)."""
        if hosts_file is None:
            return ["ip", "netns", "exec", self.ns[machine], *argv]
        script = 'mount --bind "$0" /etc/hosts && exec nsenter --net=/run/netns/' + self.ns[machine] + ' "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, hosts_file, *argv]

    def popen(self, machine: int, argv: list[str], log, hosts_file: str | None = None, **kw) -> subprocess.Popen:
        p = subprocess.Popen(
            self.cmd(machine, argv, hosts_file),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            **kw,
        )
        self.procs.append(p)
        return p

    def run(self, machine: int, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(machine, argv), capture_output=True, text=True, timeout=timeout, **kw)

    def link(self, machine: int, up: bool):
        """Cut (or restore) machine `machine`'s side of the link."""
        _ip("-n", self.ns[machine], "link", "set", self.ifname[machine], "up" if up else "down")

    def pids(self, machine: int) -> list[int]:
        """Every process still running inside machine `machine`'s namespace."""
        out = _ip("netns", "pids", self.ns[machine], check=False).stdout
        return [int(p) for p in out.split()]

    def down(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self.ns:
            for _ in range(50):
                left = self.pids(self.ns.index(ns))
                if not left:
                    break
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)  # also removes the veth end inside it
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
