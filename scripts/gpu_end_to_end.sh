#!/usr/bin/env bash
# One GPU, end to end, with the accelerator setting and no other speed flags, within a time
# limit of BUDGET_S (510 s by default; docs/gpu.md):
#   pretrain  base/512, batch 64, bf16 (configs/rotary.py:size=base,source=files,accel=gpu) for
#             PRETRAIN_STEPS steps on the Wikipedia files under $DATA/wikipedia_en (wiki_0*)
#   glue      GLUE_TASKS (default cola,mrpc,stsb,sst2) fine-tuned from that workdir, 1 seed,
#             GLUE_EPOCHS (3) epochs, batch 32, length 128, configs/glue.py:accel=gpu, with an
#             empty persistent compilation cache ($WORK/xla): every program compiled (cold)
#   glue_warm GLUE_WARM_TASKS (default cola,mrpc,stsb) again with GLUE_WARM_SEEDS (5, the
#             protocol's) seeds, in a new process with the cache the glue stage filled: what a
#             second run (another checkpoint or task list) pays to compile (warm), its share
#             of a task's wall time as the protocol runs it
#   glue_loop python -m roformer.bench glue_loop at base, the accelerator setting, synthetic
#             SST-2-like batches of 32 up to length 128: steps/s of the GLUE loop itself
#             (finetune) against its compiled programs fed batches already on the device
#             (bare), each with a step's batch padded per step (a branch per length), per
#             call (no branch) and packed (a step's examples end to end in full rows):
#             whether the device or the host paces a GLUE step, what the per-step branch
#             costs and what packing saves
#   export    python -m roformer.convert to-hf of the pretraining workdir
#   parity    scripts/hf_parity.py: the export in transformers (AutoTokenizer,
#             AutoModelForMaskedLM) on the GPU against ours, float32 logits
#   peers     python -m roformer.bench hf at base/512/64 bf16: ours against transformers'
#             PyTorch RoFormer eager and under torch.compile on the same GPU (bf16 autocast,
#             fused AdamW), alternating rounds
#   glue_flags (only when STEPS names it) GLUE_FLAG_TASKS (cola) from random init at
#             GLUE_FLAGS_MODEL (base), 1 seed, GLUE_EPOCHS epochs, once per XLA flag set of
#             GLUE_FLAG_SETS (';'-separated; default: none, --xla_gpu_autotune_level=0,
#             --xla_gpu_enable_triton_gemm=false, none again), each in its own process with
#             XLA_FLAGS set to exactly that set and its own empty compilation cache: what
#             each set does to a cold compile and to steps/s (the repeated empty set shows
#             the noise); an unknown flag fails only its own set; a set starts only when its
#             whole limit (75 s) is left of BUDGET_S
# then writes table.md: tokens/s and MFU, GLUE steps/s, compile seconds and compile share
# per task (cold and warm, against the targets), scores, parity, ratios to the peers. OUTDIR
# ends with three files: table.md, log.txt and files.tar.gz, every stage's own files (results,
# summaries, versions). Each
# stage has its own time limit and writes its own files, so a slow or failing stage costs
# only itself (a stage that needs an earlier one's output is skipped when that output is
# missing); no stage runs past BUDGET_S (510) seconds from the start: set it to your time
# limit.
# The exit status is the worst of the stages' (0: every stage run ran to its end; a skipped one counts 0).
# Usage: scripts/gpu_end_to_end.sh OUTDIR
#   DATA=dir with glue/, vocab/, wikipedia_en/ (default ../shared/data, else .device/data); STEPS picks stages;
#   PYTHON=... the interpreter; PRETRAIN_ARGS, GLUE_ARGS: more --config flags for those stages;
#   PEERS_SHAPE (base/512/64); WIKI_FILES (wiki_0*) the pretraining files; BUDGET_S;
#   GLUE_FLAG_SETS, GLUE_FLAG_TASKS, GLUE_FLAGS_MODEL for glue_flags.
#   TINY=1: every stage at a size a CPU runs in minutes (tiny models, a few steps and rows),
#   to check the script itself, not to measure anything.
set -u
out=${1:?usage: scripts/gpu_end_to_end.sh OUTDIR}
py=${PYTHON:-python3}
data=${DATA:-../shared/data}
[[ -n ${DATA:-} || -d $data ]] || data=.device/data   # a machine without the shared data: scripts/device_files.sh's copy
if [ "${TINY:-0}" = 1 ]; then
  : "${PRETRAIN_STEPS:=4}" "${PEERS_SHAPE:=tiny/32/2}" "${WIKI_FILES:=wiki_00}"
  : "${PRETRAIN_ARGS:=--config.model.size=tiny --config.train.batch_size=4 --config.train.seq_len=64}"
  : "${GLUE_ARGS:=--config.max_train_examples=64 --config.max_eval_examples=32 --config.max_seq_len=32 --config.batch_size=8}"
  : "${GLUE_LOOP_ARGS:=--preset tiny --accel cpu --batch 8 --max-len 32 --steps 32}"
  : "${GLUE_FLAGS_MODEL:=tiny}"
fi
pretrain_steps=${PRETRAIN_STEPS:-300}
glue_tasks=${GLUE_TASKS:-cola,mrpc,stsb,sst2}
glue_warm_tasks=${GLUE_WARM_TASKS:-cola,mrpc,stsb}
glue_epochs=${GLUE_EPOCHS:-3}
budget=${BUDGET_S:-510}
# what every GLUE stage runs: the accelerator setting, the GLUE data, GLUE_EPOCHS, no bar
glue_command=(-m roformer.glue --config=configs/glue.py:accel=gpu --config.data_dir="$data/glue"
              --config.num_epochs="$glue_epochs" --config.progress_bar=false)
default=" pretrain glue glue_warm glue_loop export parity peers "
known="${default}glue_flags "   # glue_flags would take the default run past BUDGET_S: named only
stages=${STEPS:-$default}
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

run_stage() {   # run_stage NAME SECONDS CMD...: one stage under its limit (cut to what is left of
  # the budget); its exit and time in stages.tsv. With whole=1, a stage is skipped unless all of
  # its limit is left (one cut short measures nothing and only spends the device's time).
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  if [ $((budget - SECONDS)) -lt "$limit" ]; then
    if [ "${whole:-0}" = 1 ]; then limit=0; else limit=$((budget - SECONDS)); fi
  fi
  if [ "$limit" -lt 10 ]; then
    printf '%s\t%s\t%s\n' "$name" "skipped" 0 >>"$out/stages.tsv"
    echo "=== $name: skipped ($((budget - SECONDS)) s left of BUDGET_S=$budget)" | tee -a "$log"
    return
  fi
  echo "=== $name (limit $limit s): $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  status=$?
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$out/stages.tsv"
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
  if ((status > worst)); then worst=$status; fi
}
worst=0   # the worst exit status of the stages run: the script's own (a skipped stage counts 0)

for stage in $stages; do
  case $stage in
    pretrain)
      run_stage pretrain 200 "$py" -m roformer.pretrain --config=configs/rotary.py:size=base,source=files,accel=gpu \
        --workdir="$work/pretrain" --config.data.files="$data/wikipedia_en/${WIKI_FILES:-wiki_0*}" \
        --config.data.vocab="$data/vocab/bert-base-uncased-vocab.txt" --config.data.cache_dir="$work/cache" \
        --config.train.steps="$pretrain_steps" --config.train.batch_size=64 --config.train.seq_len=512 \
        --config.train.log_every=50 --config.train.eval_every="$pretrain_steps" \
        --config.train.checkpoint_every="$pretrain_steps" --config.train.progress_bar=false ${PRETRAIN_ARGS:-}
      cp "$work/pretrain/summary.json" "$out/pretrain_summary.json" 2>/dev/null
      cp "$work/pretrain/metrics.jsonl" "$out/pretrain_metrics.jsonl" 2>/dev/null ;;
    glue|glue_warm)
      [ -f "$work/pretrain/summary.json" ] || { echo "=== $stage: skipped (no pretraining workdir)" | tee -a "$log"; continue; }
      if [ "$stage" = glue ]; then
        rm -rf "$work/xla" "$work/glue"; tasks=$glue_tasks limit=240 results=glue_results.json seeds=1
      else
        [ -d "$work/xla" ] || { echo "=== glue_warm: skipped (no cache from the glue stage)" | tee -a "$log"; continue; }
        rm -rf "$work/glue_warm"; tasks=$glue_warm_tasks limit=120 results=glue_warm_results.json
        seeds=${GLUE_WARM_SEEDS:-5}
        warm_args=--config.save_models=none    # the models were saved by the glue stage
      fi
      run_stage "$stage" "$limit" "$py" "${glue_command[@]}" --config.task="$tasks" --config.init="$work/pretrain" \
        --config.seeds="$seeds" ${warm_args:-} --config.compilation_cache_dir="$work/xla" --workdir="$work/$stage" \
        ${GLUE_ARGS:-}
      cp "$work/$stage/glue_results.json" "$out/$results" 2>/dev/null ;;
    glue_loop)
      run_stage glue_loop 150 "$py" -m roformer.bench glue_loop --variants=finetune,bare --steps-per-call 16 \
        --paddings=step,call,packed --rounds 2 ${GLUE_LOOP_ARGS:---preset base --accel gpu --batch 32 --max-len 128 --steps 192} \
        --json "$out/glue_loop.json" ;;
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
    glue_flags)
      # a ';' appended so that read keeps a trailing empty set
      IFS=';' read -ra flag_sets <<<"${GLUE_FLAG_SETS-;--xla_gpu_autotune_level=0;--xla_gpu_enable_triton_gemm=false;};"
      for i in "${!flag_sets[@]}"; do
        read -r set_flags <<<"${flag_sets[$i]}"   # trimmed
        echo "$set_flags" >"$out/glue_flags$i.txt"
        rm -rf "$work/glue_flags$i" "$work/xla_flags$i"
        whole=1 run_stage "glue_flags$i" 75 env XLA_FLAGS="$set_flags" "$py" "${glue_command[@]}" \
          --config.task="${GLUE_FLAG_TASKS:-cola}" --config.init=none --config.model.size="${GLUE_FLAGS_MODEL:-base}" \
          --config.vocab="$data/vocab/bert-base-uncased-vocab.txt" --config.seeds=1 --config.save_models=none \
          --config.compilation_cache_dir="$work/xla_flags$i" --workdir="$work/glue_flags$i" ${GLUE_ARGS:-}
        cp "$work/glue_flags$i/glue_results.json" "$out/glue_flags${i}_results.json" 2>/dev/null
      done ;;
  esac
done

"$py" scripts/gpu_end_to_end_table.py "$out" | tee "$out/table.md"
date -u | tee -a "$out/host.txt"
# OUTDIR keeps the table and the log to read first, and every stage's own files go into one
# archive beside them.
(cd "$out" && find . -maxdepth 1 -type f ! -name table.md ! -name log.txt ! -name files.tar.gz -printf '%f\n' \
  | sort | tar -czf files.tar.gz -T - --remove-files)
exit "$worst"
