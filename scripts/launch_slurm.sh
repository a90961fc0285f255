#!/usr/bin/env bash
# Multi-node GPU MLM pretraining under SLURM: one process per node, all its GPUs.
#
#   sbatch --nodes=4 scripts/launch_slurm.sh WORKDIR [CONFIG] [--config.key=value ...]
#   sbatch --nodes=2 scripts/launch_slurm.sh /shared/runs/base configs/rotary.py:size=base \
#       --config.train.batch_size=512 --config.mesh.fsdp=8
#
# Check the config for the nodes first, on any host (no GPU; docs/scale.md):
#   python -m roformer.pretrain --config=configs/rotary.py:size=base,accel=gpu --compile_only=h100:8
# WORKDIR must be on a filesystem all nodes share (each node writes its checkpoint
# shards). jax.distributed reads the SLURM environment (coordinator = first node,
# process id = task rank), so only --config.distributed.enabled=True is needed.
# Resubmitting the same command resumes from the newest checkpoint; SLURM's
# preemption SIGTERM (--signal=TERM@120) makes the run save and exit 0.
#SBATCH --job-name=roformer-pretrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,15p' "$0"; exit 2
fi
WORKDIR=$1; shift
CONFIG=configs/rotary.py:size=base
if [[ $# -gt 0 && $1 != --* ]]; then CONFIG=$1; shift; fi

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
# The venv must have jax[cuda12] (pip install -e . 'jax[cuda12]').
srun --kill-on-bad-exit=1 python -m roformer.pretrain --config="$CONFIG" --workdir="$WORKDIR" \
  --config.distributed.enabled=True --config.model.dtype=bfloat16 "$@"
