"""Two hosts on a real (virtual) network: two network namespaces joined by a veth pair (tests/netns.py), machine 0
at 10.77.0.1 and machine 1 at 10.77.0.2, each with its own interface, and a host name that resolves to neither
(as on clusters whose names point at a management network). Each machine runs the `accel-trainer launch` line
the wizard printed for it, with 2 CPU processes: a world of 4 across the link.

- static and c10d: the run forms a world of 4 and trains to the weights of one process over the same global batch;
- the link is cut mid-run: both machines stop within the documented bound, exit non-zero, name what was lost, and
  leave no process behind;
- c10d with --max_restarts: when the link comes back, machine 1 rejoins and the run resumes from its newest
  checkpoint and completes;
- `accel-trainer check` reports each machine's address and interface, and a reachable / unreachable machine 0.

Skipped (with the reason) without root or iproute2. Every wait is bounded; the namespaces and every process in
them are removed whatever happens.
"""

import os
import shlex
import subprocess
import sys
import time

import netns
import pytest
from helpers import ROOT, assert_same_weights, env, last_step, run, run_config, weights

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason())),
    pytest.mark.slow,
]

CLI = [sys.executable, "-m", "accel_trainer.cli"]
FAULT_RECIPE = os.path.join(ROOT, "tests", "fault_recipe.py")
STEPS, PER_DEVICE = 4, 4  # global batch 16: 2 machines x 2 processes x 4, or 1 process x 16
DDP_TIMEOUT = 10  # seconds: the bound on every collective in the link-cut tests
# A machine whose link is cut stops within this (see docs/topology.md, "Tested on a real network"): the collective
# timeout, the Trainer naming the lost ranks (a monitored barrier bounded by the same timeout) or, on the side
# that lost machine 0, the launcher's probe, then torchrun ending its workers; plus start-up noise on 2 shared cores.
STOP_BOUND = 3 * DDP_TIMEOUT + 30


@pytest.fixture
def hosts():
    h = netns.TwoHosts()
    try:
        h.up()
    except subprocess.CalledProcessError as e:
        h.down()
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        yield h
    finally:
        h.down()


def wizard_lines(tmp_path, hosts, rdzv, restarts=0, main=None) -> tuple[str, list[list[str]]]:
    """The config and the launch line for each machine, as `accel-trainer config` writes and prints them."""
    argv = ["--dir", str(tmp_path), "--name", f"net_{rdzv}", "--no-interactive", "--cpu", "--machines", "2"]
    argv += ["--processes-per-machine", "2", "--main-ip", main or hosts.addr[0], "--rdzv", rdzv, "--rdzv-timeout", "60"]
    argv += ["--script", "recipes/regression.py"] + (["--max-restarts", str(restarts)] if restarts else [])
    out = subprocess.run(CLI + ["config", *argv], capture_output=True, text=True, timeout=60, env=env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = []
    for r in (0, 1):
        line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith(f"machine {r}:"))
        cmd = shlex.split(line.split(":", 1)[1])
        assert cmd[:2] == ["accel-trainer", "launch"] and cmd[-2:] == ["--output_dir", "runs/<name>"], line
        lines.append(CLI + cmd[1:-2])  # the console script, run with this Python; our output folder follows
    return str(tmp_path / f"net_{rdzv}.yaml"), lines


def start_both(hosts, tmp_path, lines, args, step_delay=None):
    """Both machines' launch lines; with `step_delay`, the script is tests/fault_recipe.py (the regression recipe
    slowed by S seconds per update, so that a link can be cut mid-run)."""
    if step_delay is not None:
        lines = [[FAULT_RECIPE if a == "recipes/regression.py" else a for a in line] for line in lines]
        args = args + ["--faults", f"step_delay={step_delay}"]
    logs = [open(tmp_path / f"machine{r}.log", "w") for r in (0, 1)]
    procs = [hosts.popen(r, lines[r] + args, logs[r], env=env(), cwd=ROOT) for r in (0, 1)]
    return procs, logs


def wait_all(procs, timeout) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            codes.append(None)  # still running at the bound: the fixture kills it
    return codes


def read_logs(tmp_path) -> list[str]:
    return [(tmp_path / f"machine{r}.log").read_text() for r in (0, 1)]


def wait_for(cond, timeout, what, procs=()):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        assert all(p.poll() is None for p in procs), f"{what}: a machine exited first"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run("regression.py", ["--output_dir", out, "--max_steps", STEPS, "--per_device_train_batch_size", 4 * PER_DEVICE])
    return weights(out)


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_hosts_form_a_world_of_4_and_train_like_one_process(hosts, tmp_path, rdzv, one_process_weights):
    cfg, lines = wizard_lines(tmp_path, hosts, rdzv)
    out = tmp_path / "run"  # one folder seen by both machines, as on a cluster's shared file system
    args = ["--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", str(PER_DEVICE)]
    procs, _ = start_both(hosts, tmp_path, lines, args)
    codes = wait_all(procs, 240)
    logs = read_logs(tmp_path)
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    cfg = run_config(out)
    assert cfg["num_processes"] == 4, cfg  # one world of 4, not two worlds of 2
    topo = cfg["topology"]
    assert (topo["num_machines"], topo["local_world_size"], topo["backend"]) == (2, 2, "gloo"), topo
    # The workers talked over the link: machine 0's address and interface, not the host name's 127.0.0.1.
    assert topo["network"]["MASTER_ADDR"] == hosts.addr[0] and topo["network"]["GLOO_SOCKET_IFNAME"] == hosts.ifname[0]
    for r in (0, 1):
        assert f"GLOO_SOCKET_IFNAME={hosts.ifname[r]}" in logs[r] and f"PET_LOCAL_ADDR={hosts.addr[r]}" in logs[r]
    if rdzv == "c10d":  # machine 0 hosts the rendezvous store, machine 1 never tries
        assert "is_host=1" in logs[0] and "is_host=0" in logs[1]
    assert_same_weights(weights(out), one_process_weights)


def test_machine_0_whose_host_name_resolves_to_127_0_1_1_here_still_forms_the_world(hosts, tmp_path):
    """The Debian default /etc/hosts maps the machine's own name to 127.0.1.1, and SLURM scripts name machine 0 by
    host name. Machine 0 must not announce loopback (c10d hands its address to the other machines as the store's):
    it uses its address on the link instead, and says so."""
    _, lines = wizard_lines(tmp_path, hosts, "c10d", main="node0")
    etc = []
    for r, addr in ((0, "127.0.1.1"), (1, hosts.addr[0])):  # machine 0: its own name is loopback; machine 1: DNS
        etc.append(tmp_path / f"hosts{r}")
        etc[r].write_text(f"127.0.0.1 localhost\n{addr} node0\n")
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", str(PER_DEVICE)]
    logs = [open(tmp_path / f"machine{r}.log", "w") for r in (0, 1)]
    procs = [hosts.popen(r, lines[r] + args, logs[r], hosts_file=str(etc[r]), env=env(), cwd=ROOT) for r in (0, 1)]
    codes = wait_all(procs, 240)
    text = read_logs(tmp_path)
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in text)
    assert "'node0' resolves to 127.0.1.1" in text[0] and f"using {hosts.addr[0]} ({hosts.ifname[0]}" in text[0]
    assert f"PET_LOCAL_ADDR={hosts.addr[0]}" in text[0] and "is_host=1" in text[0]
    cfg = run_config(out)
    assert cfg["num_processes"] == 4 and cfg["topology"]["network"]["MASTER_ADDR"] == hosts.addr[0], cfg["topology"]


def stop_times(procs, timeout) -> list[float | None]:
    """Seconds until each process exits (None: still running at `timeout`; the fixture kills it)."""
    t0, took = time.monotonic(), [None] * len(procs)
    while None in took and time.monotonic() - t0 < timeout:
        for i, p in enumerate(procs):
            if took[i] is None and p.poll() is not None:
                took[i] = time.monotonic() - t0
        time.sleep(0.2)
    return took


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_link_cut_mid_run_stops_both_machines_within_the_bound_naming_the_lost_ranks(hosts, tmp_path, rdzv):
    """The config the wizard writes, both machines. With c10d, machine 1's torchrun agent used to wait on the
    unreachable rendezvous store for minutes after the launcher had named the loss and ended its workers."""
    _, lines = wizard_lines(tmp_path, hosts, rdzv)
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--max_steps", "400", "--per_device_train_batch_size", str(PER_DEVICE)]
    args += ["--ddp_timeout", str(DDP_TIMEOUT), "--logging_steps", "1", "--disable_tqdm"]
    procs, _ = start_both(hosts, tmp_path, lines, args, step_delay=0.2)
    wait_for(lambda: last_step(out) >= 3, 240, "training", procs)
    hosts.link(1, up=False)
    took = stop_times(procs, STOP_BOUND)
    codes = [p.poll() for p in procs]
    logs = read_logs(tmp_path)
    both = "\n\n".join(log[-3000:] for log in logs)
    for r in (0, 1):  # each machine, on its own: stopped within the bound, non-zero
        assert took[r] is not None and took[r] < STOP_BOUND, f"machine {r}: {took} s, bound {STOP_BOUND}\n{both}"
        assert codes[r] not in (None, 0), f"machine {r}: exit {codes[r]}\n{both}"
    print(
        f"link cut ({rdzv}): machines stopped {took[0]:.0f} s and {took[1]:.0f} s after the cut (bound {STOP_BOUND} s)"
    )
    # Machine 0 names the ranks it lost, and the machine; machine 1 says it lost machine 0.
    if rdzv == "static":
        assert "rank(s) 2, 3 = machine 1 stopped answering" in logs[0], logs[0][-3000:]
    else:  # c10d assigns the machines at the rendezvous
        assert "rank(s) 2, 3 (on the machine(s) that joined the c10d rendezvous as 1) stopped" in logs[0], logs[0][
            -3000:
        ]
    assert "lost machine 0" in logs[1], logs[1][-3000:]
    time.sleep(1)
    assert hosts.pids(0) == [] and hosts.pids(1) == [], "processes left behind"
    assert last_step(out) < 400


def test_c10d_machine_that_comes_back_rejoins_and_the_run_resumes_and_completes(hosts, tmp_path, one_process_weights):
    _, lines = wizard_lines(tmp_path, hosts, "c10d", restarts=1)
    out = tmp_path / "run"
    steps = 24
    args = ["--output_dir", str(out), "--max_steps", str(steps), "--per_device_train_batch_size", str(PER_DEVICE)]
    args += ["--ddp_timeout", str(DDP_TIMEOUT), "--logging_steps", "1", "--save_steps", "4", "--disable_tqdm"]
    procs, _ = start_both(hosts, tmp_path, lines, args, step_delay=0.3)
    wait_for(lambda: os.path.isdir(out / "checkpoints" / "step_8"), 240, "a checkpoint", procs)
    hosts.link(1, up=False)
    # Machine 0's workers fail (the collective times out) and its agent waits for a new rendezvous round.
    wait_for(lambda: "died or hangs" in read_logs(tmp_path)[0], STOP_BOUND, "machine 0 noticing the cut", procs)
    hosts.link(1, up=True)
    codes = wait_all(procs, 300)
    logs = read_logs(tmp_path)
    assert codes == [0, 0], "\n\n".join(log[-4000:] for log in logs)
    resumed = [ln for ln in logs[0].splitlines() if ln.startswith("Resumed from")]
    assert resumed and "checkpoints/step_" in resumed[-1], logs[0][-3000:]
    assert run_config(out)["num_processes"] == 4 and last_step(out) == steps
    # The resumed run is the same run: compare with an uninterrupted run of 4 processes' global batch.
    ref = tmp_path / "ref"
    run("regression.py", ["--output_dir", ref, "--max_steps", steps, "--per_device_train_batch_size", 4 * PER_DEVICE])
    assert_same_weights(weights(out), weights(ref))


def check(hosts, machine, cfg, *extra, timeout=120):
    argv = CLI + ["check", "--config_file", cfg, "--machine_rank", str(machine), "--timeout", "8", *extra]
    return hosts.run(machine, argv, timeout=timeout, env=env(), cwd=ROOT)


def test_check_reports_each_machines_address_and_interface_and_an_unreachable_machine_0(hosts, tmp_path):
    cfg, _ = wizard_lines(tmp_path, hosts, "static")
    # Both machines at once: the collective runs across the link, and machine 0 reports where each machine is.
    procs = [
        hosts.popen(
            r,
            CLI + ["check", "--config_file", cfg, "--machine_rank", str(r), "--timeout", "60"],
            open(tmp_path / f"check{r}.log", "w"),
            env=env(),
            cwd=ROOT,
        )
        for r in (0, 1)
    ]
    codes = wait_all(procs, 200)
    outs = [(tmp_path / f"check{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    assert f"owns machine 0's address {hosts.addr[0]} (interface {hosts.ifname[0]})" in outs[0]
    assert f"from {hosts.addr[1]} (interface {hosts.ifname[1]})" in outs[1]
    assert f"{hosts.addr[0]} is reachable" in outs[1]
    assert "collective OK: 4 processes on 2 machine(s) (2 per machine)" in outs[0], outs[0][-2000:]
    for r in (0, 1):
        assert f"{hosts.addr[r]} ({hosts.ifname[r]})" in outs[0]  # where each machine's processes talk from

    # Machine 0's side of the link is down: machine 1 still has its route, but machine 0 does not answer.
    hosts.link(0, up=False)
    t0 = time.monotonic()
    r = check(hosts, 1, cfg, "--no-collective")
    assert r.returncode == 1, r.stdout
    # (within the 8 s timeout, or at once when ARP finds no one: "No route to host")
    assert f"[FAIL] no answer from {hosts.addr[0]}:29500" in r.stdout and "machine 0" in r.stdout, r.stdout
    assert "Nothing was launched" in r.stdout and time.monotonic() - t0 < 60
    # Machine 1's own interface is down: no route at all, said at once.
    hosts.link(0, up=True)
    hosts.link(1, up=False)
    r = check(hosts, 1, cfg, "--no-collective")
    assert r.returncode == 1, r.stdout
    assert (
        f"[FAIL] no route from this machine to machine 0's address {hosts.addr[0]}: Network is unreachable" in r.stdout
    )
