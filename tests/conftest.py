"""The two tiers of the suite (CONTRIBUTING.md, "Tests").

- The fast tier, `python -m pytest` (pyproject.toml's addopts: `-m "not slow"`): tests that run in this process,
  every module of the package among them, in a few minutes.
- The slow tier, `python -m pytest -m slow`: tests marked `slow`, which start processes (python, accelerate launch,
  a notebook kernel, SLURM) or wait out the bounds they assert. `.ci/run` runs both tiers.

What keeps the fast tier fast: a test that is not marked slow may not start a process. Starting one -- subprocess,
os.fork (a DataLoader's workers), multiprocessing's spawn (inductor's compile workers) -- in the test or in a
fixture it sets up fails the test, naming the mark, instead of making the fast tier slower a few seconds at a time.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess

import pytest


class StartsAProcess(BaseException):  # not an Exception: a test's `except Exception` must not swallow it
    pass


def _refuse(*args, **kwargs):
    raise StartsAProcess(
        "this test starts a process, which the fast tier does not: mark it @pytest.mark.slow (tests/conftest.py)"
    )


# Every way Python starts a process: subprocess (and what calls it), fork, forkpty (pexpect), posix_spawn,
# multiprocessing's spawn.
_STARTERS = [(subprocess.Popen, "__init__"), (os, "fork"), (os, "forkpty"), (os, "posix_spawn"),
             (os, "posix_spawnp"), (_posixsubprocess, "fork_exec")]  # fmt: skip


@contextlib.contextmanager
def _no_process():
    saved = [(owner, name, getattr(owner, name)) for owner, name in _STARTERS if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, _refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up (module fixtures included), call and teardown of a test not marked slow, with no process start."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with _no_process():
        return (yield)
