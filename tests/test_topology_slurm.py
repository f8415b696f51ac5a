"""SLURM for real: the batch script `accel-trainer config --slurm` writes is submitted with `sbatch` as written to a
real one-node SLURM cluster (munged + slurmctld + slurmd started here, tests/slurm_cluster.py), and trains a world
of 2 CPU processes. Preempted while it runs (`scancel --batch --signal=USR1`, what `#SBATCH --signal=B:USR1@T`
sends before the time limit), the job checkpoints, exits 75, requeues itself, resumes from the checkpoint and
ends with final weights byte-identical to an uninterrupted job's.

Skipped (with the reason) without root or without slurm-wlm/munge (`.ci/run` installs them). Every wait is
bounded; the daemons and the jobs' processes are stopped at the end whatever happens.
"""

import os
import sys
import time

import pytest
import slurm_cluster
from helpers import ROOT, env, free_port, last_step, run_config

from accel_trainer.cluster import wizard
from accel_trainer.faults import EXIT_PREEMPTED

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(slurm_cluster.skip_reason() is not None, reason=str(slurm_cluster.skip_reason())),
]

# 256 samples, 2 ranks x 8 = global batch 16; dropout and masked targets make every random stream matter.
ARGS = ["--max_steps", "16", "--per_device_train_batch_size", "8", "--logging_steps", "1", "--save_steps", "0"]
ARGS += ["--dropout", "0.2", "--mask_prob", "0.3", "--disable_tqdm"]
FAULT_RECIPE = os.path.join(ROOT, "tests", "fault_recipe.py")
JOB_BOUND = 240  # seconds one job may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def batch_script(tmp_path) -> str:
    """The wizard's script for one node x 2 CPU processes (absolute paths: the job runs in tmp_path). The script
    trained is tests/fault_recipe.py: the regression recipe, which `--faults step_delay=S` slows down."""
    argv = ["--dir", str(tmp_path), "--name", "job", "--no-interactive", "--machines", "1"]
    argv += ["--processes-per-machine", "2", "--cpu", "--main-port", str(free_port()), "--slurm"]
    assert wizard.main(argv + ["--script", FAULT_RECIPE]) == 0
    return str(tmp_path / "job.slurm.sh")


def job_env() -> dict:
    # The job runs the console script `accel-trainer` from this Python's environment.
    e = env()
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    return e


def submit(cluster, tmp_path, out, faults=None) -> tuple[str, str]:
    args = ["--output_dir", str(out), *ARGS] + (["--faults", faults] if faults else [])
    job = cluster.sbatch(batch_script(tmp_path), args, str(tmp_path), job_env())
    return job, str(tmp_path / f"job-{job}.out")  # the script's `#SBATCH --output=%x-%j.out`


def model_bytes(out) -> bytes:
    return open(os.path.join(out, "model.safetensors"), "rb").read()


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The script as written, submitted with sbatch, trains a world of 2 to the end."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job, log = submit(cluster, tmp, tmp / "run")
    info = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_BOUND, log)
    text = open(log).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    return tmp / "run", text, info


@pytest.mark.slow
def test_sbatch_the_generated_script_as_written_trains_a_world_of_2(uninterrupted):
    out, text, info = uninterrupted
    # The node's CPUs are the job's (#SBATCH --exclusive), not one: its workers and their loader workers share them.
    assert info["NumCPUs"] == str(os.cpu_count()), info
    cfg = run_config(out)
    assert cfg["num_processes"] == 2, cfg  # one world of 2, not two worlds of 1
    assert (cfg["topology"]["num_machines"], cfg["topology"]["local_world_size"]) == (1, 2), cfg["topology"]
    assert os.environ.get("SLURM_JOB_ID") is None  # the test itself is not inside a job
    assert "accel-trainer launch: accelerate launch" in text and "the launchers exited with 0" in text, text[-3000:]
    assert last_step(out) == 16


def test_generated_script_carries_what_preemption_needs(tmp_path):
    text = open(batch_script(tmp_path)).read()
    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
    assert "--resume_from_checkpoint auto" in text
    assert f'if [ "$rc" -eq {EXIT_PREEMPTED} ]' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    argv = ["--dir", str(tmp_path), "--name", "noq", "--no-interactive", "--machines", "1", "--cpu", "--slurm"]
    assert wizard.main(argv + ["--no-requeue"]) == 0
    text = open(tmp_path / "noq.slurm.sh").read()
    assert "scontrol requeue" not in text and "#SBATCH --requeue" not in text and "--signal=B:USR1@" in text


@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_itself_and_resumes_bit_identically(cluster, tmp_path, uninterrupted):
    out = tmp_path / "run"
    job, log = submit(cluster, tmp_path, out, faults="step_delay=0.3")
    cluster.wait_job(job, ("RUNNING",), JOB_BOUND, log)
    t0 = time.monotonic()
    while last_step(out) < 4:  # training, not starting up
        assert time.monotonic() - t0 < JOB_BOUND, open(log).read()[-4000:]
        assert cluster.job(job).get("JobState") == "RUNNING", open(log).read()[-4000:]
        time.sleep(0.2)
    # What `#SBATCH --signal=B:USR1@T` does T seconds before the time limit: USR1 to the batch shell only.
    cluster.cmd("scancel", "--batch", "--signal=USR1", job)
    # The script requeues the job; SLURM holds a requeued job until the old job credential expired (BeginTime;
    # the test cluster's cred_expire is 10 s instead of the default 120 s), then it starts again by itself.
    info = cluster.wait_job(job, ("PENDING",), JOB_BOUND, log)
    assert int(info.get("Restarts", 0)) == 1, info
    text = open(log).read()
    assert "Preempted (SIGUSR1)" in text and f"exiting with code {EXIT_PREEMPTED}" in text, text[-4000:]
    assert f"the launchers exited with {EXIT_PREEMPTED}" in text and f"requeueing job {job}" in text, text[-4000:]
    (ckpt,) = os.listdir(out / "checkpoints")  # the preemption checkpoint, mid-run
    assert 4 <= int(ckpt.split("_")[1]) < 16, ckpt
    assert not os.path.exists(out / "model.safetensors")
    info = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_BOUND, log)
    text = open(log).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    assert "start (restart 1)" in text and f"Resumed from {out / 'checkpoints' / ckpt}" in text, text[-4000:]
    assert run_config(out)["num_processes"] == 2
    assert model_bytes(out) == model_bytes(uninterrupted[0])  # byte-identical to the uninterrupted job


@pytest.fixture
def two_node_cluster(tmp_path_factory):
    """Two slurmd, one per network namespace (10.77.0.1 and 10.77.0.2), slurmctld beside node 0."""
    import netns

    if netns.skip_reason():
        pytest.skip(netns.skip_reason())
    hosts = netns.TwoHosts()
    c = slurm_cluster.LocalSlurm(tmp_path_factory.mktemp("slurm2"), hosts=hosts)
    try:
        hosts.up()
        c.start()
        yield c
    finally:
        c.stop()
        hosts.down()


@pytest.mark.slow
def test_two_nodes_on_a_real_network_train_one_world_and_a_preempted_job_requeues_and_resumes(
    two_node_cluster, tmp_path, uninterrupted
):
    """The wizard's two-node script, as written: one `accel-trainer launch` per node through srun, each finding its
    own interface on the route to the first node (whose name resolves only to its cluster address). Preempted
    mid-run, both nodes checkpoint and stop, the job requeues itself, resumes and completes."""
    c, hosts = two_node_cluster, two_node_cluster.hosts
    argv = ["--dir", str(tmp_path), "--name", "job2", "--no-interactive", "--machines", "2", "--cpu"]
    argv += ["--processes-per-machine", "1", "--main-ip", hosts.addr[0], "--rdzv", "c10d", "--rdzv-timeout", "60"]
    assert wizard.main(argv + ["--slurm", "--script", FAULT_RECIPE]) == 0
    out = tmp_path / "run"
    args = ["--output_dir", str(out), *ARGS, "--faults", "step_delay=0.3"]
    job = c.sbatch(str(tmp_path / "job2.slurm.sh"), args, str(tmp_path), job_env())
    log = str(tmp_path / f"job2-{job}.out")
    t0 = time.monotonic()
    while last_step(out) < 4:
        assert time.monotonic() - t0 < JOB_BOUND and c.job(job).get("JobState") in ("PENDING", "RUNNING"), (
            open(log).read()[-4000:] if os.path.exists(log) else c.job(job)
        )
        time.sleep(0.2)
    c.cmd("scancel", "--batch", "--signal=USR1", job)
    info = c.wait_job(job, ("PENDING", "COMPLETED", "FAILED", "CANCELLED"), JOB_BOUND, log)
    text = open(log).read()
    assert info["JobState"] == "PENDING" and int(info.get("Restarts", 0)) == 1, f"{info}\n{text[-4000:]}"
    info = c.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_BOUND, log)
    text = open(log).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}\n{c.logs()}"
    assert "accel-trainer launch: preempted: the workers wrote a checkpoint" in text, text[-4000:]
    assert f"requeueing job {job}" in text and "start (restart 1)" in text and "Resumed from" in text, text[-4000:]
    cfg = run_config(out)
    assert cfg["num_processes"] == 2 and cfg["topology"]["num_machines"] == 2, cfg["topology"]
    assert cfg["topology"]["network"]["MASTER_ADDR"] == hosts.addr[0] and last_step(out) == 16
    for r in (0, 1):  # each node found its own address and interface on the route to the first node
        assert f"PET_LOCAL_ADDR={hosts.addr[r]} GLOO_SOCKET_IFNAME={hosts.ifname[r]}" in text, text[-4000:]
    # The same world of 2 as the one-node uninterrupted job, preempted and resumed: the same bytes.
    assert model_bytes(out) == model_bytes(uninterrupted[0])
