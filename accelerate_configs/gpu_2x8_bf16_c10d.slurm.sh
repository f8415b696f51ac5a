#!/bin/bash
#SBATCH --job-name=gpu_2x8_bf16_c10d
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
# One `accel-trainer launch` per node; each starts 8 process(es). Extra arguments go to the training script.
# Preemption: USR1 reaches this shell 120 s before the time limit (or `scancel --batch --signal=USR1 <job>`);
# it is passed on to the workers, which checkpoint and exit 75; then the job requeues itself and resumes
# from the newest checkpoint (--resume_from_checkpoint auto). docs/topology.md, "Tested under SLURM".
set -uo pipefail
export MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MAIN_PORT=29500
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "job $SLURM_JOB_ID start (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"
SRUN= NOTICE=
trap 'NOTICE=1; echo "USR1: preemption notice, passing it to the launchers"; [ -n "$SRUN" ] && kill -USR1 "$SRUN"' USR1
srun --kill-on-bad-exit=1 bash -c 'exec accel-trainer launch --config_file "$1" \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_HOST" --main_process_port "$MAIN_PORT" \
    --rdzv_backend c10d --rdzv_conf join_timeout=120,read_timeout=120 --max_restarts 3 \
    "$2" --resume_from_checkpoint auto "${@:3}"' _ accelerate_configs/gpu_2x8_bf16_c10d.yaml 'recipes/<recipe>.py' "$@" &
SRUN=$!
# `wait` returns early when the trap runs: wait again until srun has really ended.
while :; do wait "$SRUN"; rc=$?; kill -0 "$SRUN" 2>/dev/null || break; done
echo "job $SLURM_JOB_ID: the launchers exited with $rc"
if [ "$rc" -eq 75 ] || { [ "$rc" -ne 0 ] && [ -n "$NOTICE" ]; }; then
    echo "preempted: the checkpoint is written; requeueing job $SLURM_JOB_ID (it resumes from the checkpoint)"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
