#!/usr/bin/env bash
# The accelerator benchmarks in one command, each step under its own time limit (docs/gpu.md):
#   profile.json        where a base/512 bf16 train step's time goes, op by op (fused attention),
#                       with its trace and compiled program in profile_trace/ (read them again
#                       elsewhere: python -m roformer.bench profile --from-trace profile_trace)
#   gpu.json            the train-step table (tiny..base at 128 and 512, bf16, MFU) and RoPE kernels
#                       (batch 32: at 8 the per-call floor hides most of the kernel time on an H200)
#   runs_<shape>.json   small runs per GPU-hour at tiny/128/16 and mini/128/32: one run, 8 runs
#                       side by side (a process each), 8 vmapped seeds in one process
#   runs64_<shape>.json one run against 64 vmapped seeds (seeds per GPU-hour, device memory per seed)
#   ablation_vmap.json  whole ablation sessions, 8 rope seeds of the reference recipe on the embedded
#                       corpus: vmapped (--config.vmap_seeds=8) and in turn; wall time, each run's
#                       tokens/s and held-out losses (ABLATION_FLAGS: more --config flags for both)
#   flags.json          the base/512 bf16 step under XLA flag sets (bench flags' GPU candidates: GEMM
#                       epilogues, cuDNN layer norm, Triton normalisation fusions, launches), each set in
#                       a process of its own between two reference runs, with its first-step loss, then
#                       the sets that took under 0.99x the reference's step together
#   ab_levers.json      the speed levers' A/B (bench levers, about 5 min): at base/512/64 the step
#                       without them (baseline), all together, each alone and all at batch 128, then
#                       the ones that paid alone together (adopted) against the baseline, then
#                       baseline and adopted at base/128/256 and small/512/64, in alternating rounds
#                       in one process (bf16, cuDNN attention); ab_flags<N>.json: baseline and all at
#                       base/512/64 under each XLA flag set of AB_FLAG_SETS (';'-separated, default
#                       one: cuBLASLt epilogues), a process each (about 1.5 min each); ab_hf.json:
#                       bench hf at base/512/64, ours with the adopted levers against transformers +
#                       torch.compile on the same GPU (130 s limit); ab.json: all their rows in one
#                       table, printed, with x_baseline, each row's tokens/s over the flag-free
#                       baseline of its shape, and the ratio to torch.compile after the levers and
#                       before them (divided by the levers' own x_tokens of adopted). The ab step
#                       alone: STEPS=ab scripts/bench_accelerator.sh OUTDIR (its limits add up to 525 s)
#   confirm_*.json      the GPU default forms against none, as the cost model predicted them
#                       (docs/cost-model.md): confirm_levers.json, bench levers' baseline (no form)
#                       and gpu_default (backend.DEFAULT_FORMS["gpu"]) at base/512/64 and
#                       base/128/256 in alternating rounds; confirm_profile.json and
#                       confirm_trace/, the default step profiled; confirm_hf.json, ours (the
#                       default) against transformers eager, torch.compile and torch.compile with a
#                       masked-position head at base/512/64. STEPS=confirm (about 9 minutes)
#   log.txt             everything the commands printed, with each compilation's time
# Each step has its own time limit and its own file, so a slow one costs only itself.
# STEPS picks and orders them (default: all, in the order above). Their limits add up to
# 2,120 s, so with less time than that on a machine, split them over several runs, e.g.
#   STEPS="profile gpu runs_mini" then STEPS="runs_tiny runs64_tiny runs64_mini", STEPS=ablation_vmap, STEPS=flags,
#   STEPS=ab. The exit status is the worst of the steps' (0: every step ran to its end).
# Usage: scripts/bench_accelerator.sh OUTDIR   (PYTHON=... to choose the interpreter)
set -u
out=${1:?usage: scripts/bench_accelerator.sh OUTDIR}
py=${PYTHON:-python3}
known=" profile gpu runs_tiny runs_mini runs64_tiny runs64_mini ablation_vmap flags ab confirm "
steps=${STEPS:-$known}
for step in $steps; do   # a misspelt step stops the script before any benchmark runs
  [[ $known == *" $step "* ]] || { echo "unknown step '$step'; choose from:$known" >&2; exit 2; }
done
mkdir -p "$out"
log="$out/log.txt"
worst=0   # the worst exit status of the steps: the script's own
# the repository root on the path: scripts/bench_ab_table.py imports the package
export PYTHONUNBUFFERED=1 JAX_LOG_COMPILES=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
    --format=csv 2>&1; "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$out/host.txt"

bench() {   # bench NAME SECONDS ARGS...: one benchmark, its JSON as NAME.json, its table printed
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  echo "=== $name: $*" >>"$log"
  timeout "$limit" "$py" -m roformer.bench "$@" --json "$out/$name.json" >>"$log" 2>&1
  status=$?
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
  if ((status > worst)); then worst=$status; fi
  [ -f "$out/$name.json" ] && "$py" -c "import json, sys
from roformer.bench.common import format_table
result = json.load(open(sys.argv[1]))
print(format_table(result['rows'], result.get('columns')))
for note in result.get('notes', []): print('note:', note)" "$out/$name.json"
}

ablations() {   # whole ablation sessions, vmapped and in turn (workdirs outside OUTDIR: many files)
  local work start status mode
  work=$(mktemp -d)
  for mode in vmap turn; do
    start=$SECONDS
    echo "=== ablation_$mode" >>"$log"
    timeout "$([ $mode = vmap ] && echo 140 || echo 240)" "$py" -m roformer.ablate --config=configs/ablation.py:reference --config.schemes=rope \
      --config.seeds=8 --config.scheme_seeds= --config.pretrain.data.source=embedded --config.glue.task= \
      --config.extension.enabled=False --config.extrapolation.factors=1 --config.extrapolation.scalings= \
      --config.extrapolation.num_docs=2 --config.pretrain.train.progress_bar=False \
      --config.vmap_seeds=$([ $mode = vmap ] && echo 8 || echo 1) ${ABLATION_FLAGS:-} --workdir="$work/$mode" >>"$log" 2>&1
    status=$?
    echo "$mode $status $((SECONDS - start))" >>"$work/times.txt"
    echo "=== ablation_$mode: exit $status after $((SECONDS - start)) s" | tee -a "$log"
    if ((status > worst)); then worst=$status; fi
  done
  "$py" - "$work" "$out/ablation_vmap.json" <<'PY'
import json, sys
from pathlib import Path
from roformer.train.metrics import read_metrics
work, result = Path(sys.argv[1]), {}
for line in (work / "times.txt").read_text().split("\n"):
    if line:
        mode, status, seconds = line.split()
        runs = {}
        for run in sorted((work / mode / "pretrain" / "rope").glob("seed*")):
            summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
            runs[run.name] = {"tokens_per_sec": summary.get("tokens_per_sec"), "wall_time_s": summary.get("wall_time_s"),
                              "seeds_in_step": summary.get("seeds_in_step"),
                              "eval_loss": {r["step"]: r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r}}
        result[mode] = {"exit": int(status), "wall_s": int(seconds), "runs": runs}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print({mode: (r["exit"], r["wall_s"], len(r["runs"])) for mode, r in result.items()})
PY
  rm -rf "$work"
}

keep_trace() {   # the profiler's trace up to DIR itself, beside the compiled program, for --from-trace
  local trace
  trace=$(find "$1" -name '*.trace.json.gz' -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -n 1 | cut -d' ' -f2-)
  [ -n "$trace" ] && mv "$trace" "$1/step.trace.json.gz" && rm -rf "$1/plugins"
}

ab() {   # the levers' A/B, then under each XLA flag set, then one table of them all
  local sets=() set index=0 limit=${AB_LEVERS_S:-310} continued=()
  # AB_SHAPES (commas or spaces between shapes), AB_FLAG_SHAPE and AB_ARGS (more levers options, e.g. a CPU smoke test's
  # "--rounds 1 --iters 1 --vocab-size 512"), AB_HF_SHAPE and AB_HF_ARGS (more hf options)
  # change what is timed. For a shorter time limit: AB_LEVERS_S (the levers' limit; no build
  # starts in its last 35 s), AB_FLAG_SETS=none, AB_HF=0. For the shapes an earlier run's time
  # limit left: AB_ADOPTED_FROM=its ab_levers.json (copied to this machine) times its adopted
  # levers against the baseline at AB_SHAPES, without the levers alone.
  [[ -z ${AB_ADOPTED_FROM:-} ]] || continued=(--adopted-from "$AB_ADOPTED_FROM")
  # Compiled steps kept outside OUTDIR: a rerun on the same machine loads them instead of
  # compiling each variant again (the builds are most of the levers' time).
  local -x JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/roformer-ab-jax-cache}
  local shapes=${AB_SHAPES:-base/512/64,base/128/256,small/512/64}
  # shellcheck disable=SC2086
  bench ab_levers "$limit" levers --shapes="${shapes// /,}" \
    --budget-s $((limit - 35)) --rounds 3 --iters 5 "${continued[@]}" ${AB_ARGS:-}
  [[ ${AB_FLAG_SETS:-} == none ]] || IFS=';' read -ra sets <<<"${AB_FLAG_SETS:---xla_gpu_enable_cublaslt=true}"
  for set in "${sets[@]}"; do
    index=$((index + 1))
    # shellcheck disable=SC2086
    # (a build takes 20-27 s at base/512 on an H200, and no build starts past the budget less
    # 1.2x the longest so far: room for the baseline's and all's, from the process's start)
    XLA_FLAGS="${XLA_FLAGS:-} $set" bench "ab_flags$index" 85 levers --shapes "${AB_FLAG_SHAPE:-base/512/64}" \
      --variants=baseline,all --other-variants=baseline --budget-s 70 --rounds 3 --iters 5 ${AB_ARGS:-}
  done
  [[ ${AB_HF:-1} == 0 ]] || ab_hf
  "$py" scripts/bench_ab_table.py "$out" "$index"
}

ab_hf() {   # ours against transformers + torch.compile on this GPU, ours with the adopted levers
  # (the forms and dropout keys that paid alone in ab_levers.json; none when none did or the
  # levers failed); jax takes GPU memory as it needs it, so the peer's process fits beside it
  local rng forms
  read -r rng forms < <("$py" -c "import json, os, sys
from roformer.bench.levers import adopted_in_result
adopted = adopted_in_result(json.load(open(sys.argv[1]))) if os.path.isfile(sys.argv[1]) else None
print(adopted.dropout_rng_impl if adopted else 'threefry2x32', ','.join(adopted.forms) if adopted else '')" \
    "$out/ab_levers.json")
  # shellcheck disable=SC2086
  ROFORMER_BACKEND_FORMS="$forms" XLA_PYTHON_CLIENT_PREALLOCATE=false bench ab_hf 130 hf \
    --shapes "${AB_HF_SHAPE:-base/512/64}" --peers hf_torch_compile --dtype bfloat16 --attention-dropout 0 \
    --dropout-rng-impl "${rng:-threefry2x32}" --rounds 3 --iters 3 ${AB_HF_ARGS:-}
}

confirm() {   # the GPU default forms against none (levers), the default profiled, and the peers
  # shellcheck disable=SC2086
  bench confirm_levers 300 levers --shapes=base/512/64,base/128/256 --variants=baseline,gpu_default,rope_half_pairs,fused_qkv \
    --other-variants=baseline,gpu_default --budget-s 260 --rounds 3 --iters 5 ${AB_ARGS:-}
  bench confirm_profile 120 profile --size base --seq-len 512 --batch 64 --scheme rope --dtype bfloat16 \
    --attention-impl cudnn --attention-dropout 0 --top 40 --trace-dir "$out/confirm_trace"
  keep_trace "$out/confirm_trace"
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false bench confirm_hf 160 hf --shapes "${AB_HF_SHAPE:-base/512/64}" \
    --peers=hf_torch,hf_torch_compile,hf_torch_compile_masked_head --dtype bfloat16 --attention-dropout 0 \
    --rounds 3 --iters 3 ${AB_HF_ARGS:-}
}

run_step() {
  case $1 in
    profile) bench profile 120 profile --size base --seq-len 512 --batch 64 --scheme rope --dtype bfloat16 \
               --attention-impl cudnn --attention-dropout 0 --top 40 --trace-dir "$out/profile_trace"
             keep_trace "$out/profile_trace" ;;
    gpu) bench gpu 300 gpu --sizes=base,small,mini,tiny --seq-lens=512,128 --rope-batch 32 --budget-s 240 ;;
    runs_tiny) bench runs_tiny 75 runs --shapes tiny/128/16 --modes=one,procs,vmap --parallel 8 --rounds 3 --steps 30 ;;
    runs_mini) bench runs_mini 100 runs --shapes mini/128/32 --modes=one,procs,vmap --parallel 8 --rounds 3 --steps 30 ;;
    runs64_tiny) bench runs64_tiny 60 runs --shapes tiny/128/16 --modes=one,vmap --parallel 64 --rounds 3 --steps 20 ;;
    runs64_mini) bench runs64_mini 60 runs --shapes mini/128/32 --modes=one,vmap --parallel 64 --rounds 3 --steps 20 ;;
    ablation_vmap) ablations ;;
    flags) bench flags 500 flags --timeout-s 80 --combine-below 0.99 --step-args "--sizes base --seq-lens 512 --batch 64 --schemes rope \
             --dtype bfloat16 --attention-impl cudnn --attention-dropout 0 --rounds 3 --iters 5" ;;
    ab) ab ;;
    confirm) confirm ;;
  esac
}
for step in $steps; do
  run_step "$step"
done
echo "slowest compilations:"
grep -o "Finished XLA compilation of .* in [0-9.]* sec" "$log" | sort -k7 -g | tail -n 5
date -u | tee -a "$out/host.txt"
exit "$worst"
