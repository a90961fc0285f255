#!/usr/bin/env bash
# One GPU, end to end, with the accelerator setting and no other speed flags, in one call of
# under nine minutes on an H100/H200:
#   pretrain  base/512, batch 64, bf16 (configs/rotary.py:size=base,source=files,accel=gpu) for
#             PRETRAIN_STEPS steps on the Wikipedia files under $DATA/wikipedia_en (wiki_0*)
#   glue      GLUE_TASKS (default cola,mrpc,stsb,sst2) fine-tuned from that workdir, 1 seed,
#             GLUE_EPOCHS (3) epochs, batch 32, length 128, configs/glue.py:accel=gpu
#   export    python -m roformer.convert to-hf of the pretraining workdir
#   parity    scripts/hf_parity.py: the export in transformers (AutoTokenizer,
#             AutoModelForMaskedLM) on the GPU against ours, float32 logits
#   peers     python -m roformer.bench hf at base/512/64 bf16: ours against transformers'
#             PyTorch RoFormer eager and under torch.compile on the same GPU (bf16 autocast,
#             fused AdamW), alternating rounds
# then writes table.md: tokens/s and MFU, GLUE steps/s and compile seconds per task, scores,
# parity, ratios to the peers. Each stage has its own time limit and writes its own files,
# so a slow or failing stage costs only itself (a stage that needs an earlier one's output
# is skipped when that output is missing).
# Usage: scripts/gpu_end_to_end.sh OUTDIR
#   DATA=dir with glue/, vocab/, wikipedia_en/ (default ../shared/data); STEPS picks stages;
#   PYTHON=... the interpreter; PRETRAIN_ARGS, GLUE_ARGS: more --config flags for those stages;
#   PEERS_SHAPE (base/512/64). A CPU smoke of the whole script (tests/test_gpu_scripts.py):
#   PRETRAIN_STEPS=4 PRETRAIN_ARGS="--config.model.size=tiny --config.train.batch_size=4
#   --config.train.seq_len=64" GLUE_ARGS="--config.max_train_examples=32 ..." PEERS_SHAPE=tiny/32/2
set -u
out=${1:?usage: scripts/gpu_end_to_end.sh OUTDIR}
py=${PYTHON:-python3}
data=${DATA:-../shared/data}
pretrain_steps=${PRETRAIN_STEPS:-300}
glue_tasks=${GLUE_TASKS:-cola,mrpc,stsb,sst2}
glue_epochs=${GLUE_EPOCHS:-3}
known=" pretrain glue export parity peers "
stages=${STEPS:-$known}
for stage in $stages; do
  [[ $known == *" $stage "* ]] || { echo "unknown stage '$stage'; choose from:$known" >&2; exit 2; }
done
for needed in "$data/glue" "$data/vocab/bert-base-uncased-vocab.txt" "$data/wikipedia_en"; do
  [ -e "$needed" ] || { echo "missing $needed (set DATA=...)" >&2; exit 2; }
done
mkdir -p "$out"
work=${WORK:-$(mktemp -d)}
log="$out/log.txt"
# the repository root on the path (scripts/hf_parity.py imports the package); jax takes GPU
# memory as it needs it, so the PyTorch peers' processes fit beside it on one GPU
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
  "$py" -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'orbax', o.__version__, jax.devices())"
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1
} 2>&1 | tee "$out/host.txt"

run_stage() {   # run_stage NAME SECONDS CMD...: one stage under its limit; its exit and time in stages.tsv
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  echo "=== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  status=$?
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$out/stages.tsv"
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
}

for stage in $stages; do
  case $stage in
    pretrain)
      run_stage pretrain 200 "$py" -m roformer.pretrain --config=configs/rotary.py:size=base,source=files,accel=gpu \
        --workdir="$work/pretrain" --config.data.files="$data/wikipedia_en/wiki_0*" \
        --config.data.vocab="$data/vocab/bert-base-uncased-vocab.txt" --config.data.cache_dir="$work/cache" \
        --config.train.steps="$pretrain_steps" --config.train.batch_size=64 --config.train.seq_len=512 \
        --config.train.log_every=50 --config.train.eval_every="$pretrain_steps" \
        --config.train.checkpoint_every="$pretrain_steps" --config.train.progress_bar=false ${PRETRAIN_ARGS:-}
      cp "$work/pretrain/summary.json" "$out/pretrain_summary.json" 2>/dev/null
      cp "$work/pretrain/metrics.jsonl" "$out/pretrain_metrics.jsonl" 2>/dev/null ;;
    glue)
      [ -f "$work/pretrain/summary.json" ] || { echo "=== glue: skipped (no pretraining workdir)" | tee -a "$log"; continue; }
      run_stage glue 240 "$py" -m roformer.glue --config=configs/glue.py:accel=gpu --config.task="$glue_tasks" \
        --config.init="$work/pretrain" --config.data_dir="$data/glue" --config.seeds=1 \
        --config.num_epochs="$glue_epochs" --config.progress_bar=false --workdir="$work/glue" ${GLUE_ARGS:-}
      cp "$work/glue/glue_results.json" "$out/glue_results.json" 2>/dev/null ;;
    export)
      [ -f "$work/pretrain/summary.json" ] || { echo "=== export: skipped (no pretraining workdir)" | tee -a "$log"; continue; }
      run_stage export 60 "$py" -m roformer.convert to-hf "$work/pretrain" "$work/hf" ;;
    parity)
      [ -f "$work/hf/config.json" ] || { echo "=== parity: skipped (no export)" | tee -a "$log"; continue; }
      run_stage parity 90 "$py" scripts/hf_parity.py "$work/pretrain" "$work/hf" --json "$out/parity.json" ;;
    peers)
      run_stage peers 200 "$py" -m roformer.bench hf --shapes "${PEERS_SHAPE:-base/512/64}" --dtype bfloat16 \
        --attention-dropout 0 \
        --rounds 3 --iters 3 --json "$out/hf.json" ;;
  esac
done

"$py" scripts/gpu_end_to_end_table.py "$out" | tee "$out/table.md"
date -u | tee -a "$out/host.txt"
