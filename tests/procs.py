"""Launching and wrapping processes in tests: one launch in its own session, its output in a file, its whole process
tree tracked (torchrun puts its workers in sessions of their own) so that it can be signalled, killed and checked
gone. Every wait has a bound."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
from helpers import env as child_env


class Launch:
    def __init__(self, cmd: list[str], log: str, *, env: dict | None = None, cwd=None, deadline: float = 240):
        self.deadline = deadline  # seconds a wait may take by default
        self.log = open(log, "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or child_env(), cwd=cwd,
                                     start_new_session=True)  # fmt: skip
        self.seen: dict[int, psutil.Process] = {}

    def tree(self) -> list[psutil.Process]:
        """The processes of the launch still running; every one seen is remembered, to be killed and checked."""
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root] + root.children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return [p for p in self.seen.values() if p.is_running()]

    def kill(self, sig=signal.SIGKILL):
        """Send `sig` to every process of the tree (without waiting)."""
        for p in self.tree():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def stop(self):
        """Kill the whole tree and wait (bounded) until it is gone."""
        self.kill()
        psutil.wait_procs(list(self.seen.values()), timeout=10)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; whatever is left of the tree is killed afterwards."""
        try:
            return self.proc.wait(timeout=timeout or self.deadline)
        finally:
            self.stop()

    def wait_ok(self) -> str:
        """Wait for exit 0 (asserted) and return the whole output."""
        rc = self.wait()
        assert rc == 0, f"exit {rc}:\n{self.output()}"
        return self.output(None)

    def wait_until(self, cond, timeout: float | None = None, poll: float = 0.05):
        start = time.monotonic()
        while not cond():
            self.tree()  # keep the list of descendants fresh while they live
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before the condition held:\n{self.output()}")
            if time.monotonic() - start > (timeout or self.deadline):
                raise AssertionError(f"condition not met within {timeout or self.deadline} s:\n{self.output()}")
            time.sleep(poll)

    def output(self, tail: int | None = 6000) -> str:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        return text[-tail:] if tail else text

    def no_process_left(self):
        alive = [p for p in self.seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes left: {alive}"
