"""Real launches on this machine: two `accelerate launch` invocations as machine 0 and 1 on 127.0.0.1 (static and
c10d rendezvous, gloo, 1 process each) train to the weights of one process over the same global batch; a c10d
run with --max_restarts 1 survives a worker failing once; and each way a world can go wrong ends with a clear
error, a non-zero exit and no hang (every wait below is bounded)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, assert_same_weights, call, env, free_port, launch_cmd, two_machine_config, weights

from accel_trainer.cluster.cluster_config import RESTART_SAFE_ENV, rdzv_flags

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
STEPS, PER_DEVICE = 4, 8  # global batch 16: 2 machines x 1 process x 8, or 1 process x 16
BOUND = 60  # seconds within which every failure must have ended


def start(cmd, log, **extra_env):
    f = open(log, "w")
    return subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env(**extra_env), cwd=ROOT, start_new_session=True
    ), f


def finish(procs, timeout):
    """Wait for all; kill what is left at the deadline (so a hang fails the test instead of blocking CI)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p, f in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            codes.append(p.wait(timeout=10))
        f.close()
    return codes


def wait_listening(port, proc, timeout=60):
    """Until machine 0 listens on `port` (bounded). On one host machine 1 must start after machine 0's launcher
    has checked that the port is free, or it could take the port first (c10d hosts the store on any machine
    whose address matches the endpoint, and here both do)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)


def two_launches(cfg, port, tmp_path, script_and_args, rdzv, extra=(), timeout=120, **extra_env):
    """Machine 0 and machine 1, as `accel-trainer config` prints them (rendezvous flags included)."""
    procs = []
    for rank in (0, 1):
        cmd = LAUNCH + ["--config_file", cfg, "--machine_rank", str(rank), *rdzv_flags(rdzv, 60), *extra]
        procs.append(
            start(cmd + [a.format(rank=rank) for a in script_and_args], tmp_path / f"machine{rank}.log", **extra_env)
        )
        if rank == 0:
            wait_listening(port, procs[0][0])
    codes = finish(procs, timeout)
    logs = [(tmp_path / f"machine{r}.log").read_text() for r in (0, 1)]
    return codes, logs


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    proc = call(
        [
            sys.executable,
            "recipes/regression.py",
            "--output_dir",
            str(out),
            "--max_steps",
            str(STEPS),
            "--per_device_train_batch_size",
            str(2 * PER_DEVICE),
        ],
        180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return weights(out)


# static: one output folder for both machines, as on a cluster's shared file system, with the checkpoint of the
# last update; c10d: a folder each, as on two machines with disks of their own, without checkpoints.
@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_machines_on_loopback_train_like_one_process(tmp_path, rdzv, one_process_weights):
    port = free_port()
    cfg = two_machine_config(tmp_path, port=port, rdzv=rdzv)
    out = str(tmp_path / "out0") if rdzv == "static" else str(tmp_path / "out{rank}")
    codes, logs = two_launches(
        cfg,
        port,
        tmp_path,
        ["recipes/regression.py", "--output_dir", out, "--max_steps", str(STEPS), "--per_device_train_batch_size",
         str(PER_DEVICE)] + (["--save_strategy", "no"] if rdzv == "c10d" else []),
        rdzv,
    )  # fmt: skip
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    import json

    run_config = json.loads((tmp_path / "out0" / "run_config.json").read_text())
    assert '"num_processes": 2' in json.dumps(run_config), run_config  # a world of 2, not two worlds of 1
    assert_same_weights(weights(tmp_path / "out0"), one_process_weights)
    if rdzv == "static":  # the checkpoint holds both ranks' parts
        assert sorted(p.name for p in (tmp_path / "out0" / "checkpoints" / f"step_{STEPS}").glob("rng_state_*")) == [
            "rng_state_0.json", "rng_state_1.json"]  # fmt: skip


@pytest.mark.slow
def test_two_machines_with_a_folder_each_and_checkpoints_are_refused_in_one_line(tmp_path):
    # Each rank writes its part of a checkpoint into output_dir: on a node whose folder the main process does not
    # see, it was lost (format 2: a traceback at the first checkpoint; before: a checkpoint without rank 1's RNG
    # state, which resumed with other random numbers).
    port = free_port()
    cfg = two_machine_config(tmp_path, port=port, rdzv="static")
    codes, logs = two_launches(
        cfg, port, tmp_path,
        ["recipes/regression.py", "--output_dir", str(tmp_path / "out{rank}"), "--max_steps", str(STEPS)],
        "static", timeout=BOUND,
    )  # fmt: skip
    assert codes[0] != 0 and codes[1] != 0, logs
    for log in logs:  # each machine's rank says it in one line
        line = next((ln for ln in log.splitlines() if "is not one folder for every process" in ln), None)
        assert line is not None and line.startswith("error: output_dir ") and "rank 1 on " in line, log[-3000:]
        assert line.endswith("or --save_strategy no to train without checkpoints."), line
    assert not (tmp_path / "out0" / "checkpoints").exists()


FAIL_ONCE = textwrap.dedent("""
    import os, sys, time, torch
    from accelerate import Accelerator
    from accel_trainer.world import check_world
    from accel_trainer.accel import process_group_kwargs
    marker = sys.argv[1]
    first_round = not os.path.exists(marker)  # read before the barrier, so both ranks agree
    acc = Accelerator(cpu=True, kwargs_handlers=[process_group_kwargs(30)])
    check_world(acc)
    acc.wait_for_everyone()
    if first_round:
        if acc.process_index == 1:
            open(marker, "w").close()
            sys.exit(3)  # this worker fails, once
        time.sleep(90)  # the survivor idles; its agent restarts it when the failed machine re-joins
        sys.exit(4)  # never restarted: the test fails
    total = acc.reduce(torch.ones(1), "sum").item()
    restarts = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"SURVIVED world={acc.num_processes} sum={total} restarts_used_here={restarts}", flush=True)
    # Leave together and close the process group, as the Trainer does (end_training): a worker that exits while
    # its peer still holds the gloo pair can be aborted (SIGABRT) at exit, failing a run that had succeeded.
    acc.wait_for_everyone()
    acc.end_training()
""")


@pytest.mark.slow
def test_c10d_with_max_restarts_survives_one_worker_failure(tmp_path):
    script = tmp_path / "fail_once.py"
    script.write_text(FAIL_ONCE)
    port = free_port()
    cfg = two_machine_config(tmp_path, port=port, rdzv="c10d")
    codes, logs = two_launches(
        cfg,
        port,
        tmp_path,
        [str(script), str(tmp_path / "failed_once")],
        "c10d",
        extra=["--max_restarts", "1"],
        **{RESTART_SAFE_ENV: "1"},
    )  # as printed
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    both = "".join(logs)
    assert (tmp_path / "failed_once").exists()  # a worker did fail
    assert both.count("SURVIVED world=2 sum=2.0") == 2, both[-3000:]  # printed by every process of the new world
    assert "restarts_used_here=1" in both, both[-3000:]


WRAPPER = [sys.executable, "-m", "accel_trainer.cli", "launch"]
FAULT_RECIPE = os.path.join(ROOT, "tests", "fault_recipe.py")  # regression + --faults step_delay=S (slows a run)


def machine_0_alone(cfg, rdzv_conf, output_dir):
    """`accel-trainer launch` as machine 0 of `cfg`, with no machine 1 started, its rendezvous bounded by
    `rdzv_conf`."""
    cmd = WRAPPER + ["--config_file", cfg, "--machine_rank", "0", "--rdzv_conf", rdzv_conf]
    return call(cmd + ["recipes/regression.py", "--output_dir", str(output_dir)], BOUND + 30)


@pytest.mark.slow
def test_missing_peer_static_fails_within_bound_and_says_who(tmp_path):
    port = free_port()
    cfg = two_machine_config(tmp_path, port=port, rdzv="static")
    t0 = time.monotonic()
    proc = machine_0_alone(cfg, "timeout=5", tmp_path / "o")
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < BOUND, took
    out = proc.stdout + proc.stderr
    assert "waiting for clients. 1/2 clients joined" in out, out[-2000:]  # torch's words
    assert "only 1 of 2 machines joined (1 missing: those with --machine_rank 1..1" in proc.stderr
    assert f"reaches 127.0.0.1:{port}" in proc.stderr and "firewall" in proc.stderr
    assert "NCCL_SOCKET_IFNAME" in proc.stderr


@pytest.mark.slow
def test_missing_peer_c10d_fails_within_bound_and_says_what_to_check(tmp_path):
    cfg = two_machine_config(tmp_path, port=free_port(), rdzv="c10d")
    t0 = time.monotonic()
    # No --rdzv_backend: `accel-trainer launch` takes c10d from the config (accelerate alone would run static).
    proc = machine_0_alone(cfg, "join_timeout=5,read_timeout=5", tmp_path / "o")
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < BOUND, took
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("accel-trainer launch: accelerate launch"))
    assert "--rdzv_backend c10d" in line and "join_timeout=5,read_timeout=5,is_host=1" in line, line
    assert "RendezvousTimeoutError" in proc.stdout, proc.stdout[-2000:]
    assert "not all 2 machines joined the c10d rendezvous" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_busy_port_on_machine_0_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = two_machine_config(tmp_path, port=busy.getsockname()[1], rdzv="static")
        t0 = time.monotonic()
        proc = machine_0_alone(cfg, "timeout=5", tmp_path / "o")
    assert proc.returncode != 0
    assert time.monotonic() - t0 < BOUND
    assert "another process is utilizing it" in proc.stdout, proc.stdout[-2000:]  # accelerate's words
    assert "the rendezvous port is busy on machine 0" in proc.stderr


def test_wrapper_refuses_a_config_that_would_run_the_wrong_world(tmp_path, capsys):
    from accel_trainer.cluster import launch

    cfg = tmp_path / "multi_cpu.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: true\n")
    assert launch.launch(["--config_file", str(cfg), "recipes/regression.py"]) == 2
    assert "launched by accelerate as ONE process" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cpu_flag", "multi_cpu_config"])
def test_launch_that_runs_one_process_instead_of_two_is_stopped(tmp_path, how):
    """The silent world-size-1 traps: both start ONE process; the Trainer's check_world must refuse to train."""
    if how == "cpu_flag":
        launch = ["--cpu", "--num_processes", "2"]
    else:
        cfg = tmp_path / "multi_cpu.yaml"
        cfg.write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\n"
            "num_machines: 1\nnum_processes: 2\nuse_cpu: true\n"
        )
        launch = ["--config_file", str(cfg)]
    proc = call(
        LAUNCH + launch + ["recipes/regression.py", "--output_dir", str(tmp_path / "o"), "--max_steps", "2"],
        BOUND + 30,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert "total processes: expected 2, joined 1" in out, out[-2000:]
    assert "--multi_gpu" in out  # the fix is named
    assert not (tmp_path / "o" / "model.safetensors").exists()


NAIVE = textwrap.dedent("""
    from accelerate import Accelerator
    from accel_trainer.world import check_world
    check_world(Accelerator())  # no cpu=True on a machine without CUDA
    print("TRAINED ALONE", flush=True)
""")


@pytest.mark.slow
def test_each_process_alone_in_a_world_of_one_is_stopped(tmp_path):
    script = tmp_path / "naive.py"
    script.write_text(NAIVE)
    proc = call(
        LAUNCH + ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()), str(script)],
        BOUND + 30,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "TRAINED ALONE" not in out
    assert "WORLD_SIZE=2" in out and "joined a world of 1" in out and "cpu=True" in out, out[-2000:]


def test_wrapper_refuses_a_rank_out_of_range_and_an_unresolvable_main_address(tmp_path, capsys):
    from accel_trainer.cluster import launch

    cfg = two_machine_config(tmp_path, port=free_port(), rdzv="static")
    capsys.readouterr()
    assert launch.launch(["--config_file", cfg, "--machine_rank", "2", "recipes/regression.py"]) == 2
    assert "--machine_rank 2 is out of range for 2 machines (valid: 0..1)" in capsys.readouterr().err
    assert (
        launch.launch(
            [
                "--config_file",
                cfg,
                "--machine_rank",
                "1",
                "--main_process_ip",
                "machine0.invalid",
                "recipes/regression.py",
            ]
        )
        == 2
    )
    assert "cannot resolve machine 0's address 'machine0.invalid'" in capsys.readouterr().err


MALFORMED = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: [2\nuse_cpu: true\n"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["launch", "check"])
def test_malformed_yaml_is_one_line_naming_file_and_line(tmp_path, command):
    """A YAML typo gives one line (file:line:column, what, the fix), a non-zero exit, no parser traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(MALFORMED)
    tail = ["recipes/regression.py", "--output_dir", str(tmp_path / "o")] if command == "launch" else []
    proc = call(
        [sys.executable, "-m", "accel_trainer.cli", command, "--config_file", str(bad), *tail],
        60,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    # the parser notices at line 4; the unclosed bracket opened on line 3
    assert f"{bad}:4:8: not valid YAML" in out and "started at line 3" in out, out
    assert "accel-trainer config" in out  # the fix
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_preemption_signal_to_the_launcher_alone_reaches_each_worker_once_and_exits_75(tmp_path):
    """SIGUSR1 to `accel-trainer launch` only (what `kill <launcher>` or a batch script forwarding SLURM's
    notice through srun with process-group tracking does): each worker gets exactly one SIGUSR1 (a second would
    mean "exit now, no checkpoint"), all checkpoint at the same step, and the launcher exits 75 where torchrun
    reports 1. torchrun's agent must survive the signal (it dies of it by default, orphaning the workers)."""
    import json

    import psutil

    out = tmp_path / "o"
    cmd = WRAPPER + launch_cmd(2)[3:] + [FAULT_RECIPE, "--faults", "step_delay=0.2", "--output_dir", str(out)]
    log = open(tmp_path / "log.txt", "w+")
    e = env()
    proc = subprocess.Popen(
        cmd + ["--max_steps", "40", "--logging_steps", "1", "--save_steps", "0", "--disable_tqdm"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=e,
        cwd=ROOT,
        start_new_session=True,
    )
    seen = {}
    try:
        t0 = time.monotonic()
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None and time.monotonic() - t0 < BOUND + 60, (tmp_path / "log.txt").read_text()
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen[p.pid] = p
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=BOUND)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)  # the workers and agent end with it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in seen.values():
            try:
                p.kill()
            except psutil.Error:
                pass
    text = (tmp_path / "log.txt").read_text()
    assert rc == 75, text[-3000:]
    assert text.count("[rank 0] SIGUSR1 received") == 1 and text.count("[rank 1] SIGUSR1 received") == 1, text[-3000:]
    assert "preempted: the workers wrote a checkpoint and stopped; exit 75" in text
    (ckpt,) = os.listdir(out / "checkpoints")
    assert json.load(open(out / "checkpoints" / ckpt / "manifest.json"))["num_processes"] == 2
    assert not alive, alive


@pytest.mark.slow
def test_preemption_notice_during_set_up_is_kept_checkpointed_at_the_first_update_and_exits_75(tmp_path):
    """SIGUSR1 while the workers still build their data (a slow tokenisation or load): the launcher ignores SIGUSR1
    in torchrun's agent, and an ignored signal stays ignored across exec into the workers, so the notice used to
    be dropped and the run went on to the time limit. The workers keep it from the start of Trainer() on: training
    starts, every rank checkpoints at the first update boundary they agree on, and the launcher exits 75 (requeue)."""
    import psutil
    from procs import Launch

    out = tmp_path / "o"
    cmd = WRAPPER + launch_cmd(2)[3:] + [FAULT_RECIPE, "--faults", "build_delay=8", "--output_dir", str(out)]
    cmd += ["--max_steps", "40", "--logging_steps", "1", "--save_steps", "0", "--disable_tqdm"]
    run = Launch(cmd, str(tmp_path / "log.txt"), cwd=ROOT, deadline=BOUND + 60)
    try:
        run.wait_until(lambda: run.output(None).count("builds its data") >= 2, poll=0.2)  # both ranks in set-up
        run.proc.send_signal(signal.SIGUSR1)  # the launcher passes it on to each worker, still in build_data
        rc = run.proc.wait(timeout=BOUND + 60)
        _, alive = psutil.wait_procs(list(run.seen.values()), timeout=10)  # the workers and agent end with it
    finally:
        run.stop()
    text = (tmp_path / "log.txt").read_text()
    assert rc == 75, text[-3000:]
    assert text.count("[rank 0] SIGUSR1 received") == 1 and text.count("[rank 1] SIGUSR1 received") == 1, text[-3000:]
    assert "preempted: the workers wrote a checkpoint and stopped; exit 75" in text
    (ckpt,) = os.listdir(out / "checkpoints")
    assert int(ckpt.split("_")[1]) <= 2, ckpt  # the first boundary the ranks agree on, not the end of the run
    assert not alive, alive
