#!/bin/bash
#SBATCH --job-name=gpu_2x8_bf16_c10d
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --output=%x-%j.out
# One launcher per node; each starts 8 process(es). Extra arguments go to the training script.
set -euo pipefail
export MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MAIN_PORT=29500
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --config_file accelerate_configs/gpu_2x8_bf16_c10d.yaml \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_HOST" --main_process_port "$MAIN_PORT" \
    --rdzv_backend c10d --rdzv_conf join_timeout=120,read_timeout=120 --max_restarts 3 \
    recipes/<recipe>.py "$@"' _ "$@"
