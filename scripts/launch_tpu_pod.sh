#!/usr/bin/env bash
# Launch MLM pretraining on every worker of a Cloud TPU VM (single host or pod slice).
#
#   scripts/launch_tpu_pod.sh TPU_NAME ZONE WORKDIR [CONFIG] [--config.key=value ...]
#   scripts/launch_tpu_pod.sh my-v4-32 us-central2-b /mnt/bucket/runs/base \
#       configs/rotary.py:size=base --config.train.batch_size=512 --config.mesh.fsdp=4
#
# Check the config for the slice first, on any host (no TPU; docs/scale.md):
#   python -m roformer.pretrain --config=configs/rotary.py:size=base,accel=tpu --compile_only=v4:2x2x4
# WORKDIR must be storage every worker sees at the same path (a gcsfuse-mounted
# bucket or Filestore): each host writes its own shards of the orbax checkpoints,
# process 0 writes the logs. The code is copied to ~/roformer-jax on every worker,
# installed with jax[tpu], and started on all workers at once; jax.distributed
# discovers the pod by itself (--config.distributed.enabled=True). Re-running the
# same command resumes from the newest checkpoint in WORKDIR.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,17p' "$0"; exit 2
fi
TPU_NAME=$1; ZONE=$2; WORKDIR=$3; shift 3
CONFIG=configs/rotary.py:size=base
if [[ $# -gt 0 && $1 != --* ]]; then CONFIG=$1; shift; fi
EXTRA=$(printf ' %q' "$@")

cd "$(dirname "$0")/.."
gcloud compute tpus tpu-vm scp --zone "$ZONE" --worker=all --recurse \
  roformer configs pyproject.toml README.md "$TPU_NAME":~/roformer-jax/
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  cd ~/roformer-jax
  python3 -m pip install --quiet -e . 'jax[tpu]'
  python3 -m roformer.pretrain --config=$CONFIG --workdir=$WORKDIR \
    --config.distributed.enabled=True --config.model.dtype=bfloat16 $EXTRA
"
